// One rank of `eplbx demo --serve`: an expert-parallel forward loop over real weights.
//
// Every step, a gate routes `tokens` x `top_k` tokens per layer to logical experts (the
// simulator's Zipf + drift trace, the same on every rank); an expert's tokens are split over
// its replicas; for each routed token the rank works over `work_bytes` of the expert's
// row (it recomputes the pattern the row must hold and compares: real work over the
// weights, and a check of every row it uses against the map it read). The work is timed
// in this thread's CPU time, so ranks sharing cores do not distort it. After the work the
// rank calls the Balancer's Step and Commit (its safe point) and records when it entered and
// left them (CLOCK_MONOTONIC, the same clock in every process): the coordinator models a
// step as the slowest rank's work plus the Balancer's cost, from the last rank entering to
// the last leaving (serve_report.cc).
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
  std::vector<double> cpu_s, balancedness;
  std::vector<int64_t> enter_ns, exit_ns;
  std::vector<int> rebalancing;  // 1 while a rebalance was in flight during the step
  std::vector<int> committed;    // layers whose map changed at this step's Commit
  uint64_t rows_checked = 0, bad_rows = 0;
  std::string first_bad, error;
  bool verified = false;
};

}  // namespace

int RunServeRank(const DemoOptions& o, int rank, SocketBootstrap& boot) {
  nlohmann::json report = {{"rank", rank},
                           {"verified", false},
                           {"weights_intact", false},
                           {"weights_created", false},
                           {"error", ""}};
  auto finish = [&](int code) {
    (void)boot.SendMessage(report.dump());
    return code;
  };
  const auto deadline = std::chrono::milliseconds(static_cast<int64_t>(o.deadline_s * 1000));
  Result<std::unique_ptr<Agent>> agent = MakeDemoAgent(o, rank, false);
  if (!agent.ok()) {
    report["error"] = agent.status().message();
    return finish(1);
  }
  Result<Weights> made = MakeWeights(o, rank, **agent);
  if (!made.ok()) {
    report["error"] = made.status().message();
    return finish(1);
  }
  Weights w = std::move(*made);
  report["weights_created"] = true;
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
  const Topology topo{o.ranks, 1, o.ranks * o.slots_per_rank, 1};
  const LoadMatrix uniform = *LoadMatrix::Create(
      o.layers, o.experts, std::vector<double>(static_cast<size_t>(o.layers) * o.experts, 1.0));
  Result<Placement> initial =
      trace.ok() ? Plan(uniform, topo, {.policy = Policy::kBalanced}) : trace.status();
  Result<Policy> policy = ParsePolicy(o.policy);
  if (!initial.ok() || !policy.ok()) {
    report["error"] = (initial.ok() ? policy.status() : initial.status()).message();
    return finish(1);
  }
  RearrangeOptions ro;
  ro.deadline = deadline;
  Result<std::unique_ptr<Rearranger>> rearranger =
      Rearranger::Create(agent->get(), &boot, w.layout, ro);
  if (!rearranger.ok()) {
    report["error"] = rearranger.status().message();
    return finish(1);
  }
  const uint64_t row0 = w.bytes[0];
  const uint64_t work = std::min<uint64_t>(o.work_bytes_value, row0) & ~uint64_t{7};
  const uint64_t segments = std::max<uint64_t>(1, row0 / std::max<uint64_t>(work, 8));
  nlohmann::json modes = nlohmann::json::object();
  bool all_ok = true;
  for (const std::string& mode : o.mode_list) {
    ModeRun m;
    for (int l = 0; l < o.layers; ++l) FillLayer(w, *initial, l, rank);
    Status ready = boot.Barrier(deadline);
    if (!ready.ok()) {
      report["error"] = ready.message();
      return finish(1);
    }
    BalancerOptions bo;
    bo.topology = topo;
    bo.policy = *policy;
    bo.window = o.interval;
    bo.trigger.interval = mode == "off" ? o.steps + 1 : o.interval;
    bo.mode = mode == "sync" ? BalancerMode::kSynchronous : BalancerMode::kAsynchronous;
    bo.bytes_per_expert = o.expert_bytes_value;
    Result<std::unique_ptr<Balancer>> balancer =
        Balancer::Create(*initial, bo, mode == "off" ? nullptr : rearranger->get());
    if (!balancer.ok()) {
      report["error"] = balancer.status().message();
      return finish(1);
    }
    Balancer& b = **balancer;
    volatile uint64_t sink = 0;
    for (int step = 0; step < o.steps; ++step) {
      const std::span<const double> counts = trace->step(step);
      const Placement& p = b.placement();
      const double cpu0 = ThreadCpuSeconds();
      for (int l = 0; l < o.layers; ++l) {
        const std::vector<int64_t> tokens = SlotTokens(p, counts, l, rank, w.rows);
        const TensorSpec& t0 = w.layout.layers[l][0];
        for (int row = 0; row < w.rows; ++row) {
          const uint32_t e = static_cast<uint32_t>(p.phy2log(l, rank * w.rows + row));
          const uint64_t key = PatternKey(static_cast<uint32_t>(l), e, 0);
          const uint8_t* base = reinterpret_cast<const uint8_t*>(t0.base) + row * row0;
          bool bad = false;
          uint64_t acc = 0;
          // A row without tokens is still checked (one word); one with tokens at every word
          // its tokens touch.
          const int64_t n = std::max<int64_t>(tokens[row], 0);
          for (int64_t i = 0; i < n; ++i) {
            const uint64_t off = ((static_cast<uint64_t>(step) * 131 + i) % segments) * work;
            for (uint64_t j = 0; j + 8 <= work; j += 8) {
              uint64_t v;
              std::memcpy(&v, base + off + j, 8);
              acc += v;
              bad |= v != PatternWord(key, off + j);
            }
          }
          if (n == 0) {
            uint64_t v;
            std::memcpy(&v, base, 8);
            bad = v != PatternWord(key, 0);
          }
          sink = sink + acc;
          ++m.rows_checked;
          if (bad) {
            if (m.bad_rows++ == 0) {
              m.first_bad = StrCat("rank ", rank, " step ", step, " layer ", l, " row ", row,
                                   " does not hold expert ", e, ", which its map says");
            }
          }
        }
      }
      m.cpu_s.push_back(ThreadCpuSeconds() - cpu0);
      m.enter_ns.push_back(MonotonicNs());
      Result<BalancerStep> st = b.Step(counts);
      const bool in_flight = b.progress().rebalancing;
      BalancerCommit c = b.Commit();
      m.exit_ns.push_back(MonotonicNs());
      if (!st.ok()) {
        m.error = st.status().message();
        break;
      }
      m.balancedness.push_back(st->balancedness);
      m.rebalancing.push_back(in_flight || (st->began && mode == "sync") ? 1 : 0);
      m.committed.push_back(static_cast<int>(c.layers.size()));
      if (c.finished && !c.status.ok() && m.error.empty()) m.error = c.status.message();
    }
    // A rebalance still in flight ends on every rank at the same step.
    while (b.progress().rebalancing) {
      BalancerCommit c = b.Commit();
      if (c.finished && !c.status.ok() && m.error.empty()) m.error = c.status.message();
    }
    std::string bad;
    for (int l = 0; l < o.layers && bad.empty(); ++l) bad = VerifyLayer(w, b.placement(), l, rank);
    if (!bad.empty() && m.error.empty()) m.error = StrCat("final verification: ", bad);
    if (m.bad_rows > 0 && m.error.empty()) m.error = m.first_bad;
    m.verified = m.error.empty();
    all_ok = all_ok && m.verified;
    const BalancerReport& br = b.report();
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
                            {"bytes_read", x.bytes_read},
                            {"bytes_copied", x.bytes_copied},
                            {"bytes_by_path", paths},
                            {"plan_s", x.plan_s},
                            {"migration_plan_s", x.migration_plan_s},
                            {"rearrange_s", x.rearrange_s},
                            {"poll_s", x.poll_s},
                            {"wait_s", x.wait_s},
                            {"commit_s", x.commit_s}});
    }
    modes[mode] = {{"cpu_s", m.cpu_s},
                   {"enter_ns", m.enter_ns},
                   {"exit_ns", m.exit_ns},
                   {"balancedness", m.balancedness},
                   {"rebalancing", m.rebalancing},
                   {"committed", m.committed},
                   {"rows_checked", m.rows_checked},
                   {"bad_rows", m.bad_rows},
                   {"bytes_read", bytes_read},
                   {"bytes_copied", bytes_copied},
                   {"rebalances", rebalances},
                   {"failed", br.failed},
                   {"error", m.error},
                   {"verified", m.verified}};
    if (!m.error.empty() && report["error"].get<std::string>().empty())
      report["error"] = StrCat(mode, ": ", m.error);
    if (rank == 0) {
      (void)boot.SendMessage(
          nlohmann::json{{"progress", StrCat(mode, ": ", o.steps, " steps served, ",
                                             br.rebalances.size(), " rebalances, ",
                                             m.rows_checked, " rows checked on rank 0")}}
              .dump());
    }
  }
  // Nobody tears its agent down while a peer may still be finishing.
  Status done = boot.Barrier(deadline);
  if (!done.ok() && report["error"].get<std::string>().empty()) report["error"] = done.message();
  report["modes"] = std::move(modes);
  report["verified"] = all_ok && done.ok();
  report["weights_intact"] = all_ok;
  return finish(all_ok && done.ok() ? 0 : 1);
}

}  // namespace eplbx::cli
