// Internal: numbering transfers into contention-free rounds (bipartite edge colouring).
#ifndef EPLBX_SRC_PLAN_ROUND_COLORING_H_
#define EPLBX_SRC_PLAN_ROUND_COLORING_H_

#include <cstdint>
#include <utility>
#include <vector>

namespace eplbx::internal {

// pairs: distinct (reader, server) rank pairs, reader != server, ids in [0, ranks).
// Returns a round for every pair such that in each round every rank reads from at most
// one server and serves at most one reader, using exactly D rounds, D = the largest number
// of distinct peers any rank reads from or serves (König's theorem; D is also a lower
// bound). Pairs are coloured in the given order with the lowest free round, swapping two
// rounds along an alternating path when the reader's and the server's lowest free rounds
// differ. Deterministic.
std::vector<int32_t> ColorRounds(const std::vector<std::pair<int32_t, int32_t>>& pairs, int ranks,
                                 int* rounds_used);

// The lower bound D for `pairs` (0 when empty).
int RoundsLowerBound(const std::vector<std::pair<int32_t, int32_t>>& pairs, int ranks);

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_PLAN_ROUND_COLORING_H_
