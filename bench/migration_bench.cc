// Migration planning against what engines do today, in the same run; prints JSON.
//   build/bin/eplbx_migration_bench [--layers 58] [--seed 1]
//
// Scenario: DeepSeek-V3 shape (256 experts -> 288 slots, 32 ranks, 4 nodes, 8 groups); the
// old placement is DeepSeek's plan for a Zipf load, the new one DeepSeek's plan after every
// expert's load drifted by exp(N(0, 0.3)). Both strategies move the same rows; they differ
// in source choice and scheduling:
//   eplbx    : PlanMigration (same-node sources, min-max source load, König rounds);
//   baseline : the first holder (lowest rank) serves, one read per (rank, expert), and
//              first-fit batching into rounds (each pair goes into the first round where
//              neither side is busy).
// The time estimate runs rounds one after another; a round lasts as long as its busiest
// pair (bytes / link bandwidth). The physical limit is time_lower_bound_s.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <string>

#include "eplbx/migration.h"
#include "eplbx/policy.h"

namespace {

constexpr uint64_t kBytesPerExpert = 3ull * 7168 * 2048;  // DeepSeek-V3 expert, fp8
constexpr double kLinkGbps = 400.0;

struct Figures {
  uint64_t bytes = 0, cross = 0, max_out = 0;
  int64_t reads = 0, rounds = 0;
  double time_s = 0;
};

// Rounds as a list of (reader, server) -> bytes, and their serial time.
double RoundTime(const std::vector<std::map<std::pair<int, int>, uint64_t>>& rounds) {
  double t = 0;
  for (const auto& round : rounds) {
    uint64_t worst = 0;
    for (const auto& [pair, bytes] : round) worst = std::max(worst, bytes);
    t += static_cast<double>(worst) / (kLinkGbps * 1e9 / 8);
  }
  return t;
}

Figures Eplbx(const eplbx::MigrationPlan& plan) {
  Figures f;
  for (const eplbx::LayerMigration& m : plan.layers) {
    std::vector<std::map<std::pair<int, int>, uint64_t>> rounds(static_cast<size_t>(m.rounds));
    std::map<int, uint64_t> out;
    for (const eplbx::RemoteRead& t : m.transfers) {
      rounds[t.round][{t.dst, t.src}] += kBytesPerExpert;
      out[t.src] += kBytesPerExpert;
    }
    for (auto& [rank, bytes] : out) f.max_out = std::max(f.max_out, bytes);
    f.time_s += RoundTime(rounds);
    f.rounds += m.rounds;
  }
  f.reads = plan.summary.remote_transfers;
  f.bytes = plan.summary.bytes_moved;
  f.cross = plan.summary.cross_node_bytes;
  return f;
}

Figures Baseline(const eplbx::Placement& from, const eplbx::Placement& to, int ranks, int nodes) {
  Figures f;
  const int rows = from.slots() / ranks;
  auto node = [&](int r) { return r / (ranks / nodes); };
  for (int l = 0; l < from.layers(); ++l) {
    std::set<std::pair<int, int>> done;  // (rank, expert)
    std::vector<std::pair<int, int>> pairs;
    std::map<std::pair<int, int>, uint64_t> pair_bytes;
    std::map<int, uint64_t> out;
    for (int s = 0; s < to.slots(); ++s) {
      const int r = s / rows, e = to.phy2log(l, s);
      if (e < 0 || e == from.phy2log(l, s)) continue;
      bool held = false;
      for (int i = 0; i < rows; ++i) held |= from.phy2log(l, r * rows + i) == e;
      if (held || !done.insert({r, e}).second) continue;
      const int src = from.log2phy(l, e, 0) / rows;  // first holder
      if (!pair_bytes.count({r, src})) pairs.emplace_back(r, src);
      pair_bytes[{r, src}] += kBytesPerExpert;
      out[src] += kBytesPerExpert;
      ++f.reads;
      f.bytes += kBytesPerExpert;
      if (node(src) != node(r)) f.cross += kBytesPerExpert;
    }
    for (auto& [rank, bytes] : out) f.max_out = std::max(f.max_out, bytes);
    std::map<int, std::set<int>> reading, serving;
    std::vector<std::map<std::pair<int, int>, uint64_t>> rounds;
    for (const auto& [r, src] : pairs) {
      size_t k = 0;
      while (reading[r].count(static_cast<int>(k)) || serving[src].count(static_cast<int>(k))) ++k;
      reading[r].insert(static_cast<int>(k));
      serving[src].insert(static_cast<int>(k));
      if (rounds.size() <= k) rounds.resize(k + 1);
      rounds[k][{r, src}] = pair_bytes[{r, src}];
    }
    f.rounds += static_cast<int64_t>(rounds.size());
    f.time_s += RoundTime(rounds);
  }
  return f;
}

eplbx::LoadMatrix Load(int layers, std::mt19937_64& rng, const eplbx::LoadMatrix* base) {
  std::normal_distribution<double> drift(0, 0.3);
  std::vector<double> v(static_cast<size_t>(layers) * 256);
  for (int l = 0; l < layers; ++l) {
    std::vector<int> perm(256);
    for (int e = 0; e < 256; ++e) perm[e] = e;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int e = 0; e < 256; ++e) {
      v[l * 256 + e] = base ? std::round(base->at(l, e) * std::exp(drift(rng)))
                            : std::round(100000.0 / (perm[e] + 1));
    }
  }
  return *eplbx::LoadMatrix::Create(layers, 256, v);
}

