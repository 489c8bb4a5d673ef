// Policies side by side; prints one JSON object per line.
//   build/bin/eplbx_policy_bench
// 1. Balance: Zipf loads (exponent 0.7-1.3) on global shapes (one extra slot per rank) and
//    the DeepSeek-V3 hierarchical shape: balancedness of deepseek and balanced, the share
//    of deepseek's gap to the bound that balanced closes (bound: 1 globally; hierarchical:
//    the best node-level balancedness over all group-to-node assignments), and plan time.
// 2. Drift: 10 steps, each multiplying every expert's load by exp(N(0, 0.3)); copies that
//    deepseek (from scratch, rows preserved) and incremental (from its previous plan) move,
//    and the worst per-layer shortfall of incremental against balanced.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <numeric>
#include <random>
#include <span>

#include "eplbx/policy.h"

namespace {

using eplbx::Policy;

eplbx::LoadMatrix Zipf(int layers, int experts, double exponent, std::mt19937_64& rng) {
  std::vector<double> v(static_cast<size_t>(layers) * experts);
  for (int l = 0; l < layers; ++l) {
    std::vector<int> perm(static_cast<size_t>(experts));
    for (int e = 0; e < experts; ++e) perm[e] = e;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int e = 0; e < experts; ++e) {
      v[static_cast<size_t>(l) * experts + e] = std::round(1e5 / std::pow(perm[e] + 1, exponent));
    }
  }
  return *eplbx::LoadMatrix::Create(layers, experts, std::move(v));
}

