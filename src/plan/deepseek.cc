// DeepSeek's EPLB algorithm (github.com/deepseek-ai/EPLB), re-implemented from its
// description to give identical phy2log and logcnt. See docs/placement.md for the tie rules.
#include <algorithm>
#include <bit>
#include <numeric>

#include "plan/deepseek_internal.h"

namespace eplbx::internal {

std::vector<int32_t> DescendingOrder(std::span<const float> weight) {
  // (-weight, index) as one integer key per item: for non-negative floats the bit pattern
  // orders like the value, so inverting it sorts descending, and the index in the low bits
  // breaks ties toward the lower index. Keys are unique, so an unstable sort of the keys
  // gives the stable order.
  const size_t n = weight.size();
  std::vector<uint64_t> keys(n);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t bits = std::bit_cast<uint32_t>(weight[i] + 0.0f);  // -0 -> +0
    keys[i] = (static_cast<uint64_t>(~bits) << 32) | static_cast<uint32_t>(i);
  }
  std::sort(keys.begin(), keys.end());
  std::vector<int32_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = static_cast<int32_t>(keys[i] & 0xffffffffu);
  return order;
}

void BalancedPacking(std::span<const float> weight, int packs, std::vector<int32_t>& pack,
                     std::vector<int32_t>& rank_in_pack) {
  const int n = static_cast<int>(weight.size());
  const int per_pack = n / packs;
  pack.assign(static_cast<size_t>(n), 0);
  rank_in_pack.assign(static_cast<size_t>(n), 0);
  if (per_pack == 1) {  // the reference's shortcut: identity, not the greedy
    std::iota(pack.begin(), pack.end(), 0);
    return;
  }
  const std::vector<int32_t> order = DescendingOrder(weight);
  std::vector<int32_t> pack_items(static_cast<size_t>(packs), 0);
  if (packs <= 16) {  // a linear scan beats a heap for the usual 4-16 ranks per node
    // `open` lists the packs with room, ascending, so the first lightest one wins ties;
    // `open_weight` mirrors their weights densely for a tight scan.
    std::vector<int32_t> open(static_cast<size_t>(packs));
    std::iota(open.begin(), open.end(), 0);
    std::vector<float> open_weight(static_cast<size_t>(packs), 0.0f);
    for (int32_t item : order) {
      size_t at = 0;
      float lightest = open_weight[0];
      for (size_t k = 1; k < open_weight.size(); ++k) {  // branch-free: loads are random
        const bool lighter = open_weight[k] < lightest;
        lightest = lighter ? open_weight[k] : lightest;
        at = lighter ? k : at;
      }
      const int32_t best = open[at];
      pack[item] = best;
      rank_in_pack[item] = pack_items[best]++;
      open_weight[at] += weight[item];
      if (pack_items[best] == per_pack) {
        open.erase(open.begin() + static_cast<ptrdiff_t>(at));
        open_weight.erase(open_weight.begin() + static_cast<ptrdiff_t>(at));
      }
    }
    return;
  }
  // Min-heap of packs with room, keyed (weight, index): the top is the lightest pack, the
  // lowest index among equals. Full packs leave the heap. Same choices as the scan above.
  std::vector<float> pack_weight(static_cast<size_t>(packs), 0.0f);
  auto heavier = [&](int32_t a, int32_t b) {
    return pack_weight[a] != pack_weight[b] ? pack_weight[a] > pack_weight[b] : a > b;
  };
  std::vector<int32_t> heap(static_cast<size_t>(packs));
  std::iota(heap.begin(), heap.end(), 0);  // equal weights, ascending index: a valid heap
  for (int32_t item : order) {
    std::pop_heap(heap.begin(), heap.end(), heavier);
    const int32_t best = heap.back();
    pack[item] = best;
    rank_in_pack[item] = pack_items[best]++;
    pack_weight[best] += weight[item];
    if (pack_items[best] == per_pack) {
      heap.pop_back();
    } else {
      std::push_heap(heap.begin(), heap.end(), heavier);
    }
  }
}

