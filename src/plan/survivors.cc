#include "eplbx/survivors.h"

#include <algorithm>
#include <string>
#include <string_view>

#include "common/strings.h"

namespace eplbx {

using internal::StrCat;

namespace {

// "ranks 2, 5" / "rank 2".
std::string RankList(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) out += StrCat(i ? ", " : "", ranks[i]);
  return out;
}

// The placement, the load and the topology describe the same deployment.
Status CheckShapes(std::string_view what, const Placement& in_force, const LoadMatrix& load,
                   const Topology& topology) {
  EPLBX_RETURN_IF_ERROR(topology.Validate(in_force.experts()));
  if (in_force.slots() != topology.slots || load.layers() != in_force.layers() ||
      load.experts() != in_force.experts()) {
    return Status::InvalidArgument(
        StrCat(what, ": the placement is ", in_force.layers(), " layers x ", in_force.slots(),
               " slots x ", in_force.experts(), " experts, the load ", load.layers(), " x ",
               load.experts(), ", the topology ", topology.slots, " slots; they must agree"));
  }
  return Status::OK();
}

// The members' slots of `held` (layers x span slots, -1 empty), compact in `members` order.
std::vector<int32_t> Compact(const std::vector<int32_t>& held, int layers, int span_slots,
                             int per_rank, const std::vector<int>& members) {
  const int small = static_cast<int>(members.size()) * per_rank;
  std::vector<int32_t> out(static_cast<size_t>(layers) * small, -1);
  for (int l = 0; l < layers; ++l) {
    for (size_t k = 0; k < members.size(); ++k) {
      for (int i = 0; i < per_rank; ++i) {
        out[static_cast<size_t>(l) * small + k * per_rank + i] =
            held[static_cast<size_t>(l) * span_slots + members[k] * per_rank + i];
      }
    }
  }
  return out;
}

// `compact` (layers x members' slots) back over the span; other ranks' slots empty.
std::vector<int32_t> Spread(const Placement& compact, int span_slots, int per_rank,
                            const std::vector<int>& members) {
  const int layers = compact.layers();
  std::vector<int32_t> out(static_cast<size_t>(layers) * span_slots, -1);
  for (int l = 0; l < layers; ++l) {
    for (size_t k = 0; k < members.size(); ++k) {
      for (int i = 0; i < per_rank; ++i) {
        out[static_cast<size_t>(l) * span_slots + members[k] * per_rank + i] =
            compact.phy2log(l, static_cast<int>(k) * per_rank + i);
      }
    }
  }
  return out;
}

// The ranks `members` (ids in a span of ranks with `per_rank` slots each) planned on `small`
// (their topology, in that order), incremental from what the span's slots hold (`held`,
// layers x span slots, -1 empty): the plan spread back over the span (other ranks' slots
// empty) and compact (member k's slots are k * per_rank ...).
struct OverMembers {
  std::vector<int32_t> span;
  Placement compact;
};
Result<OverMembers> PlanOverMembers(const LoadMatrix& load, const std::vector<int32_t>& held,
                                    int experts, int span_slots, int per_rank,
                                    const std::vector<int>& members, const Topology& small,
                                    Policy policy, double tolerance) {
  const int layers = load.layers();
  EPLBX_ASSIGN_OR_RETURN(
      Placement previous,
      Placement::FromPhy2Log(layers, small.slots, experts,
                             Compact(held, layers, span_slots, per_rank, members)));
  PlanOptions po;
  po.policy = policy;
  po.tolerance = tolerance;
  po.previous = &previous;
  EPLBX_ASSIGN_OR_RETURN(Placement planned, Plan(load, small, po));
  std::vector<int32_t> span = Spread(planned, span_slots, per_rank, members);
  return OverMembers{std::move(span), std::move(planned)};
}

std::vector<int> Members(const std::vector<bool>& live) {
  std::vector<int> out;
  for (size_t r = 0; r < live.size(); ++r) {
    if (live[r]) out.push_back(static_cast<int>(r));
  }
  return out;
}

Status CheckLive(const Topology& topology, const std::vector<bool>& live) {
  if (live.size() != static_cast<size_t>(topology.ranks)) {
    return Status::InvalidArgument(
        StrCat(live.size(), " liveness flags for ", topology.ranks, " ranks (one per rank)"));
  }
  return Status::OK();
}

}  // namespace

