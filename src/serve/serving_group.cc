// ServingGroup: the Balancer and the Rearranger of one rank, and the settling of the group
// over every change of its member set. See eplbx/serving.h; the settling's decisions are the
// pure machine of serve/settle.h, the maps members exchange serve/members_map.h.
#include "eplbx/serving.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <string>

#include "common/strings.h"
#include "eplbx/survivors.h"
#include "serve/members_map.h"
#include "serve/settle.h"

namespace eplbx {

using internal::StrCat;

namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

std::vector<int> MemberList(const std::vector<bool>& live) {
  std::vector<int> out;
  for (size_t r = 0; r < live.size(); ++r) {
    if (live[r]) out.push_back(static_cast<int>(r));
  }
  return out;
}

}  // namespace

struct ServingGroup::State {
  Agent* agent = nullptr;
  Bootstrap* boot = nullptr;
  RankLayout layout;
  ServingOptions o;
  std::vector<const BackupSource*> backups;
  std::unique_ptr<Rearranger> rearranger;
  std::unique_ptr<Balancer> balancer;
  int rows = 0;        // slots per rank
  int experts = 0;     // logical experts per layer
  uint64_t epoch = 0;  // at the start or the last settling
  bool left = false;
  std::vector<bool> members;  // as of the last settling (or the start)
  std::vector<RecoveryRecord> recoveries;

  const Topology& topo() const { return o.balancer.topology; }
  int rank() const { return static_cast<int>(boot->rank()); }

  // Before it serves: the options checked against the bootstrap and the layout.
  Status Init(Agent* a, Bootstrap* b, RankLayout l, int e, ServingOptions opts,
              std::vector<const BackupSource*> sources);

  // This rank's own slots as `p` has them: layers x rows.
  std::vector<int32_t> OwnSlots(const Placement& p) const {
    std::vector<int32_t> out;
    for (int l = 0; l < p.layers(); ++l) {
      for (int row = 0; row < rows; ++row) out.push_back(p.phy2log(l, rank() * rows + row));
    }
    return out;
  }

  // The Rearranger's row tables (swap mode) into the layout the backups restore through.
  void TakeRowTables() {
    if (layout.spare_rows == 0 || rearranger == nullptr) return;
    layout.row_of_slot.resize(layout.layers.size());
    for (uint32_t l = 0; l < layout.layers.size(); ++l) {
      layout.row_of_slot[l] = rearranger->RowTable(l);
    }
  }

  // Ends the rebalance in flight: its next Commits end it on every member at once (the member
  // set changed under it; the layers committed so far stay).
  void EndRebalance(RecoveryRecord& rec) {
    const auto t = Clock::now();
    while (balancer != nullptr && balancer->progress().rebalancing) {
      BalancerCommit c = balancer->Commit();
      if (c.finished) rec.interrupted = c.status.ok() ? "finished" : c.status.message();
    }
    TakeRowTables();
    rec.end_s += Since(t);
  }

  // The Rearranger over the members at the bootstrap's epoch (created on a joiner's first
  // placement; again while the member set moves under the rebuild).
  Status OverMembers(RecoveryRecord& rec) {
    const auto t = Clock::now();
    Status built = Status::Internal("not built");
    for (int attempt = 0; attempt < 4; ++attempt) {
      const uint64_t epoch = boot->epoch();
      if (rearranger == nullptr) {
        Result<std::unique_ptr<Rearranger>> r =
            Rearranger::Create(agent, boot, layout, o.rearrange);
        built = r.status();
        if (r.ok()) rearranger = std::move(*r);
      } else {
        built = rearranger->Rebuild();
      }
      if (built.ok() || boot->epoch() == epoch) break;
    }
    rec.setup_s += Since(t);
    if (!built.ok()) return built.WithPrefix("the Rearranger over the members");
    TakeRowTables();
    return Status::OK();
  }

