// The `balanced` policy: replica counts and packing chosen together, then local search.
#include <algorithm>
#include <functional>
#include <numeric>
#include <queue>

#include "plan/balanced_internal.h"
#include "plan/local_search.h"

namespace eplbx::internal {

void BalancedSlots(std::span<const double> weight, int slots, int ranks, std::span<int32_t> out) {
  const int n = static_cast<int>(weight.size());
  const int per_rank = slots / ranks;
  // Replica counts: each extra replica to the largest share (ties: lowest expert), at most
  // one replica per rank while the slots allow it.
  const int cap = std::max(ranks, (slots + n - 1) / n);
  std::vector<int32_t> count(static_cast<size_t>(n), 1);
  using Entry = std::pair<double, int32_t>;  // (share, -expert): max-heap, lowest id first
  std::priority_queue<Entry> heap;
  for (int32_t e = 0; e < n; ++e) heap.push({weight[e], -e});
  for (int i = n; i < slots; ++i) {
    while (count[-heap.top().second] >= cap) heap.pop();
    const int32_t e = -heap.top().second;
    heap.pop();
    ++count[e];
    heap.push({weight[e] / count[e], -e});
  }
  // Packing: replicas by descending share (ties: lowest expert), each to the lightest rank
  // with room that does not hold the expert (ties: lowest rank); duplicates only when
  // nothing else fits.
  std::vector<int32_t> replicas;
  for (int32_t e = 0; e < n; ++e) replicas.insert(replicas.end(), count[e], e);
  auto share = [&](int32_t e) { return weight[e] / count[e]; };
  std::stable_sort(replicas.begin(), replicas.end(),
                   [&](int32_t a, int32_t b) { return share(a) > share(b); });
  std::vector<int32_t> packed(static_cast<size_t>(slots), -1);
  std::vector<double> load(static_cast<size_t>(ranks), 0.0);
  std::vector<int> filled(static_cast<size_t>(ranks), 0);
  auto holds = [&](int r, int32_t e) {
    const auto first = packed.begin() + r * per_rank;
    return std::find(first, first + filled[r], e) != first + filled[r];
  };
  for (int32_t e : replicas) {
    int best = -1;
    for (int pass = 0; pass < 2 && best < 0; ++pass) {
      for (int r = 0; r < ranks; ++r) {
        if (filled[r] == per_rank || (pass == 0 && holds(r, e))) continue;
        if (best < 0 || load[r] < load[best]) best = r;
      }
    }
    packed[best * per_rank + filled[best]++] = e;
    load[best] += share(e);
  }
  // Local search on the heaviest rank: swaps and re-pointed replicas.
  Layout layout(weight, std::move(packed), ranks);
  for (int iter = 0; iter < 64 * ranks; ++iter) {
    const Move move = BestMove(layout, layout.Heaviest(), nullptr);
    if (move.a < 0) break;
    Apply(layout, move);
  }
  std::copy(layout.expert.begin(), layout.expert.end(), out.begin());
}

std::vector<int32_t> AssignGroupsToNodes(std::span<const double> group_load, int nodes) {
  const int g = static_cast<int>(group_load.size());
  const int per_node = g / nodes;
  std::vector<int32_t> order(static_cast<size_t>(g));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return group_load[a] > group_load[b]; });
  // Greedy start: heaviest group to the lightest node with room (ties: lowest node).
  std::vector<int32_t> best(static_cast<size_t>(g)), cur(static_cast<size_t>(g));
  std::vector<double> load(static_cast<size_t>(nodes), 0.0);
  std::vector<int> fill(static_cast<size_t>(nodes), 0);
  for (int32_t k : order) {
    int pick = -1;
    for (int n = 0; n < nodes; ++n) {
      if (fill[n] < per_node && (pick < 0 || load[n] < load[pick])) pick = n;
    }
    best[k] = pick;
    load[pick] += group_load[k];
    ++fill[pick];
  }
  double best_max = *std::max_element(load.begin(), load.end());
  // Exact branch and bound over the rest, within a budget.
  std::fill(load.begin(), load.end(), 0.0);
  std::fill(fill.begin(), fill.end(), 0);
  int64_t budget = 2'000'000;
  std::function<void(int)> search = [&](int i) {
    if (--budget < 0) return;
    if (i == g) {
      const double m = *std::max_element(load.begin(), load.end());
      if (m < best_max * (1 - 1e-12)) {
        best_max = m;
        best = cur;
      }
      return;
    }
    const int32_t k = order[i];
    bool tried_empty = false;
    for (int n = 0; n < nodes; ++n) {
      if (fill[n] == per_node) continue;
      if (fill[n] == 0) {  // empty nodes are interchangeable: try only the first
        if (tried_empty) continue;
        tried_empty = true;
      }
      if (load[n] + group_load[k] >= best_max * (1 - 1e-12)) continue;
      load[n] += group_load[k];
      ++fill[n];
      cur[k] = n;
      search(i + 1);
      load[n] -= group_load[k];
      --fill[n];
    }
  };
  search(0);
  return best;
}

double NodeBalancedness(std::span<const double> group_load, std::span<const int32_t> node,
                        int nodes) {
  std::vector<double> load(static_cast<size_t>(nodes), 0.0);
  for (size_t k = 0; k < group_load.size(); ++k) load[node[k]] += group_load[k];
  const double max = *std::max_element(load.begin(), load.end());
  const double total = std::accumulate(load.begin(), load.end(), 0.0);
  return max > 0 ? total / nodes / max : 1.0;
}

}  // namespace eplbx::internal
