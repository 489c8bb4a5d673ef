// DeepSeek's EPLB algorithm (github.com/deepseek-ai/EPLB), re-implemented from its
// description to give identical phy2log and logcnt. See docs/placement.md for the tie rules.
#include <algorithm>
#include <numeric>

#include "plan/deepseek_internal.h"

namespace eplbx::internal {

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
  std::vector<int32_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return weight[a] > weight[b]; });
  std::vector<float> pack_weight(static_cast<size_t>(packs), 0.0f);
  std::vector<int32_t> pack_items(static_cast<size_t>(packs), 0);
  for (int32_t item : order) {
    int best = -1;
    for (int p = 0; p < packs; ++p) {
      if (pack_items[p] < per_pack && (best < 0 || pack_weight[p] < pack_weight[best])) best = p;
    }
    pack[item] = best;
    rank_in_pack[item] = pack_items[best]++;
    pack_weight[best] += weight[item];
  }
}

void ReplicateExperts(std::span<const float> weight, int physical, std::vector<int32_t>& phy2log,
                      std::vector<int32_t>& replica_rank, std::vector<int32_t>& count) {
  const int n = static_cast<int>(weight.size());
  phy2log.resize(static_cast<size_t>(physical));
  replica_rank.assign(static_cast<size_t>(physical), 0);
  count.assign(static_cast<size_t>(n), 1);
  std::iota(phy2log.begin(), phy2log.begin() + n, 0);
  // Per-replica load of each item; only the chosen item's entry changes per step.
  std::vector<float> share(weight.begin(), weight.end());
  for (int i = n; i < physical; ++i) {
    const int best = static_cast<int>(std::max_element(share.begin(), share.end()) - share.begin());
    phy2log[i] = best;
    replica_rank[i] = count[best]++;
    share[best] = weight[best] / static_cast<float>(count[best]);
  }
}

void DeepSeekLayer(std::span<const float> weight, int slots, int groups, int nodes, int ranks,
                   std::span<int32_t> phy2log, std::span<int32_t> logcnt) {
  const int experts = static_cast<int>(weight.size());
  const int group_size = experts / groups;
  const int groups_per_node = groups / nodes;
  const int experts_per_node = experts / nodes;
  const int slots_per_node = slots / nodes;
  const int ranks_per_node = ranks / nodes;
  const int slots_per_rank = slots / ranks;

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
  // log2mlog: logical expert -> position in node-major order ("mlog").
  std::vector<int32_t> log2mlog(static_cast<size_t>(experts)), mlog2log(log2mlog.size());
  for (int e = 0; e < experts; ++e) {
    const int g = e / group_size;
    const int m = (group_pack[g] * groups_per_node + group_rank[g]) * group_size + e % group_size;
    log2mlog[e] = m;
    mlog2log[m] = e;
  }

  std::vector<float> node_weight(static_cast<size_t>(experts_per_node));
  std::vector<float> replica_weight(static_cast<size_t>(slots_per_node));
  std::vector<int32_t> phy2mlog, replica_rank, mlogcnt, pack, rank_in_pack;
  for (int node = 0; node < nodes; ++node) {
    const int mlog_base = node * experts_per_node;
    // Step 2: replicate the node's experts into the node's slots.
    for (int j = 0; j < experts_per_node; ++j) node_weight[j] = weight[mlog2log[mlog_base + j]];
    ReplicateExperts(node_weight, slots_per_node, phy2mlog, replica_rank, mlogcnt);
    // Step 3: pack the replicas onto the node's ranks.
    for (int i = 0; i < slots_per_node; ++i) {
      const int32_t m = phy2mlog[i];
      replica_weight[i] = node_weight[m] / static_cast<float>(mlogcnt[m]);
    }
    BalancedPacking(replica_weight, ranks_per_node, pack, rank_in_pack);
    for (int i = 0; i < slots_per_node; ++i) {
      const int slot = node * slots_per_node + pack[i] * slots_per_rank + rank_in_pack[i];
      phy2log[slot] = mlog2log[mlog_base + phy2mlog[i]];
    }
    for (int j = 0; j < experts_per_node; ++j) logcnt[mlog2log[mlog_base + j]] = mlogcnt[j];
  }
}

}  // namespace eplbx::internal
