// Internal: helpers on one layer's slots (rank-major expert ids) shared by the policies.
#ifndef EPLBX_SRC_PLAN_ROWS_H_
#define EPLBX_SRC_PLAN_ROWS_H_

#include <cstdint>
#include <span>
#include <vector>

#include "eplbx/policy.h"

namespace eplbx::internal {

// Per rank: the sum of weight / replicas over its slots.
std::vector<double> RankLoads(std::span<const double> weight, std::span<const int32_t> slots,
                              int ranks);

// mean / max rank load, rank load = sum of weight / replicas over its slots (1.0 if zero).
double SlotsBalancedness(std::span<const double> weight, std::span<const int32_t> slots, int ranks);
// The same from the rank loads RankLoads gave.
double LoadsBalancedness(std::span<const double> load);

// `previous` made a valid placement for these experts: every expert present and every slot
// filled. A missing expert takes an empty slot, else the redundant replica with the
// smallest share (on the lightest rank); leftover empty slots take extra replicas of the
// largest shares. Unchanged when `previous` is already complete.
std::vector<int32_t> CompleteSlots(std::span<const double> weight,
                                   std::span<const int32_t> previous, int ranks);

// Renames the ranks of `next` within each node so that as many (rank, expert) pairs as
// possible are the same as in `previous` (greedy: the pair of ranks sharing the most
// experts first; ties: lowest ranks).
void RelabelRanks(std::span<const int32_t> previous, std::vector<int32_t>& next, int ranks,
                  int ranks_per_node);

// Reorders each rank's rows in `next` so that an expert the rank held before keeps its old
// row; the others fill the remaining rows in their current order.
void PreserveRows(std::span<const int32_t> previous, std::span<int32_t> next, int ranks);

LayerMoves CountLayerMoves(std::span<const int32_t> previous, std::span<const int32_t> next,
                           int ranks);

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_PLAN_ROWS_H_
