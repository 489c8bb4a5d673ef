// Copyright (c) eplbx authors. The placement model: topology, load, placement, balance.
//
// Vocabulary (the field's): a *logical expert* is one expert of the model; a *physical slot*
// is one row of expert weights on some rank; a logical expert may have several *replicas*.
//   phy2log[layer][slot]            logical expert held by a slot (-1: empty slot)
//   log2phy[layer][expert][k]       the slots holding the expert, ascending, -1 padded
//   logcnt[layer][expert]           number of replicas
// Slot s lives on rank s / (slots / ranks); rank r lives on node r / (ranks / nodes).
//
// All types here are plain values: copyable, no shared state, safe to use from any thread
// as long as one object is not mutated concurrently.
#ifndef EPLBX_PLACEMENT_H_
#define EPLBX_PLACEMENT_H_

#include <cstdint>
#include <span>
#include <vector>

#include "eplbx/status.h"

namespace eplbx {

// The shape of an expert-parallel deployment.
struct Topology {
  int ranks = 1;   // GPUs (expert-parallel ranks)
  int nodes = 1;   // hosts; ranks % nodes == 0
  int slots = 1;   // physical slots in total; slots % ranks == 0
  int groups = 1;  // expert groups (DeepSeek-V3 has 8); experts % groups == 0

  int slots_per_rank() const { return slots / ranks; }
  int ranks_per_node() const { return ranks / nodes; }
  int rank_of_slot(int slot) const { return slot / slots_per_rank(); }
  int node_of_rank(int rank) const { return rank / ranks_per_node(); }

  // Checks every field and their divisibility rules against `experts` logical experts
  // (pass experts <= 0 to skip the expert rules). The message names the field, its value
  // and what was expected.
  Status Validate(int experts) const;
  // The work a plan or migration of `layers` x `experts` on this topology implies must fit
  // the documented limits (docs/placement.md): slots and experts per layer <= kMaxSlots,
  // ranks x experts, layers x slots and layers x experts <= kMaxWorkEntries. Beyond them a
  // plan would take gigabytes or minutes; the error names the product and the limit.
  Status CheckWork(int layers, int experts) const;
  static constexpr int kMaxSlots = 1 << 16;
  static constexpr int64_t kMaxWorkEntries = int64_t{1} << 24;
};

// Load per (layer, logical expert): tokens routed, or any non-negative finite weight.
class LoadMatrix {
 public:
  LoadMatrix() = default;

  // REQUIRES nothing: every rule is checked. Errors name the layer, expert and value.
  // `values` is row-major, layers x experts.
  static Result<LoadMatrix> Create(int layers, int experts, std::vector<double> values);
  // Rows must all have the same length.
  static Result<LoadMatrix> FromRows(const std::vector<std::vector<double>>& rows);

  int layers() const { return layers_; }
  int experts() const { return experts_; }
  double at(int layer, int expert) const { return values_[Index(layer, expert)]; }
  const double* row(int layer) const { return values_.data() + Index(layer, 0); }
  const std::vector<double>& values() const { return values_; }

 private:
  size_t Index(int layer, int expert) const {
    return static_cast<size_t>(layer) * static_cast<size_t>(experts_) + static_cast<size_t>(expert);
  }

  int layers_ = 0;
  int experts_ = 0;
  std::vector<double> values_;
};

// Where every logical expert of every layer lives. Built only through FromPhy2Log, so
// phy2log, log2phy and logcnt always agree.
class Placement {
 public:
  Placement() = default;

  // `phy2log` is row-major, layers x slots. Every entry must be -1 (empty slot) or in
  // [0, experts). Experts without a replica are allowed here (logcnt 0); policies never
  // produce them, and CheckEveryExpertPlaced() rejects them.
  static Result<Placement> FromPhy2Log(int layers, int slots, int experts,
                                       std::vector<int32_t> phy2log);

  int layers() const { return layers_; }
  int slots() const { return slots_; }
  int experts() const { return experts_; }
  // Largest replica count over all layers and experts (the width of log2phy); >= 1.
  int max_replicas() const { return max_replicas_; }

  int32_t phy2log(int layer, int slot) const { return phy2log_[Slot(layer, slot)]; }
  int32_t logcnt(int layer, int expert) const { return logcnt_[Expert(layer, expert)]; }
  // k-th slot (ascending) holding `expert`, or -1 when k >= logcnt.
  int32_t log2phy(int layer, int expert, int k) const {
    return k < logcnt(layer, expert)
               ? replica_slots_[replica_offset_[Expert(layer, expert)] + static_cast<size_t>(k)]
               : -1;
  }
  // The slots holding `expert`, ascending (logcnt entries).
  std::span<const int32_t> replicas(int layer, int expert) const {
    return {replica_slots_.data() + replica_offset_[Expert(layer, expert)],
            static_cast<size_t>(logcnt(layer, expert))};
  }

  // Row-major layers x slots.
  const std::vector<int32_t>& phy2log() const { return phy2log_; }
  // Row-major layers x experts.
  const std::vector<int32_t>& logcnt() const { return logcnt_; }
  // The field's dense log2phy: row-major layers x experts x max_replicas(), ascending,
  // -1 padded. Built on each call (the Placement itself stores replicas compactly).
  std::vector<int32_t> Log2PhyPadded() const;

  // Error (naming layer and expert) when some expert has no replica.
  Status CheckEveryExpertPlaced() const;

  friend bool operator==(const Placement& a, const Placement& b) {
    return a.layers_ == b.layers_ && a.slots_ == b.slots_ && a.experts_ == b.experts_ &&
           a.phy2log_ == b.phy2log_;
  }

 private:
  size_t Slot(int layer, int slot) const {
    return static_cast<size_t>(layer) * static_cast<size_t>(slots_) + static_cast<size_t>(slot);
  }
  size_t Expert(int layer, int expert) const {
    return static_cast<size_t>(layer) * static_cast<size_t>(experts_) + static_cast<size_t>(expert);
  }

  int layers_ = 0;
  int slots_ = 0;
  int experts_ = 0;
  int max_replicas_ = 1;
  std::vector<int32_t> phy2log_;
  std::vector<int32_t> logcnt_;
  // Replicas in CSR form: the slots of (layer, expert) i, ascending, are
  // replica_slots_[replica_offset_[i] .. replica_offset_[i] + logcnt_[i]).
  std::vector<uint32_t> replica_offset_;
  std::vector<int32_t> replica_slots_;
};

// Load of each rank in one layer: the sum over the rank's slots of
// load(expert) / replicas(expert). Empty slots add nothing.
// REQUIRES: placement and load agree on layers and experts; ranks divides slots.
std::vector<double> RankLoads(const Placement& placement, const LoadMatrix& load, int layer,
                              int ranks);

struct Balance {
  std::vector<double> per_layer;  // mean rank load / max rank load; 1.0 for an all-zero layer
  double total = 1.0;             // sum over layers of mean / sum over layers of max
};

// Balancedness of `placement` under `load`. Errors when shapes disagree.
Result<Balance> ComputeBalance(const Placement& placement, const LoadMatrix& load, int ranks);

}  // namespace eplbx

#endif  // EPLBX_PLACEMENT_H_
