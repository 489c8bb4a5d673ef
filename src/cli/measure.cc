#include "cli/measure.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <vector>

namespace eplbx::cli {

double MeasureMemcpyGbps() {
  const size_t n = 64ull << 20;
  std::vector<uint8_t> a(n, 1), b(n, 2);
  std::vector<double> rates;
  for (int i = 0; i < 9; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(b.data(), a.data(), n);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rates.push_back(static_cast<double>(n) / s / 1e9);
    std::swap(a, b);
  }
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

}  // namespace eplbx::cli
