#include "eplbx/simulate.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <numeric>

#include "common/strings.h"
#include "eplbx/balancer.h"
#include "eplbx/migration.h"

namespace eplbx {

using internal::StrCat;

namespace {

// splitmix64 and Box-Muller: the same stream on every machine for a seed.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }  // [0, 1)
  double Normal() {
    const double u = 1.0 - Uniform(), v = Uniform();
    return std::sqrt(-2.0 * std::log(u)) * std::cos(2.0 * std::numbers::pi * v);
  }
  int Below(int n) { return static_cast<int>(Next() % static_cast<uint64_t>(n)); }

 private:
  uint64_t state_;
};

void Shuffle(std::vector<int>& v, Rng& rng) {
  for (int i = static_cast<int>(v.size()) - 1; i > 0; --i) std::swap(v[i], v[rng.Below(i + 1)]);
}

}  // namespace

Result<LoadTrace> SynthTrace(const SynthOptions& o) {
  if (o.layers < 1 || o.experts < 1 || o.steps < 1) {
    return Status::InvalidArgument(
        StrCat("trace synth needs --layers, --experts and --steps >= 1 (got ", o.layers, ", ",
               o.experts, ", ", o.steps, ")"));
  }
  if (!(o.zipf >= 0) || !(o.drift >= 0) || !(o.reversion >= 0 && o.reversion <= 1) ||
      !(o.burst_prob >= 0 && o.burst_prob <= 1) || !(o.burst_factor > 0) || o.burst_steps < 0 ||
      o.phase_steps < 0 || o.tokens < 1 || o.top_k < 1) {
    return Status::InvalidArgument(
        "trace synth: zipf and drift must be >= 0, reversion and burst probability in [0, 1], "
        "burst factor "
        "> 0, burst steps and phase steps >= 0, tokens and top-k >= 1");
  }
  const size_t per_step = static_cast<size_t>(o.layers) * o.experts;
  if (static_cast<double>(per_step) * static_cast<double>(o.steps) > 2e9) {
    return Status::InvalidArgument(StrCat("trace of ", o.steps, " steps x ", o.layers, " layers x ",
                                          o.experts, " experts is too large (limit 2e9 counts)"));
  }
  Rng rng(o.seed);
  LoadTrace trace{o.layers, o.experts, {}};
  trace.values.reserve(per_step * static_cast<size_t>(o.steps));
  std::vector<double> log_w(per_step), base(per_step);
  std::vector<int> burst_expert(static_cast<size_t>(o.layers), -1);
  std::vector<int64_t> burst_left(static_cast<size_t>(o.layers), 0);
  std::vector<int> perm(static_cast<size_t>(o.experts));
  auto new_phase = [&](int l) {
    std::iota(perm.begin(), perm.end(), 0);
    Shuffle(perm, rng);
    for (int e = 0; e < o.experts; ++e) {
      base[static_cast<size_t>(l) * o.experts + e] = -o.zipf * std::log(perm[e] + 1.0);
    }
  };
  for (int l = 0; l < o.layers; ++l) new_phase(l);
  log_w = base;
  const double routed = static_cast<double>(o.tokens) * o.top_k;
  std::vector<double> w(static_cast<size_t>(o.experts));
  for (int64_t step = 0; step < o.steps; ++step) {
    for (int l = 0; l < o.layers; ++l) {
      if (o.phase_steps > 0 && step > 0 && step % o.phase_steps == 0) new_phase(l);
      double* lw = log_w.data() + static_cast<size_t>(l) * o.experts;
      const double* b = base.data() + static_cast<size_t>(l) * o.experts;
      for (int e = 0; e < o.experts; ++e) {
        lw[e] += o.reversion * (b[e] - lw[e]) + o.drift * rng.Normal();
      }
      if (burst_left[l] == 0 && rng.Uniform() < o.burst_prob) {
        burst_expert[l] = rng.Below(o.experts);
        burst_left[l] = o.burst_steps;
      }
      double total = 0;
      for (int e = 0; e < o.experts; ++e) {
        w[e] = std::exp(lw[e]) * (burst_left[l] > 0 && e == burst_expert[l] ? o.burst_factor : 1);
        total += w[e];
      }
      if (burst_left[l] > 0) --burst_left[l];
      for (int e = 0; e < o.experts; ++e) trace.values.push_back(std::round(routed * w[e] / total));
    }
  }
  return trace;
}

