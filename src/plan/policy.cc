#include "eplbx/policy.h"

#include <algorithm>
#include <atomic>
#include <limits>
#include <numeric>
#include <system_error>
#include <thread>
#include <vector>

#include "common/strings.h"
#include "plan/balanced_internal.h"
#include "plan/deepseek_internal.h"
#include "plan/incremental_internal.h"
#include "plan/nodes.h"
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

using internal::LayerContext;
using internal::NodeSlice;

void DeepSeekSlots(const LayerContext& c, std::span<int32_t> out) {
  std::vector<float> weight(c.weight.begin(), c.weight.end());
  std::vector<int32_t> logcnt(weight.size());
  internal::DeepSeekLayer(weight, c.topology.slots, c.hierarchical ? c.topology.groups : 1,
                          c.hierarchical ? c.topology.nodes : 1, c.topology.ranks, out, logcnt);
}

// Never worse than deepseek on any layer: deepseek's placement replaces `out` when it is
// more balanced. Its nodes are planned one at a time, heaviest first (by the weight of the
// groups on them; ties: lowest node); once a planned node has a rank heavier than `out`'s
// heaviest by more than rounding could make up (a factor 1 + 1e-9; the two layers' mean
// loads differ by rounding only), deepseek's placement is the less balanced and the other
// nodes are not planned: the outcome of planning them all and comparing.
void NeverWorseThanDeepSeek(const LayerContext& c, std::span<int32_t> out) {
  const Topology& t = c.topology;
  const std::vector<double> ours = internal::RankLoads(c.weight, out, t.ranks);
  const double heaviest = *std::max_element(ours.begin(), ours.end()) * (1 + 1e-9);
  const int groups = c.hierarchical ? t.groups : 1, nodes = c.hierarchical ? t.nodes : 1;
  const std::vector<float> weight(c.weight.begin(), c.weight.end());
  std::vector<int32_t> deepseek(out.size()), logcnt(weight.size());
  internal::DeepSeekNodes planner(weight, t.slots, groups, nodes, t.ranks, deepseek, logcnt);
  std::vector<int> order(static_cast<size_t>(nodes));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return planner.node_load(a) > planner.node_load(b); });
  const size_t slots_per_node = static_cast<size_t>(t.slots / nodes);
  const size_t per_rank = static_cast<size_t>(t.slots / t.ranks);
  std::vector<int32_t> count(weight.size(), 0);
  for (int node : order) {
    planner.Plan(node);
    const std::span<const int32_t> part =
        std::span<const int32_t>(deepseek).subspan(node * slots_per_node, slots_per_node);
    for (int32_t e : part) ++count[e];  // (an expert's replicas are all on its node)
    for (size_t first = 0; first < part.size(); first += per_rank) {
      double load = 0;
      for (size_t k = first; k < first + per_rank; ++k) load += c.weight[part[k]] / count[part[k]];
      if (load > heaviest) return;
    }
  }
  if (internal::SlotsBalancedness(c.weight, deepseek, t.ranks) > internal::LoadsBalancedness(ours))
    std::copy(deepseek.begin(), deepseek.end(), out.begin());
}

void BalancedSlotsForLayer(const LayerContext& c, std::span<int32_t> out) {
  const Topology& t = c.topology;
  // The layer's balancedness is its largest rank load: the search stops once a packing
  // reaches a maximum the layer has anyway (the floor below which no packing goes; with
  // nodes, also the largest that a node searched before reached).
  if (!c.hierarchical || t.nodes == 1) {
    internal::BalancedSlots(c.weight, t.slots, t.ranks, out,
                            internal::BalancedFloor(c.weight, t.slots, t.ranks));
  } else {
    const int experts = static_cast<int>(c.weight.size());
    const int group_size = experts / t.groups;
    std::vector<double> group_load(static_cast<size_t>(t.groups), 0.0);
    for (int e = 0; e < experts; ++e) group_load[e / group_size] += c.weight[e];
    const std::vector<int32_t> node_of = internal::AssignGroupsToNodes(group_load, t.nodes);
    const int slots_per_node = t.slots / t.nodes;
    std::vector<std::vector<int32_t>> ids(static_cast<size_t>(t.nodes));  // ascending
    for (int e = 0; e < experts; ++e) ids[node_of[e / group_size]].push_back(e);
    std::vector<std::vector<double>> local(ids.size());
    std::vector<double> floor(ids.size());
    for (int node = 0; node < t.nodes; ++node) {
      for (int32_t e : ids[node]) local[node].push_back(c.weight[e]);
      floor[node] = internal::BalancedFloor(local[node], slots_per_node, t.ranks_per_node());
    }
    // Nodes with the highest floor first (ties: lowest node): the one likely to end the
    // heaviest sets the bar the others stop at.
    std::vector<int> order(static_cast<size_t>(t.nodes));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return floor[a] > floor[b]; });
    double enough = *std::max_element(floor.begin(), floor.end());
    for (int node : order) {
      std::span<int32_t> node_out = out.subspan(static_cast<size_t>(node) * slots_per_node,
                                                static_cast<size_t>(slots_per_node));
      enough = std::max(enough, internal::BalancedSlots(local[node], slots_per_node,
                                                        t.ranks_per_node(), node_out, enough));
      for (int32_t& e : node_out) e = ids[node][e];
    }
  }
  NeverWorseThanDeepSeek(c, out);
}

