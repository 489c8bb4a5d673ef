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

#include <nlohmann/json.hpp>

#include "cli/demo.h"
#include "common/bytes.h"
#include "common/strings.h"
#include "eplbx/backup.h"
#include "eplbx/serving.h"
#include "eplbx/simulate.h"
#include "eplbx/survivors.h"

namespace eplbx::cli {
namespace {

using internal::StrCat;

double ThreadCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

int64_t MonotonicNs() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// Tokens of each slot of this rank in `layer`: each expert's count split over its replicas
// in slot order (the first count % replicas replicas get one more).
std::vector<int64_t> SlotTokens(const Placement& p, std::span<const double> counts, int layer,
                                int rank, int rows) {
  std::vector<int64_t> out(rows, 0);
  for (int row = 0; row < rows; ++row) {
    const int slot = rank * rows + row;
    const int32_t e = p.phy2log(layer, slot);
    if (e < 0) continue;
    const int64_t c = static_cast<int64_t>(counts[static_cast<size_t>(layer) * p.experts() + e]);
    const int reps = p.logcnt(layer, e);
    int k = 0;
    for (int s = 0; s < slot; ++s) k += p.phy2log(layer, s) == e;
    out[row] = c / reps + (k < c % reps ? 1 : 0);
  }
  return out;
}

struct ModeRun {
  std::vector<double> cpu_s;  // steps x layers: this rank's work on each layer
  std::vector<double> balancedness;
  std::vector<int64_t> enter_ns, exit_ns;
  std::vector<int> rebalancing;  // 1 while a rebalance was in flight during the step
  std::vector<int> committed;    // layers whose map changed at this step's Commit
  uint64_t rows_checked = 0, bad_rows = 0;
  uint64_t checksum = 0;  // of the work (reported, so the compiler keeps it)
  std::string first_bad, error;
  bool verified = false;
};

// One mode's world on this rank: its own weights and agent, its ServingGroup (the Balancer,
// the Rearranger, the settling of member-set changes), what it measured.
struct Mode {
  std::string name;
  std::unique_ptr<Agent> agent;
  Weights w;
  std::unique_ptr<ServingGroup> group;
  ModeRun m;
  // The group's row tables (swap mode) into the weights the work reads.
  void TakeRowTables() {
    if (w.spare == 0 || group == nullptr) return;
    for (int l = 0; l < static_cast<int>(w.row_of_slot.size()); ++l)
      w.SetRows(l, group->RowTable(static_cast<uint32_t>(l)));
    w.layout.row_of_slot = w.row_of_slot;
  }
};

// The expert work of one step on `mode`'s weights: every row this rank holds, each routed
// token over `work` bytes of tensor 0 (which `segments` cycle through), checked against the
// pattern of the expert the placement in force names.
void Work(const DemoOptions& o, int rank, int step, std::span<const double> counts, Mode& mode,
          uint64_t work, uint64_t segments) {
  const Weights& w = mode.w;
  const Placement& p = mode.group->placement();
  const uint64_t row0 = w.bytes[0];
  uint64_t sink = 0;
  for (int l = 0; l < o.layers; ++l) {
    const double cpu0 = ThreadCpuSeconds();
    const std::vector<int64_t> tokens = SlotTokens(p, counts, l, rank, w.rows);
    const TensorSpec& t0 = w.layout.layers[l][0];
    for (int row = 0; row < w.rows; ++row) {
      const uint32_t e = static_cast<uint32_t>(p.phy2log(l, rank * w.rows + row));
      const uint64_t key = PatternKey(static_cast<uint32_t>(l), e, 0);
      const uint8_t* base = reinterpret_cast<const uint8_t*>(t0.base) + w.Row(l, row) * row0;
      bool bad = false;
      uint64_t acc = 0;
      // A row without tokens is still checked (one word); one with tokens at every word its
      // tokens touch.
      const int64_t n = std::max<int64_t>(tokens[row], 0);
      for (int64_t i = 0; i < n; ++i) {
        const uint64_t off = ((static_cast<uint64_t>(step) * 131 + i) % segments) * work;
        for (uint64_t j = 0; j + 8 <= work; j += 8) {
          uint64_t v;
          std::memcpy(&v, base + off + j, 8);
          // A dependent chain (as a dot product's accumulation is): the work per token is the
          // same whether the row is in cache or not.
          acc = Mix(acc ^ v);
          bad |= v != PatternWord(key, off + j);
        }
      }
      if (n == 0) {
        uint64_t v;
        std::memcpy(&v, base, 8);
        bad = v != PatternWord(key, 0);
      }
      sink += acc;
      ++mode.m.rows_checked;
      if (bad && mode.m.bad_rows++ == 0) {
        mode.m.first_bad = StrCat("rank ", rank, " step ", step, " layer ", l, " row ", row,
                                  " does not hold expert ", e, ", which its map says");
      }
    }
    mode.m.cpu_s.push_back(ThreadCpuSeconds() - cpu0);
  }
  mode.m.checksum += sink;
}

nlohmann::json ModeReport(Mode& mode) {
  ModeRun& m = mode.m;
  static const BalancerReport kNone;
  const BalancerReport& br = mode.group != nullptr ? mode.group->report() : kNone;
  uint64_t bytes_read = 0, bytes_copied = 0;
  nlohmann::json rebalances = nlohmann::json::array();
  const std::vector<RebalanceRecord>& all = br.rebalances;
  for (const RebalanceRecord& x : all) {
    bytes_read += x.bytes_read;
    bytes_copied += x.bytes_copied;
    nlohmann::json paths = nlohmann::json::object();
    for (const PathTotals& pt : x.bytes_by_path) {
      if (pt.bytes > 0) paths[pt.path] = pt.bytes;
    }
    rebalances.push_back({{"step", x.step},
                          {"finished_step", x.finished_step},
                          {"ok", x.status.ok()},
                          {"window_before", x.window_before},
                          {"window_after", x.window_after},
                          {"layers_committed", x.layers_committed},
                          {"layers_swapped", x.layers_swapped},
                          {"bytes_read", x.bytes_read},
                          {"bytes_copied", x.bytes_copied},
                          {"bytes_by_path", paths},
                          {"bytes_from_rank", x.bytes_from_rank},
                          {"plan_s", x.plan_s},
                          {"migration_plan_s", x.migration_plan_s},
                          {"plan_wait_s", x.plan_wait_s},
                          {"rearrange_s", x.rearrange_s},
                          {"poll_s", x.poll_s},
                          {"wait_s", x.wait_s},
                          {"commit_s", x.commit_s}});
  }
  return {{"cpu_s", m.cpu_s},
          {"enter_ns", m.enter_ns},
          {"exit_ns", m.exit_ns},
          {"balancedness", m.balancedness},
          {"rebalancing", m.rebalancing},
          {"committed", m.committed},
          {"rows_checked", m.rows_checked},
          {"bad_rows", m.bad_rows},
          {"work_checksum", m.checksum},
          {"bytes_read", bytes_read},
          {"bytes_copied", bytes_copied},
          {"rebalances", rebalances},
          {"failed", br.failed},
          {"error", m.error},
          {"verified", m.verified}};
}

// What this rank saw of the drill's membership events (docs/cli.md, "Serving through a lost
// rank"): the ServingGroup's records, and the step times around them.
struct DrillLog {
  int detected_step = -1;    // the step of the first event this rank settled
  double detect_wait_s = 0;  // from that step's start (a join: the request) until known here
  std::vector<int64_t> step_ns;  // wall-clock time of every step here, recovery included
};

nlohmann::json RecordJson(const RecoveryRecord& r) {
  return {{"kind", r.kind},
          {"step", r.step - 1},  // the step it was settled at (0-based, like the trace)
          {"epoch", r.epoch},
          {"members", r.members},
          {"recovery_s", r.recovery_s},
          {"interrupted", r.interrupted},
          {"experts_recovered", r.experts_recovered},
          {"rows_recovered", r.rows_recovered},
          {"bytes_moved", r.bytes_moved},
          {"placements", r.placements},
          {"restarts", r.restarts}};
}

// The step's membership event on this rank, for a drill: a drain (`remove` at this step),
// else the step's collective (ServingGroup::Sync), which settles any change of the member
// set. Returns false when this rank stops (it left, or the group cannot go on: m.error).
bool Membership(const DemoOptions& o, int step, int64_t step_t0, int64_t asked_ns,
                Mode& mode, DrillLog& log, bool* left, bool* coordinator_gone) {
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
      mode.m.error = StrCat("removing rank ", removal->rank, " at step ", step, ": ",
                            drained.message());
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
  mode.m.error = why.code() == Code::kTimeout
                     ? StrCat("step ", step,
                              ": the coordinator (rank 0's store) did not answer the step's "
                              "collective within ",
                              o.deadline_s * 2, " s (2 x --deadline): rank 0 stopped, hung or "
                              "unreachable")
                     : StrCat("step ", step, ": ", why.message());
  return false;
}

}  // namespace

int RunServeRank(const DemoOptions& o, int rank, SocketBootstrap& boot, nlohmann::json* sent) {
  nlohmann::json report = NewRankReport(rank);
  report["node"] = NodeName();
  auto finish = [&](int code) {
    (void)boot.SendMessage(report.dump());
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
  const auto round_wait = std::chrono::milliseconds(static_cast<int64_t>(o.deadline_s * 2000));
  // The gate: the simulator's skewed, drifting load, the same on every rank.
  SynthOptions so;
  so.layers = o.layers;
  so.experts = o.experts;
  so.steps = o.steps;
  so.seed = o.seed;
  so.zipf = 1.0;
  so.drift = 0.05;
  so.reversion = 0.01;
  so.phase_steps = std::max<int64_t>(o.interval * 2, o.steps / 3);
  so.tokens = o.tokens;
  so.top_k = o.top_k;
  Result<LoadTrace> trace = SynthTrace(so);
  if (!trace.ok()) return fail(trace.status().message());
  const Topology topo{o.ranks, 1, o.ranks * o.slots_per_rank, 1};
  const LoadMatrix uniform = *LoadMatrix::Create(
      o.layers, o.experts, std::vector<double>(static_cast<size_t>(o.layers) * o.experts, 1.0));
  const bool drill = !o.events.empty() || o.survive;
  // A process for a rank added later, or a lost rank's process started again: it joins where
  // the members are (told by the demo, or by the store's welcome).
  const bool joiner = o.joining || boot.joining();
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
  const bool losses =
      o.survive || std::any_of(o.events.begin(), o.events.end(), [](const auto& e) {
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
    if (i == 0 && losses && !joiner) {
      // The node's backup (a joiner has none: experts count as recoverable only where every
      // member's backups hold them).
      // On one host rank 0's file holds what every rank's slots hold; `eplbx worker` loads
      // every expert into each node's (as from the checkpoint: the demo's weights are a
      // function of layer, expert and tensor).
      const std::vector<TensorSpec>& tensors = mode.w.layout.layers[0];
      ExpertLoader load = [&tensors](int l, int e, const std::string& name, uint8_t* dst,
                                     uint64_t n) {
        uint32_t t = 0;
        while (t + 1 < tensors.size() && tensors[t].name != name) ++t;
        Pattern(dst, n, static_cast<uint32_t>(l), static_cast<uint32_t>(e), t);
      };
      Result<std::unique_ptr<HostBackup>> b = SetUpNodeBackup(
          boot, o.survive ? NodeName() : std::string("node"), o.backup_dir, mode.w.layout,
          o.experts, *initial, round_wait, o.survive ? load : nullptr);
      if (!b.ok()) return fail(b.status().message());
      backup = std::move(*b);
    }
    ServingOptions so;
    BalancerOptions& bo = so.balancer;
    bo.topology = topo;
    bo.policy = *policy;
    bo.window = o.interval;
    bo.trigger.interval = mode.name == "off" ? o.steps + 1 : o.interval;
    bo.mode = mode.name == "sync" ? BalancerMode::kSynchronous : BalancerMode::kAsynchronous;
    bo.bytes_per_expert = o.expert_bytes_value;
    if (!all_live) bo.live = live;
    so.rearrange.deadline = std::chrono::milliseconds(static_cast<int64_t>(o.deadline_s * 1000));
    so.round_wait = round_wait;
    // `--inject ...,KIND:RANK@recovery`: strikes as the first move of the recovery from the
    // event before it begins.
    so.before_move = [&o, &modes, rank](int placement) {
      if (placement != 1 || modes.empty() || modes[0].group == nullptr) return;
      const int settled = static_cast<int>(modes[0].group->recoveries().size());
      for (const DemoOptions::Event& e : o.events) {
        if (e.step < 0 && e.rank == rank && e.after == settled)
          raise(e.kind == "kill" ? SIGKILL : SIGSTOP);
      }
    };
    std::vector<const BackupSource*> backups;
    if (backup != nullptr) backups.push_back(backup.get());
    const int64_t t0 = MonotonicNs();
    Result<std::unique_ptr<ServingGroup>> g =
        joiner ? ServingGroup::Join(mode.agent.get(), &boot, mode.w.layout, o.experts, so, backups)
               : ServingGroup::Create(mode.agent.get(), &boot, mode.w.layout, *initial, so,
                                      backups);
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
  if (!joiner) {
    Status ready = boot.Barrier(round_wait);
    if (!ready.ok()) return fail(ready.message());
  }
  const uint64_t row0 = modes[0].w.bytes[0];
  const uint64_t work = std::max<uint64_t>(8, std::min<uint64_t>(o.work_bytes_value, row0) & ~7ull);
  const uint64_t segments = std::max<uint64_t>(1, row0 / work);
  auto* turn = static_cast<sem_t*>(o.work_turn);
  bool stopped = false, left = false;
  bool coordinator_gone = false;  // no round can be answered any more: no final barrier
  int64_t asked_ns = 0;           // when the last `add` was asked for
  for (int step = first_step; step < o.steps && !stopped; ++step) {
    const int64_t step_t0 = MonotonicNs();
    for (const DemoOptions::Event& e : o.events) {
      if (e.step != step) continue;
      if ((e.kind == "kill" || e.kind == "stop") && e.rank == rank) {
        raise(e.kind == "kill" ? SIGKILL : SIGSTOP);  // as a crash or a hung host would
      }
      if (e.kind == "add") {
        // The operator scales up: the coordinator starts the new rank's process; the members
        // serve on until it asks to join. The lowest member asks.
        asked_ns = step_t0;
        const std::vector<bool> now = MembersAt(o, step);
        const int asker = static_cast<int>(std::find(now.begin(), now.end(), true) - now.begin());
        if (rank == asker) {
          if (Status asked = boot.SendMessage(nlohmann::json{{"spawn", e.rank}}.dump());
              !asked.ok()) {
            modes[0].m.error = StrCat("asking for rank ", e.rank, ": ", asked.message());
            stopped = true;
          }
        }
      }
    }
    if (stopped) break;
    const std::span<const double> counts = trace->step(step);
    for (Mode& mode : modes) {
      ModeRun& m = mode.m;
      while (turn != nullptr && sem_wait(turn) != 0) {
      }
      Work(o, rank, step, counts, mode, work, segments);
      if (turn != nullptr) sem_post(turn);
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
      stopped = !Membership(o, step, step_t0, asked_ns, modes[0], drill_log, &left,
                            &coordinator_gone);
      drill_log.step_ns.push_back(MonotonicNs() - step_t0);
    }
    if (rank == 0 && (step + 1) % 100 == 0) {
      (void)boot.SendMessage(nlohmann::json{
          {"progress", StrCat("step ", step + 1, "/", o.steps, " served in every mode")}}.dump());
    }
  }
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
    static const RecoveryRecord kNone;
    const RecoveryRecord& first = recs.empty() ? kNone : recs.front();
    int64_t rows_recovered = 0;
    nlohmann::json events = nlohmann::json::array();
    for (const RecoveryRecord& r : recs) {
      rows_recovered += r.rows_recovered;
      events.push_back(RecordJson(r));
    }
    std::vector<int> members;
    const std::vector<bool> now = modes[0].group->members();
    for (size_t r = 0; r < now.size(); ++r) {
      if (now[r]) members.push_back(static_cast<int>(r));
    }
    report["drill"] = {{"detected_step", drill_log.detected_step},
                       {"detect_wait_s", drill_log.detect_wait_s},
                       {"recovery_s", first.recovery_s},
                       {"drain_s", first.end_s + first.gather_s},
                       {"setup_s", first.setup_s},
                       {"balancer_s", first.balancer_s},
                       {"plan_s", first.plan_s},
                       {"move_s", first.move_s},
                       {"restore_s", first.restore_s},
                       {"epoch", modes[0].group->epoch()},
                       {"members", members},
                       {"interrupted", first.interrupted},
                       {"experts_recovered", first.experts_recovered},
                       {"rows_recovered", rows_recovered},
                       {"bytes_moved", first.bytes_moved},
                       {"backup_bytes", backup == nullptr ? 0 : backup->held_bytes()},
                       {"placements", first.placements},
                       {"restarts", first.restarts},
                       {"events", events},
                       {"step_ns", drill_log.step_ns}};
  }
  report["modes"] = std::move(out);
  report["verified"] = all_ok && done.ok();
  report["weights_intact"] = all_ok;
  return finish(all_ok && done.ok() ? 0 : 1);
}

}  // namespace eplbx::cli