std::string Json(const char* name, const Figures& f) {
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "\"%s\": {\"remote_transfers\": %lld, \"bytes_moved\": %llu, "
                "\"cross_node_bytes\": %llu, \"max_bytes_out_per_layer\": %llu, \"rounds\": %lld, "
                "\"time_estimate_s\": %.6f}",
                name, static_cast<long long>(f.reads), static_cast<unsigned long long>(f.bytes),
                static_cast<unsigned long long>(f.cross),
                static_cast<unsigned long long>(f.max_out), static_cast<long long>(f.rounds),
                f.time_s);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  int layers = 58;
  uint64_t seed = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--layers")) layers = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--seed")) seed = std::strtoull(argv[i + 1], nullptr, 10);
  }
  const eplbx::Topology t{.ranks = 32, .nodes = 4, .slots = 288, .groups = 8};
  std::mt19937_64 rng(seed);
  const eplbx::LoadMatrix before = Load(layers, rng, nullptr);
  const eplbx::LoadMatrix after = Load(layers, rng, &before);
  const eplbx::Placement from = *eplbx::Plan(before, t);
  const eplbx::Placement to = *eplbx::Plan(after, t);
  const eplbx::MigrationOptions options{
      .ranks = 32, .nodes = 4, .bytes_per_expert = kBytesPerExpert, .link_gbps = kLinkGbps};
  const auto start = std::chrono::steady_clock::now();
  const eplbx::MigrationPlan plan = *eplbx::PlanMigration(from, to, options);
  const double plan_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  const Figures ours = Eplbx(plan), base = Baseline(from, to, 32, 4);
  std::printf(
      "{\"scenario\": \"dsv3 %d layers, 288 slots, 32 ranks, 4 nodes, drift exp(N(0,0.3))\", "
      "\"bytes_per_expert\": %llu, \"link_gbps\": %.0f, \"plan_ms\": %.3f, "
      "\"time_lower_bound_s\": %.6f, \"rounds_lower_bound\": %lld, %s, %s}\n",
      layers, static_cast<unsigned long long>(kBytesPerExpert), kLinkGbps, plan_ms,
      plan.summary.time_lower_bound_s, static_cast<long long>(plan.summary.rounds_lower_bound),
      Json("eplbx", ours).c_str(), Json("baseline_first_holder_first_fit", base).c_str());
  return 0;
}