Topology MembersTopology(const Topology& topology, const std::vector<bool>& live) {
  const int per_rank = topology.slots_per_rank();
  Topology small = topology;
  small.ranks = 0;
  std::vector<int> lost_per_node(std::max(topology.nodes, 1), 0);
  for (int r = 0; r < topology.ranks && r < static_cast<int>(live.size()); ++r) {
    if (live[r]) {
      ++small.ranks;
    } else if (topology.nodes >= 1) {
      ++lost_per_node[topology.node_of_rank(r)];
    }
  }
  small.slots = small.ranks * per_rank;
  bool even = topology.nodes > 1;
  for (int n : lost_per_node) even = even && n == lost_per_node[0];
  small.nodes = even && small.ranks % topology.nodes == 0 ? topology.nodes : 1;
  return small;
}

Result<Placement> CompactToMembers(const Placement& full, const Topology& topology,
                                   const std::vector<bool>& live) {
  EPLBX_RETURN_IF_ERROR(CheckLive(topology, live));
  const std::vector<int> members = Members(live);
  const int per_rank = topology.slots_per_rank();
  return Placement::FromPhy2Log(
      full.layers(), static_cast<int>(members.size()) * per_rank, full.experts(),
      Compact(full.phy2log(), full.layers(), full.slots(), per_rank, members));
}

Result<Placement> SpreadOverMembers(const Placement& compact, const Topology& topology,
                                    const std::vector<bool>& live) {
  EPLBX_RETURN_IF_ERROR(CheckLive(topology, live));
  const std::vector<int> members = Members(live);
  const int per_rank = topology.slots_per_rank();
  if (compact.slots() != static_cast<int>(members.size()) * per_rank) {
    return Status::InvalidArgument(StrCat("a placement over the members has ", compact.slots(),
                                          " slots; ", members.size(), " members x ", per_rank,
                                          " slots per rank expected"));
  }
  return Placement::FromPhy2Log(compact.layers(), topology.slots, compact.experts(),
                                Spread(compact, topology.slots, per_rank, members));
}

