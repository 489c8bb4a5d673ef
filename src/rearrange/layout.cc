#include "eplbx/layout.h"

#include <cstring>
#include <sstream>
#include <unordered_map>

#include "common/bytes.h"
#include "common/strings.h"

namespace eplbx {
namespace {

using internal::ByteReader;
using internal::ByteWriter;
using internal::StrCat;

constexpr char kMagic[4] = {'E', 'P', 'X', 'L'};
// 2: spare rows and row tables (swap commit mode).
constexpr uint16_t kVersion = 2;
constexpr size_t kMaxLayers = 4096;
constexpr size_t kMaxTensors = 256;
constexpr size_t kMaxDims = 8;
constexpr size_t kMaxText = 128;
constexpr size_t kMaxProblems = 8;
constexpr uint32_t kMaxTableSlots = 1u << 20;

std::string Shape(const std::vector<int64_t>& s) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < s.size(); ++i) out << (i ? ", " : "") << s[i];
  out << "]";
  return out.str();
}

std::string Describe(const TensorSpec& t) {
  return StrCat(t.bytes_per_expert, " bytes per expert (dtype ", t.dtype.empty() ? "?" : t.dtype,
                ", shape ", Shape(t.expert_shape), ")");
}

}  // namespace

std::string EncodeLayout(const RankLayout& layout) {
  ByteWriter w;
  w.Raw(std::string_view(kMagic, 4));
  w.U16(kVersion);
  w.U16(0);
  const size_t length_at = w.size();
  w.U32(0);
  w.U32(layout.rank);
  w.U32(static_cast<uint32_t>(layout.layers.size()));
  for (const auto& layer : layout.layers) {
    w.U32(static_cast<uint32_t>(layer.size()));
    for (const TensorSpec& t : layer) {
      w.Str16(t.name);
      w.Str16(t.dtype);
      w.U8(static_cast<uint8_t>(t.expert_shape.size()));
      for (int64_t d : t.expert_shape) w.U64(static_cast<uint64_t>(d));
      w.U64(t.base);
      w.U64(t.bytes_per_expert);
      w.U32(t.rows);
    }
  }
  w.U32(layout.spare_rows);
  w.U32(static_cast<uint32_t>(layout.row_of_slot.size()));
  for (const auto& table : layout.row_of_slot) {
    w.U32(static_cast<uint32_t>(table.size()));
    for (uint32_t row : table) w.U32(row);
  }
  w.PatchU32(length_at, static_cast<uint32_t>(w.size()));
  return w.Take();
}

Result<RankLayout> DecodeLayout(std::string_view bytes) {
  ByteReader r(bytes, "layout");
  std::string magic;
  if (!r.Raw("magic", 4, &magic)) return r.status();
  if (std::memcmp(magic.data(), kMagic, 4) != 0) {
    return Status::Corruption("layout: bad magic (expected 'EPXL')");
  }
  uint16_t version = 0, reserved = 0;
  uint32_t length = 0, layers = 0;
  RankLayout out;
  if (!r.U16("version", &version) || !r.U16("reserved", &reserved) || !r.U32("length", &length)) {
    return r.status();
  }
  if (reserved != 0)
    return Status::Corruption(StrCat("layout: reserved field is ", reserved, ", must be 0"));
  if (version != kVersion) {
    return Status::NotSupported(StrCat("layout: version ", version,
                                       " is not supported (this build reads ", kVersion,
                                       "); run the same eplbx release on every rank"));
  }
  if (length != bytes.size()) {
    return Status::Corruption(
        StrCat("layout: length field says ", length, " bytes, got ", bytes.size()));
  }
  if (!r.U32("rank", &out.rank) || !r.U32("layer_count", &layers)) return r.status();
  if (layers > kMaxLayers) {
    return Status::Corruption(StrCat("layout: ", layers, " layers, the limit is ", kMaxLayers));
  }
  out.layers.resize(layers);
  for (uint32_t l = 0; l < layers; ++l) {
    uint32_t tensors = 0;
    if (!r.U32(StrCat("layers[", l, "].tensor_count"), &tensors)) return r.status();
    if (tensors > kMaxTensors) {
      return Status::Corruption(
          StrCat("layout: layer ", l, " has ", tensors, " tensors, the limit is ", kMaxTensors));
    }
    out.layers[l].resize(tensors);
    for (uint32_t t = 0; t < tensors; ++t) {
      TensorSpec& s = out.layers[l][t];
      const std::string f = StrCat("layers[", l, "].tensors[", t, "]");
      uint8_t dims = 0;
      if (!r.Str16(f + ".name", kMaxText, &s.name) || !r.Str16(f + ".dtype", kMaxText, &s.dtype) ||
          !r.U8(f + ".dims", &dims)) {
        return r.status();
      }
      if (dims > kMaxDims)
        return Status::Corruption(StrCat("layout: ", f, " has ", +dims, " dimensions"));
      s.expert_shape.resize(dims);
      for (auto& d : s.expert_shape) {
        uint64_t v = 0;
        if (!r.U64(f + ".shape", &v)) return r.status();
        d = static_cast<int64_t>(v);
      }
      if (!r.U64(f + ".base", &s.base) || !r.U64(f + ".bytes_per_expert", &s.bytes_per_expert) ||
          !r.U32(f + ".rows", &s.rows)) {
        return r.status();
      }
    }
  }
  uint32_t tables = 0;
  if (!r.U32("spare_rows", &out.spare_rows) || !r.U32("row_table_count", &tables))
    return r.status();
  if (tables != 0 && tables != layers) {
    return Status::Corruption(
        StrCat("layout: ", tables, " row tables for ", layers, " layers (0 or one per layer)"));
  }
  out.row_of_slot.resize(tables);
  for (uint32_t l = 0; l < tables; ++l) {
    uint32_t n = 0;
    if (!r.U32(StrCat("row_of_slot[", l, "].size"), &n)) return r.status();
    if (n > kMaxTableSlots || n > r.remaining() / 4) {
      return Status::Corruption(
          StrCat("layout: the row table of layer ", l, " has ", n, " slots (malformed)"));
    }
    out.row_of_slot[l].resize(n);
    for (uint32_t& row : out.row_of_slot[l]) {
      if (!r.U32(StrCat("row_of_slot[", l, "]"), &row)) return r.status();
    }
  }
  if (r.remaining() != 0)
    return Status::Corruption(StrCat("layout: ", r.remaining(), " trailing bytes"));
  return out;
}

