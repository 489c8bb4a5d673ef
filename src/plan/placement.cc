#include "eplbx/placement.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/strings.h"

namespace eplbx {

using internal::StrCat;

namespace {

constexpr int kMaxDimension = 1 << 20;           // far above any deployment
constexpr size_t kMaxEntries = size_t{1} << 28;  // per matrix; keeps offsets in 32 bits

Status CheckPositive(const char* field, int value) {
  if (value < 1 || value > kMaxDimension) {
    return Status::InvalidArgument(
        StrCat(field, " is ", value, " (expected an integer in [1, ", kMaxDimension, "])"));
  }
  return Status::OK();
}

}  // namespace

Status Topology::CheckWork(int layers, int experts) const {
  if (slots > kMaxSlots || experts > kMaxSlots) {
    return Status::InvalidArgument(StrCat("slots (", slots, ") and experts (", experts,
                                          ") per layer must be at most ", kMaxSlots,
                                          " (the planning limit)"));
  }
  const std::pair<const char*, int64_t> products[] = {
      {"ranks x experts", int64_t{ranks} * experts},
      {"layers x slots", int64_t{layers} * slots},
      {"layers x experts", int64_t{layers} * experts}};
  for (const auto& [what, value] : products) {
    if (value > kMaxWorkEntries) {
      return Status::InvalidArgument(StrCat(what, " is ", value, "; the planning limit is ",
                                            kMaxWorkEntries, " (", layers, " layers, ", experts,
                                            " experts, ", ranks, " ranks, ", slots, " slots)"));
    }
  }
  return Status::OK();
}

Status Topology::Validate(int experts) const {
  EPLBX_RETURN_IF_ERROR(CheckPositive("ranks", ranks));
  EPLBX_RETURN_IF_ERROR(CheckPositive("nodes", nodes));
  EPLBX_RETURN_IF_ERROR(CheckPositive("slots", slots));
  EPLBX_RETURN_IF_ERROR(CheckPositive("groups", groups));
  if (slots % ranks != 0) {
    return Status::InvalidArgument(StrCat("slots (", slots, ") is not a multiple of ranks (", ranks,
                                          "): every rank must hold the same number of "
                                          "slots; try slots = ",
                                          (slots / ranks + 1) * ranks));
  }
  if (ranks % nodes != 0) {
    return Status::InvalidArgument(StrCat("ranks (", ranks, ") is not a multiple of nodes (", nodes,
                                          "): every node must hold the same number of ranks"));
  }
  if (experts <= 0) return Status::OK();
  if (experts % groups != 0) {
    return Status::InvalidArgument(StrCat("experts (", experts, ") is not a multiple of groups (",
                                          groups,
                                          "): every group must hold the same number of experts"));
  }
  if (slots < experts) {
    return Status::InvalidArgument(StrCat("slots (", slots, ") is less than experts (", experts,
                                          "): every expert needs at least one slot"));
  }
  return Status::OK();
}

Result<LoadMatrix> LoadMatrix::Create(int layers, int experts, std::vector<double> values) {
  if (layers < 1 || experts < 1) {
    return Status::InvalidArgument(StrCat("load is empty (", layers, " layers x ", experts,
                                          " experts); expected at least one of each"));
  }
  if (layers > kMaxDimension || experts > kMaxDimension) {
    return Status::InvalidArgument(StrCat("load is ", layers, " layers x ", experts,
                                          " experts; each dimension must be <= ", kMaxDimension));
  }
  const size_t expected = static_cast<size_t>(layers) * static_cast<size_t>(experts);
  if (expected > kMaxEntries) {
    return Status::InvalidArgument(StrCat("load is ", layers, " layers x ", experts,
                                          " experts; at most ", kMaxEntries, " values"));
  }
  if (values.size() != expected) {
    return Status::InvalidArgument(StrCat("load has ", values.size(), " values; expected ", layers,
                                          " layers x ", experts, " experts = ", expected));
  }
  for (size_t i = 0; i < values.size(); ++i) {
    const double v = values[i];
    // The DeepSeek policy computes in float32, as the reference does; values beyond
    // float32's range would become infinite there.
    if (!std::isfinite(v) || v < 0 || v > std::numeric_limits<float>::max()) {
      return Status::InvalidArgument(StrCat(
          "layer ", i / experts, ", expert ", i % experts, ": load is ", v,
          " (expected a finite number >= 0 and <= ", std::numeric_limits<float>::max(), ")"));
    }
  }
  LoadMatrix m;
  m.layers_ = layers;
  m.experts_ = experts;
  m.values_ = std::move(values);
  return m;
}

Result<LoadMatrix> LoadMatrix::FromRows(const std::vector<std::vector<double>>& rows) {
  if (rows.empty() || rows[0].empty()) {
    return Status::InvalidArgument("load is empty; expected at least one layer of one expert");
  }
  std::vector<double> flat;
  flat.reserve(rows.size() * rows[0].size());
  for (size_t l = 0; l < rows.size(); ++l) {
    if (rows[l].size() != rows[0].size()) {
      return Status::InvalidArgument(StrCat("layer ", l, " has ", rows[l].size(),
                                            " experts but layer 0 has ", rows[0].size(),
                                            " (every layer must have the same experts)"));
    }
    flat.insert(flat.end(), rows[l].begin(), rows[l].end());
  }
  if (rows.size() > static_cast<size_t>(kMaxDimension) ||
      rows[0].size() > static_cast<size_t>(kMaxDimension)) {
    return Status::InvalidArgument(StrCat("load is ", rows.size(), " layers x ", rows[0].size(),
                                          " experts; each dimension must be <= ", kMaxDimension));
  }
  return Create(static_cast<int>(rows.size()), static_cast<int>(rows[0].size()), std::move(flat));
}

Result<Placement> Placement::FromPhy2Log(int layers, int slots, int experts,
                                         std::vector<int32_t> phy2log) {
  if (layers < 1 || slots < 1 || experts < 1 || layers > kMaxDimension || slots > kMaxDimension ||
      experts > kMaxDimension) {
    return Status::InvalidArgument(
        StrCat("placement shape ", layers, " layers x ", slots, " slots with ", experts,
               " experts is invalid (each must be in [1, ", kMaxDimension, "])"));
  }
  const size_t expected = static_cast<size_t>(layers) * static_cast<size_t>(slots);
  if (expected > kMaxEntries ||
      static_cast<size_t>(layers) * static_cast<size_t>(experts) > kMaxEntries) {
    return Status::InvalidArgument(StrCat("placement of ", layers, " layers x ", slots, " slots x ",
                                          experts, " experts is too large (at most ", kMaxEntries,
                                          " entries per matrix)"));
  }
  if (phy2log.size() != expected) {
    return Status::InvalidArgument(StrCat("phy2log has ", phy2log.size(), " entries; expected ",
                                          layers, " layers x ", slots, " slots = ", expected));
  }
  Placement p;
  p.layers_ = layers;
  p.slots_ = slots;
  p.experts_ = experts;
  p.logcnt_.assign(static_cast<size_t>(layers) * static_cast<size_t>(experts), 0);
  for (int l = 0; l < layers; ++l) {
    for (int s = 0; s < slots; ++s) {
      const int32_t e = phy2log[p.Slot(l, s)];
      if (e < -1 || e >= experts) {
        return Status::InvalidArgument(StrCat("layer ", l, ", slot ", s, ": expert id ", e,
                                              " is out of range (expected -1 for an empty slot "
                                              "or an id in [0, ",
                                              experts, "))"));
      }
      if (e >= 0) p.max_replicas_ = std::max(p.max_replicas_, ++p.logcnt_[p.Expert(l, e)]);
    }
  }
  // Replicas in CSR form; a per-layer cursor keeps the scratch memory to one layer.
  p.replica_offset_.resize(p.logcnt_.size() + 1);
  p.replica_offset_[0] = 0;
  for (size_t i = 0; i < p.logcnt_.size(); ++i) {
    p.replica_offset_[i + 1] = p.replica_offset_[i] + static_cast<uint32_t>(p.logcnt_[i]);
  }
  p.replica_slots_.resize(p.replica_offset_.back());
  std::vector<uint32_t> cursor(static_cast<size_t>(experts));
  for (int l = 0; l < layers; ++l) {
    std::copy_n(p.replica_offset_.begin() + static_cast<ptrdiff_t>(p.Expert(l, 0)), experts,
                cursor.begin());
    for (int s = 0; s < slots; ++s) {  // ascending slots give ascending replica lists
      const int32_t e = phy2log[p.Slot(l, s)];
      if (e >= 0) p.replica_slots_[cursor[static_cast<size_t>(e)]++] = s;
    }
  }
  p.phy2log_ = std::move(phy2log);
  return p;
}

std::vector<int32_t> Placement::Log2PhyPadded() const {
  const size_t width = static_cast<size_t>(max_replicas_);
  std::vector<int32_t> out(logcnt_.size() * width, -1);
  for (size_t i = 0; i < logcnt_.size(); ++i) {
    std::copy_n(replica_slots_.begin() + replica_offset_[i], logcnt_[i], out.begin() + i * width);
  }
  return out;
}

Status Placement::CheckEveryExpertPlaced() const {
  for (int l = 0; l < layers_; ++l) {
    for (int e = 0; e < experts_; ++e) {
      if (logcnt(l, e) == 0) {
        return Status::InvalidArgument(
            StrCat("layer ", l, ": expert ", e, " has no replica in any slot"));
      }
    }
  }
  return Status::OK();
}

std::vector<double> RankLoads(const Placement& placement, const LoadMatrix& load, int layer,
                              int ranks) {
  std::vector<double> loads(static_cast<size_t>(ranks), 0.0);
  const int per_rank = placement.slots() / ranks;
  for (int s = 0; s < placement.slots(); ++s) {
    const int32_t e = placement.phy2log(layer, s);
    if (e < 0) continue;
    loads[static_cast<size_t>(s / per_rank)] +=
        load.at(layer, e) / static_cast<double>(placement.logcnt(layer, e));
  }
  return loads;
}

Result<Balance> ComputeBalance(const Placement& placement, const LoadMatrix& load, int ranks) {
  if (placement.layers() != load.layers() || placement.experts() != load.experts()) {
    return Status::Mismatch(StrCat("placement is ", placement.layers(), " layers x ",
                                   placement.experts(), " experts but load is ", load.layers(),
                                   " layers x ", load.experts(), " experts"));
  }
  if (ranks < 1 || placement.slots() % ranks != 0) {
    return Status::InvalidArgument(
        StrCat("ranks (", ranks, ") must divide the placement's ", placement.slots(), " slots"));
  }
  Balance b;
  double sum_mean = 0, sum_max = 0;
  for (int l = 0; l < placement.layers(); ++l) {
    const std::vector<double> loads = RankLoads(placement, load, l, ranks);
    double total = 0, max = 0;
    for (double v : loads) {
      total += v;
      max = std::max(max, v);
    }
    const double mean = total / ranks;
    b.per_layer.push_back(max > 0 ? mean / max : 1.0);
    sum_mean += mean;
    sum_max += max;
  }
  b.total = sum_max > 0 ? sum_mean / sum_max : 1.0;
  return b;
}

}  // namespace eplbx
