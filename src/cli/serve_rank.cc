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
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include <nlohmann/json.hpp>

#include "cli/demo.h"
#include "common/strings.h"
#include "eplbx/balancer.h"
#include "eplbx/rearrange.h"
#include "eplbx/simulate.h"

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

// One mode's world on this rank: its own weights (and agent and Rearranger when it moves
// weights), its Balancer, what it measured.
struct Mode {
  std::string name;
  std::unique_ptr<Agent> agent;
  Weights w;
  std::unique_ptr<Rearranger> rearranger;
  std::unique_ptr<Balancer> balancer;
  ModeRun m;
};

// The expert work of one step on `mode`'s weights: every row this rank holds, each routed
// token over `work` bytes of tensor 0 (which `segments` cycle through), checked against the
// pattern of the expert the placement in force names.
void Work(const DemoOptions& o, int rank, int step, std::span<const double> counts, Mode& mode,
          uint64_t work, uint64_t segments) {
  const Weights& w = mode.w;
  const Placement& p = mode.balancer->placement();
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
  const BalancerReport& br = mode.balancer->report();
  uint64_t bytes_read = 0, bytes_copied = 0;
  nlohmann::json rebalances = nlohmann::json::array();
  for (const RebalanceRecord& x : br.rebalances) {
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

}  // namespace

int RunServeRank(const DemoOptions& o, int rank, SocketBootstrap& boot) {
  nlohmann::json report = NewRankReport(rank);
  report["node"] = NodeName();
  auto finish = [&](int code) {
    (void)boot.SendMessage(report.dump());
    return code;
  };
  auto fail = [&](const std::string& why) {
    report["error"] = why;
    return finish(1);
  };
  const auto deadline = std::chrono::milliseconds(static_cast<int64_t>(o.deadline_s * 1000));
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
  Result<Placement> initial = Plan(uniform, topo, {.policy = Policy::kBalanced});
  if (!initial.ok()) return fail(initial.status().message());
  Result<Policy> policy = ParsePolicy(o.policy);
  if (!policy.ok()) return fail(policy.status().message());
  // Every mode has its own weights (and agent): the modes run step by step interleaved, so
  // that a slow spell of this machine falls on all of them alike.
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
    for (int l = 0; l < o.layers; ++l) FillLayer(mode.w, *initial, l, rank);
    if (mode.name != "off") {
      RearrangeOptions ro;
      ro.deadline = deadline;
      Result<std::unique_ptr<Rearranger>> r =
          Rearranger::Create(mode.agent.get(), &boot, mode.w.layout, ro);
      if (!r.ok()) return fail(StrCat(mode.name, ": ", r.status().message()));
      mode.rearranger = std::move(*r);
    }
    BalancerOptions bo;
    bo.topology = topo;
    bo.policy = *policy;
    bo.window = o.interval;
    bo.trigger.interval = mode.name == "off" ? o.steps + 1 : o.interval;
    bo.mode = mode.name == "sync" ? BalancerMode::kSynchronous : BalancerMode::kAsynchronous;
    bo.bytes_per_expert = o.expert_bytes_value;
    Result<std::unique_ptr<Balancer>> b = Balancer::Create(*initial, bo, mode.rearranger.get());
    if (!b.ok()) return fail(StrCat(mode.name, ": ", b.status().message()));
    mode.balancer = std::move(*b);
  }
  Status ready = boot.Barrier(deadline);
  if (!ready.ok()) return fail(ready.message());
  const uint64_t row0 = modes[0].w.bytes[0];
  const uint64_t work = std::max<uint64_t>(8, std::min<uint64_t>(o.work_bytes_value, row0) & ~7ull);
  const uint64_t segments = std::max<uint64_t>(1, row0 / work);
  auto* turn = static_cast<sem_t*>(o.work_turn);
  bool stopped = false;
  for (int step = 0; step < o.steps && !stopped; ++step) {
    const std::span<const double> counts = trace->step(step);
    for (Mode& mode : modes) {
      ModeRun& m = mode.m;
      while (turn != nullptr && sem_wait(turn) != 0) {
      }
      Work(o, rank, step, counts, mode, work, segments);
      if (turn != nullptr) sem_post(turn);
      Balancer& b = *mode.balancer;
      m.enter_ns.push_back(MonotonicNs());
      Result<BalancerStep> st = b.Step(counts);
      const bool in_flight = b.progress().rebalancing;
      BalancerCommit c = b.Commit();
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
      if (c.finished && !c.status.ok() && m.error.empty()) m.error = c.status.message();
    }
    if (rank == 0 && (step + 1) % 100 == 0) {
      (void)boot.SendMessage(nlohmann::json{
          {"progress",
           StrCat("step ", step + 1, "/", o.steps,
                  " served in every "
                  "mode")}}.dump());
    }
  }
  bool all_ok = true;
  nlohmann::json out = nlohmann::json::object();
  for (Mode& mode : modes) {
    ModeRun& m = mode.m;
    // A rebalance still in flight ends on every rank at the same step.
    while (mode.balancer->progress().rebalancing) {
      BalancerCommit c = mode.balancer->Commit();
      for (const CommittedLayer& cl : c.layers)
        mode.w.SetRows(static_cast<int>(cl.layer), cl.row_of_slot);
      if (c.finished && !c.status.ok() && m.error.empty()) m.error = c.status.message();
    }
    std::string bad;
    for (int l = 0; l < o.layers && bad.empty(); ++l)
      bad = VerifyLayer(mode.w, mode.balancer->placement(), l, rank);
    if (!bad.empty() && m.error.empty()) m.error = StrCat("final verification: ", bad);
    if (m.bad_rows > 0 && m.error.empty()) m.error = m.first_bad;
    m.verified = m.error.empty();
    all_ok = all_ok && m.verified;
    if (!m.error.empty() && report["error"].get<std::string>().empty())
      report["error"] = StrCat(mode.name, ": ", m.error);
    out[mode.name] = ModeReport(mode);
  }
  // Nobody tears its agents down while a peer may still be finishing.
  Status done = boot.Barrier(deadline);
  if (!done.ok() && report["error"].get<std::string>().empty()) report["error"] = done.message();
  report["modes"] = std::move(out);
  report["verified"] = all_ok && done.ok();
  report["weights_intact"] = all_ok;
  return finish(all_ok && done.ok() ? 0 : 1);
}

}  // namespace eplbx::cli