  Result<LoadMatrix> WindowOf(const internal::MembersRound& round) const {
    const Placement& p = round.in_force;
    std::vector<double> w = round.window;
    if (w.empty()) w.assign(static_cast<size_t>(p.layers()) * p.experts(), 0.0);
    return LoadMatrix::Create(p.layers(), p.experts(), std::move(w));
  }

  // Plans over the members from the round's placement in force and moves there: among the
  // members (a joiner's empty slots filled from the others), then the experts no member
  // holds from the backups. `own` follows what this rank's slots hold as layers commit.
  Status Place(const internal::MembersRound& round, RecoveryRecord& rec, std::vector<int32_t>* own,
               Placement* placed) {
    auto t = Clock::now();
    const std::vector<bool> live = boot->members();
    EPLBX_ASSIGN_OR_RETURN(LoadMatrix window, WindowOf(round));
    SurvivorOptions so;
    so.policy = Policy::kIncremental;
    // Recoverable where every member's backups hold it (the round's flags): every member
    // plans alike, and whichever member restores it can.
    const int experts_per_layer = round.in_force.experts();
    if (std::find(round.backed.begin(), round.backed.end(), 1) != round.backed.end()) {
      so.backup = [&round, experts_per_layer](int l, int e) {
        return round.backed[static_cast<size_t>(l) * experts_per_layer + e] != 0;
      };
    }
    so.migration.bytes_per_expert = o.balancer.bytes_per_expert;
    so.migration.nodes = topo().nodes;
    Result<SurvivorPlan> plan = PlanSurvivors(round.in_force, window, topo(), live, so);
    rec.plan_s += Since(t);
    if (!plan.ok()) return plan.status();
    rec.experts_recovered = plan->experts_recovered;  // the last plan's
    if (o.before_move) o.before_move(rec.placements);
    t = Clock::now();
    RearrangeReport moved = rearranger->Rearrange(plan->sources, plan->interim, plan->migration);
    rec.bytes_moved += moved.bytes_read;
    TakeRowTables();
    const std::vector<int32_t> interim = OwnSlots(plan->interim);
    for (const LayerOutcome& lo : moved.layers) {
      if (!lo.committed) continue;
      for (int row = 0; row < rows; ++row) {
        const size_t i = static_cast<size_t>(lo.layer) * rows + row;
        (*own)[i] = interim[i];
      }
    }
    rec.move_s += Since(t);
    if (!moved.status.ok()) return moved.status.WithPrefix("moving among the members");
    t = Clock::now();
    // (Without backups PlanSurvivors names every expert no member holds: nothing to restore.)
    if (!plan->recovered.empty()) {
      Result<int64_t> restored = RecoverSlots(*plan, layout, backups);
      if (!restored.ok()) return restored.status().WithPrefix("restoring from the backups");
      rec.rows_recovered += *restored;
    }
    *own = OwnSlots(plan->placement);
    rec.restore_s += Since(t);
    *placed = std::move(plan->placement);
    return Status::OK();
  }

  // Which (layer, expert) this rank's backups hold: once per settling (a host backup's
  // Holds() reads the file).
  std::vector<uint8_t> Backed() const {
    std::vector<uint8_t> backed(static_cast<size_t>(layout.layers.size()) * experts, 0);
    for (size_t i = 0; i < backed.size() && !backups.empty(); ++i) {
      const int l = static_cast<int>(i / experts), e = static_cast<int>(i % experts);
      backed[i] = std::any_of(backups.begin(), backups.end(),
                              [&](const BackupSource* b) { return b->Holds(l, e); });
    }
    return backed;
  }

