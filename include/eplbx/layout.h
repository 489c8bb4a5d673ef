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
  uint32_t rows = 0;                  // rows of the tensor: local expert slots + spare rows
};

struct RankLayout {
  uint32_t rank = 0;
  std::vector<std::vector<TensorSpec>> layers;  // [layer][tensor]
  // Swap commit mode (docs/protocol.md, "Commit modes"). With spare rows, every tensor of a
  // layer has rows = slots per rank + spare_rows, and the engine finds the row of local slot
  // s through a row table (row_of_slot[layer][s]). A rearrangement READs new experts straight
  // into rows no slot uses and commits by publishing the new table: each byte moves once.
  // 0: in place (row s is slot s; READs land in staging, the commit copies them over).
  uint32_t spare_rows = 0;
  // This rank's row table in force, per layer (empty: row s for slot s in every layer). Each
  // table has one distinct row < rows per slot. A Rearranger keeps every rank's tables from
  // here on (they change only at agreed commits); a rebuilt one takes them from its layouts.
  std::vector<std::vector<uint32_t>> row_of_slot;

  // Local expert slots of `layer` (rows minus spare rows; 0 for a layer without tensors).
  uint32_t slots(size_t layer) const {
    return layers[layer].empty() || layers[layer][0].rows < spare_rows
               ? 0
               : layers[layer][0].rows - spare_rows;
  }
  // The row of local slot `slot` in `layer` under row_of_slot (identity when it is empty).
  uint32_t RowOf(size_t layer, uint32_t slot) const {
    return row_of_slot.empty() ? slot : row_of_slot[layer][slot];
  }
};

// Versioned binary form (magic "EPXL"); decoding rejects malformed input with the field name.
std::string EncodeLayout(const RankLayout& layout);
Result<RankLayout> DecodeLayout(std::string_view bytes);

// Checks that every rank in `all` (indexed by rank) has the same (layer, tensor) keys, the
// same bytes per expert, dtype and shape per key, the same number of rows per layer and the
// same spare rows as rank `self`, and that every row table is a table of distinct rows. Fails with
// kMismatch listing up to 8 problems, each naming the rank, layer, tensor (index and name), both
// values, their ratio and the likely cause.
Status ValidateLayouts(std::span<const RankLayout> all, uint32_t self);

}  // namespace eplbx

#endif  // EPLBX_LAYOUT_H_