void ReplicateExperts(std::span<const float> weight, int physical, std::vector<int32_t>& phy2log,
                      std::vector<int32_t>& replica_rank, std::vector<int32_t>& count) {
  const int n = static_cast<int>(weight.size());
  phy2log.resize(static_cast<size_t>(physical));
  replica_rank.assign(static_cast<size_t>(physical), 0);
  count.assign(static_cast<size_t>(n), 1);
  std::iota(phy2log.begin(), phy2log.begin() + n, 0);
  const int extra = physical - n;
  if (static_cast<int64_t>(extra) * n <= 4096) {  // few replicas to add: scan for the max
    std::vector<float> share(weight.begin(), weight.end());
    for (int i = n; i < physical; ++i) {
      int best = 0;  // first maximum, branch-free
      float largest = share[0];
      for (int j = 1; j < n; ++j) {
        const bool larger = share[j] > largest;
        largest = larger ? share[j] : largest;
        best = larger ? j : best;
      }
      phy2log[i] = best;
      replica_rank[i] = count[best]++;
      share[best] = weight[best] / static_cast<float>(count[best]);
    }
    return;
  }
  // Max-heap of (weight / count, index): the top is the largest share, the lowest index
  // among equals (the same choice as max_element above). Only the chosen item's share
  // changes per step.
  struct Share {
    float value;
    int32_t index;
  };
  auto smaller = [](const Share& a, const Share& b) {
    return a.value != b.value ? a.value < b.value : a.index > b.index;
  };
  std::vector<Share> heap(static_cast<size_t>(n));
  for (int j = 0; j < n; ++j) heap[j] = {weight[j], j};
  std::make_heap(heap.begin(), heap.end(), smaller);
  for (int i = n; i < physical; ++i) {
    std::pop_heap(heap.begin(), heap.end(), smaller);
    Share& top = heap.back();
    const int best = top.index;
    phy2log[i] = best;
    replica_rank[i] = count[best]++;
    top.value = weight[best] / static_cast<float>(count[best]);
    std::push_heap(heap.begin(), heap.end(), smaller);
  }
}

DeepSeekNodes::DeepSeekNodes(std::span<const float> weight, int slots, int groups, int nodes,
                             int ranks, std::span<int32_t> phy2log, std::span<int32_t> logcnt)
    : weight_(weight),
      phy2log_(phy2log),
      logcnt_(logcnt),
      experts_per_node_(static_cast<int>(weight.size()) / nodes),
      slots_per_node_(slots / nodes),
      ranks_per_node_(ranks / nodes),
      slots_per_rank_(slots / ranks),
      node_load_(static_cast<size_t>(nodes), 0.0f),
      node_weight_(static_cast<size_t>(experts_per_node_)),
      replica_weight_(static_cast<size_t>(slots_per_node_)) {
  const int experts = static_cast<int>(weight.size());
  const int group_size = experts / groups;
  const int groups_per_node = groups / nodes;
  // Step 1: pack groups onto nodes. Group sums are taken in double and rounded once, which
  // is what torch's pairwise float32 sum gives for every realistic load.
  std::vector<float> group_load(static_cast<size_t>(groups));
  for (int g = 0; g < groups; ++g) {
    double sum = 0;
    for (int j = 0; j < group_size; ++j) sum += weight[g * group_size + j];
    group_load[g] = static_cast<float>(sum);
  }
  std::vector<int32_t> group_pack, group_rank;
  BalancedPacking(group_load, nodes, group_pack, group_rank);
  for (int g = 0; g < groups; ++g) node_load_[group_pack[g]] += group_load[g];
  // mlog2log: position in node-major order ("mlog") -> logical expert.
  mlog2log_.resize(static_cast<size_t>(experts));
  for (int e = 0; e < experts; ++e) {
    const int g = e / group_size;
    const int m = (group_pack[g] * groups_per_node + group_rank[g]) * group_size + e % group_size;
    mlog2log_[m] = e;
  }
}

void DeepSeekNodes::Plan(int node) {
  const int mlog_base = node * experts_per_node_;
  // Step 2: replicate the node's experts into the node's slots.
  for (int j = 0; j < experts_per_node_; ++j) node_weight_[j] = weight_[mlog2log_[mlog_base + j]];
  ReplicateExperts(node_weight_, slots_per_node_, phy2mlog_, replica_rank_, mlogcnt_);
  // Step 3: pack the replicas onto the node's ranks.
  for (int i = 0; i < slots_per_node_; ++i) {
    const int32_t m = phy2mlog_[i];
    replica_weight_[i] = node_weight_[m] / static_cast<float>(mlogcnt_[m]);
  }
  BalancedPacking(replica_weight_, ranks_per_node_, pack_, rank_in_pack_);
  for (int i = 0; i < slots_per_node_; ++i) {
    const int slot = node * slots_per_node_ + pack_[i] * slots_per_rank_ + rank_in_pack_[i];
    phy2log_[slot] = mlog2log_[mlog_base + phy2mlog_[i]];
  }
  for (int j = 0; j < experts_per_node_; ++j) logcnt_[mlog2log_[mlog_base + j]] = mlogcnt_[j];
}

void DeepSeekLayer(std::span<const float> weight, int slots, int groups, int nodes, int ranks,
                   std::span<int32_t> phy2log, std::span<int32_t> logcnt) {
  DeepSeekNodes planner(weight, slots, groups, nodes, ranks, phy2log, logcnt);
  for (int node = 0; node < nodes; ++node) planner.Plan(node);
}

}  // namespace eplbx::internal