Result<std::vector<Balance>> HindsightBalance(const LoadTrace& trace, const Topology& topology,
                                              int interval, Policy policy) {
  const int64_t steps = trace.steps();
  if (steps < 1 || trace.layers < 1 || trace.experts < 1) {
    return Status::InvalidArgument("the trace is empty; expected at least one step");
  }
  if (interval < 1) {
    return Status::InvalidArgument(StrCat("interval (", interval, ") must be >= 1 steps"));
  }
  EPLBX_RETURN_IF_ERROR(topology.Validate(trace.experts));
  if (policy == Policy::kIncremental) policy = Policy::kBalanced;  // nothing to keep: free moves
  const size_t cells = static_cast<size_t>(trace.layers) * trace.experts;
  std::vector<Balance> out;
  out.reserve(static_cast<size_t>(steps));
  for (int64_t begin = 0; begin < steps; begin += interval) {
    const int64_t end = std::min<int64_t>(steps, begin + interval);
    std::vector<double> sum(cells, 0.0);
    for (int64_t s = begin; s < end; ++s) {
      const std::span<const double> v = trace.step(s);
      for (size_t i = 0; i < cells; ++i) sum[i] += v[i];
    }
    EPLBX_ASSIGN_OR_RETURN(LoadMatrix block,
                           LoadMatrix::Create(trace.layers, trace.experts, std::move(sum)));
    EPLBX_ASSIGN_OR_RETURN(Placement p, Plan(block, topology, {.policy = policy}));
    for (int64_t s = begin; s < end; ++s) {
      const std::span<const double> v = trace.step(s);
      EPLBX_ASSIGN_OR_RETURN(
          LoadMatrix load,
          LoadMatrix::Create(trace.layers, trace.experts, std::vector<double>(v.begin(), v.end())));
      EPLBX_ASSIGN_OR_RETURN(Balance b, ComputeBalance(p, load, topology.ranks));
      out.push_back(std::move(b));
    }
  }
  return out;
}

