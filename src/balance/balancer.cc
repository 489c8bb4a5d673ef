#include "eplbx/balancer.h"

#include <chrono>
#include <cmath>
#include <future>
#include <map>
#include <optional>

#include "common/strings.h"
#include "eplbx/migration.h"
#include "eplbx/survivors.h"

namespace eplbx {

using internal::StrCat;

namespace {

using SteadyClock = std::chrono::steady_clock;

double Since(SteadyClock::time_point t0) {
  return std::chrono::duration<double>(SteadyClock::now() - t0).count();
}

// The balance of `p` under `load` over the ranks that serve (the members' slots only when
// options.live is set).
Result<Balance> BalanceOver(const BalancerOptions& o, const Placement& p, const LoadMatrix& load) {
  if (o.live.empty()) return ComputeBalance(p, load, o.topology.ranks);
  EPLBX_ASSIGN_OR_RETURN(Placement compact, CompactToMembers(p, o.topology, o.live));
  return ComputeBalance(compact, load, MembersTopology(o.topology, o.live).ranks);
}

// The next placement from the window, incremental from `current`: over every rank, or with
// options.live planned on the members' topology and spread back (other ranks' slots empty).
Result<Placement> PlanNext(const BalancerOptions& o, const LoadMatrix& window,
                           const Placement& current) {
  if (o.live.empty()) {
    return Plan(window, o.topology,
                {.policy = o.policy, .previous = &current, .tolerance = o.tolerance});
  }
  EPLBX_ASSIGN_OR_RETURN(Placement compact, CompactToMembers(current, o.topology, o.live));
  EPLBX_ASSIGN_OR_RETURN(
      Placement next, Plan(window, MembersTopology(o.topology, o.live),
                           {.policy = o.policy, .previous = &compact, .tolerance = o.tolerance}));
  return SpreadOverMembers(next, o.topology, o.live);
}

// `live` (one flag per rank, or none) fits `t` and `p`: the members have a slot for every
// expert, and no other rank's slot holds one.
Status CheckLive(const Topology& t, const Placement& initial, const std::vector<bool>& live) {
  if (live.empty()) return Status::OK();
  if (live.size() != static_cast<size_t>(t.ranks)) {
    return Status::InvalidArgument(StrCat(live.size(), " liveness flags (live) for ", t.ranks,
                                          " ranks (one per rank, or none)"));
  }
  const Topology members = MembersTopology(t, live);
  if (members.slots < initial.experts()) {
    return Status::InvalidArgument(StrCat("the ", members.ranks, " serving ranks have ",
                                          members.slots, " slots for ", initial.experts(),
                                          " experts; every expert needs a slot"));
  }
  const int per_rank = t.slots_per_rank();
  for (int l = 0; l < initial.layers(); ++l) {
    for (int slot = 0; slot < initial.slots(); ++slot) {
      if (!live[slot / per_rank] && initial.phy2log(l, slot) >= 0) {
        return Status::InvalidArgument(
            StrCat("the initial placement puts expert ", initial.phy2log(l, slot), " of layer ", l,
                   " in slot ", slot, " of rank ", slot / per_rank,
                   ", which does not serve (live); its slots must be empty (-1)"));
      }
    }
  }
  return Status::OK();
}

}  // namespace

// What the planning step decides, on the serving thread or on a planning thread.
struct Planned {
  Status status;
  TriggerDecision decision = TriggerDecision::kRebalance;
  std::optional<Placement> next;
  MigrationPlan migration;
  RebalanceRecord record;  // window balances, copies, bytes, plan and migration-plan times
};

// From the window and the placement in force: the next placement, whether it is worth it,
// and the migration plan. Pure; runs on any thread.
Planned PlanRebalance(const BalancerOptions& o, const LoadMatrix& window, const Placement& current,
                      double before) {
  Planned out;
  const Topology& t = o.topology;
  auto t0 = SteadyClock::now();
  Result<Placement> next = PlanNext(o, window, current);
  out.record.plan_s = Since(t0);
  if (!next.ok()) {
    out.status = next.status();
    return out;
  }
  Result<Balance> planned = BalanceOver(o, *next, window);
  if (!planned.ok()) {
    out.status = planned.status();
    return out;
  }
  out.record.window_before = before;
  out.record.window_after = planned->total;
  out.decision = Decide(o.trigger, before, planned->total);
  if (out.decision != TriggerDecision::kRebalance) return out;
  t0 = SteadyClock::now();
  const MigrationOptions mig{.ranks = t.ranks,
                             .nodes = t.nodes,
                             .bytes_per_expert = o.bytes_per_expert,
                             .link_gbps = o.link_gbps};
  Result<MigrationPlan> m = PlanMigration(current, *next, mig);
  out.record.migration_plan_s = Since(t0);
  Result<Moves> moves = m.ok() ? CountMoves(current, *next, t.ranks) : Result<Moves>(m.status());
  if (!moves.ok()) {
    out.status = moves.status();
    return out;
  }
  out.record.copies = moves->total.remote_copies;
  out.record.bytes = m->summary.bytes_moved;
  out.record.stall_estimate_s = m->summary.time_lower_bound_s;
  out.migration = std::move(*m);
  out.next = std::move(*next);
  return out;
}

struct Balancer::State {
  BalancerOptions o;
  Rearranger* rearranger = nullptr;
  Placement current;
  std::vector<int32_t> flat;  // current's phy2log
  LoadRecorder recorder;
  BalancerReport report;
  std::optional<Placement> next;       // plan only: takes effect at the next Commit
  std::vector<CommittedLayer> synced;  // synchronous: committed in Step, reported by Commit
  bool synced_finished = false;
  Status synced_status;
  bool active = false;            // an asynchronous rebalance is running
  std::future<Planned> planning;  // asynchronous: the plan being computed
  int64_t begin_at = 0;           // the step (count) at which it begins
  int64_t last_commit_step = 0, layers_committed = 0;
  double balancedness = 1.0;  // the last Step's

