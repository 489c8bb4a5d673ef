// Internal: the `incremental` policy's local search. Not installed.
#ifndef EPLBX_SRC_PLAN_INCREMENTAL_INTERNAL_H_
#define EPLBX_SRC_PLAN_INCREMENTAL_INTERNAL_H_

#include <cstdint>
#include <span>
#include <vector>

namespace eplbx::internal {

// Starting from `start` (one layer's slots, rank-major, expert ids), repeatedly applies
// the move with the most relief per copy paid — relief: the total rank load above `goal`
// that disappears; moves: swaps of one or two replicas between ranks, or re-pointing a
// redundant replica to another expert (BestMove with a goal); a copy is a (rank, expert)
// pair absent from `previous` (same shape) — until no rank is above `goal`, no move helps,
// or `max_steps` moves were made. Ties: lower ranks and slots.
std::vector<int32_t> ImproveFrom(std::span<const double> weight, std::span<const int32_t> previous,
                                 std::span<const int32_t> start, int ranks, double goal,
                                 int max_steps);

// `start` with redundant replicas re-pointed until every expert e has count[e] replicas
// (or no further re-point is possible): repeatedly, the expert short of replicas with the
// largest share after one more (ties: lowest expert) takes a surplus replica on the
// lightest rank that lacks it (ties: lowest slot). One copy per re-point.
std::vector<int32_t> AdoptCounts(std::span<const double> weight, std::span<const int32_t> start,
                                 int ranks, std::span<const int32_t> count);

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_PLAN_INCREMENTAL_INTERNAL_H_
