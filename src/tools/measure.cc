#include "tools/measure.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "transfer/shm/copier.h"

namespace eplbx::internal {
namespace {

constexpr size_t kBlock = 64ull << 20;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

double MeasureMemcpyGbps() {
  std::vector<uint8_t> a(kBlock, 1), b(kBlock, 2);
  std::vector<double> rates;
  for (int i = 0; i < 9; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(b.data(), a.data(), kBlock);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rates.push_back(static_cast<double>(kBlock) / s / 1e9);
    std::swap(a, b);
  }
  return Median(rates);
}

double MeasureCopyLimitGbps(int threads) { return CopyLimitProbe(threads).Sample(7); }

CopyLimitProbe::CopyLimitProbe(int threads) : threads_(std::max(threads, 1)) {
  for (int t = 0; t < threads_; ++t) {
    src_.emplace_back(kBlock, 1);
    dst_.emplace_back(kBlock, 2);
  }
}

double CopyLimitProbe::Sample(int rounds) {
  constexpr size_t kPiece = 4u << 20;
  std::vector<double> rates;
  for (int round = 0; round < std::max(rounds, 1); ++round) {
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> workers;
    for (int t = 0; t < threads_; ++t) {
      workers.emplace_back([&, t] {
        for (size_t off = 0; off < kBlock; off += kPiece)
          CopyBytes(dst_[t].data() + off, src_[t].data() + off, kPiece);
      });
    }
    for (auto& w : workers) w.join();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rates.push_back(static_cast<double>(kBlock) * threads_ / s / 1e9);
    std::swap(src_, dst_);
  }
  return Median(rates);
}

}  // namespace eplbx::internal