  State(BalancerOptions options, Rearranger* r, Placement initial, LoadRecorder rec)
      : o(std::move(options)),
        rearranger(r),
        current(std::move(initial)),
        flat(current.phy2log().begin(), current.phy2log().end()),
        recorder(std::move(rec)) {}

  RebalanceRecord& last() { return report.rebalances.back(); }
  // Begins (or runs, or schedules) the rebalance `planned` decided.
  Result<BalancerStep> Start(Planned planned, BalancerStep out);

  // Layer `l` now holds `map`.
  void Apply(const CommittedLayer& c) {
    const int slots = current.slots();
    std::copy(c.phy2log.begin(), c.phy2log.end(),
              flat.begin() + static_cast<long>(c.layer) * slots);
    ++layers_committed;
    last_commit_step = report.steps;
  }
  void Rebuild() {
    current = *Placement::FromPhy2Log(current.layers(), current.slots(), current.experts(), flat);
  }
  void Finished(const Status& s, const RearrangeReport& r) {
    RebalanceRecord& rec = last();
    rec.status = s;
    rec.finished_step = report.steps - 1;
    rec.bytes_read = r.bytes_read;
    rec.bytes_by_path = r.bytes_by_path;
    rec.bytes_from_rank = r.bytes_from_rank;
    rec.bytes_from_node.clear();
    const Topology& t = o.topology;
    if (!r.bytes_from_rank.empty() && t.nodes >= 1 && t.ranks % t.nodes == 0) {
      rec.bytes_from_node.assign(t.nodes, 0);
      for (size_t src = 0; src < r.bytes_from_rank.size(); ++src) {
        if (static_cast<int>(src) < t.ranks)
          rec.bytes_from_node[t.node_of_rank(static_cast<int>(src))] += r.bytes_from_rank[src];
      }
    }
    for (const LayerOutcome& o : r.layers) {
      if (!o.committed) continue;
      ++rec.layers_committed;
      rec.layers_swapped += o.swapped ? 1 : 0;
      rec.bytes_copied += o.bytes_copied;
    }
    if (!s.ok()) ++report.failed;
  }
};

Balancer::Balancer(std::unique_ptr<State> state) : state_(std::move(state)) {}
Balancer::~Balancer() = default;

Result<std::unique_ptr<Balancer>> Balancer::Create(Placement initial, BalancerOptions options,
                                                   Rearranger* rearranger) {
  if (options.window < 1 || options.trigger.interval < 1) {
    return Status::InvalidArgument(StrCat("window (", options.window, ") and interval (",
                                          options.trigger.interval, ") must be >= 1 steps"));
  }
  // The one check of the real-valued options, for every caller (the CLI's flags have the
  // same ranges; Python passes its arguments here).
  const struct {
    const char* name;
    double value, lo, hi;
  } reals[] = {{"tolerance", options.tolerance, 0, 1},
               {"min_gain", options.trigger.min_gain, 0, 1},
               {"skip_above", options.trigger.skip_above, 0, 2}};
  for (const auto& r : reals) {
    if (!(r.value >= r.lo && r.value <= r.hi)) {  // NaN fails both
      return Status::InvalidArgument(
          StrCat(r.name, " is ", std::isnan(r.value) ? std::string("nan") : StrCat(r.value),
                 ": expected a number in [", r.lo, ", ", r.hi, "]"));
    }
  }
  EPLBX_RETURN_IF_ERROR(options.topology.Validate(initial.experts()));
  if (options.topology.slots != initial.slots()) {
    return Status::InvalidArgument(StrCat("the topology has ", options.topology.slots,
                                          " slots, the initial placement ", initial.slots()));
  }
  EPLBX_RETURN_IF_ERROR(CheckLive(options.topology, initial, options.live));
  EPLBX_ASSIGN_OR_RETURN(LoadRecorder rec,
                         LoadRecorder::Create(initial.layers(), initial.experts(), options.window));
  if (rearranger != nullptr) EPLBX_RETURN_IF_ERROR(rearranger->Reserve(options.async));
  return std::unique_ptr<Balancer>(new Balancer(
      std::make_unique<State>(std::move(options), rearranger, std::move(initial), std::move(rec))));
}

Status Balancer::SetMembers(Placement placement, std::vector<bool> live, const LoadMatrix& window,
                            int64_t steps) {
  State& s = *state_;
  if (s.active || s.next) {
    return Status::InProgress(
        "a rebalance is in flight: end it (Commit() until progress().rebalancing is false) "
        "before the member set changes");
  }
  if (placement.layers() != s.current.layers() || placement.slots() != s.current.slots() ||
      placement.experts() != s.current.experts() || steps < 0) {
    return Status::InvalidArgument(
        StrCat("the members' placement is ", placement.layers(), " layers x ", placement.slots(),
               " slots x ", placement.experts(), " experts at step ", steps, "; the Balancer has ",
               s.current.layers(), " x ", s.current.slots(), " x ", s.current.experts()));
  }
  EPLBX_RETURN_IF_ERROR(CheckLive(s.o.topology, placement, live));
  EPLBX_ASSIGN_OR_RETURN(LoadRecorder rec,
                         LoadRecorder::Create(placement.layers(), placement.experts(), s.o.window));
  EPLBX_RETURN_IF_ERROR(rec.Seed(window));
  if (s.planning.valid()) (void)s.planning.get();  // dropped (it planned for the old members)
  s.recorder = std::move(rec);
  s.o.live = std::move(live);
  s.current = std::move(placement);
  s.flat.assign(s.current.phy2log().begin(), s.current.phy2log().end());
  s.report.steps = steps;
  s.last_commit_step = steps;
  return Status::OK();
}

Result<LoadMatrix> Balancer::window() const { return state_->recorder.Window(); }

const Placement& Balancer::placement() const { return state_->current; }
const BalancerReport& Balancer::report() const { return state_->report; }

BalancerProgress Balancer::progress() const {
  const State& s = *state_;
  BalancerProgress p;
  p.rebalancing = s.active || s.next.has_value();
  p.planning = s.planning.valid();
  if (s.rearranger != nullptr) p.rearrangement = s.rearranger->progress();
  p.steps = s.report.steps;
  p.steps_since_commit = s.report.steps - s.last_commit_step;
  p.layers_committed = s.layers_committed;
  p.balancedness = s.balancedness;
  return p;
}

Result<BalancerStep> Balancer::StepSlots(std::span<const double> slot_counts) {
  State& s = *state_;
  const Placement& p = s.current;
  const size_t want = static_cast<size_t>(p.layers()) * p.slots();
  if (slot_counts.size() != want) {
    return Status::InvalidArgument(StrCat("step ", s.report.steps, ": ", slot_counts.size(),
                                          " slot counts, expected ", want, " (", p.layers(),
                                          " layers x ", p.slots(), " slots)"));
  }
  std::vector<double> counts(static_cast<size_t>(p.layers()) * p.experts(), 0.0);
  for (int l = 0; l < p.layers(); ++l) {
    for (int slot = 0; slot < p.slots(); ++slot) {
      const double c = slot_counts[static_cast<size_t>(l) * p.slots() + slot];
      // Checked per slot: a negative count on one replica must not hide in its expert's sum.
      if (!std::isfinite(c) || c < 0) {
        return Status::InvalidArgument(StrCat("step ", s.report.steps, ": the count of layer ", l,
                                              " slot ", slot, " is ", c,
                                              "; counts must be finite and >= 0"));
      }
      const int32_t e = p.phy2log(l, slot);
      if (e >= 0) counts[static_cast<size_t>(l) * p.experts() + e] += c;
    }
  }
  return Step(counts);
}

Result<BalancerStep> Balancer::Step(std::span<const double> expert_counts) {
  State& s = *state_;
  EPLBX_ASSIGN_OR_RETURN(LoadMatrix load,
                         LoadMatrix::Create(s.current.layers(), s.current.experts(),
                                            {expert_counts.begin(), expert_counts.end()}));
  BalancerStep out;
  EPLBX_ASSIGN_OR_RETURN(Balance b, BalanceOver(s.o, s.current, load));
  out.balancedness = b.total;
  s.balancedness = b.total;
  EPLBX_RETURN_IF_ERROR(s.recorder.Record(expert_counts));
  ++s.report.steps;
  Poll();  // drives the rebalance in flight, if any
  if (s.planning.valid()) {
    if (s.report.steps < s.begin_at) return out;
    const auto t0 = SteadyClock::now();
    Planned planned = s.planning.get();  // ready by now, normally
    const double waited = Since(t0);
    out.decision = planned.decision;
    EPLBX_RETURN_IF_ERROR(planned.status);
    if (planned.decision != TriggerDecision::kRebalance) {
      ++s.report.skipped_small_gain;
      return out;
    }
    planned.record.plan_wait_s = waited;
    return s.Start(std::move(planned), out);
  }
  if (!Due(s.o.trigger, s.report.steps) || s.active || s.next) return out;
  ++s.report.considered;
  EPLBX_ASSIGN_OR_RETURN(LoadMatrix window, s.recorder.Window());
  EPLBX_ASSIGN_OR_RETURN(const Balance on_window, BalanceOver(s.o, s.current, window));
  const double before = on_window.total;
  out.decision = Decide(s.o.trigger, before, 0);
  if (out.decision == TriggerDecision::kSkipBalanced) {
    ++s.report.skipped_balanced;
    return out;
  }
  if (s.rearranger != nullptr && s.o.mode == BalancerMode::kAsynchronous &&
      s.o.plan_lag_steps > 0) {
    s.planning = std::async(std::launch::async,
                            [o = s.o, window = std::move(window), current = s.current, before] {
                              return PlanRebalance(o, window, current, before);
                            });
    s.begin_at = s.report.steps + s.o.plan_lag_steps;
    out.decision = TriggerDecision::kNotDue;  // decided at the begin step
    return out;
  }
  Planned planned = PlanRebalance(s.o, window, s.current, before);
  EPLBX_RETURN_IF_ERROR(planned.status);
  out.decision = planned.decision;
  if (planned.decision != TriggerDecision::kRebalance) {
    ++s.report.skipped_small_gain;
    return out;
  }
  return s.Start(std::move(planned), out);
}

Result<BalancerStep> Balancer::State::Start(Planned planned, BalancerStep out) {
  State& s = *this;
  RebalanceRecord rec = std::move(planned.record);
  rec.step = s.report.steps - 1;  // 0-based, like the steps of a trace
  rec.finished_step = rec.step;
  s.report.rebalances.push_back(std::move(rec));
  out.began = true;
  Placement next = std::move(*planned.next);
  const MigrationPlan& m = planned.migration;
  if (s.rearranger == nullptr) {
    s.next = std::move(next);
    return out;
  }
  if (s.o.mode == BalancerMode::kSynchronous) {
    const auto t0 = SteadyClock::now();
    RearrangeReport r = s.rearranger->Rearrange(s.current, next, m);
    s.last().rearrange_s = Since(t0);
    for (const LayerOutcome& o : r.layers) {
      if (!o.committed) continue;
      CommittedLayer c;
      c.layer = o.layer;
      for (int slot = 0; slot < next.slots(); ++slot)
        c.phy2log.push_back(next.phy2log(static_cast<int>(o.layer), slot));
      c.row_of_slot = s.rearranger->RowTable(o.layer);
      s.Apply(c);
      s.synced.push_back(std::move(c));
    }
    s.Rebuild();
    s.Finished(r.status, r);
    s.synced_finished = true;
    s.synced_status = r.status;
    return out;
  }
  const auto t0 = SteadyClock::now();
  Status begun = s.rearranger->Begin(s.current, next, m, s.o.async);
  s.last().poll_s += Since(t0);
  if (!begun.ok()) {
    s.Finished(begun, {});
    s.synced_finished = true;
    s.synced_status = begun;
    return out;
  }
  s.active = true;
  return out;
}

void Balancer::Poll() {
  State& s = *state_;
  if (!s.active) return;
  const auto t0 = SteadyClock::now();
  (void)s.rearranger->Poll();  // its failure comes to every rank through Commit
  s.last().poll_s += Since(t0);
}

BalancerCommit Balancer::Commit() {
  State& s = *state_;
  BalancerCommit out;
  if (s.next) {  // plan only
    for (int l = 0; l < s.next->layers(); ++l) {
      CommittedLayer c;
      c.layer = static_cast<uint32_t>(l);
      for (int slot = 0; slot < s.next->slots(); ++slot)
        c.phy2log.push_back(s.next->phy2log(l, slot));
      s.Apply(c);
      out.layers.push_back(std::move(c));
    }
    s.current = std::move(*s.next);
    s.next.reset();
    s.last().layers_committed = static_cast<uint32_t>(out.layers.size());
    out.finished = true;
    return out;
  }
  if (s.synced_finished) {
    out.layers = std::move(s.synced);
    s.synced.clear();
    out.finished = true;
    out.status = s.synced_status;
    s.synced_finished = false;
    return out;
  }
  if (!s.active) return out;
  const auto t0 = SteadyClock::now();
  CommitResult c = s.rearranger->Commit();
  RebalanceRecord& rec = s.last();
  rec.wait_s += c.wait_seconds;
  rec.commit_s += Since(t0) - c.wait_seconds;
  for (const CommittedLayer& l : c.layers) s.Apply(l);
  if (!c.layers.empty()) s.Rebuild();
  out.layers = std::move(c.layers);
  if (c.finished) {
    s.active = false;
    s.Finished(c.status, s.rearranger->async_report());
    out.finished = true;
    out.status = c.status;
  }
  return out;
}

std::string PrometheusText(const BalancerReport& r, const BalancerProgress& p) {
  uint64_t bytes_read = 0, bytes_copied = 0;
  double stall = 0, wait = 0, commit = 0, poll = 0, rebalance = 0;
  std::map<std::string, uint64_t> by_path;  // sorted: the same text every time
  for (const RebalanceRecord& x : r.rebalances) {
    bytes_read += x.bytes_read;
    bytes_copied += x.bytes_copied;
    stall += x.rearrange_s;
    wait += x.wait_s;
    commit += x.commit_s;
    poll += x.poll_s;
    rebalance += x.plan_s + x.migration_plan_s + x.plan_wait_s + x.rearrange_s + x.poll_s +
                 x.wait_s + x.commit_s;
    for (const PathTotals& t : x.bytes_by_path) by_path[t.path] += t.bytes;
  }
  std::string out;
  auto metric = [&out](const char* name, const char* type, const char* help, auto value) {
    out += StrCat("# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n", name, " ", value,
                  "\n");
  };
  metric("eplbx_steps_total", "counter", "Forward steps seen.", r.steps);
  metric("eplbx_rebalances_total", "counter", "Rebalances begun.", r.rebalances.size());
  metric("eplbx_rebalances_failed_total", "counter", "Rebalances that ended with an error.",
         r.failed);
  metric("eplbx_rebalances_skipped_total", "counter", "Due rebalances skipped by the trigger.",
         r.skipped_balanced + r.skipped_small_gain);
  metric("eplbx_bytes_read_total", "counter", "Bytes this rank read from peers.", bytes_read);
  metric("eplbx_bytes_copied_total", "counter", "Bytes copied within this rank.", bytes_copied);
  metric("eplbx_stall_seconds_total", "counter", "Seconds inside synchronous rearrangements.",
         stall);
  metric("eplbx_poll_seconds_total", "counter", "Seconds inside asynchronous polls.", poll);
  metric("eplbx_vote_wait_seconds_total", "counter", "Seconds waiting for peers' votes.", wait);
  metric("eplbx_commit_seconds_total", "counter", "Seconds applying committed layers.", commit);
  metric("eplbx_layers_committed_total", "counter", "Layers switched to a new map.",
         p.layers_committed);
  metric("eplbx_rebalancing", "gauge", "1 while a rebalance is in flight.", p.rebalancing ? 1 : 0);
  metric("eplbx_bytes_in_flight", "gauge", "READs posted and not yet landed.",
         p.rearrangement.bytes_in_flight);
  metric("eplbx_steps_since_commit", "gauge", "Steps since a layer last changed its map.",
         p.steps_since_commit);
  metric("eplbx_balancedness", "gauge",
         "Balancedness of the placement in force on the last step's load (mean / max rank load).",
         p.balancedness);
  out +=
      "# HELP eplbx_rebalance_seconds Seconds this rank spent on rebalances (planning, "
      "moving, waiting, committing).\n# TYPE eplbx_rebalance_seconds summary\n";
  out += StrCat("eplbx_rebalance_seconds_sum ", rebalance, "\neplbx_rebalance_seconds_count ",
                r.rebalances.size(), "\n");
  out +=
      "# HELP eplbx_bytes_moved_total Bytes this rank's rebalances moved, per data path.\n"
      "# TYPE eplbx_bytes_moved_total counter\n";
  for (const auto& [path, bytes] : by_path) {
    out += StrCat("eplbx_bytes_moved_total{path=\"", path, "\"} ", bytes, "\n");
  }
  return out;
}

}  // namespace eplbx
