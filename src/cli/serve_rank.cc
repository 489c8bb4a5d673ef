// One rank of `eplbx demo --serve`: an expert-parallel forward loop over real weights.
//
// Every step, a gate routes `tokens` x `top_k` tokens per layer to logical experts (the
// simulator's Zipf + drift trace, the same on every rank); an expert's tokens are split over
// its replicas; for each routed token the rank works over `work_bytes` of the expert's
// row (it recomputes the pattern the row must hold and compares: real work over the
// weights, and a check of every row it uses against the map it read). The work is timed
// in this thread's CPU time per layer, one rank at a time (a semaphore the coordinator
// shares), so ranks sharing cores do not distort it. After the work the
// rank calls the Balancer's Step and Commit (its safe point) and records when it entered and
// left them (CLOCK_MONOTONIC, the same clock in every process): the coordinator models a
// step as the slowest rank's work plus the Balancer's cost, from the last rank entering to
// the last leaving (serve_report.cc). Each layer is its own synchronisation point (its
// dispatch and combine all-to-all): a step's work is the sum over layers of the slowest
// rank's work on that layer.
#include <semaphore.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstring>
#include <iostream>

#include <nlohmann/json.hpp>

#include "cli/demo.h"
#include "cli/serve_mode.h"
#include "common/bytes.h"
#include "common/strings.h"
#include "eplbx/backup.h"
#include "eplbx/serving.h"
#include "eplbx/simulate.h"
#include "eplbx/survivors.h"

