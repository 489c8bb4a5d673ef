// Node-by-node planning for the `incremental` policy: local search per node, groups
// gathered or swapped between nodes, nodes renamed to match a previous placement.
#include "plan/nodes.h"

#include <map>
#include <numeric>

#include "plan/balanced_internal.h"
#include "plan/incremental_internal.h"
#include "plan/rows.h"

namespace eplbx::internal {

NodeSlice Slice(const LayerContext& c, std::span<const int32_t> slots, int index) {
  const int slices = c.hierarchical ? c.topology.nodes : 1;
  const size_t size = slots.size() / static_cast<size_t>(slices);
  NodeSlice n{index * size, size, {}, {}};
  for (size_t s = n.first; s < n.first + n.size; ++s) {
    if (slots[s] >= 0) n.ids.push_back(slots[s]);
  }
  std::sort(n.ids.begin(), n.ids.end());
  n.ids.erase(std::unique(n.ids.begin(), n.ids.end()), n.ids.end());
  for (int32_t e : n.ids) n.weight.push_back(c.weight[e]);
  return n;
}

std::vector<NodeSlice> Slices(const LayerContext& c, std::span<const int32_t> slots) {
  std::vector<NodeSlice> out;
  for (int i = 0; i < (c.hierarchical ? c.topology.nodes : 1); ++i)
    out.push_back(Slice(c, slots, i));
  return out;
}

void ImproveNode(const LayerContext& c, const NodeSlice& n, std::span<const int32_t> previous,
                 std::span<const int32_t> start, double goal, std::span<int32_t> out) {
  const std::vector<int32_t> improved = internal::ImproveFrom(
      n.weight, n.ToLocal(previous), n.ToLocal(start), c.ranks_per_slice(), goal,
      /*max_steps=*/8 * static_cast<int>(n.size));
  for (size_t i = 0; i < n.size; ++i) out[n.first + i] = improved[i] >= 0 ? n.ids[improved[i]] : -1;
}

std::vector<int32_t> ImproveByNode(const LayerContext& c, std::span<const int32_t> previous,
                                   std::span<const int32_t> start, double goal) {
  std::vector<int32_t> out(start.size());
  for (const NodeSlice& n : Slices(c, start)) ImproveNode(c, n, previous, start, goal, out);
  return out;
}

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

namespace {

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

}  // namespace

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
  // More arriving experts than free slots (the node kept extra replicas of its experts):
  // the kept replica with the smallest share among experts with several goes first.
  std::vector<int32_t> kept(c.weight.size(), 0);
  for (size_t s = first; s < first + per_node; ++s) {
    if (out[s] >= 0) ++kept[out[s]];
  }
  while (arriving.size() > free.size()) {
    size_t drop = out.size();
    for (size_t s = first; s < first + per_node; ++s) {
      const int32_t e = out[s];
      if (e >= 0 && kept[e] > 1 &&
          (drop == out.size() || c.weight[e] / kept[e] < c.weight[out[drop]] / kept[out[drop]]))
        drop = s;
    }
    if (drop == out.size()) break;  // cannot happen: the node has a slot per expert it keeps
    --kept[out[drop]];
    out[drop] = -1;
    free.push_back(drop);
  }
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
  auto holds = [&](size_t r, int32_t e) {  // r: the node's r-th rank
    for (size_t q = first + r * per_rank; q < first + (r + 1) * per_rank; ++q) {
      if (out[q] == e) return true;
    }
    return false;
  };
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
      if (!holds(r, e) && (pick == free.size() || load[r] < load[(free[pick] - first) / per_rank]))
        pick = k;
    }
    if (pick == free.size()) continue;
    out[free[pick]] = e;
    load[(free[pick] - first) / per_rank] += share;
  }
  // Slots left empty (every rank with room held the replica): an expert of the node that
  // the rank lacks, else (the rank holds them all) a second replica of the largest share.
  for (size_t s : free) {
    const size_t r = (s - first) / per_rank;
    int32_t fallback = -1;
    for (int32_t e = 0; out[s] < 0 && e < static_cast<int32_t>(c.weight.size()); ++e) {
      if (next[e / group_size] != node) continue;
      if (!holds(r, e)) out[s] = e;
      if (fallback < 0 || c.weight[e] > c.weight[fallback]) fallback = e;
    }
    if (out[s] < 0) out[s] = fallback;
  }
  return out;
}

namespace {

// Per node: whether a rank of it in `slots` carries more than `goal`.
std::vector<uint8_t> NodesAbove(const LayerContext& c, std::span<const int32_t> slots,
                                double goal) {
  const int rpn = c.topology.ranks_per_node();
  std::vector<uint8_t> above(static_cast<size_t>(c.topology.nodes), 0);
  const std::vector<double> load = RankLoads(c.weight, slots, c.topology.ranks);
  for (int r = 0; r < c.topology.ranks; ++r) {
    if (load[r] > goal) above[r / rpn] = 1;
  }
  return above;
}

}  // namespace

