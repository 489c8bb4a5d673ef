// Planning speed through the public API. Run with --benchmark_format=json for JSON.
//   build/bin/eplbx_plan_bench --benchmark_format=json
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <utility>

#include "eplbx/policy.h"

namespace {

// A Zipf-like load (exponent 1.0, experts shuffled per layer), integer token counts.
eplbx::LoadMatrix ZipfLoad(int layers, int experts, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<double> v(static_cast<size_t>(layers) * experts);
  std::vector<int> perm(experts);
  for (int l = 0; l < layers; ++l) {
    for (int e = 0; e < experts; ++e) perm[e] = e;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int e = 0; e < experts; ++e) {
      v[static_cast<size_t>(l) * experts + e] = std::round(100000.0 / (perm[e] + 1));
    }
  }
  return *eplbx::LoadMatrix::Create(layers, experts, std::move(v));
}

// Cycles through 16 different loads so that the branch predictor cannot learn one input
// (a real rebalance sees a new load every time; one repeated input runs ~30% faster).
void PlanDeepSeek(benchmark::State& state, eplbx::Topology topology, int layers, int experts) {
  std::vector<eplbx::LoadMatrix> loads;
  for (uint64_t seed = 1; seed <= 16; ++seed) loads.push_back(ZipfLoad(layers, experts, seed));
  size_t next = 0;
  for (auto _ : state) {
    eplbx::Result<eplbx::Placement> p = eplbx::Plan(loads[next++ % loads.size()], topology);
    benchmark::DoNotOptimize(p);
    if (!p.ok()) state.SkipWithError(p.status().ToString().c_str());
  }
  state.counters["layers"] = layers;
  state.counters["experts"] = experts;
  state.counters["slots"] = topology.slots;
}

// DeepSeek-V3 size: 58 layers x 256 experts -> 288 slots, 32 ranks, 4 nodes, 8 groups.
BENCHMARK_CAPTURE(PlanDeepSeek, dsv3_hierarchical,
                  eplbx::Topology{.ranks = 32, .nodes = 4, .slots = 288, .groups = 8}, 58, 256)
    ->Unit(benchmark::kMillisecond);
// The same shape in global mode (decode): 1 node of 32 ranks.
BENCHMARK_CAPTURE(PlanDeepSeek, dsv3_global,
                  eplbx::Topology{.ranks = 32, .nodes = 1, .slots = 288, .groups = 1}, 58, 256)
    ->Unit(benchmark::kMillisecond);
// A large decode deployment: 256 experts -> 320 slots on 64 ranks.
BENCHMARK_CAPTURE(PlanDeepSeek, ep64_global,
                  eplbx::Topology{.ranks = 64, .nodes = 1, .slots = 320, .groups = 1}, 58, 256)
    ->Unit(benchmark::kMillisecond);

// The three policies at one shape, in the same run (issue 34: balanced and incremental
// against deepseek). incremental re-plans from the deepseek placement of the same load (as
// `eplbx plan --policy incremental --previous <the deepseek plan>`). Layers run on one thread per
// core (PlanOptions::threads 0) for balanced and incremental, and on one (`_1thread`); deepseek on
// one.
void PlanPolicy(benchmark::State& state, eplbx::Policy policy, eplbx::Topology topology, int layers,
                int experts, int threads = 0, bool drift = false) {
  std::vector<eplbx::LoadMatrix> loads;
  std::vector<eplbx::Placement> previous;
  for (uint64_t seed = 1; seed <= 4; ++seed) loads.push_back(ZipfLoad(layers, experts, seed));
  for (size_t i = 0; i < loads.size(); ++i) {
    if (!drift) {
      previous.push_back(*eplbx::Plan(loads[i], topology));
      continue;
    }
    // `_drift`: the balanced placement of the load before, each expert's load since scaled
    // by a factor drawn uniformly from [0.5, 1.5] (what a rebalance every few thousand
    // steps sees; the previous placement is then close to good, and the search from it long).
    previous.push_back(*eplbx::Plan(loads[i], topology, {.policy = eplbx::Policy::kBalanced}));
    std::mt19937_64 rng(100 + i);
    std::uniform_real_distribution<double> factor(0.5, 1.5);
    std::vector<double> v = loads[i].values();
    for (double& x : v) x = std::round(x * factor(rng));
    loads[i] = *eplbx::LoadMatrix::Create(layers, experts, std::move(v));
  }
  size_t next = 0;
  for (auto _ : state) {
    const size_t i = next++ % loads.size();
    eplbx::Result<eplbx::Placement> p = eplbx::Plan(
        loads[i], topology, {.policy = policy, .previous = &previous[i], .threads = threads});
    benchmark::DoNotOptimize(p);
    if (!p.ok()) state.SkipWithError(p.status().ToString().c_str());
  }
}

// Registers PlanPolicy for each shape and policy (balanced and incremental also on one
// thread: `_1thread`).
void RegisterPolicies() {
  struct Shape {
    const char* name;
    eplbx::Topology topology;
    int layers, experts;
  };
  // EP256 and DeepSeek-V3 (58 layers x 256 experts), and the serving demo's (8 x 64 on 4
  // ranks: what its Balancer plans at every rebalance).
  const Shape shapes[] = {
      {"ep256", {.ranks = 256, .nodes = 32, .slots = 512, .groups = 8}, 58, 256},
      {"dsv3", {.ranks = 32, .nodes = 4, .slots = 288, .groups = 8}, 58, 256},
      {"demo", {.ranks = 4, .nodes = 1, .slots = 72, .groups = 1}, 8, 64}};
  const std::pair<const char*, eplbx::Policy> policies[] = {
      {"deepseek", eplbx::Policy::kDeepSeek},
      {"balanced", eplbx::Policy::kBalanced},
      {"incremental", eplbx::Policy::kIncremental}};
  for (const Shape& shape : shapes) {
    for (const auto& [name, policy] : policies) {
      for (int threads : {0, 1}) {
        if (threads == 1 && policy == eplbx::Policy::kDeepSeek) continue;  // always one
        const std::string label =
            std::string("PlanPolicy/") + shape.name + "_" + name + (threads == 1 ? "_1thread" : "");
        benchmark::RegisterBenchmark(label.c_str(), PlanPolicy, policy, shape.topology,
                                     shape.layers, shape.experts, threads, false)
            ->Unit(benchmark::kMillisecond);
      }
    }
    // incremental from the balanced placement of a load that has since drifted.
    benchmark::RegisterBenchmark(
        (std::string("PlanPolicy/") + shape.name + "_incremental_drift").c_str(), PlanPolicy,
        eplbx::Policy::kIncremental, shape.topology, shape.layers, shape.experts, 0, true)
        ->Unit(benchmark::kMillisecond);
  }
}

}  // namespace

int main(int argc, char** argv) {
  RegisterPolicies();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