Result<SurvivorPlan> PlanSurvivors(const Placement& in_force, const LoadMatrix& load,
                                   const Topology& topology, const std::vector<bool>& live,
                                   const SurvivorOptions& options) {
  EPLBX_RETURN_IF_ERROR(CheckShapes("survivor planning", in_force, load, topology));
  const int layers = in_force.layers(), slots = in_force.slots(), experts = in_force.experts();
  if (Status s = CheckLive(topology, live); !s.ok()) return s.WithPrefix("survivor planning");
  const int per_rank = topology.slots_per_rank();
  std::vector<int> alive, lost;
  for (int r = 0; r < topology.ranks; ++r) (live[r] ? alive : lost).push_back(r);
  if (alive.empty()) {
    return Status::Unavailable(StrCat("survivor planning: every one of the ", topology.ranks,
                                      " ranks is lost; nothing can serve"));
  }
  if (static_cast<int64_t>(alive.size()) * per_rank < experts) {
    return Status::InvalidArgument(
        StrCat("survivor planning: the ", alive.size(), " surviving ranks have ",
               alive.size() * per_rank, " slots (", per_rank, " each) for ", experts,
               " experts; every expert needs a slot: add ranks or slots before serving again"));
  }

  // What the survivors still hold; experts none of them holds.
  std::vector<int32_t> held = in_force.phy2log();
  for (int l = 0; l < layers; ++l) {
    for (int r : lost) {
      for (int i = 0; i < per_rank; ++i)
        held[static_cast<size_t>(l) * slots + r * per_rank + i] = -1;
    }
  }
  EPLBX_ASSIGN_OR_RETURN(Placement sources, Placement::FromPhy2Log(layers, slots, experts, held));
  std::vector<std::pair<int, int>> orphans;  // (layer, expert) no survivor holds
  for (int l = 0; l < layers; ++l) {
    for (int e = 0; e < experts; ++e) {
      if (sources.logcnt(l, e) == 0) orphans.push_back({l, e});
    }
  }
  std::string missing;
  int64_t unrecoverable = 0;
  int last_layer = -1;
  for (const auto& [l, e] : orphans) {
    if (options.backup && options.backup(l, e)) continue;
    ++unrecoverable;
    if (missing.size() < 400) {
      missing += l == last_layer ? StrCat(", ", e)
                                 : StrCat(missing.empty() ? "" : "; ", "layer ", l, ": ", e);
      last_layer = l;
    } else if (missing.back() != '.') {
      missing += ", ...";
    }
  }
  if (unrecoverable > 0) {
    return Status::Unavailable(StrCat(
        RankList(lost), " ", lost.size() == 1 ? "was" : "were", " lost with the only replicas of ",
        unrecoverable, " expert", unrecoverable == 1 ? "" : "s", " (", missing,
        ") and no backup source holds them; register a host backup or the checkpoint "
        "(SurvivorOptions::backup)"));
  }

  // Plan on a topology of the survivors: the live ranks' slots, in rank order.
  const Topology small = MembersTopology(topology, live);
  Result<OverMembers> planned = PlanOverMembers(load, held, experts, slots, per_rank, alive, small,
                                                options.policy, options.tolerance);
  if (!planned.ok()) return planned.status().WithPrefix("survivor planning");

  // The lost ranks' slots stay empty.
  std::vector<int32_t> interim = held;
  SurvivorPlan plan;
  plan.lost_ranks = lost;
  for (int l = 0; l < layers; ++l) {
    for (int r : alive) {
      for (int i = 0; i < per_rank; ++i) {
        const size_t at = static_cast<size_t>(l) * slots + r * per_rank + i;
        const int32_t e = planned->span[at];
        // A slot whose expert no survivor holds keeps its contents through the migration
        // and is filled from the backup afterwards.
        if (e >= 0 && sources.logcnt(l, e) == 0) {
          plan.recovered.push_back({l, e, r * per_rank + i});
        } else {
          interim[at] = e;
        }
      }
    }
  }
  const std::vector<int32_t>& out = planned->span;
  plan.experts_recovered = static_cast<int64_t>(orphans.size());
  EPLBX_ASSIGN_OR_RETURN(plan.placement, Placement::FromPhy2Log(layers, slots, experts, out));
  EPLBX_ASSIGN_OR_RETURN(plan.interim, Placement::FromPhy2Log(layers, slots, experts, interim));
  MigrationOptions mo = options.migration;
  mo.ranks = topology.ranks;
  mo.nodes = topology.nodes;
  Result<MigrationPlan> m = PlanMigration(sources, plan.interim, mo);
  if (!m.ok()) return m.status().WithPrefix("survivor planning: the migration among survivors");
  plan.migration = std::move(*m);
  plan.sources = std::move(sources);
  return plan;
}