namespace eplbx::cli {
namespace {

using internal::StrCat;

// The step's membership event on this rank, for a drill: a drain (`remove` at this step),
// else the step's collective (ServingGroup::Sync), which settles any change of the member
// set. Returns false when this rank stops (it left, or the group cannot go on: m.error).
bool Membership(const DemoOptions& o, int step, int64_t step_t0, int64_t asked_ns, Mode& mode,
                DrillLog& log, bool* left, bool* coordinator_gone) {
  ServingGroup& g = *mode.group;
  const size_t before = g.recoveries().size();
  const auto removal = std::find_if(o.events.begin(), o.events.end(), [&](const auto& e) {
    return e.kind == "remove" && e.step == step;
  });
  if (removal != o.events.end()) {
    // Every member drains the leaving rank; it leaves, the others go on over the members.
    Status drained = g.Drain(static_cast<uint32_t>(removal->rank));
    mode.TakeRowTables();
    if (log.detected_step < 0) log.detected_step = step;
    if (!drained.ok()) {
      mode.m.error =
          StrCat("removing rank ", removal->rank, " at step ", step, ": ", drained.message());
      return false;
    }
    *left = g.left();
    return !*left;
  }
  Result<bool> synced = g.Sync();
  mode.TakeRowTables();
  if (synced.ok()) {
    if (*synced && log.detected_step < 0) {
      // From the step's start (a join: from the request) until the change was known here.
      const RecoveryRecord& r = g.recoveries().back();
      const int64_t from = r.kind == "join" && asked_ns > 0 ? asked_ns : step_t0;
      log.detected_step = step;
      log.detect_wait_s = static_cast<double>(MonotonicNs() - from) * 1e-9 - r.recovery_s;
    }
    return true;
  }
  if (g.recoveries().size() > before) {  // a settling that failed (named by the library)
    mode.m.error = synced.status().message();
    return false;
  }
  // The coordinator fails a round a member misses at 0.8 x the deadline; a member that waited
  // 2 x for the step's collective heard nothing: the coordinator (rank 0's store) is stopped,
  // hung or unreachable, and no later round can be answered.
  const Status& why = synced.status();
  *coordinator_gone = why.code() == Code::kTimeout || why.code() == Code::kUnavailable;
  mode.m.error = why.code() == Code::kTimeout && !o.coordination.empty()
                     ? StrCat("step ", step, ": the step's collective on etcd (", o.coordination,
                              ") did not complete: ", why.message())
                 : why.code() == Code::kTimeout
                     ? StrCat("step ", step,
                              ": the coordinator (rank 0's store) did not answer the step's "
                              "collective within ",
                              o.deadline_s * 2,
                              " s (2 x --deadline): rank 0 stopped, hung or "
                              "unreachable")
                     : StrCat("step ", step, ": ", why.message());
  return false;
}

}  // namespace

int RunServeRank(const DemoOptions& o, int rank, SocketBootstrap& boot, nlohmann::json* sent) {
  return RunServeRank(
      o, rank, boot, boot.joining(), [&boot](const std::string& m) { return boot.SendMessage(m); },
      sent);
}

int RunServeRank(const DemoOptions& o, int rank, Bootstrap& boot, bool joining,
                 const SendToCoordinator& send, nlohmann::json* sent) {
  nlohmann::json report = NewRankReport(rank);
  report["node"] = NodeName();
  auto finish = [&](int code) {
    (void)send(report.dump());
    if (sent != nullptr) *sent = report;
    return code;
  };
  auto fail = [&](const std::string& why) {
    report["error"] = why;
    return finish(1);
  };
  // A round over the coordinator: it fails a round a member misses after 0.8 x the deadline
  // (naming it, under a new epoch); the members wait twice the deadline, so they hear that
  // rather than give up first on a loaded machine.
  // On etcd a lost member is seen when its lease runs out (an etcd leader change extends
  // leases by up to a lease): three leases more.
  const auto round_wait =
      std::chrono::milliseconds(static_cast<int64_t>((o.deadline_s * 2 + o.lease_s * 3) * 1000));
  Result<LoadTrace> trace = DemoTrace(o);
  if (!trace.ok()) return fail(trace.status().message());
  const Topology topo{o.ranks, 1, o.ranks * o.slots_per_rank, 1};
  const LoadMatrix uniform = *LoadMatrix::Create(
      o.layers, o.experts, std::vector<double>(static_cast<size_t>(o.layers) * o.experts, 1.0));
  const bool drill = !o.events.empty() || o.survive;
  // A process for a rank added later, or a lost rank's process started again: it joins where
  // the members are (told by the demo, or by the store's welcome).
  const bool joiner = o.joining || joining;
  const std::vector<bool> live = MembersAt(o, 0);
  const bool all_live = std::all_of(live.begin(), live.end(), [](bool b) { return b; });
  Result<Placement> initial = Status::Internal("not planned");
  {
    Result<Placement> compact =
        Plan(uniform, MembersTopology(topo, live), {.policy = Policy::kBalanced});
    initial = compact.ok() ? SpreadOverMembers(*compact, topo, live) : compact.status();
  }
  if (!initial.ok()) return fail(initial.status().message());
  Result<Policy> policy = ParsePolicy(o.policy);
  if (!policy.ok()) return fail(policy.status().message());
  const bool losses = o.survive || std::any_of(o.events.begin(), o.events.end(), [](const auto& e) {
                        return e.kind == "kill" || e.kind == "stop";
                      });
  std::unique_ptr<HostBackup> backup;
  DrillLog drill_log;
  // Every mode has its own weights, agent and ServingGroup: the modes run step by step
  // interleaved, so that a slow spell of this machine falls on all of them alike.
  std::vector<Mode> modes(o.mode_list.size());
  for (size_t i = 0; i < modes.size(); ++i) {
    Mode& mode = modes[i];
    mode.name = o.mode_list[i];
    Result<std::unique_ptr<Agent>> agent = MakeDemoAgent(o, rank, false, StrCat("-", mode.name));
    if (!agent.ok()) return fail(agent.status().message());
    mode.agent = std::move(*agent);
    Result<Weights> made = MakeWeights(o, rank, *mode.agent);
    if (!made.ok()) return fail(made.status().message());
    mode.w = std::move(*made);
    report["weights_created"] = true;
    // (A joiner's slots hold nothing until it joins: nothing to write.)
    for (int l = 0; l < o.layers && !joiner; ++l) FillLayer(mode.w, *initial, l, rank);
    if (i == 0 && losses) {
      Result<std::unique_ptr<HostBackup>> b =
          DemoBackup(o, boot, mode.w, *initial, joiner, round_wait);
      if (!b.ok()) return fail(b.status().message());
      backup = std::move(*b);
    }
    const ServingOptions so =
        ModeOptions(o, rank, mode.name, *policy, all_live ? std::vector<bool>{} : live, modes);
    std::vector<const BackupSource*> backups;
    if (backup != nullptr) backups.push_back(backup.get());
    if (joiner && !o.joining) {
      // A worker the store (or etcd) took in as a joiner, a standby or one restarted for a
      // lost rank: ready now, it waits to be taken in (an operator, or a test, knows when).
      std::cerr << "eplbx: rank " << rank
                << ": ready to join (its agent and weights set up); waiting for the "
                   "members to take it in\n"
                << std::flush;
    }
    const int64_t t0 = MonotonicNs();
    Result<std::unique_ptr<ServingGroup>> g =
        joiner
            ? ServingGroup::Join(mode.agent.get(), &boot, mode.w.layout, o.experts, so, backups)
            : ServingGroup::Create(mode.agent.get(), &boot, mode.w.layout, *initial, so, backups);
    if (!g.ok()) {
      return fail(joiner ? StrCat("joining: ", g.status().message())
                         : StrCat(mode.name, ": ", g.status().message()));
    }
    mode.group = std::move(*g);
    mode.TakeRowTables();
    if (joiner) {
      drill_log.detected_step = static_cast<int>(mode.group->step()) - 1;
      drill_log.detect_wait_s = static_cast<double>(MonotonicNs() - t0) * 1e-9 -
                                mode.group->recoveries().back().recovery_s;
    }
  }
  // The joiner joined the members where they are; the members start together.
  const int first_step = joiner ? static_cast<int>(modes[0].group->step()) : 0;
  drill_log.step_ns.assign(static_cast<size_t>(first_step), 0);  // steps before it joined
  // Outside a drill the ranks meet at every layer (WorkTurns); in a drill, whose figures are
  // wall-clock times around a loss, they only take turns: a lost rank would hold the others
  // at its last layer until it went stale. Each says where it starts before the barrier.
  std::optional<Meeting> meeting;
  if (o.work_turns != nullptr) {
    meeting.emplace(static_cast<WorkTurns*>(o.work_turns), rank, o.ranks, /*meet=*/!drill);
    meeting->Arrive(LayerIndex(first_step, 0, static_cast<int>(modes.size()), 0, o.layers));
  }
  if (!joiner) {
    Status ready = boot.Barrier(round_wait);
    if (!ready.ok()) return fail(ready.message());
  }
  const uint64_t row0 = modes[0].w.bytes[0];
  const uint64_t work = std::max<uint64_t>(8, std::min<uint64_t>(o.work_bytes_value, row0) & ~7ull);
  const uint64_t segments = std::max<uint64_t>(1, row0 / work);
  bool stopped = false, left = false;
  bool coordinator_gone = false;  // no round can be answered any more: no final barrier
  int64_t asked_ns = 0;           // when the last `add` was asked for
  // Rank 0 says how far it got every 100 steps, and at least every quarter of the deadline
  // (at most 5 s): outside a drill the steps send nothing through the coordinator, which gives
  // up on a group silent for the deadline + 10 s (a healthy run on a busy host took 40 s for
  // 100 steps, 2026-12-07, and was ended as hung).
  const int64_t progress_every_ns = static_cast<int64_t>(std::min(5.0, o.deadline_s / 4) * 1e9);
  int64_t progress_ns = MonotonicNs();
  for (int step = first_step; step < o.steps && !stopped; ++step) {
    const int64_t step_t0 = MonotonicNs();
    if (Status struck = StrikeEvents(o, rank, step, step_t0, send, &asked_ns); !struck.ok()) {
      modes[0].m.error = struck.message();
      stopped = true;
    }
    if (stopped) break;
    const std::span<const double> counts = trace->step(step);
    for (size_t mi = 0; mi < modes.size(); ++mi) {
      Mode& mode = modes[mi];
      ModeRun& m = mode.m;
      Work(o, rank, step, counts, mode, static_cast<int>(mi), work, segments,
           meeting ? &*meeting : nullptr);
      ServingGroup& g = *mode.group;
      m.enter_ns.push_back(MonotonicNs());
      Result<BalancerStep> st = g.Step(counts);
      const bool in_flight = g.progress().rebalancing;
      BalancerCommit c = g.Commit();
      for (const CommittedLayer& cl : c.layers)
        mode.w.SetRows(static_cast<int>(cl.layer), cl.row_of_slot);
      m.exit_ns.push_back(MonotonicNs());
      if (!st.ok()) {  // the same load on every rank: every rank stops here
        m.error = st.status().message();
        stopped = true;
        break;
      }
      m.balancedness.push_back(st->balancedness);
      m.rebalancing.push_back(in_flight || (st->began && mode.name == "sync") ? 1 : 0);
      m.committed.push_back(static_cast<int>(c.layers.size()));
      // In a drill the rebalance a lost rank was in fails (its layers roll back); the step's
      // collective says why. Outside one, a failed rebalance is an error.
      if (c.finished && !c.status.ok() && !drill && m.error.empty()) m.error = c.status.message();
    }
    if (drill && !stopped) {
      stopped =
          !Membership(o, step, step_t0, asked_ns, modes[0], drill_log, &left, &coordinator_gone);
      drill_log.step_ns.push_back(MonotonicNs() - step_t0);
    }
    if (rank == 0 && ((step + 1) % 100 == 0 || MonotonicNs() - progress_ns >= progress_every_ns)) {
      (void)send(nlohmann::json{
          {"progress", StrCat("step ", step + 1, "/", o.steps, " served in every mode")}}
                     .dump());
      progress_ns = MonotonicNs();
    }
  }
  if (meeting) meeting->Leave();  // nobody waits for this rank any more
  bool all_ok = true;
  nlohmann::json out = nlohmann::json::object();
  for (Mode& mode : modes) {
    ModeRun& m = mode.m;
    // A rebalance still in flight ends on every rank at the same step.
    while (!left && !coordinator_gone && mode.group->progress().rebalancing) {
      BalancerCommit c = mode.group->Commit();
      for (const CommittedLayer& cl : c.layers)
        mode.w.SetRows(static_cast<int>(cl.layer), cl.row_of_slot);
      if (c.finished && !c.status.ok() && m.error.empty()) m.error = c.status.message();
    }
    std::string bad;
    for (int l = 0; l < o.layers && bad.empty() && !left; ++l)
      bad = VerifyLayer(mode.w, mode.group->placement(), l, rank);
    if (!bad.empty() && m.error.empty()) m.error = StrCat("final verification: ", bad);
    if (m.bad_rows > 0 && m.error.empty()) m.error = m.first_bad;
    m.verified = m.error.empty();
    all_ok = all_ok && m.verified;
    if (!m.error.empty() && report["error"].get<std::string>().empty())
      report["error"] = StrCat(mode.name, ": ", m.error);
    out[mode.name] = ModeReport(mode);
  }
  // Nobody tears its agents down while a peer may still be finishing (a rank that left is
  // no member any more: it reports and goes).
  Status done = left || coordinator_gone ? Status::OK() : boot.Barrier(round_wait);
  if (!done.ok() && report["error"].get<std::string>().empty()) report["error"] = done.message();
  if (drill) {
    const std::vector<RecoveryRecord>& recs = modes[0].group->recoveries();
    report["left"] = left;
    report["joined"] = joiner;
    if (recs.empty() && o.fault_step >= 0 && report["error"].get<std::string>().empty()) {
      report["error"] = StrCat("the ", o.fault, " of rank ", o.fault_rank, " at step ",
                               o.fault_step, " was never detected");
      all_ok = false;
    }
    report["drill"] =
        DrillReport(*modes[0].group, drill_log, backup == nullptr ? 0 : backup->held_bytes());
  }
  report["modes"] = std::move(out);
  // The placement in force at the end (FNV-1a of its map): equal on every member that ended
  // in one epoch.
  uint64_t digest = 1469598103934665603ull;
  for (int32_t e : modes[0].group->placement().phy2log()) {
    digest = (digest ^ static_cast<uint32_t>(e)) * 1099511628211ull;
  }
  report["placement_digest"] = StrCat(digest);
  report["verified"] = all_ok && done.ok();
  report["weights_intact"] = all_ok;
  return finish(all_ok && done.ok() ? 0 : 1);
}

}  // namespace eplbx::cli
