// libFuzzer: the layout decoder and validation (bytes from peers).
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "eplbx/layout.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view in(reinterpret_cast<const char*>(data), size);
  auto layout = eplbx::DecodeLayout(in);
  if (!layout.ok()) return 0;
  if (eplbx::EncodeLayout(*layout) != in) __builtin_trap();
  // Validate it against itself and a copy with a changed rank.
  eplbx::RankLayout other = *layout;
  other.rank = layout->rank == 0 ? 1 : 0;
  std::vector<eplbx::RankLayout> all(2);
  all[layout->rank == 0 ? 0 : 1] = *layout;
  all[other.rank] = other;
  if (layout->rank <= 1) (void)eplbx::ValidateLayouts(all, 0);
  return 0;
}