  // One round of the members' maps; `window` sent when this rank has a Balancer.
  Result<internal::MembersRound> Gather(int step, uint64_t placed_at,
                                        const std::vector<int32_t>& own,
                                        const std::vector<uint8_t>& backed,
                                        std::chrono::milliseconds wait) {
    std::vector<double> window;
    if (balancer != nullptr) {
      EPLBX_ASSIGN_OR_RETURN(LoadMatrix w, balancer->window());
      window = w.values();
    }
    const std::string mine = internal::EncodeMembersMap(step, placed_at, own, window, backed);
    EPLBX_ASSIGN_OR_RETURN(std::vector<std::string> all, boot->AllGather(mine, wait));
    if (all.size() != static_cast<size_t>(topo().ranks)) {
      return Status::Internal(StrCat("the members' maps came from ", all.size(),
                                     " ranks; the group has ", topo().ranks));
    }
    return internal::DecodeMembersRound(all, static_cast<int>(layout.layers.size()), rows, experts);
  }

  // Settles the group over the bootstrap's member set (docs: eplbx/serving.h), from `own`
  // (what this rank's slots hold; a joiner's are empty and it says no step).
  Status Settle(bool joiner, std::vector<int32_t> own, RecoveryRecord& rec) {
    internal::Settle machine(o.max_placements);
    internal::SettleAction a = machine.Start();
    internal::MembersRound round;
    Placement placed;
    const int my_step = joiner ? -1 : static_cast<int>(balancer->report().steps);
    const std::vector<uint8_t> backed = Backed();
    bool first = true;
    for (;;) {
      switch (a.kind) {
        case internal::SettleActionKind::kGather: {
          const auto t = Clock::now();
          const uint64_t before = boot->epoch();
          const auto wait = o.round_wait * (joiner && first ? std::max(1, o.join_wait_rounds) : 1);
          first = false;
          Result<internal::MembersRound> got = Gather(my_step, a.placed_at, own, backed, wait);
          rec.gather_s += Since(t);
          Result<internal::SettleRound> summary = got.status();
          if (got.ok()) {
            round = std::move(*got);
            summary = internal::SettleRound{round.step, round.all_placed, round.placed_at,
                                            round.not_placed};
          }
          a = machine.OnGathered(summary, before, boot->epoch());
          break;
        }
        case internal::SettleActionKind::kPlace: {
          rec.placements = machine.placements();  // begun so far
          Status s = OverMembers(rec);
          if (s.ok()) s = Place(round, rec, &own, &placed);
          a = machine.OnPlaced(s, boot->epoch());
          break;
        }
        case internal::SettleActionKind::kDone: {
          rec.placements = machine.placements();
          rec.restarts = machine.restarts();
          rec.step = a.step;
          return Serve(std::move(placed), round, a.step, rec);
        }
        case internal::SettleActionKind::kFailed:
          rec.placements = machine.placements();
          rec.restarts = machine.restarts();
          return a.status;
      }
    }
  }

  // Settled: the Balancer goes on over the members from `placed` (a joiner's is made now),
  // with the members' window and step count.
  Status Serve(Placement placed, const internal::MembersRound& round, int step,
               RecoveryRecord& rec) {
    const auto t = Clock::now();
    members = boot->members();
    epoch = rec.epoch = boot->epoch();
    rec.members = MemberList(members);
    EPLBX_ASSIGN_OR_RETURN(LoadMatrix window, WindowOf(round));
    if (balancer == nullptr) {
      BalancerOptions bo = o.balancer;
      bo.live = members;
      Result<std::unique_ptr<Balancer>> b = Balancer::Create(placed, bo, rearranger.get());
      if (!b.ok()) return b.status().WithPrefix("a Balancer over the members");
      balancer = std::move(*b);
    }
    Status set = balancer->SetMembers(std::move(placed), members, window, step);
    rec.balancer_s += Since(t);
    return set.WithPrefix("the Balancer over the members");
  }
};

ServingGroup::ServingGroup(std::unique_ptr<State> state) : state_(std::move(state)) {}
ServingGroup::~ServingGroup() = default;

