// The `incremental` policy: start from the previous placement and move as few expert
// copies as possible until the layer is within the tolerance of `balanced`.
#include "plan/incremental_internal.h"

#include <algorithm>

#include "plan/local_search.h"

namespace eplbx::internal {

std::vector<int32_t> ImproveFrom(std::span<const double> weight, std::span<const int32_t> previous,
                                 std::span<const int32_t> start, int ranks, double goal,
                                 int max_steps) {
  const size_t n = weight.size();
  Layout layout(weight, std::vector<int32_t>(start.begin(), start.end()), ranks);
  // Load removed below the goal is worth nothing: prefer the cheapest moves that bring
  // every rank down to it.
  layout.goal = goal;
  std::vector<uint8_t> before(static_cast<size_t>(ranks) * n, 0);
  for (size_t s = 0; s < previous.size(); ++s) {
    if (previous[s] >= 0) before[static_cast<size_t>(layout.rank_of(s)) * n + previous[s]] = 1;
  }
  auto over = [&] { return *std::max_element(layout.load.begin(), layout.load.end()) > goal; };
  thread_local SwapCache cache(ranks);
  cache.Reset(ranks);
  for (int step = 0; step < max_steps && over(); ++step) {
    const Move move = BestMove(layout, layout.Heaviest(), &before, &cache);
    if (move.a < 0) break;
    Apply(layout, move);
    cache.Invalidate(layout, move);
  }
  return layout.expert;
}

std::vector<int32_t> AdoptCounts(std::span<const double> weight, std::span<const int32_t> start,
                                 int ranks, std::span<const int32_t> count) {
  Layout layout(weight, std::vector<int32_t>(start.begin(), start.end()), ranks);
  const int32_t n = static_cast<int32_t>(weight.size());
  for (size_t guard = 0; guard < layout.expert.size(); ++guard) {
    int32_t y = -1;  // the neediest expert short of replicas
    for (int32_t e = 0; e < n; ++e) {
      if (layout.count[e] < count[e] &&
          (y < 0 || weight[e] / (layout.count[e] + 1) > weight[y] / (layout.count[y] + 1))) {
        y = e;
      }
    }
    if (y < 0) break;
    int best = -1;  // a surplus replica on the lightest rank that lacks y
    for (size_t a = 0; a < layout.expert.size(); ++a) {
      const int32_t x = layout.expert[a];
      const int r = layout.rank_of(a);
      if (x < 0 || layout.count[x] <= count[x] || layout.holds(r, y)) continue;
      if (best < 0 || layout.load[r] < layout.load[layout.rank_of(static_cast<size_t>(best))]) {
        best = static_cast<int>(a);
      }
    }
    if (best < 0) break;
    Apply(layout, Move{.a = best, .to = y});
  }
  return layout.expert;
}

}  // namespace eplbx::internal
