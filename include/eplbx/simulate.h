// What-if replay of EPLB settings on a load trace: which window, interval, trigger and
// policy keep balance high without moving weights too often.
//
//   eplbx::LoadTrace trace = *eplbx::SynthTrace({.layers = 8, .experts = 64, .steps = 5000});
//   eplbx::SimulateResult r = *eplbx::Simulate(trace, {.topology = {.ranks = 8, .slots = 72}});
#ifndef EPLBX_SIMULATE_H_
#define EPLBX_SIMULATE_H_

#include <cstdint>
#include <span>
#include <vector>

#include "eplbx/load.h"
#include "eplbx/placement.h"
#include "eplbx/policy.h"
#include "eplbx/status.h"

namespace eplbx {

// Token counts per logical expert, per layer, per step.
struct LoadTrace {
  int layers = 0, experts = 0;
  std::vector<double> values;  // steps x layers x experts, row-major

  int64_t steps() const {
    return layers && experts ? static_cast<int64_t>(values.size()) / (layers * experts) : 0;
  }
  std::span<const double> step(int64_t i) const {
    const size_t n = static_cast<size_t>(layers) * experts;
    return {values.data() + static_cast<size_t>(i) * n, n};
  }
};

// A synthetic trace when no real one is at hand. Per layer: a Zipf base load over a random
// permutation of the experts; every step each expert's log-weight drifts by N(0, drift)
// and is pulled back toward its base by `reversion` of the difference (log-normal,
// mean-reverting: stationary spread drift / sqrt(2 reversion); 0: a pure random walk);
// with probability burst_prob per layer and step one expert runs burst_factor times hotter
// for burst_steps steps; every phase_steps steps (0: never) the permutation is redrawn (a
// new traffic mix). Counts are tokens x top_k routed per layer, in proportion to weight,
// rounded. Deterministic for a seed on every machine (own generator, no std distributions).
struct SynthOptions {
  int layers = 8, experts = 64;
  int64_t steps = 2000;
  uint64_t seed = 1;
  double zipf = 1.0;
  double drift = 0.01;
  double reversion = 0.01;
  double burst_prob = 0.0005;
  double burst_factor = 4.0;
  int burst_steps = 50;
  int64_t phase_steps = 0;
  int tokens = 4096, top_k = 8;
};
Result<LoadTrace> SynthTrace(const SynthOptions& options);

struct SimulateOptions {
  Topology topology;
  Policy policy = Policy::kDeepSeek;
  double tolerance = 0.002;  // incremental only
  int window = 1000;         // steps of load a plan is built from
  TriggerOptions trigger;
  uint64_t bytes_per_expert = 44040192;  // 42 MiB: a DeepSeek-V3 expert in bf16
  double link_gbps = 400.0;              // per-rank link for the stall estimate
  // Steps a new placement takes to come into force beyond the step after the one that
  // decided it: the asynchronous path's plan lag plus the steps its READs are spread over
  // (BalancerOptions::plan_lag_steps + AsyncOptions::target_steps). 0: from the next step.
  int lag_steps = 0;
};

struct SimulateStep {
  int64_t step = 0;
  double balancedness = 1.0;  // of the placement in force, on this step's load
  bool rebalanced = false;    // a new placement takes effect from the next step
};

struct RebalanceEvent {
  int64_t step = 0;
  double window_before = 0, window_after = 0;  // balancedness on the window
  int64_t copies = 0;                          // (rank, expert) pairs gained remotely
  uint64_t bytes = 0;
  double stall_s = 0;  // migration time lower bound at link_gbps
};

struct SimulateResult {
  double mean_balancedness = 1.0, p5_balancedness = 1.0;
  // The hindsight ceiling (HindsightBalance with the run's interval): the mean balancedness
  // of placements planned on each interval's own load, moved for free. What the trigger,
  // window and policy leave on the table is the gap to it; what the slots leave, its gap to 1.
  double hindsight_mean_balancedness = 1.0;
  // The same from the step after the first rebalance on (without the uniform start); equal
  // to the above when nothing was rebalanced.
  double steady_mean_balancedness = 1.0, steady_p5_balancedness = 1.0;
  int64_t rebalances = 0, considered = 0, skipped_balanced = 0, skipped_small_gain = 0;
  int64_t copies = 0;
  uint64_t bytes_moved = 0;
  double stall_seconds_est = 0;
  std::vector<SimulateStep> steps;
  std::vector<RebalanceEvent> events;
};

// Replays `trace`: the first placement is planned from a uniform load (nothing is known
// yet); at every step the placement in force is scored on that step's load (planned on past
// data, scored on new data: no look-ahead), the step joins the window, and when the trigger
// is due a plan from the window (with the current placement as previous) replaces the
// current one if Decide says so. Errors: an empty trace, an invalid topology for the
// trace's experts, window or interval < 1.
Result<SimulateResult> Simulate(const LoadTrace& trace, const SimulateOptions& options);

// The hindsight ceiling of a trace: for every block of `interval` steps (steps 0..interval-1,
// then the next ...), the placement `policy` plans on that block's own summed load — known
// only afterwards — is in force for the block and costs nothing to move in. Returns every
// step's balance under it (per layer and total). No real EPLB reaches it: it plans with the
// future and moves for free; the perfectly balanced oracle (1.0) is above it by what the
// slots cannot fix. Errors: an empty trace, interval < 1, a topology that does not fit.
Result<std::vector<Balance>> HindsightBalance(const LoadTrace& trace, const Topology& topology,
                                              int interval, Policy policy = Policy::kBalanced);

}  // namespace eplbx

#endif  // EPLBX_SIMULATE_H_