namespace {

Status CheckOptions(const Bootstrap* boot, const RankLayout& layout, const ServingOptions& o) {
  if (boot == nullptr) return Status::InvalidArgument("a ServingGroup needs a bootstrap");
  const Topology& t = o.balancer.topology;
  if (t.ranks != static_cast<int>(boot->size())) {
    return Status::InvalidArgument(
        StrCat("the topology has ", t.ranks, " ranks; the bootstrap's group ", boot->size()));
  }
  if (layout.layers.empty() || t.ranks < 1 || t.slots % t.ranks != 0 ||
      layout.slots(0) != static_cast<uint32_t>(t.slots / t.ranks)) {
    return Status::InvalidArgument(
        StrCat("rank ", boot->rank(), "'s layout has ", layout.layers.empty() ? 0 : layout.slots(0),
               " slots per rank; the topology ", t.ranks < 1 ? 0 : t.slots / t.ranks, " (", t.slots,
               " slots over ", t.ranks, " ranks)"));
  }
  if (o.round_wait.count() <= 0 || o.max_placements < 1) {
    return Status::InvalidArgument(StrCat("round_wait (", o.round_wait.count(),
                                          " ms) and max_placements (", o.max_placements,
                                          ") must be >= 1"));
  }
  return Status::OK();
}

}  // namespace

Status ServingGroup::State::Init(Agent* a, Bootstrap* b, RankLayout l, int e, ServingOptions opts,
                                 std::vector<const BackupSource*> sources) {
  EPLBX_RETURN_IF_ERROR(CheckOptions(b, l, opts));
  agent = a;
  boot = b;
  layout = std::move(l);
  o = std::move(opts);
  // The Rearranger's exchanges are rounds over the bootstrap too: they wait as long as the
  // group's rounds (a member lost over etcd is seen only when its lease runs out).
  if (o.rearrange.exchange_deadline.count() <= 0) o.rearrange.exchange_deadline = o.round_wait;
  backups = std::move(sources);
  rows = topo().slots_per_rank();
  experts = e;
  epoch = b->epoch();
  return Status::OK();
}

Result<std::unique_ptr<ServingGroup>> ServingGroup::Create(
    Agent* agent, Bootstrap* bootstrap, RankLayout layout, Placement initial,
    ServingOptions options, std::vector<const BackupSource*> backups) {
  auto s = std::make_unique<State>();
  EPLBX_RETURN_IF_ERROR(s->Init(agent, bootstrap, std::move(layout), initial.experts(),
                                std::move(options), std::move(backups)));
  if (s->o.balancer.live.empty()) {
    const std::vector<bool> m = bootstrap->members();
    if (!std::all_of(m.begin(), m.end(), [](bool b) { return b; })) s->o.balancer.live = m;
  }
  s->members =
      s->o.balancer.live.empty() ? std::vector<bool>(bootstrap->size(), true) : s->o.balancer.live;
  Result<std::unique_ptr<Rearranger>> r =
      Rearranger::Create(agent, bootstrap, s->layout, s->o.rearrange);
  if (!r.ok()) return r.status().WithPrefix("the Rearranger");
  s->rearranger = std::move(*r);
  s->TakeRowTables();
  Result<std::unique_ptr<Balancer>> b =
      Balancer::Create(std::move(initial), s->o.balancer, s->rearranger.get());
  if (!b.ok()) return b.status().WithPrefix("the Balancer");
  s->balancer = std::move(*b);
  return std::unique_ptr<ServingGroup>(new ServingGroup(std::move(s)));
}

Result<std::unique_ptr<ServingGroup>> ServingGroup::Join(Agent* agent, Bootstrap* bootstrap,
                                                         RankLayout layout, int experts,
                                                         ServingOptions options,
                                                         std::vector<const BackupSource*> backups) {
  auto s = std::make_unique<State>();
  EPLBX_RETURN_IF_ERROR(s->Init(agent, bootstrap, std::move(layout), experts, std::move(options),
                                std::move(backups)));
  RecoveryRecord rec;
  rec.kind = "join";
  rec.epoch_before = bootstrap->epoch();
  const auto t0 = Clock::now();
  const std::vector<int32_t> empty(s->layout.layers.size() * static_cast<size_t>(s->rows), -1);
  Status settled = s->Settle(/*joiner=*/true, empty, rec);
  rec.recovery_s = Since(t0);
  if (!settled.ok()) return settled.WithPrefix("joining the members");
  s->recoveries.push_back(std::move(rec));
  return std::unique_ptr<ServingGroup>(new ServingGroup(std::move(s)));
}