bool Regroup(const LayerContext& c, std::span<const int32_t> previous,
             std::span<const int32_t> start, const std::vector<int32_t>& node_of,
             const std::vector<int32_t>& local, double goal, double miss,
             const std::function<bool(const std::vector<int32_t>&)>& accept) {
  const Topology& t = c.topology;
  const int rpn = t.ranks_per_node();
  const size_t per_node = start.size() / static_cast<size_t>(t.nodes);
  const std::vector<uint8_t> above = NodesAbove(c, local, goal);
  // A node's part of a candidate depends only on the groups the candidate gives it, so it
  // is searched once per (node, groups). Every expert of a part lives on its node alone,
  // so its rank loads are those of the whole candidate; a part with a rank above `miss`
  // fails every candidate it is in, which is then passed over without searching its other
  // nodes or asking `accept`.
  struct Part {
    std::vector<int32_t> slots;
    bool misses;
  };
  std::map<std::vector<int32_t>, Part> parts;  // key: the node, then its groups ascending
  for (const std::vector<int32_t>& next : GroupSwaps(c, start, node_of, goal * rpn)) {
    std::vector<int32_t> out = local;
    bool misses = false;
    for (int node = 0; node < t.nodes && !misses; ++node) {
      bool same = !above[node];  // local's part meets the goal
      for (int g = 0; g < t.groups && same; ++g) same = (node_of[g] == node) == (next[g] == node);
      if (same) continue;
      std::vector<int32_t> key{node};
      for (int g = 0; g < t.groups; ++g) {
        if (next[g] == node) key.push_back(g);
      }
      const size_t first = static_cast<size_t>(node) * per_node;
      auto it = parts.find(key);
      if (it == parts.end()) {
        const std::vector<int32_t> slots = Substitute(c, start, next, node);
        std::vector<int32_t> searched(slots.size());
        ImproveNode(c, Slice(c, slots, node), previous, slots, goal, searched);
        Part part{{searched.begin() + first, searched.begin() + first + per_node}, false};
        const std::vector<double> rank_load = internal::RankLoads(c.weight, part.slots, rpn);
        part.misses = *std::max_element(rank_load.begin(), rank_load.end()) > miss;
        it = parts.emplace(std::move(key), std::move(part)).first;
      }
      std::copy(it->second.slots.begin(), it->second.slots.end(), out.begin() + first);
      misses = it->second.misses;
    }
    if (!misses && accept(out)) return true;
  }
  return false;
}

namespace {

// StickyFromBalanced's packing of one slice (a node, or the whole layer), into `out`.
void StickySlice(const LayerContext& c, const NodeSlice& n, std::span<const int32_t> balanced,
                 std::span<const int32_t> previous, double cap, std::span<int32_t> out) {
  const int ranks_per_node = c.ranks_per_slice();
  const size_t per_rank = balanced.size() / static_cast<size_t>(c.topology.ranks);
  std::vector<int32_t> count(n.ids.size(), 0);
  for (int32_t e : n.ToLocal(balanced)) ++count[e];
  std::vector<uint8_t> held(static_cast<size_t>(ranks_per_node) * n.ids.size(), 0);
  const std::vector<int32_t> before = n.ToLocal(previous);
  for (size_t s = 0; s < n.size; ++s) {
    if (before[s] >= 0) held[s / per_rank * n.ids.size() + before[s]] = 1;
  }
  const std::span<int32_t> node_out = out.subspan(n.first, n.size);
  StickySlots(n.weight, count, held, ranks_per_node, cap, node_out);
  for (int32_t& e : node_out) e = n.ids[e];
}

}  // namespace

std::vector<int32_t> StickyFromBalanced(const LayerContext& c, std::span<const int32_t> balanced,
                                        std::span<const int32_t> previous, double cap) {
  std::vector<int32_t> out(balanced.size());
  for (const NodeSlice& n : Slices(c, balanced)) StickySlice(c, n, balanced, previous, cap, out);
  return out;
}

std::vector<int32_t> RepairNodes(const LayerContext& c, std::span<const int32_t> previous,
                                 std::span<const int32_t> start,
                                 const std::vector<int32_t>& node_of,
                                 const std::vector<int32_t>& local,
                                 const std::vector<int32_t>& balanced, double goal) {
  const Topology& t = c.topology;
  const int rpn = t.ranks_per_node();
  const std::vector<int32_t> balanced_node_of = GroupNodes(c, balanced);
  if (balanced_node_of.empty()) return {};
  const std::vector<uint8_t> above = NodesAbove(c, local, goal);
  std::vector<int> repair;
  for (int node = 0; node < t.nodes; ++node) {
    if (!above[node]) continue;
    for (int g = 0; g < t.groups; ++g) {
      if ((node_of[g] == node) != (balanced_node_of[g] == node)) return {};
    }
    repair.push_back(node);
  }
  if (repair.empty()) return {};
  std::vector<int32_t> out = local;
  std::vector<int32_t> sticky(balanced.size(), -1);  // the nodes repaired only
  std::vector<int32_t> renamed = balanced;
  RelabelRanks(previous, renamed, t.ranks, rpn);
  const size_t per_node = out.size() / static_cast<size_t>(t.nodes);
  for (int node : repair) {
    StickySlice(c, Slice(c, balanced, node), balanced, start, goal, sticky);
    ImproveNode(c, Slice(c, sticky, node), start, sticky, goal, out);
    if (NodesAbove(c, out, goal)[node]) {
      std::copy(renamed.begin() + node * per_node, renamed.begin() + (node + 1) * per_node,
                out.begin() + node * per_node);
    }
  }
  return out;
}

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

}  // namespace eplbx::internal