Result<SimulateResult> Simulate(const LoadTrace& trace, const SimulateOptions& o) {
  const int64_t steps = trace.steps();
  if (steps < 1 || trace.layers < 1 || trace.experts < 1) {
    return Status::InvalidArgument("the trace is empty; expected at least one step");
  }
  if (o.lag_steps < 0 || o.lag_steps > 1000000) {
    return Status::InvalidArgument(StrCat("lag (", o.lag_steps, ") must be 0 .. 1000000 steps"));
  }
  if (o.window < 1 || o.trigger.interval < 1) {
    return Status::InvalidArgument(StrCat("window (", o.window, ") and interval (",
                                          o.trigger.interval, ") must be >= 1 steps"));
  }
  const Topology& t = o.topology;
  EPLBX_RETURN_IF_ERROR(t.Validate(trace.experts));
  const Policy first_policy = o.policy == Policy::kIncremental ? Policy::kBalanced : o.policy;
  const LoadMatrix uniform = *LoadMatrix::Create(
      trace.layers, trace.experts,
      std::vector<double>(static_cast<size_t>(trace.layers) * trace.experts, 1.0));
  EPLBX_ASSIGN_OR_RETURN(Placement current, Plan(uniform, t, {.policy = first_policy}));
  // The Balancer without a Rearranger: plans only; a new placement takes effect at the
  // Commit that follows the step that decided it.
  BalancerOptions bo;
  bo.topology = t;
  bo.policy = o.policy;
  bo.tolerance = o.tolerance;
  bo.window = o.window;
  bo.trigger = o.trigger;
  bo.bytes_per_expert = o.bytes_per_expert;
  bo.link_gbps = o.link_gbps;
  EPLBX_ASSIGN_OR_RETURN(std::unique_ptr<Balancer> balancer,
                         Balancer::Create(std::move(current), bo));
  SimulateResult r;
  r.steps.reserve(static_cast<size_t>(steps));
  // With a lag, the placements committed after each of the last lag_steps steps wait their
  // turn: step s is served by the one committed after step s - 1 - lag_steps.
  std::vector<Placement> waiting;  // [k]: committed after step (step - 1 - lag_steps + k)
  waiting.push_back(balancer->placement());
  for (int64_t step = 0; step < steps; ++step) {
    EPLBX_ASSIGN_OR_RETURN(const BalancerStep b, balancer->Step(trace.step(step)));
    double balancedness = b.balancedness;
    if (o.lag_steps > 0) {
      const std::span<const double> v = trace.step(step);
      EPLBX_ASSIGN_OR_RETURN(
          LoadMatrix load,
          LoadMatrix::Create(trace.layers, trace.experts, std::vector<double>(v.begin(), v.end())));
      EPLBX_ASSIGN_OR_RETURN(Balance in_force, ComputeBalance(waiting.front(), load, t.ranks));
      balancedness = in_force.total;
    }
    r.steps.push_back({step, balancedness, b.began});
    (void)balancer->Commit();
    if (o.lag_steps > 0) {
      waiting.push_back(balancer->placement());
      if (static_cast<int64_t>(waiting.size()) > o.lag_steps + 1) waiting.erase(waiting.begin());
    }
  }
  const BalancerReport& report = balancer->report();
  r.considered = report.considered;
  r.skipped_balanced = report.skipped_balanced;
  r.skipped_small_gain = report.skipped_small_gain;
  for (const RebalanceRecord& e : report.rebalances) {
    r.events.push_back(
        {e.step, e.window_before, e.window_after, e.copies, e.bytes, e.stall_estimate_s});
    r.copies += e.copies;
    r.bytes_moved += e.bytes;
    r.stall_seconds_est += e.stall_estimate_s;
    ++r.rebalances;
  }
  auto summarize = [](std::vector<double> bal, double& mean, double& p5) {
    mean = std::accumulate(bal.begin(), bal.end(), 0.0) / static_cast<double>(bal.size());
    const size_t k = static_cast<size_t>(0.05 * static_cast<double>(bal.size() - 1));
    std::nth_element(bal.begin(), bal.begin() + static_cast<std::ptrdiff_t>(k), bal.end());
    p5 = bal[k];
  };
  std::vector<double> bal(r.steps.size());
  for (size_t i = 0; i < bal.size(); ++i) bal[i] = r.steps[i].balancedness;
  summarize(bal, r.mean_balancedness, r.p5_balancedness);
  EPLBX_ASSIGN_OR_RETURN(const std::vector<Balance> ceiling,
                         HindsightBalance(trace, t, o.trigger.interval));
  double ceiling_sum = 0;
  for (const Balance& b : ceiling) ceiling_sum += b.total;
  r.hindsight_mean_balancedness = ceiling_sum / static_cast<double>(ceiling.size());
  const size_t first = r.events.empty() ? 0 : static_cast<size_t>(r.events[0].step + 1);
  if (first < bal.size()) {
    summarize({bal.begin() + static_cast<std::ptrdiff_t>(first), bal.end()},
              r.steady_mean_balancedness, r.steady_p5_balancedness);
  } else {
    r.steady_mean_balancedness = r.mean_balancedness;
    r.steady_p5_balancedness = r.p5_balancedness;
  }
  return r;
}

}  // namespace eplbx
