// Internal: the `balanced` and `incremental` policies' building blocks. Not installed.
#ifndef EPLBX_SRC_PLAN_BALANCED_INTERNAL_H_
#define EPLBX_SRC_PLAN_BALANCED_INTERNAL_H_

#include <cstdint>
#include <limits>
#include <span>
#include <vector>

namespace eplbx::internal {

// Places n = weight.size() experts into `slots` slots on `ranks` ranks (slots % ranks == 0,
// slots >= n) minimising the largest rank load, where a rank's load is the sum over its
// slots of weight / replicas. Replica counts: greedy largest share (capped at `ranks`);
// packing: heaviest replica first onto the lightest rank with room that does not hold the
// expert yet (ties: lowest rank); then local search: swap replicas between the heaviest
// rank and another rank, and re-point a redundant replica to another expert, while that
// lowers the heaviest rank's load. Writes out[slots] (expert ids, rank-major) and returns
// the largest rank load.
// No step of the search raises that maximum, so a search cut short once it is at most
// `enough` (0: never) ends at the full search's maximum where that is above `enough`, and
// at or below `enough` where the full search's is: a caller for whom no maximum below
// `enough` matters (another node's ranks are at least that heavy, or the floor below)
// gets the same max(maximum, enough) for less work.
double BalancedSlots(std::span<const double> weight, int slots, int ranks, std::span<int32_t> out,
                     double enough = 0);

// A largest rank load no placement of BalancedSlots can go below: the mean rank load, and
// the share of the heaviest expert with as many replicas as BalancedSlots allows.
double BalancedFloor(std::span<const double> weight, int slots, int ranks);

// The greedy packing BalancedSlots searches with, exposed for tests: count[e] replicas of
// each expert onto `ranks` ranks of `per_rank` slots (sum of counts = out.size()), heaviest
// share first onto the lightest rank with room that does not hold the expert yet (ties:
// lowest expert, lowest rank). Returns the largest rank load (infinity once a rank reaches
// `bound`) and the slots in `out`, rank-major. Two slots per rank (but for a zero share
// among the first `ranks` replicas) and at most 16 ranks take paths without the heap
// (`fast` says whether it did); `general` sends every shape through the heap (the
// reference those paths are tested against).
double PackReplicas(std::span<const double> weight, std::span<const int32_t> count, int ranks,
                    int per_rank, bool general, std::span<int32_t> out,
                    double bound = std::numeric_limits<double>::infinity(), bool* fast = nullptr);
// Tests: packs each of `counts` in turn with one packer, as the count search does (it keeps
// its order of experts by share from one call to the next and moves only those whose count
// changed); the slots of each packing.
std::vector<std::vector<int32_t>> PackEach(std::span<const double> weight,
                                           const std::vector<std::vector<int32_t>>& counts,
                                           int ranks, int per_rank);

// Packs the replicas of `count` (per expert) onto `ranks` ranks of out.size() / ranks slots
// like BalancedSlots' packing, except that a replica first goes to the lightest rank that
// held the expert (held: ranks x experts flags) where the rank stays within `cap`, so that
// it costs no copy. Replicas by descending share (ties: lowest expert).
void StickySlots(std::span<const double> weight, std::span<const int32_t> count,
                 std::span<const uint8_t> held, int ranks, double cap, std::span<int32_t> out);

// Assigns `groups.size()` groups to `nodes` nodes, groups.size() / nodes each, minimising
// the largest node load: exact search (groups by descending load, first empty node only)
// within a work budget, else the best found from a greedy start. Returns node per group.
std::vector<int32_t> AssignGroupsToNodes(std::span<const double> group_load, int nodes);

// mean / max of the node loads of an assignment (1.0 when all are zero).
double NodeBalancedness(std::span<const double> group_load, std::span<const int32_t> node,
                        int nodes);

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_PLAN_BALANCED_INTERNAL_H_
