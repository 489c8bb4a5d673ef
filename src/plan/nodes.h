// Internal: one layer as the policies see it, and the planning that works node by node
// (hierarchical mode keeps each group of experts on one node). Not installed.
#ifndef EPLBX_SRC_PLAN_NODES_H_
#define EPLBX_SRC_PLAN_NODES_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "eplbx/policy.h"

namespace eplbx::internal {

// One layer's inputs and the layout rules that every policy shares.
struct LayerContext {
  const Topology& topology;
  std::span<const double> weight;
  bool hierarchical;

  // Ranks of one node's slice (the whole layer outside hierarchical mode).
  int ranks_per_slice() const { return hierarchical ? topology.ranks_per_node() : topology.ranks; }
};

// One node's share of a layer (the whole layer outside hierarchical mode): its slots in
// `slots`, its experts (those the slots hold, ascending) and their weights, with local
// ids 0..ids.size()-1 for the planners that work on a node alone.
struct NodeSlice {
  size_t first, size;  // slot range
  std::vector<int32_t> ids;
  std::vector<double> weight;

  int Local(int32_t e) const {
    const auto it = std::lower_bound(ids.begin(), ids.end(), e);
    return it != ids.end() && *it == e ? static_cast<int>(it - ids.begin()) : -1;
  }
  // `slots`' part for this node in local ids (-1 for experts not on the node).
  std::vector<int32_t> ToLocal(std::span<const int32_t> slots) const {
    std::vector<int32_t> out(size);
    for (size_t i = 0; i < size; ++i) out[i] = slots[first + i] >= 0 ? Local(slots[first + i]) : -1;
    return out;
  }
};

// Slice `index` of `slots` (its experts: those its slots hold).
NodeSlice Slice(const LayerContext& c, std::span<const int32_t> slots, int index);

// The slices of `slots`: one per node in hierarchical mode, else one for the whole layer.
std::vector<NodeSlice> Slices(const LayerContext& c, std::span<const int32_t> slots);

// ImproveFrom on one node's slice of `start` (copies: pairs absent from `previous`),
// written into `out`.
void ImproveNode(const LayerContext& c, const NodeSlice& n, std::span<const int32_t> previous,
                 std::span<const int32_t> start, double goal, std::span<int32_t> out);

// ImproveFrom on each node alone (the whole layer outside hierarchical mode), so that no
// expert changes node: a group stays where `start` has it.
std::vector<int32_t> ImproveByNode(const LayerContext& c, std::span<const int32_t> previous,
                                   std::span<const int32_t> start, double goal);

// Hierarchical mode: the node of each group in `slots` (the node holding most of its
// replicas; ties: lowest node), or an empty vector when some node does not hold exactly
// groups / nodes groups.
std::vector<int32_t> GroupNodes(const LayerContext& c, std::span<const int32_t> slots);

// `start` with node `node`'s slots changed for the group assignment `next` (node per
// group): slots holding experts of the node's groups keep them; the others are freed
// (experts of other groups leave), and, if the node's missing experts outnumber them, so
// are kept redundant replicas, smallest share first. The freed slots take the missing
// experts, one replica each and then extra replicas of the largest shares, heaviest share
// first onto the lightest rank of the node with a free slot that lacks the expert (ties:
// lowest rank, then lowest expert).
std::vector<int32_t> Substitute(const LayerContext& c, std::span<const int32_t> start,
                                const std::vector<int32_t>& next, int node);

// Hierarchical mode, when a node's groups weigh more than its ranks can carry at the goal
// (no search within nodes can help): for each assignment of GroupSwaps away from `node_of`
// (the groups' nodes in `start`) in turn, the nodes whose groups change, or whose part of
// `local` misses the goal, are searched again from `start` with the arriving groups
// substituted (Substitute), and the others keep `local`; copies are pairs absent from
// `previous`. Returns whether `accept` took a candidate. A node's part is searched once
// per set of groups it gets; a candidate with a node whose heaviest rank is above `miss`
// (a load with which `accept` certainly refuses) is passed over unfinished and unasked.
bool Regroup(const LayerContext& c, std::span<const int32_t> previous,
             std::span<const int32_t> start, const std::vector<int32_t>& node_of,
             const std::vector<int32_t>& local, double goal, double miss,
             const std::function<bool(const std::vector<int32_t>&)>& accept);

// The balanced placement's replica counts packed onto the ranks that held each expert in
// `previous` where they stay within `cap` (per node in hierarchical mode: the node's
// experts are those `balanced` puts there).
std::vector<int32_t> StickyFromBalanced(const LayerContext& c, std::span<const int32_t> balanced,
                                        std::span<const int32_t> previous, double cap);

// Hierarchical mode, when local search from the previous placement (`local`, searched from
// `start` with groups on the nodes `node_of` gives) leaves some nodes above `goal` and each
// of them has the groups it has in `balanced` (so `balanced`'s part of it meets the goal):
// those nodes alone are planned again, each with local search from `balanced`'s replica
// counts of the node packed sticky (StickyFromBalanced), else, if still above the goal,
// `balanced`'s part with the node's ranks renamed to keep the most (rank, expert) pairs of
// `previous` (RelabelRanks); every other node keeps its part of `local` slot for slot.
// Copies are pairs absent from `start`. Empty when a node above the goal has other groups
// than in `balanced` (moving groups between nodes is Regroup's), or none is above it.
std::vector<int32_t> RepairNodes(const LayerContext& c, std::span<const int32_t> previous,
                                 std::span<const int32_t> start,
                                 const std::vector<int32_t>& node_of,
                                 const std::vector<int32_t>& local,
                                 const std::vector<int32_t>& balanced, double goal);

// Renames the nodes of `next` (moves whole node blocks of slots) so that as many experts
// as possible stay on the node that held them in `previous`: exhaustive over node
// permutations up to 8 nodes (ties: the first permutation in lexicographic order), greedy
// beyond (the pair sharing the most experts first).
void RelabelNodes(std::span<const int32_t> previous, std::vector<int32_t>& next, int nodes,
                  size_t experts);

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_PLAN_NODES_H_