Status ValidateLayouts(std::span<const RankLayout> all, uint32_t self) {
  if (self >= all.size()) {
    return Status::InvalidArgument(StrCat("layout check: rank ", self, " of ", all.size()));
  }
  const RankLayout& mine = all[self];
  // The same problem in many layers is reported once, with the count of further layers.
  std::vector<std::string> problems;
  std::vector<std::string> keys;
  std::vector<int> repeats;
  auto add = [&](std::string p) {
    std::string key = p;
    if (auto at = key.find("layer "); at != std::string::npos) {
      auto end = key.find_first_not_of("0123456789", at + 6);
      key.replace(at, (end == std::string::npos ? key.size() : end) - at, "layer #");
    }
    for (size_t i = 0; i < keys.size(); ++i) {
      if (keys[i] == key) {
        ++repeats[i];
        return;
      }
    }
    if (problems.size() >= kMaxProblems) return;
    problems.push_back(std::move(p));
    keys.push_back(std::move(key));
    repeats.push_back(0);
  };
  for (uint32_t peer = 0; peer < all.size(); ++peer) {
    const RankLayout& other = all[peer];
    if (other.rank != peer) {
      add(StrCat("the layout in slot ", peer, " says it is rank ", other.rank));
      continue;
    }
    if (peer == self) continue;
    if (other.spare_rows != mine.spare_rows) {
      add(StrCat("layout mismatch with rank ", peer, ": it has ", other.spare_rows,
                 " spare rows per layer, rank ", self, " has ", mine.spare_rows,
                 "; every rank must use the same commit mode (spare rows)"));
    }
    if (other.layers.size() != mine.layers.size()) {
      add(StrCat("layout mismatch with rank ", peer, ": it has ", other.layers.size(),
                 " MoE layers, rank ", self, " has ", mine.layers.size(),
                 " (a different model or model revision?)"));
      continue;
    }
    for (size_t l = 0; l < mine.layers.size(); ++l) {
      const auto& a = mine.layers[l];
      const auto& b = other.layers[l];
      for (size_t t = 0; t < std::max(a.size(), b.size()); ++t) {
        if (t >= b.size()) {
          add(StrCat("layout mismatch with rank ", peer, ": key (layer ", l, ", tensor ", t, " '",
                     a[t].name, "') is missing on rank ", peer, " (rank ", self,
                     " has it); every rank must register the same tensors for every layer"));
          continue;
        }
        if (t >= a.size()) {
          add(StrCat("layout mismatch with rank ", peer, ": key (layer ", l, ", tensor ", t, " '",
                     b[t].name, "') exists on rank ", peer, " but not on rank ", self,
                     "; every rank must register the same tensors for every layer"));
          continue;
        }
        const TensorSpec& x = a[t];
        const TensorSpec& y = b[t];
        if (x.name != y.name) {
          add(StrCat("layout mismatch with rank ", peer, ": (layer ", l, ", tensor ", t, ") is '",
                     y.name, "' there and '", x.name, "' on rank ", self,
                     " (tensors registered in another order?)"));
        }
        if (x.bytes_per_expert != y.bytes_per_expert || x.dtype != y.dtype ||
            x.expert_shape != y.expert_shape) {
          const double ratio = y.bytes_per_expert == 0
                                   ? 0.0
                                   : static_cast<double>(x.bytes_per_expert) / y.bytes_per_expert;
          add(StrCat(
              "nbytes_per_expert mismatch for (layer ", l, ", tensor ", t, " '", x.name,
              "') with rank ", peer, ": local (rank ", self, ") = ", Describe(x), ", peer (rank ",
              peer, ") = ", Describe(y), ", ratio ", ratio,
              "; different quantization, tensor-parallel size or model revision across ranks?"));
        }
        if (x.rows != y.rows) {
          add(StrCat("layout mismatch with rank ", peer, ": (layer ", l, ", tensor ", t, " '",
                     x.name, "') has ", y.rows, " local experts there and ", x.rows, " on rank ",
                     self, "; every rank must hold the same number of expert slots"));
        }
      }
    }
  }
  // Rows of one rank's tensors must agree too (one slot count per layer).
  for (size_t l = 0; l < mine.layers.size(); ++l) {
    for (const TensorSpec& t : mine.layers[l]) {
      if (t.rows != mine.layers[l][0].rows) {
        add(StrCat("layout of rank ", self, ", layer ", l, ": tensor '", t.name, "' has ", t.rows,
                   " rows but '", mine.layers[l][0].name, "' has ", mine.layers[l][0].rows));
      }
      if (t.bytes_per_expert == 0) {
        add(StrCat("layout of rank ", self, ", layer ", l, ": tensor '", t.name,
                   "' has 0 bytes per expert"));
      }
    }
  }
  // Row tables: every rank's, since every rank reads through them.
  for (uint32_t peer = 0; peer < all.size(); ++peer) {
    const RankLayout& x = all[peer];
    if (x.row_of_slot.empty()) continue;
    if (x.row_of_slot.size() != x.layers.size()) {
      add(StrCat("layout of rank ", peer, ": ", x.row_of_slot.size(), " row tables for ",
                 x.layers.size(), " layers (pass none, or one per layer)"));
      continue;
    }
    for (size_t l = 0; l < x.layers.size(); ++l) {
      const auto& table = x.row_of_slot[l];
      const uint32_t rows = x.layers[l].empty() ? 0 : x.layers[l][0].rows;
      if (table.size() != x.slots(l)) {
        add(StrCat("layout of rank ", peer, ", layer ", l, ": the row table has ", table.size(),
                   " slots, the layer ", x.slots(l), " (", rows, " rows - ", x.spare_rows,
                   " spare)"));
        continue;
      }
      // Keyed by row, sized by the table: the row count comes from a peer and
      // may be far larger than the table (many spare rows).
      std::unordered_map<uint32_t, uint32_t> slot_of;
      slot_of.reserve(table.size());
      for (uint32_t s = 0; s < table.size(); ++s) {
        if (table[s] >= rows) {
          add(StrCat("layout of rank ", peer, ", layer ", l, ": the row table puts slot ", s,
                     " in row ", table[s], ", past the layer's ", rows, " rows"));
          break;
        }
        const auto [it, fresh] = slot_of.emplace(table[s], s);
        if (!fresh) {
          add(StrCat("layout of rank ", peer, ", layer ", l, ": the row table puts slots ",
                     it->second, " and ", s, " in the same row ", table[s],
                     " (every slot needs a row of its own)"));
          break;
        }
      }
    }
  }
  for (size_t l = 0; l < mine.layers.size(); ++l) {
    if (!mine.layers[l].empty() && mine.layers[l][0].rows <= mine.spare_rows) {
      add(StrCat("layout of rank ", self, ", layer ", l, ": ", mine.layers[l][0].rows,
                 " rows with ", mine.spare_rows, " spare rows leave no expert slot"));
    }
  }
  if (problems.empty()) return Status::OK();
  std::string msg;
  for (size_t i = 0; i < problems.size(); ++i) {
    if (i > 0) msg += "; ";
    msg += problems[i];
    if (repeats[i] > 0)
      msg += StrCat(" (the same in ", repeats[i], " more layer", repeats[i] > 1 ? "s" : "", ")");
  }
  return Status::Mismatch(std::move(msg));
}

}  // namespace eplbx
