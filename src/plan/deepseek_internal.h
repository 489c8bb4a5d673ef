// Internal: the building blocks of DeepSeek's EPLB algorithm, exposed for tests and for
// the other policies. Not installed. All arithmetic is float32, as in the reference.
#ifndef EPLBX_SRC_PLAN_DEEPSEEK_INTERNAL_H_
#define EPLBX_SRC_PLAN_DEEPSEEK_INTERNAL_H_

#include <cstdint>
#include <span>
#include <vector>

namespace eplbx::internal {

// Indices of `weight` by descending weight, equal weights in ascending index order.
// REQUIRES: every weight >= 0 (or -0).
std::vector<int32_t> DescendingOrder(std::span<const float> weight);

// Packs n = weight.size() items into `packs` packs of exactly n / packs items each.
// Items are visited by descending weight (ties: lower index first); each goes to the
// lightest pack that still has room (ties: lowest pack index). Pack weights accumulate in
// float32 in visiting order. When every pack takes one item, item i goes to pack i.
// REQUIRES: n % packs == 0. Writes pack[i] and rank_in_pack[i] (position within its pack).
void BalancedPacking(std::span<const float> weight, int packs, std::vector<int32_t>& pack,
                     std::vector<int32_t>& rank_in_pack);

// Replicates n = weight.size() logical items into `physical` >= n replicas so that the
// largest weight / replicas is minimised greedily: replica i < n is item i; each further
// replica goes to argmax(weight / count) (ties: lowest index).
// Writes phy2log[physical], replica_rank[physical] (0 for the first replica of an item, then
// 1, 2, ...) and count[n].
void ReplicateExperts(std::span<const float> weight, int physical, std::vector<int32_t>& phy2log,
                      std::vector<int32_t>& replica_rank, std::vector<int32_t>& count);

// DeepSeekLayer one node at a time: the constructor packs the groups onto nodes (step 1);
// Plan(node) replicates the node's experts within it and packs the replicas onto its ranks
// (steps 2-3), writing the node's part of phy2log and its experts' logcnt. Nodes are
// independent after step 1: every node planned, in any order, is DeepSeekLayer's result.
class DeepSeekNodes {
 public:
  DeepSeekNodes(std::span<const float> weight, int slots, int groups, int nodes, int ranks,
                std::span<int32_t> phy2log, std::span<int32_t> logcnt);
  void Plan(int node);
  // The weight of the groups step 1 put on `node` (float32, summed in group order).
  float node_load(int node) const { return node_load_[node]; }

 private:
  std::span<const float> weight_;
  std::span<int32_t> phy2log_, logcnt_;
  int experts_per_node_, slots_per_node_, ranks_per_node_, slots_per_rank_;
  std::vector<float> node_load_;
  std::vector<int32_t> mlog2log_;
  // Scratch of Plan.
  std::vector<float> node_weight_, replica_weight_;
  std::vector<int32_t> phy2mlog_, replica_rank_, mlogcnt_, pack_, rank_in_pack_;
};

// One layer of DeepSeek's hierarchical policy: pack groups onto nodes, replicate within each
// node, pack replicas onto the node's ranks. Global mode is groups = nodes = 1.
// Writes phy2log[slots] and logcnt[experts].
void DeepSeekLayer(std::span<const float> weight, int slots, int groups, int nodes, int ranks,
                   std::span<int32_t> phy2log, std::span<int32_t> logcnt);

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_PLAN_DEEPSEEK_INTERNAL_H_