// Candidates in order; the first within `tolerance` of balanced wins: (1) local search from
// the previous placement (enough on almost every layer); (2) in hierarchical mode, when the
// nodes it leaves above the goal have the groups `balanced` gives them, those nodes alone
// planned again by (3) and (4) below, the others kept (RepairNodes); else, when a node's
// groups are too heavy for it, the cheapest swaps of groups between nodes (Regroup);
// outside hierarchical mode, when the search stalls, its result re-pointed to the balanced
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
  // A rank load above which `done` certainly refuses: the candidate's mean rank load is the
  // total up to rounding (far below the margin).
  const double miss = target - 1e-12 > 0 ? total / t.ranks / (target - 1e-12) * (1 + 1e-9)
                                         : std::numeric_limits<double>::infinity();
  auto done = [&](const std::vector<int32_t>& candidate) {
    if (internal::SlotsBalancedness(c.weight, candidate, t.ranks) < target - 1e-12) return false;
    std::copy(candidate.begin(), candidate.end(), out.begin());
    return true;
  };
  // Copies are counted against `start`; the search begins from `begin`.
  const std::vector<int32_t> start = internal::CompleteSlots(c.weight, previous, t.ranks);
  std::vector<int32_t> begin = start;
  const bool by_node = c.hierarchical && t.nodes > 1;
  std::vector<int32_t> node_of;  // by_node: each group's node in `begin`
  if (by_node) {
    internal::RelabelNodes(start, balanced, t.nodes, c.weight.size());
    // Groups split across nodes (a previous placement made without them) are gathered on
    // the node holding most of each; without such an assignment only stages 3-4 remain.
    node_of = internal::GroupNodes(c, start);
    if (node_of.empty()) begin.clear();
    for (int node = 0; node < t.nodes && !begin.empty(); ++node) {
      begin = internal::Substitute(c, begin, node_of, node);
    }
  }
  if (!begin.empty()) {
    const std::vector<int32_t> local = internal::ImproveByNode(c, start, begin, goal);
    if (done(local)) return;
    if (by_node) {
      const std::vector<int32_t> repaired =
          internal::RepairNodes(c, previous, start, node_of, local, balanced, goal);
      if (!repaired.empty() && done(repaired)) return;
    }
    if (by_node && internal::Regroup(c, start, begin, node_of, local, goal, miss, done)) return;
    if (!by_node) {
      std::vector<int32_t> count(c.weight.size(), 0);
      for (int32_t e : balanced) ++count[e];
      const std::vector<int32_t> adopted = internal::AdoptCounts(c.weight, local, t.ranks, count);
      if (done(internal::ImproveByNode(c, start, adopted, goal))) return;
    }
  }
  if (done(internal::ImproveByNode(c, start, internal::StickyFromBalanced(c, balanced, start, goal),
                                   goal)))
    return;
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
  EPLBX_RETURN_IF_ERROR(topology.CheckWork(load.layers(), load.experts()));
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
  auto plan_layer = [&](int l) {
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
  };
  // Layers are independent (each writes its own rows): a thread takes the next layer not
  // taken, so the result does not depend on the number of threads or their timing.
  // By default a small plan stays on the calling thread: starting threads costs more than
  // they save below about 4,096 layer-slots (the demo's 8 x 72 plans in 0.37 ms on one thread,
  // 0.59 ms on two; docs/perf.md).
  constexpr int64_t kSmallPlan = 4096;
  int threads =
      options.threads > 0 ? options.threads : static_cast<int>(std::thread::hardware_concurrency());
  if (options.threads <= 0 && static_cast<int64_t>(load.layers()) * topology.slots < kSmallPlan)
    threads = 1;
  threads = options.policy == Policy::kDeepSeek ? 1 : std::clamp(threads, 1, load.layers());
  std::atomic<int> next{0};
  auto work = [&] {
    for (int l = next++; l < load.layers(); l = next++) plan_layer(l);
  };
  std::vector<std::thread> helpers;
  for (int i = 1; i < threads; ++i) {
    try {
      helpers.emplace_back(work);
    } catch (const std::system_error&) {  // no thread to be had: fewer do the work
      break;
    }
  }
  work();
  for (std::thread& h : helpers) h.join();
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
