// Where a rank keeps its expert weights: per MoE layer, per weight tensor, a base address and
// a row stride (bytes per expert), one row per local expert slot. Ranks exchange layouts once
// per communicator and validate them before any byte moves (ARCHITECTURE.md invariant 4).
#ifndef EPLBX_LAYOUT_H_
#define EPLBX_LAYOUT_H_

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "eplbx/status.h"

namespace eplbx {

struct TensorSpec {
  std::string name;                   // e.g. "w13", "w2", "w13_scale"
  std::string dtype;                  // e.g. "bf16", "fp8_e4m3", "f32"
  std::vector<int64_t> expert_shape;  // shape of one expert's slice
  uint64_t base = 0;                  // address of row 0 on this rank
  uint64_t bytes_per_expert = 0;      // row stride; rows are contiguous
  uint32_t rows = 0;                  // local expert slots
};

struct RankLayout {
  uint32_t rank = 0;
  std::vector<std::vector<TensorSpec>> layers;  // [layer][tensor]
};

// Versioned binary form (magic "EPXL"); decoding rejects malformed input with the field name.
std::string EncodeLayout(const RankLayout& layout);
Result<RankLayout> DecodeLayout(std::string_view bytes);

// Checks that every rank in `all` (indexed by rank) has the same (layer, tensor) keys, the
// same bytes per expert, dtype and shape per key, and the same number of rows per layer as
// rank `self`. Fails with kMismatch listing up to 8 problems, each naming the rank, layer,
// tensor (index and name), both values, their ratio and the likely cause.
Status ValidateLayouts(std::span<const RankLayout> all, uint32_t self);

}  // namespace eplbx

#endif  // EPLBX_LAYOUT_H_
