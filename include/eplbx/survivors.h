// Re-placement over the surviving ranks after ranks are lost (docs/placement.md, "After a
// lost rank").
//
// Given the placement in force and which ranks are still alive, plan a placement that uses
// only live ranks, incremental from what the survivors hold, and say how to reach it: a
// migration among the survivors (sources: surviving replicas only), then the experts whose
// every replica was on lost ranks, recovered from a backup source (a host backup, the
// checkpoint) into the slots the new placement gives them.
//
// Pure and deterministic (the same input gives the same plan on every rank); thread safe.
#ifndef EPLBX_SURVIVORS_H_
#define EPLBX_SURVIVORS_H_

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "eplbx/migration.h"
#include "eplbx/placement.h"
#include "eplbx/policy.h"
#include "eplbx/status.h"

namespace eplbx {

struct SurvivorOptions {
  Policy policy = Policy::kIncremental;  // from what the survivors hold
  double tolerance = 0.002;              // kIncremental, as in PlanOptions
  // May expert `expert` of `layer` be recovered from a backup source? (null: no backup: an
  // expert no survivor holds fails the plan, naming it.)
  std::function<bool(int layer, int expert)> backup;
  // For the migration among the survivors (same-node sources first, byte figures).
  MigrationOptions migration;
};

// One slot the new placement fills from a backup source: no survivor held its expert.
struct RecoveredSlot {
  int layer = 0;
  int expert = 0;
  int slot = 0;  // rank = slot / slots per rank, row = slot % slots per rank
};

struct SurvivorPlan {
  std::vector<int> lost_ranks;  // ascending
  // The placement in force with the lost ranks' slots emptied (-1): what can still be read.
  Placement sources;
  // The placement to serve with: every expert on live ranks, the lost ranks' slots empty.
  Placement placement;
  // Step 1: `migration` turns `sources` into `interim` (ApplyMigration), moving only between
  // survivors; `interim` is `placement` except that each recovered slot keeps what it held.
  Placement interim;
  MigrationPlan migration;
  // Step 2: each recovered slot is filled from the backup source; then `placement` is in force.
  std::vector<RecoveredSlot> recovered;
  int64_t experts_recovered = 0;  // (layer, expert) pairs no survivor held
};

// `in_force`: the placement in force over every rank (slots = ranks x slots per rank);
// `load`: the load to balance for; `topology`: the deployment before the loss; `live[r]`:
// rank r survives. The new placement is planned on a topology of the survivors (nodes kept
// when every node lost the same number of ranks, else one node), then spread back over the
// live ranks' slots. Errors (nothing planned): shapes that disagree, no survivor, fewer
// surviving slots than experts, and experts no survivor holds without a backup — named:
// "ranks 2 were lost with the only replicas of 3 experts (layer 0: 5, 9; layer 3: 1) and no
// backup source holds them; register a host backup or the checkpoint (SurvivorOptions::backup)".
Result<SurvivorPlan> PlanSurvivors(const Placement& in_force, const LoadMatrix& load,
                                   const Topology& topology, const std::vector<bool>& live,
                                   const SurvivorOptions& options = {});

// ---- Placements over the members --------------------------------------------------------
//
// A deployment of `topology.ranks` ranks where only the ranks with live[r] serve: their
// slots in rank order make a smaller deployment (rank k of it is the k-th live rank).

// The topology of the members: their slots; the nodes kept when every node lost the same
// number of ranks and the members still split evenly over them, else one node.
Topology MembersTopology(const Topology& topology, const std::vector<bool>& live);
// The members' slots of `full` (over `topology`), compact in rank order.
Result<Placement> CompactToMembers(const Placement& full, const Topology& topology,
                                   const std::vector<bool>& live);
// `compact` (over MembersTopology) spread back over every rank's slots, the other ranks'
// slots empty (-1).
Result<Placement> SpreadOverMembers(const Placement& compact, const Topology& topology,
                                    const std::vector<bool>& live);

// ---- Elastic resize (docs/placement.md, "Adding and removing ranks") --------------------
//
// Ranks join with empty slots and ranks leave gracefully: a leaving rank is still readable
// until the migration is done (its experts are drained to the others first), unlike a lost
// one. Slots per rank stay as they are.
struct ResizeRequest {
  int add = 0;              // new ranks, numbered after the existing ones, with empty slots
  std::vector<int> remove;  // existing ranks that leave once drained (any order, none twice)
};

struct ResizePlan {
  std::vector<int> added_ranks;    // ascending
  std::vector<int> removed_ranks;  // ascending
  // The ranks that serve afterwards, as ids of the span (every old rank, then the added
  // ones): the kept ranks in order, then the added ranks. Rank k after the resize is
  // members[k] during it.
  std::vector<int> members;
  Topology topology;  // after: members.size() ranks (nodes kept when the change is whole nodes)
  // During the move, over the span (old ranks + added ones): what the slots hold now (added
  // ranks empty), the placement to reach (removed ranks empty), and the migration between
  // them (removed ranks are sources only; added ranks destinations only).
  Placement sources;
  Placement placement;
  MigrationPlan migration;
  // What the span holds once `migration` ran: `placement`, except that the removed ranks'
  // rows keep what they held (they were only read; nothing serves from them any more).
  // Rearrange(sources, interim, migration) is the drain (as SurvivorPlan::interim).
  Placement interim;
  // `placement` over the ranks after the resize, renumbered by `members`.
  Placement after;
};

// `in_force` over `topology`; `load`: the load to balance for. The new placement is planned
// incremental (options.policy) from what the staying ranks hold, on the topology after; the
// migration's sources are every old rank, the leaving ones included. Nodes are kept (ranks per
// node unchanged) when only whole nodes are added or removed, else the plan and the migration
// see one node. Errors (nothing planned), named: a negative or too large add, a rank to remove
// out of range or listed twice, no rank left, fewer slots after than experts.
Result<ResizePlan> PlanResize(const Placement& in_force, const LoadMatrix& load,
                              const Topology& topology, const ResizeRequest& request,
                              const SurvivorOptions& options = {});

}  // namespace eplbx

#endif  // EPLBX_SURVIVORS_H_
