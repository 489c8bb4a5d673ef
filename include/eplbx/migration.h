// Copyright (c) eplbx authors. Migration planning: from an old and a new placement to the
// fewest, best-sourced, contention-free transfers.
//
// Rows: a rank holds slots_per_rank = slots / ranks rows of expert weights; slot s is row
// s % slots_per_rank of rank s / slots_per_rank. Every "row" below is such a local row.
//
// Semantics of a plan, per layer: every source refers to the rank's contents *before* the
// migration (the old placement), except a local copy with source kNew, which copies a row
// of the same rank *after* that row's remote read has landed. An executor therefore
// stages what it overwrites (or orders the copies) so that no source row is overwritten
// before it is read.
//
// Pure and deterministic: no I/O, no threads; the same input gives the same plan on every
// machine (tie rules in docs/migration.md). Thread safe.
#ifndef EPLBX_MIGRATION_H_
#define EPLBX_MIGRATION_H_

#include <cstdint>
#include <vector>

#include "eplbx/placement.h"
#include "eplbx/status.h"

namespace eplbx {

// One one-sided read of a whole expert row from another rank.
struct RemoteRead {
  int32_t src = 0;      // rank that serves the bytes (holds `expert` in the old placement)
  int32_t src_row = 0;  // its row holding `expert` in the old placement
  int32_t dst = 0;      // rank that reads
  int32_t dst_row = 0;  // row that receives `expert`
  int32_t expert = 0;   // logical expert
  int32_t round = 0;    // 0-based; in a round a rank reads from one peer and serves one peer
};

enum class CopySource {
  kOld,  // a row of the same rank that holds the expert in the old placement
  kNew,  // a row of the same rank that receives the expert by a remote read in this plan
};

// A copy within one rank (no network).
struct LocalCopy {
  int32_t rank = 0;
  int32_t src_row = 0;
  int32_t dst_row = 0;
  int32_t expert = 0;
  CopySource source = CopySource::kOld;
};

struct LayerMigration {
  int layer = 0;
  std::vector<RemoteRead> transfers;    // sorted by (round, dst, src, dst_row)
  std::vector<LocalCopy> local_copies;  // sorted by (rank, dst_row)
  int rounds = 0;                       // rounds used
  int rounds_lower_bound = 0;           // the most distinct peers any rank has (König)
  uint64_t bytes_remote = 0;            // bytes read over the network
  uint64_t bytes_cross_node = 0;        // of which between nodes
  uint64_t max_bytes_in = 0;            // most bytes any rank reads
  uint64_t max_bytes_out = 0;           // most bytes any rank serves
};

struct MigrationSummary {
  int64_t remote_transfers = 0;
  int64_t local_copies = 0;
  uint64_t bytes_moved = 0;       // remote bytes, all layers
  uint64_t local_copy_bytes = 0;  // bytes copied within ranks, all layers
  uint64_t cross_node_bytes = 0;
  int64_t rounds = 0;              // sum over layers (layers run one after another)
  int64_t rounds_lower_bound = 0;  // sum over layers of the per-layer bound
  int max_rounds_per_layer = 0;
  uint64_t max_bytes_in = 0;   // largest per-layer bytes any rank reads
  uint64_t max_bytes_out = 0;  // largest per-layer bytes any rank serves
  // Sum over layers of max(max_bytes_in, max_bytes_out) / link bandwidth: no schedule that
  // moves one layer at a time over links of that bandwidth can be faster.
  double time_lower_bound_s = 0;
};

struct MigrationPlan {
  std::vector<LayerMigration> layers;
  MigrationSummary summary;
};

// The largest bytes_per_expert PlanMigration takes (1 TiB): byte totals (at most 2^24 rows
// moved) stay exact in uint64.
inline constexpr uint64_t kMaxBytesPerExpert = uint64_t{1} << 40;

struct MigrationOptions {
  int ranks = 1;
  int nodes = 1;                  // rank r is on node r / (ranks / nodes)
  uint64_t bytes_per_expert = 1;  // bytes of one expert row (all its tensors); <= 2^40
  double link_gbps = 100.0;       // per-rank link bandwidth, gigabits per second
};

// Plans the migration from `from` to `to` for every layer.
// Errors (nothing is returned): the placements differ in layers or slots; ranks or nodes
// do not divide; an expert needed in `to` has no holder in `from` (names layer, expert,
// rank and row).
Result<MigrationPlan> PlanMigration(const Placement& from, const Placement& to,
                                    const MigrationOptions& options);

// Applies one layer of a plan to row contents (row-major ranks x rows of expert ids, as
// phy2log) and returns the contents afterwards: what a correct executor produces. Rows
// the plan does not write keep their contents. Errors when a source row does not hold the
// expert it is said to hold. Used by tests and by users checking a plan.
Result<std::vector<int32_t>> ApplyMigration(const std::vector<int32_t>& contents,
                                            const LayerMigration& layer, int ranks);

}  // namespace eplbx

#endif  // EPLBX_MIGRATION_H_
