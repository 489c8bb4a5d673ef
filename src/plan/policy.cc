#include "eplbx/policy.h"

#include <algorithm>
#include <numeric>
#include <vector>

#include "common/strings.h"
#include "plan/balanced_internal.h"
#include "plan/deepseek_internal.h"
#include "plan/incremental_internal.h"
#include "plan/rows.h"

namespace eplbx {

using internal::StrCat;

Result<Policy> ParsePolicy(std::string_view name) {
  if (name == "deepseek") return Policy::kDeepSeek;
  if (name == "balanced") return Policy::kBalanced;
  if (name == "incremental") return Policy::kIncremental;
  return Status::InvalidArgument(
      StrCat("unknown policy '", name, "' (expected one of: deepseek, balanced, incremental)"));
}

std::string_view PolicyName(Policy policy) {
  switch (policy) {
    case Policy::kDeepSeek:
      return "deepseek";
    case Policy::kBalanced:
      return "balanced";
    case Policy::kIncremental:
      return "incremental";
  }
  return "unknown";
}

bool IsHierarchical(const Topology& topology) { return topology.groups % topology.nodes == 0; }

namespace {

// One layer's inputs and the layout rules that every policy shares.
struct LayerContext {
  const Topology& topology;
  std::span<const double> weight;
  bool hierarchical;
};

void DeepSeekSlots(const LayerContext& c, std::span<int32_t> out) {
  std::vector<float> weight(c.weight.begin(), c.weight.end());
  std::vector<int32_t> logcnt(weight.size());
  internal::DeepSeekLayer(weight, c.topology.slots, c.hierarchical ? c.topology.groups : 1,
                          c.hierarchical ? c.topology.nodes : 1, c.topology.ranks, out, logcnt);
}

void BalancedSlotsForLayer(const LayerContext& c, std::span<int32_t> out) {
  const Topology& t = c.topology;
  if (!c.hierarchical || t.nodes == 1) {
    internal::BalancedSlots(c.weight, t.slots, t.ranks, out);
  } else {
    const int experts = static_cast<int>(c.weight.size());
    const int group_size = experts / t.groups;
    std::vector<double> group_load(static_cast<size_t>(t.groups), 0.0);
    for (int e = 0; e < experts; ++e) group_load[e / group_size] += c.weight[e];
    const std::vector<int32_t> node_of = internal::AssignGroupsToNodes(group_load, t.nodes);
    const int slots_per_node = t.slots / t.nodes;
    for (int node = 0; node < t.nodes; ++node) {
      std::vector<int32_t> ids;  // the node's experts, ascending
      for (int e = 0; e < experts; ++e) {
        if (node_of[e / group_size] == node) ids.push_back(e);
      }
      std::vector<double> local(ids.size());
      for (size_t i = 0; i < ids.size(); ++i) local[i] = c.weight[ids[i]];
      std::span<int32_t> node_out = out.subspan(static_cast<size_t>(node) * slots_per_node,
                                                static_cast<size_t>(slots_per_node));
      internal::BalancedSlots(local, slots_per_node, t.ranks_per_node(), node_out);
      for (int32_t& e : node_out) e = ids[e];
    }
  }
  // Never worse than deepseek on any layer.
  std::vector<int32_t> deepseek(out.size());
  DeepSeekSlots(c, deepseek);
  if (internal::SlotsBalancedness(c.weight, deepseek, t.ranks) >
      internal::SlotsBalancedness(c.weight, out, t.ranks)) {
    std::copy(deepseek.begin(), deepseek.end(), out.begin());
  }
}

// One node's share of a layer (the whole layer outside hierarchical mode): its slots in
// `slots`, its experts (those those slots hold, ascending) and their weights, with local
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

std::vector<NodeSlice> Slices(const LayerContext& c, std::span<const int32_t> slots) {
  const int nodes = c.hierarchical ? c.topology.nodes : 1;
  const size_t per_node = slots.size() / static_cast<size_t>(nodes);
  std::vector<NodeSlice> out;
  for (int node = 0; node < nodes; ++node) {
    NodeSlice n{node * per_node, per_node, {}, {}};
    for (size_t s = n.first; s < n.first + n.size; ++s) {
      if (slots[s] >= 0) n.ids.push_back(slots[s]);
    }
    std::sort(n.ids.begin(), n.ids.end());
    n.ids.erase(std::unique(n.ids.begin(), n.ids.end()), n.ids.end());
    for (int32_t e : n.ids) n.weight.push_back(c.weight[e]);
    out.push_back(std::move(n));
  }
  return out;
}

// The balanced placement's replica counts packed onto the ranks that held each expert
// before where they stay within `cap` (per node in hierarchical mode: the node's experts
// are those the balanced placement puts there).
std::vector<int32_t> StickyFromBalanced(const LayerContext& c, std::span<const int32_t> balanced,
                                        std::span<const int32_t> previous, double cap) {
  const int ranks_per_node = c.hierarchical ? c.topology.ranks_per_node() : c.topology.ranks;
  const size_t per_rank = balanced.size() / static_cast<size_t>(c.topology.ranks);
  std::vector<int32_t> out(balanced.size());
  for (const NodeSlice& n : Slices(c, balanced)) {
    std::vector<int32_t> count(n.ids.size(), 0);
    for (int32_t e : n.ToLocal(balanced)) ++count[e];
    std::vector<uint8_t> held(static_cast<size_t>(ranks_per_node) * n.ids.size(), 0);
    const std::vector<int32_t> before = n.ToLocal(previous);
    for (size_t s = 0; s < n.size; ++s) {
      if (before[s] >= 0) held[s / per_rank * n.ids.size() + before[s]] = 1;
    }
    const std::span<int32_t> node_out = std::span<int32_t>(out).subspan(n.first, n.size);
    internal::StickySlots(n.weight, count, held, ranks_per_node, cap, node_out);
    for (int32_t& e : node_out) e = n.ids[e];
  }
  return out;
}

int RanksPerNode(const LayerContext& c) {
  return c.hierarchical ? c.topology.ranks_per_node() : c.topology.ranks;
}

// ImproveFrom on one node's slice of `start`, written into `out`.
void ImproveNode(const LayerContext& c, const NodeSlice& n, std::span<const int32_t> previous,
                 std::span<const int32_t> start, double goal, std::span<int32_t> out) {
  const std::vector<int32_t> improved =
      internal::ImproveFrom(n.weight, n.ToLocal(previous), n.ToLocal(start), RanksPerNode(c), goal,
                            /*max_steps=*/8 * static_cast<int>(n.size));
  for (size_t i = 0; i < n.size; ++i) out[n.first + i] = n.ids[improved[i]];
}

// ImproveFrom on each node alone (the whole layer outside hierarchical mode), so that no
// expert changes node: a group stays where `start` has it.
std::vector<int32_t> ImproveByNode(const LayerContext& c, std::span<const int32_t> previous,
                                   std::span<const int32_t> start, double goal) {
  std::vector<int32_t> out(start.size());
  for (const NodeSlice& n : Slices(c, start)) ImproveNode(c, n, previous, start, goal, out);
  return out;
}

// Hierarchical mode: the node of each group in `slots` (the node holding most of its
// replicas; ties: lowest node), or an empty vector when some node does not hold exactly
// groups / nodes groups.
std::vector<int32_t> GroupNodes(const LayerContext& c, std::span<const int32_t> slots) {
  const Topology& t = c.topology;
  const int group_size = static_cast<int>(c.weight.size()) / t.groups;
  const size_t per_node = slots.size() / static_cast<size_t>(t.nodes);
  std::vector<int> replicas(static_cast<size_t>(t.groups) * t.nodes, 0);
  for (size_t s = 0; s < slots.size(); ++s) {
    if (slots[s] >= 0) ++replicas[slots[s] / group_size * t.nodes + s / per_node];
  }
  std::vector<int32_t> node_of(static_cast<size_t>(t.groups));
  std::vector<int> held(static_cast<size_t>(t.nodes), 0);
  for (int g = 0; g < t.groups; ++g) {
    const auto row = replicas.begin() + g * t.nodes;
    node_of[g] = static_cast<int32_t>(std::max_element(row, row + t.nodes) - row);
    ++held[node_of[g]];
  }
  for (int h : held) {
    if (h != t.groups / t.nodes) return {};
  }
  return node_of;
}

// Group-to-node assignments one swap of two groups away from `node_of`, else two swaps,
// that leave every node's load at most `cap`: ordered by the replicas the swapped groups
// have in `slots` (what must cross nodes), then by the heaviest node load, then by the
// order found (groups ascending). At most kRegroupCandidates.
constexpr size_t kRegroupCandidates = 8;

std::vector<std::vector<int32_t>> GroupSwaps(const LayerContext& c, std::span<const int32_t> slots,
                                             const std::vector<int32_t>& node_of, double cap) {
  const Topology& t = c.topology;
  const int group_size = static_cast<int>(c.weight.size()) / t.groups;
  std::vector<double> group_load(static_cast<size_t>(t.groups), 0.0);
  for (size_t e = 0; e < c.weight.size(); ++e) group_load[e / group_size] += c.weight[e];
  std::vector<int> replicas(static_cast<size_t>(t.groups), 0);
  for (int32_t e : slots) {
    if (e >= 0) ++replicas[e / group_size];
  }
  struct Candidate {
    int moved;
    double heaviest;
    std::vector<int32_t> node_of;
  };
  std::vector<std::pair<int, int>> swaps;  // groups on different nodes
  for (int a = 0; a < t.groups; ++a) {
    for (int b = a + 1; b < t.groups; ++b) {
      if (node_of[a] != node_of[b]) swaps.emplace_back(a, b);
    }
  }
  std::vector<Candidate> found;
  auto consider = [&](std::vector<int32_t> next, int moved) {
    std::vector<double> load(static_cast<size_t>(t.nodes), 0.0);
    for (int g = 0; g < t.groups; ++g) load[next[g]] += group_load[g];
    const double heaviest = *std::max_element(load.begin(), load.end());
    if (heaviest <= cap) found.push_back({moved, heaviest, std::move(next)});
  };
  for (const auto& [a, b] : swaps) {
    std::vector<int32_t> next = node_of;
    std::swap(next[a], next[b]);
    consider(std::move(next), replicas[a] + replicas[b]);
  }
  for (size_t i = 0; found.empty() && i < swaps.size(); ++i) {
    for (size_t j = i + 1; j < swaps.size(); ++j) {
      const auto [a, b] = swaps[i];
      const auto [x, y] = swaps[j];
      if (a == x || a == y || b == x || b == y) continue;
      std::vector<int32_t> next = node_of;
      std::swap(next[a], next[b]);
      std::swap(next[x], next[y]);
      consider(std::move(next), replicas[a] + replicas[b] + replicas[x] + replicas[y]);
    }
  }
  std::stable_sort(found.begin(), found.end(), [](const Candidate& p, const Candidate& q) {
    return p.moved != q.moved ? p.moved < q.moved : p.heaviest < q.heaviest;
  });
  std::vector<std::vector<int32_t>> out;
  for (size_t i = 0; i < found.size() && i < kRegroupCandidates; ++i) {
    out.push_back(std::move(found[i].node_of));
  }
  return out;
}

// `start` with node `node`'s slots changed for the group assignment `next`: slots of
// groups that stay keep their experts; the others take the arriving groups' experts, one
// replica each and then extra replicas of the largest shares, heaviest share first onto the
// lightest rank of the node with a free slot that lacks the expert (ties: lowest rank, then
// lowest expert).
std::vector<int32_t> Substitute(const LayerContext& c, std::span<const int32_t> start,
                                const std::vector<int32_t>& next, int node) {
  const Topology& t = c.topology;
  const int group_size = static_cast<int>(c.weight.size()) / t.groups;
  const int rpn = t.ranks_per_node();
  const size_t per_node = start.size() / static_cast<size_t>(t.nodes);
  const size_t per_rank = per_node / static_cast<size_t>(rpn);
  const size_t first = static_cast<size_t>(node) * per_node;
  std::vector<int32_t> out(start.begin(), start.end());
  std::vector<uint8_t> present(c.weight.size(), 0);
  std::vector<size_t> free;
  for (size_t s = first; s < first + per_node; ++s) {
    if (out[s] >= 0 && next[out[s] / group_size] == node) {
      present[out[s]] = 1;
    } else {
      out[s] = -1;
      free.push_back(s);
    }
  }
  std::vector<int32_t> arriving;
  for (int32_t e = 0; e < static_cast<int32_t>(c.weight.size()); ++e) {
    if (next[e / group_size] == node && !present[e]) arriving.push_back(e);
  }
  if (arriving.size() > free.size()) return out;  // cannot happen: a group has a slot per expert
  std::vector<int32_t> count(c.weight.size(), 0);
  for (int32_t e : arriving) count[e] = 1;
  for (size_t extra = arriving.size(); extra < free.size(); ++extra) {
    int32_t pick = -1;
    for (int32_t e : arriving) {
      if (count[e] < rpn &&
          (pick < 0 || c.weight[e] / (count[e] + 1) > c.weight[pick] / (count[pick] + 1)))
        pick = e;
    }
    if (pick < 0) break;
    ++count[pick];
  }
  std::vector<std::pair<double, int32_t>> replicas;  // (share, expert)
  for (int32_t e : arriving) {
    for (int k = 0; k < count[e]; ++k) replicas.emplace_back(c.weight[e] / count[e], e);
  }
  std::stable_sort(replicas.begin(), replicas.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  const std::vector<double> load0 = internal::RankLoads(c.weight, out, t.ranks);
  std::vector<double> load(load0.begin() + node * rpn, load0.begin() + (node + 1) * rpn);
  for (const auto& [share, e] : replicas) {
    size_t pick = free.size();
    for (size_t k = 0; k < free.size(); ++k) {
      const size_t s = free[k];
      if (out[s] >= 0) continue;
      const size_t r = (s - first) / per_rank;
      bool holds = false;
      for (size_t q = first + r * per_rank; q < first + (r + 1) * per_rank; ++q)
        holds |= out[q] == e;
      if (!holds && (pick == free.size() || load[r] < load[(free[pick] - first) / per_rank]))
        pick = k;
    }
    if (pick == free.size()) continue;
    out[free[pick]] = e;
    load[(free[pick] - first) / per_rank] += share;
  }
  for (size_t s : free) {  // left empty (every rank with room held the replica): any expert
    const size_t r = (s - first) / per_rank;  // of the node that the rank lacks
    for (int32_t e = 0; out[s] < 0 && e < static_cast<int32_t>(c.weight.size()); ++e) {
      if (next[e / group_size] != node) continue;
      bool holds = false;
      for (size_t q = first + r * per_rank; q < first + (r + 1) * per_rank; ++q)
        holds |= out[q] == e;
      if (!holds) out[s] = e;
    }
  }
  return out;
}

// Hierarchical mode, when a node's groups weigh more than its ranks can carry at the goal
// (no search within nodes can help): for each assignment of GroupSwaps in turn, the nodes
// whose groups change, or whose part of `local` misses the goal, are searched again from
// `start` with the arriving groups substituted (Substitute), and the others keep `local`.
// Returns whether `accept` took one of these candidates.
template <typename Accept>
bool Regroup(const LayerContext& c, std::span<const int32_t> start,
             const std::vector<int32_t>& local, double goal, Accept accept) {
  const Topology& t = c.topology;
  const std::vector<int32_t> node_of = GroupNodes(c, start);
  if (node_of.empty()) return false;
  const int group_size = static_cast<int>(c.weight.size()) / t.groups;
  const int rpn = t.ranks_per_node();
  const size_t per_node = start.size() / static_cast<size_t>(t.nodes);
  std::vector<uint8_t> keep(static_cast<size_t>(t.nodes), 1);  // local's part meets the goal
  const std::vector<double> load = internal::RankLoads(c.weight, local, t.ranks);
  for (int r = 0; r < t.ranks; ++r) {
    if (load[r] > goal) keep[r / rpn] = 0;
  }
  for (const std::vector<int32_t>& next : GroupSwaps(c, start, node_of, goal * rpn)) {
    std::vector<int32_t> out = local;
    for (int node = 0; node < t.nodes; ++node) {
      bool same = keep[node];
      for (int g = 0; g < t.groups && same; ++g) same = (node_of[g] == node) == (next[g] == node);
      if (same) continue;
      std::vector<int32_t> slots = Substitute(c, start, next, node);
      NodeSlice n{node * per_node, per_node, {}, {}};
      for (int32_t e = 0; e < static_cast<int32_t>(c.weight.size()); ++e) {
        if (next[e / group_size] == node) {
          n.ids.push_back(e);
          n.weight.push_back(c.weight[e]);
        }
      }
      ImproveNode(c, n, start, slots, goal, out);
    }
    if (accept(out)) return true;
  }
  return false;
}

// Renames the nodes of `next` (moves whole node blocks of slots) so that as many experts
// as possible stay on the node that held them in `previous`: exhaustive over node
// permutations up to 8 nodes (ties: the first permutation in lexicographic order), greedy
// beyond (the pair sharing the most experts first).
void RelabelNodes(std::span<const int32_t> previous, std::vector<int32_t>& next, int nodes,
                  size_t experts) {
  if (nodes <= 1) return;
  const size_t per_node = next.size() / static_cast<size_t>(nodes);
  std::vector<std::vector<uint8_t>> had(static_cast<size_t>(nodes), std::vector<uint8_t>(experts));
  for (size_t s = 0; s < previous.size(); ++s) {
    if (previous[s] >= 0 && static_cast<size_t>(previous[s]) < experts)
      had[s / per_node][previous[s]] = 1;
  }
  // overlap[a][b]: distinct experts of next's node a that previous had on node b.
  std::vector<std::vector<int>> overlap(static_cast<size_t>(nodes), std::vector<int>(nodes, 0));
  for (int a = 0; a < nodes; ++a) {
    std::vector<uint8_t> seen(experts, 0);
    for (size_t s = a * per_node; s < (a + 1) * per_node; ++s) {
      const int32_t e = next[s];
      if (e < 0 || seen[e]) continue;
      seen[e] = 1;
      for (int b = 0; b < nodes; ++b) overlap[a][b] += had[b][e];
    }
  }
  std::vector<int> to(static_cast<size_t>(nodes));  // next's node a becomes node to[a]
  std::iota(to.begin(), to.end(), 0);
  if (nodes <= 8) {
    std::vector<int> perm = to;
    int best = -1;
    do {
      int score = 0;
      for (int a = 0; a < nodes; ++a) score += overlap[a][perm[a]];
      if (score > best) {
        best = score;
        to = perm;
      }
    } while (std::next_permutation(perm.begin(), perm.end()));
  } else {
    std::vector<uint8_t> used_a(static_cast<size_t>(nodes)), used_b(static_cast<size_t>(nodes));
    for (int k = 0; k < nodes; ++k) {
      int ba = -1, bb = -1;
      for (int a = 0; a < nodes; ++a) {
        for (int b = 0; b < nodes; ++b) {
          if (!used_a[a] && !used_b[b] && (ba < 0 || overlap[a][b] > overlap[ba][bb])) {
            ba = a;
            bb = b;
          }
        }
      }
      used_a[ba] = used_b[bb] = 1;
      to[ba] = bb;
    }
  }
  std::vector<int32_t> moved(next.size());
  for (int a = 0; a < nodes; ++a) {
    std::copy(next.begin() + a * per_node, next.begin() + (a + 1) * per_node,
              moved.begin() + to[a] * per_node);
  }
  next = std::move(moved);
}

// Candidates in order; the first within `tolerance` of balanced wins: (1) local search from
// the previous placement (enough on almost every layer); (2) in hierarchical mode, when a
// node's groups are too heavy for it, the cheapest swaps of groups between nodes
// (Regroup); outside it, when the search stalls, its result re-pointed to the balanced
// placement's replica counts (AdoptCounts), then local search again; (3) local search from
// the balanced counts packed sticky (StickyFromBalanced); (4) the balanced placement with
// ranks renamed within each node to keep as many (rank, expert) pairs as possible, which
// always qualifies. In hierarchical mode every local search runs per node, so groups stay
// on their nodes, and the balanced placement's nodes are first renamed to keep as many
// experts on their node as possible (RelabelNodes).
void IncrementalSlots(const LayerContext& c, std::span<const int32_t> previous, double tolerance,
                      std::span<int32_t> out) {
  const Topology& t = c.topology;
  std::vector<int32_t> balanced(out.size());
  BalancedSlotsForLayer(c, balanced);
  const double target = internal::SlotsBalancedness(c.weight, balanced, t.ranks) - tolerance;
  const double total = std::accumulate(c.weight.begin(), c.weight.end(), 0.0);
  // The largest rank load that meets the target.
  const double goal = target > 0 ? total / t.ranks / target : total;
  auto done = [&](const std::vector<int32_t>& candidate) {
    if (internal::SlotsBalancedness(c.weight, candidate, t.ranks) < target - 1e-12) return false;
    std::copy(candidate.begin(), candidate.end(), out.begin());
    return true;
  };
  const std::vector<int32_t> start = internal::CompleteSlots(c.weight, previous, t.ranks);
  if (c.hierarchical) RelabelNodes(start, balanced, t.nodes, c.weight.size());
  const std::vector<int32_t> local = ImproveByNode(c, start, start, goal);
  if (done(local)) return;
  if (c.hierarchical && t.nodes > 1 && Regroup(c, start, local, goal, done)) return;
  if (!c.hierarchical || t.nodes == 1) {
    std::vector<int32_t> count(c.weight.size(), 0);
    for (int32_t e : balanced) ++count[e];
    const std::vector<int32_t> adopted = internal::AdoptCounts(c.weight, local, t.ranks, count);
    if (done(ImproveByNode(c, start, adopted, goal))) return;
  }
  if (done(ImproveByNode(c, start, StickyFromBalanced(c, balanced, start, goal), goal))) return;
  internal::RelabelRanks(previous, balanced, t.ranks, t.ranks_per_node());
  std::copy(balanced.begin(), balanced.end(), out.begin());
}

Status CheckPrevious(const Placement& previous, const LoadMatrix& load, const Topology& t) {
  if (previous.layers() != load.layers() || previous.slots() != t.slots) {
    return Status::Mismatch(StrCat("previous placement is ", previous.layers(), " layers x ",
                                   previous.slots(), " slots but this plan is ", load.layers(),
                                   " layers x ", t.slots, " slots"));
  }
  if (previous.experts() > load.experts()) {
    for (int l = 0; l < previous.layers(); ++l) {
      for (int s = 0; s < previous.slots(); ++s) {
        if (previous.phy2log(l, s) >= load.experts()) {
          return Status::Mismatch(StrCat("previous placement, layer ", l, ", slot ", s, ": expert ",
                                         previous.phy2log(l, s), " does not exist in the load (",
                                         load.experts(), " experts)"));
        }
      }
    }
  }
  return Status::OK();
}

}  // namespace

Result<Placement> Plan(const LoadMatrix& load, const Topology& topology,
                       const PlanOptions& options) {
  if (load.layers() < 1 || load.experts() < 1) {
    return Status::InvalidArgument("load is empty; expected at least one layer of one expert");
  }
  EPLBX_RETURN_IF_ERROR(topology.Validate(load.experts()));
  if (options.policy == Policy::kIncremental && options.previous == nullptr) {
    return Status::InvalidArgument(
        "the incremental policy needs the previous placement (--previous FILE)");
  }
  if (!(options.tolerance >= 0 && options.tolerance <= 1)) {
    return Status::InvalidArgument(
        StrCat("tolerance is ", options.tolerance, " (expected a number in [0, 1])"));
  }
  if (options.previous != nullptr) {
    EPLBX_RETURN_IF_ERROR(CheckPrevious(*options.previous, load, topology));
  }
  const size_t slots = static_cast<size_t>(topology.slots);
  std::vector<int32_t> phy2log(static_cast<size_t>(load.layers()) * slots);
  for (int l = 0; l < load.layers(); ++l) {
    const LayerContext c{topology,
                         std::span<const double>(load.row(l), static_cast<size_t>(load.experts())),
                         IsHierarchical(topology)};
    std::span<int32_t> out = std::span<int32_t>(phy2log).subspan(l * slots, slots);
    std::span<const int32_t> previous;
    if (options.previous != nullptr) {
      previous = std::span<const int32_t>(options.previous->phy2log()).subspan(l * slots, slots);
    }
    switch (options.policy) {
      case Policy::kDeepSeek:
        DeepSeekSlots(c, out);
        break;
      case Policy::kBalanced:
        BalancedSlotsForLayer(c, out);
        break;
      case Policy::kIncremental:
        IncrementalSlots(c, previous, options.tolerance, out);
        break;
    }
    if (!previous.empty()) internal::PreserveRows(previous, out, topology.ranks);
  }
  return Placement::FromPhy2Log(load.layers(), topology.slots, load.experts(), std::move(phy2log));
}

Result<Moves> CountMoves(const Placement& previous, const Placement& next, int ranks) {
  if (previous.layers() != next.layers() || previous.slots() != next.slots()) {
    return Status::Mismatch(StrCat("previous placement is ", previous.layers(), " layers x ",
                                   previous.slots(), " slots but the new one is ", next.layers(),
                                   " layers x ", next.slots(), " slots"));
  }
  if (ranks < 1 || next.slots() % ranks != 0) {
    return Status::InvalidArgument(
        StrCat("ranks (", ranks, ") must divide the placement's ", next.slots(), " slots"));
  }
  Moves moves;
  const size_t slots = static_cast<size_t>(next.slots());
  for (int l = 0; l < next.layers(); ++l) {
    const LayerMoves m = internal::CountLayerMoves(
        std::span<const int32_t>(previous.phy2log()).subspan(l * slots, slots),
        std::span<const int32_t>(next.phy2log()).subspan(l * slots, slots), ranks);
    moves.per_layer.push_back(m);
    moves.total.remote_copies += m.remote_copies;
    moves.total.local_copies += m.local_copies;
    moves.total.unchanged_slots += m.unchanged_slots;
  }
  return moves;
}

}  // namespace eplbx