Result<ResizePlan> PlanResize(const Placement& in_force, const LoadMatrix& load,
                              const Topology& topology, const ResizeRequest& request,
                              const SurvivorOptions& options) {
  EPLBX_RETURN_IF_ERROR(CheckShapes("resize planning", in_force, load, topology));
  const int layers = in_force.layers(), slots = in_force.slots(), experts = in_force.experts();
  const int per_rank = topology.slots_per_rank(), rpn = topology.ranks_per_node();
  if (request.add < 0 || request.add > Topology::kMaxSlots) {
    return Status::InvalidArgument(StrCat("resize planning: ", request.add,
                                          " ranks to add (expected 0..", Topology::kMaxSlots, ")"));
  }
  const int span_ranks = topology.ranks + request.add;
  std::vector<bool> leaves(topology.ranks, false);
  for (int r : request.remove) {
    if (r < 0 || r >= topology.ranks) {
      return Status::InvalidArgument(StrCat("resize planning: rank ", r,
                                            " to remove is not a rank (expected 0..",
                                            topology.ranks - 1, ")"));
    }
    if (leaves[r])
      return Status::InvalidArgument(StrCat("resize planning: rank ", r, " listed twice"));
    leaves[r] = true;
  }
  ResizePlan plan;
  for (int r = 0; r < topology.ranks; ++r) {
    if (leaves[r])
      plan.removed_ranks.push_back(r);
    else
      plan.members.push_back(r);
  }
  for (int r = topology.ranks; r < span_ranks; ++r) {
    plan.added_ranks.push_back(r);
    plan.members.push_back(r);
  }
  const int after_ranks = static_cast<int>(plan.members.size());
  if (after_ranks == 0) {
    return Status::InvalidArgument(StrCat("resize planning: removing every one of the ",
                                          topology.ranks, " ranks leaves none to serve"));
  }
  if (static_cast<int64_t>(after_ranks) * per_rank < experts) {
    return Status::InvalidArgument(
        StrCat("resize planning: ", after_ranks, " ranks after the resize have ",
               int64_t{after_ranks} * per_rank, " slots (", per_rank, " each) for ", experts,
               " experts; every expert needs a slot: remove fewer ranks or add some"));
  }
  // Whole nodes only: ranks per node stay, so every member keeps its node.
  bool whole = topology.nodes > 1 && request.add % rpn == 0;
  std::vector<int> leaving_per_node(topology.nodes, 0);
  for (int r : plan.removed_ranks) ++leaving_per_node[topology.node_of_rank(r)];
  for (int n : leaving_per_node) whole = whole && (n == 0 || n == rpn);
  plan.topology = topology;
  plan.topology.ranks = after_ranks;
  plan.topology.slots = after_ranks * per_rank;
  plan.topology.nodes = whole ? after_ranks / rpn : 1;
  EPLBX_RETURN_IF_ERROR(plan.topology.Validate(experts).WithPrefix("resize planning"));

  // The span: every old rank (what it holds now), then the added ranks (empty).
  const int span_slots = span_ranks * per_rank;
  std::vector<int32_t> held(static_cast<size_t>(layers) * span_slots, -1);
  for (int l = 0; l < layers; ++l) {
    for (int s = 0; s < slots; ++s)
      held[static_cast<size_t>(l) * span_slots + s] = in_force.phy2log(l, s);
  }
  Result<OverMembers> planned =
      PlanOverMembers(load, held, experts, span_slots, per_rank, plan.members, plan.topology,
                      options.policy, options.tolerance);
  if (!planned.ok()) return planned.status().WithPrefix("resize planning");
  EPLBX_ASSIGN_OR_RETURN(plan.sources, Placement::FromPhy2Log(layers, span_slots, experts, held));
  EPLBX_ASSIGN_OR_RETURN(plan.placement,
                         Placement::FromPhy2Log(layers, span_slots, experts, planned->span));
  plan.after = std::move(planned->compact);
  // During the move the removed ranks' rows keep what they hold (they are only read).
  std::vector<int32_t> interim = planned->span;
  for (int r : plan.removed_ranks) {
    for (int l = 0; l < layers; ++l) {
      for (int i = 0; i < per_rank; ++i) {
        const size_t at = static_cast<size_t>(l) * span_slots + r * per_rank + i;
        interim[at] = held[at];
      }
    }
  }
  EPLBX_ASSIGN_OR_RETURN(plan.interim,
                         Placement::FromPhy2Log(layers, span_slots, experts, std::move(interim)));
  MigrationOptions mo = options.migration;
  mo.ranks = span_ranks;
  mo.nodes = whole ? span_ranks / rpn : 1;
  Result<MigrationPlan> m = PlanMigration(plan.sources, plan.placement, mo);
  if (!m.ok()) return m.status().WithPrefix("resize planning: the migration");
  plan.migration = std::move(*m);
  return plan;
}

}  // namespace eplbx