double Ms(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

// Hierarchical bound: the best node-level balancedness over every assignment of groups to
// nodes (groups / nodes each); no rank can beat its node. Exhaustive (8 groups: 2,520).
double NodeBound(std::span<const double> weight, const eplbx::Topology& t) {
  const int group_size = static_cast<int>(weight.size()) / t.groups;
  std::vector<double> group(static_cast<size_t>(t.groups), 0.0);
  for (size_t e = 0; e < weight.size(); ++e) group[e / group_size] += weight[e];
  const double total = std::accumulate(group.begin(), group.end(), 0.0);
  std::vector<double> node(static_cast<size_t>(t.nodes), 0.0);
  std::vector<int> fill(static_cast<size_t>(t.nodes), 0);
  double best_max = total;
  std::function<void(int)> rec = [&](int g) {
    if (g == t.groups) {
      best_max = std::min(best_max, *std::max_element(node.begin(), node.end()));
      return;
    }
    for (int n = 0; n < t.nodes; ++n) {
      if (fill[n] == t.groups / t.nodes) continue;
      node[n] += group[g];
      ++fill[n];
      rec(g + 1);
      node[n] -= group[g];
      --fill[n];
    }
  };
  rec(0);
  return total / t.nodes / best_max;
}

void Balance(const char* name, const eplbx::Topology& t, int layers, int experts, double exponent,
             std::mt19937_64& rng) {
  const eplbx::LoadMatrix load = Zipf(layers, experts, exponent, rng);
  const auto ds = *eplbx::Plan(load, t, {.policy = Policy::kDeepSeek});
  const auto start = std::chrono::steady_clock::now();
  const auto bal = *eplbx::Plan(load, t, {.policy = Policy::kBalanced});
  const double ms = Ms(start);
  const auto bd = *eplbx::ComputeBalance(ds, load, t.ranks);
  const auto bb = *eplbx::ComputeBalance(bal, load, t.ranks);
  double closure = 0, bound_mean = 0;
  for (int l = 0; l < layers; ++l) {
    const double bound =
        t.nodes > 1 ? NodeBound({load.row(l), static_cast<size_t>(experts)}, t) : 1.0;
    bound_mean += bound / layers;
    const double gap = bound - bd.per_layer[l];
    closure += gap < 1e-9 ? 1 : (bb.per_layer[l] - bd.per_layer[l]) / gap;
  }
  std::printf(
      "{\"bench\": \"balance\", \"shape\": \"%s\", \"experts\": %d, \"slots\": %d, \"ranks\": %d, "
      "\"nodes\": %d, \"groups\": %d, \"exponent\": %.1f, \"deepseek\": %.4f, \"balanced\": %.4f, "
      "\"bound\": %.4f, \"gap_closed\": %.3f, \"balanced_plan_ms\": %.1f}\n",
      name, experts, t.slots, t.ranks, t.nodes, t.groups, exponent, bd.total, bb.total, bound_mean,
      closure / layers, ms);
}

void Drift(const eplbx::Topology& t, int layers, std::mt19937_64& rng) {
  std::normal_distribution<double> drift(0, 0.3);
  eplbx::LoadMatrix load = Zipf(layers, 256, 1.0, rng);
  eplbx::Placement ds_prev = *eplbx::Plan(load, t, {.policy = Policy::kDeepSeek});
  eplbx::Placement inc_prev = *eplbx::Plan(load, t, {.policy = Policy::kBalanced});
  int64_t ds_copies = 0, inc_copies = 0;
  double worst = 0, inc_ms = 0;
  for (int step = 0; step < 10; ++step) {
    std::vector<double> v = load.values();
    for (double& x : v) x *= std::exp(drift(rng));
    load = *eplbx::LoadMatrix::Create(layers, 256, v);
    const auto ds = *eplbx::Plan(load, t, {.policy = Policy::kDeepSeek, .previous = &ds_prev});
    const auto start = std::chrono::steady_clock::now();
    const auto inc = *eplbx::Plan(load, t, {.policy = Policy::kIncremental, .previous = &inc_prev});
    inc_ms += Ms(start);
    const auto bal = *eplbx::Plan(load, t, {.policy = Policy::kBalanced});
    const auto bi = *eplbx::ComputeBalance(inc, load, t.ranks);
    const auto bb = *eplbx::ComputeBalance(bal, load, t.ranks);
    for (int l = 0; l < layers; ++l) worst = std::max(worst, bb.per_layer[l] - bi.per_layer[l]);
    ds_copies += eplbx::CountMoves(ds_prev, ds, t.ranks)->total.remote_copies;
    inc_copies += eplbx::CountMoves(inc_prev, inc, t.ranks)->total.remote_copies;
    ds_prev = ds;
    inc_prev = inc;
  }
  std::printf(
      "{\"bench\": \"drift\", \"layers\": %d, \"slots\": %d, \"ranks\": %d, \"nodes\": %d, "
      "\"groups\": %d, \"steps\": 10, \"deepseek_copies\": %lld, \"incremental_copies\": %lld, "
      "\"ratio\": %.3f, \"worst_shortfall_vs_balanced\": %.5f, \"incremental_plan_ms_mean\": "
      "%.1f}\n",
      layers, t.slots, t.ranks, t.nodes, t.groups, static_cast<long long>(ds_copies),
      static_cast<long long>(inc_copies), static_cast<double>(inc_copies) / ds_copies, worst,
      inc_ms / 10);
}

}  // namespace

int main() {
  std::mt19937_64 rng(2026);
  for (int experts : {64, 128, 256}) {
    for (int ranks : {8, 16, 32, 64}) {
      for (double exponent : {0.7, 1.0, 1.3}) {
        Balance("global", {.ranks = ranks, .slots = experts + ranks}, 8, experts, exponent, rng);
      }
    }
  }
  for (double exponent : {0.7, 1.0, 1.3}) {
    Balance("dsv3-hierarchical", {.ranks = 32, .nodes = 4, .slots = 288, .groups = 8}, 58, 256,
            exponent, rng);
  }
  for (int run = 0; run < 3; ++run) Drift({.ranks = 32, .slots = 288}, 8, rng);
  Drift({.ranks = 32, .nodes = 4, .slots = 288, .groups = 8}, 8, rng);
  return 0;
}