Result<BalancerStep> ServingGroup::Step(std::span<const double> expert_counts) {
  if (state_->left) return Status::InvalidArgument("this rank was drained and left the group");
  return state_->balancer->Step(expert_counts);
}

BalancerCommit ServingGroup::Commit() {
  State& s = *state_;
  if (s.left) return {};
  BalancerCommit c = s.balancer->Commit();
  if (!c.layers.empty()) s.TakeRowTables();
  return c;
}

void ServingGroup::Poll() {
  if (!state_->left) state_->balancer->Poll();
}

Result<bool> ServingGroup::Sync() {
  State& s = *state_;
  if (s.left) return Status::InvalidArgument("this rank was drained and left the group");
  const uint64_t before = s.boot->epoch();
  Status alive = s.boot->Barrier(s.o.round_wait);
  if (alive.ok()) return false;
  if (s.boot->epoch() == before) {
    return alive.WithPrefix(StrCat("the step's collective (no member-set change; waited ",
                                   s.o.round_wait.count(), " ms)"));
  }
  EPLBX_RETURN_IF_ERROR(OnMembershipChanged());
  return true;
}

Status ServingGroup::OnMembershipChanged() {
  State& s = *state_;
  RecoveryRecord rec;
  rec.epoch_before = s.epoch;
  const std::vector<bool> now = s.boot->members();
  bool grew = false;
  for (size_t r = 0; r < now.size() && r < s.members.size(); ++r) grew |= now[r] && !s.members[r];
  rec.kind = grew ? "join" : "loss";
  rec.step = s.balancer->report().steps;
  const auto t0 = Clock::now();
  s.EndRebalance(rec);
  Status settled = s.Settle(/*joiner=*/false, s.OwnSlots(s.balancer->placement()), rec);
  rec.recovery_s = Since(t0);
  s.recoveries.push_back(rec);
  if (!settled.ok()) {
    return settled.WithPrefix(
        StrCat(rec.kind == "join" ? "taking in a member" : "recovery", " at step ", rec.step));
  }
  return Status::OK();
}

Status ServingGroup::Drain(uint32_t rank) {
  State& s = *state_;
  if (rank >= s.boot->size() || !s.members[rank]) {
    return Status::InvalidArgument(StrCat("rank ", rank, " is no member to drain"));
  }
  RecoveryRecord rec;
  rec.kind = "drain";
  rec.step = s.balancer->report().steps;
  rec.epoch_before = s.boot->epoch();
  const auto t0 = Clock::now();
  s.EndRebalance(rec);
  auto t = Clock::now();
  EPLBX_ASSIGN_OR_RETURN(LoadMatrix window, s.balancer->window());
  ResizeRequest request;
  request.remove = {static_cast<int>(rank)};
  SurvivorOptions so;
  so.policy = Policy::kIncremental;
  so.migration.bytes_per_expert = s.o.balancer.bytes_per_expert;
  Result<ResizePlan> plan = PlanResize(s.balancer->placement(), window, s.topo(), request, so);
  if (!plan.ok()) return plan.status().WithPrefix(StrCat("draining rank ", rank));
  rec.plan_s = Since(t);
  t = Clock::now();
  RearrangeReport moved = s.rearranger->Rearrange(plan->sources, plan->interim, plan->migration);
  rec.bytes_moved = moved.bytes_read;
  s.TakeRowTables();
  rec.move_s = Since(t);
  if (!moved.status.ok()) return moved.status.WithPrefix(StrCat("draining rank ", rank));
  if (static_cast<int>(rank) == s.rank()) {
    s.left = true;
    rec.recovery_s = Since(t0);
    s.recoveries.push_back(std::move(rec));
    return Status::OK();
  }
  // The drained rank leaves (its bootstrap closes): the next round fails with the new epoch.
  const uint64_t epoch = s.boot->epoch();
  t = Clock::now();
  Status round = s.boot->Barrier(s.o.round_wait);
  rec.gather_s = Since(t);
  if (round.ok() || s.boot->epoch() == epoch) {
    return Status::Internal(StrCat("rank ", rank, " was drained but did not leave (",
                                   round.ok() ? "the round completed" : round.message(), ")"));
  }
  EPLBX_RETURN_IF_ERROR(s.OverMembers(rec).WithPrefix(StrCat("going on without rank ", rank)));
  t = Clock::now();
  s.members = s.boot->members();
  s.epoch = rec.epoch = s.boot->epoch();
  rec.members = MemberList(s.members);
  Status set = s.balancer->SetMembers(plan->placement, s.members, window, rec.step);
  rec.balancer_s = Since(t);
  rec.recovery_s = Since(t0);
  s.recoveries.push_back(std::move(rec));
  return set.WithPrefix(StrCat("going on without rank ", rank));
}

