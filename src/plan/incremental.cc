// The `incremental` policy: start from the previous placement and move as few expert
// copies as possible until the layer is within the tolerance of `balanced`.
#include "plan/incremental_internal.h"

#include <numeric>

#include "plan/local_search.h"

namespace eplbx::internal {

std::vector<int32_t> ImproveFrom(std::span<const double> weight, std::span<const int32_t> previous,
                                 std::span<const int32_t> start, int ranks, double target,
                                 int max_steps) {
  const size_t n = weight.size();
  Layout layout(weight, std::vector<int32_t>(start.begin(), start.end()), ranks);
  // Load removed below the largest load that meets the target is worth nothing: prefer the
  // cheapest move that brings the heaviest rank down to it without lifting another above.
  const double total = std::accumulate(weight.begin(), weight.end(), 0.0);
  layout.goal = target > 0 ? total / ranks / target : 0;
  std::vector<uint8_t> before(static_cast<size_t>(ranks) * n, 0);
  for (size_t s = 0; s < previous.size(); ++s) {
    if (previous[s] >= 0) before[static_cast<size_t>(layout.rank_of(s)) * n + previous[s]] = 1;
  }
  for (int step = 0; step < max_steps && layout.Balancedness() < target; ++step) {
    const Move move = BestMove(layout, layout.Heaviest(), &before);
    if (move.a < 0) break;
    Apply(layout, move);
  }
  return layout.expert;
}

}  // namespace eplbx::internal