const Placement& ServingGroup::placement() const { return state_->balancer->placement(); }
std::vector<uint32_t> ServingGroup::RowTable(uint32_t layer) const {
  return state_->rearranger->RowTable(layer);
}
const RankLayout& ServingGroup::layout() const { return state_->layout; }
int64_t ServingGroup::step() const { return state_->balancer->report().steps; }
uint64_t ServingGroup::epoch() const { return state_->epoch; }
std::vector<bool> ServingGroup::members() const { return state_->members; }
bool ServingGroup::left() const { return state_->left; }
const std::vector<RecoveryRecord>& ServingGroup::recoveries() const { return state_->recoveries; }
const BalancerReport& ServingGroup::report() const { return state_->balancer->report(); }
BalancerProgress ServingGroup::progress() const { return state_->balancer->progress(); }
Balancer& ServingGroup::balancer() { return *state_->balancer; }

std::string PrometheusText(const ServingGroup& g) {
  std::string out = PrometheusText(g.report(), g.progress());
  std::map<std::string, int64_t> kinds{{"drain", 0}, {"join", 0}, {"loss", 0}};  // sorted
  double seconds = 0;
  int64_t experts = 0;
  for (const RecoveryRecord& r : g.recoveries()) {
    ++kinds[r.kind];
    seconds += r.recovery_s;
    experts += r.experts_recovered;
  }
  out +=
      "# HELP eplbx_recoveries_total Settlings after the member set changed, per kind "
      "(a loss, a join, a drain).\n# TYPE eplbx_recoveries_total counter\n";
  for (const auto& [kind, n] : kinds)
    out += StrCat("eplbx_recoveries_total{kind=\"", kind, "\"} ", n, "\n");
  out +=
      "# HELP eplbx_recovery_seconds Seconds from noticing a membership change until serving "
      "again.\n# TYPE eplbx_recovery_seconds summary\n";
  out += StrCat("eplbx_recovery_seconds_sum ", seconds, "\neplbx_recovery_seconds_count ",
                g.recoveries().size(), "\n");
  const std::vector<bool> members = g.members();
  out += StrCat(
      "# HELP eplbx_experts_recovered_total Experts no member held, restored from a backup.\n"
      "# TYPE eplbx_experts_recovered_total counter\neplbx_experts_recovered_total ",
      experts,
      "\n# HELP eplbx_membership_epoch The membership epoch the placement in force was planned "
      "at.\n# TYPE eplbx_membership_epoch gauge\neplbx_membership_epoch ",
      g.epoch(),
      "\n# HELP eplbx_members Ranks serving in the group.\n# TYPE eplbx_members gauge\n"
      "eplbx_members ",
      std::count(members.begin(), members.end(), true), "\n");
  return out;
}

}  // namespace eplbx
