#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <set>

#include "eplbx/policy.h"
#include "io/load_file.h"
#include "plan/deepseek_internal.h"

namespace eplbx {
namespace {

LoadMatrix ReadmeLoad() {
  return *LoadMatrix::FromRows({{90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86},
                                {20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27}});
}

std::vector<int32_t> Row(const Placement& p, int layer, bool logcnt = false) {
  std::vector<int32_t> out;
  const int n = logcnt ? p.experts() : p.slots();
  for (int i = 0; i < n; ++i) out.push_back(logcnt ? p.logcnt(layer, i) : p.phy2log(layer, i));
  return out;
}

// The example published in DeepSeek's EPLB README.
TEST(DeepSeekTest, ReadmeVector) {
  Topology t{.ranks = 8, .nodes = 2, .slots = 16, .groups = 4};
  Result<Placement> p = Plan(ReadmeLoad(), t);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(Row(*p, 0), (std::vector<int32_t>{5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1}));
  EXPECT_EQ(Row(*p, 1), (std::vector<int32_t>{7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1}));
  EXPECT_EQ(Row(*p, 0, true), (std::vector<int32_t>{1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1}));
  EXPECT_EQ(Row(*p, 1, true), (std::vector<int32_t>{1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1}));
  // log2phy lists each expert's slots ascending, -1 padded.
  EXPECT_EQ(p->max_replicas(), 2);
  EXPECT_EQ(p->log2phy(0, 5, 0), 0);
  EXPECT_EQ(p->log2phy(0, 5, 1), 2);
  EXPECT_EQ(p->log2phy(0, 0, 0), 12);
  EXPECT_EQ(p->log2phy(0, 0, 1), -1);
}

// 300 random cases (both modes, integer, float, Zipf and tie-heavy loads) and three
// DeepSeek-V3-shaped ones (4 layers x 256 experts; 288 or 320 slots) planned by
// DeepSeek's reference implementation (tests/data/deepseek_reference_cases.json, produced
// with torch; see tests/data/README.md).
TEST(DeepSeekTest, MatchesReferenceOutputs) {
  Result<std::string> text = io::ReadFile(EPLBX_TEST_DATA "/deepseek_reference_cases.json");
  ASSERT_TRUE(text.ok()) << text.status().ToString();
  const nlohmann::json doc = nlohmann::json::parse(*text);
  int checked = 0;
  for (const nlohmann::json& c : doc["cases"]) {
    Result<LoadMatrix> load =
        LoadMatrix::FromRows(c["load"].get<std::vector<std::vector<double>>>());
    ASSERT_TRUE(load.ok());
    Topology t{
        .ranks = c["ranks"], .nodes = c["nodes"], .slots = c["slots"], .groups = c["groups"]};
    Result<Placement> p = Plan(*load, t);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    const auto want_phy = c["phy2log"].get<std::vector<std::vector<int32_t>>>();
    const auto want_cnt = c["logcnt"].get<std::vector<std::vector<int32_t>>>();
    for (int l = 0; l < p->layers(); ++l) {
      EXPECT_EQ(Row(*p, l), want_phy[l])
          << "case " << checked << " (" << c["kind"] << ") layer " << l << " " << c.dump();
      EXPECT_EQ(Row(*p, l, true), want_cnt[l]) << "case " << checked << " layer " << l;
    }
    ++checked;
  }
  EXPECT_EQ(checked, 303);
}

TEST(DeepSeekInternalTest, PackingPutsEqualCountsInEachPack) {
  std::vector<float> w = {5, 1, 4, 2, 3, 3};
  std::vector<int32_t> pack, rank;
  internal::BalancedPacking(w, 2, pack, rank);
  // Visit order 0(5) 2(4) 4(3) 5(3) 3(2) 1(1): 0->p0 (tie: lowest), 2->p1, 4->p1 (4 < 5),
  // 5->p0 (5 < 7), 3->p1 (7 < 8, now full), 1->p0 (the only pack with room).
  EXPECT_EQ(pack, (std::vector<int32_t>{0, 0, 1, 1, 1, 0}));
  EXPECT_EQ(rank, (std::vector<int32_t>{0, 2, 0, 2, 1, 1}));
}

TEST(DeepSeekInternalTest, PackingWithOneItemPerPackIsIdentity) {
  std::vector<float> w = {1, 9, 5};
  std::vector<int32_t> pack, rank;
  internal::BalancedPacking(w, 3, pack, rank);
  EXPECT_EQ(pack, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(rank, (std::vector<int32_t>{0, 0, 0}));
}

TEST(DeepSeekInternalTest, ReplicationTiesGoToLowestIndex) {
  std::vector<float> w = {6, 6, 2};
  std::vector<int32_t> phy2log, rank, count;
  internal::ReplicateExperts(w, 5, phy2log, rank, count);
  // 6,6,2 -> expert 0 (tie, lowest) -> 3,6,2 -> expert 1.
  EXPECT_EQ(phy2log, (std::vector<int32_t>{0, 1, 2, 0, 1}));
  EXPECT_EQ(rank, (std::vector<int32_t>{0, 0, 0, 1, 1}));
  EXPECT_EQ(count, (std::vector<int32_t>{2, 2, 1}));
}

struct Shape {
  Topology topology;
  int layers;
  int experts;
};

Shape RandomShape(std::mt19937_64& rng) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  Shape s;
  s.topology.nodes = std::vector<int>{1, 2, 4}[pick(0, 2)];
  s.topology.ranks = s.topology.nodes * pick(1, 4);
  s.topology.groups = std::vector<int>{1, 2, 3, 4, 8}[pick(0, 4)];
  s.experts = s.topology.groups * pick(1, 8);
  const int min_per_rank = (s.experts + s.topology.ranks - 1) / s.topology.ranks;
  s.topology.slots = s.topology.ranks * pick(min_per_rank, min_per_rank + 4);
  s.layers = pick(1, 3);
  return s;
}

LoadMatrix RandomLoad(std::mt19937_64& rng, int layers, int experts) {
  std::vector<double> v(static_cast<size_t>(layers) * experts);
  const int kind = std::uniform_int_distribution<int>(0, 3)(rng);
  for (double& x : v) {
    switch (kind) {
      case 0:
        x = std::uniform_int_distribution<int>(0, 1000)(rng);
        break;
      case 1:
        x = std::uniform_real_distribution<double>(0, 1)(rng);
        break;
      case 2:
        x = std::uniform_int_distribution<int>(0, 2)(rng) * 7.0;
        break;  // many ties
      default:
        x = 0;
        break;  // all zero
    }
  }
  return *LoadMatrix::Create(layers, experts, std::move(v));
}

// Invariants over thousands of random shapes and loads.
TEST(DeepSeekPropertyTest, InvariantsHoldOnRandomInputs) {
  std::mt19937_64 rng(20261202);
  for (int iter = 0; iter < 3000; ++iter) {
    const Shape s = RandomShape(rng);
    const LoadMatrix load = RandomLoad(rng, s.layers, s.experts);
    Result<Placement> p = Plan(load, s.topology);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    SCOPED_TRACE(testing::Message() << "iter " << iter << " ranks " << s.topology.ranks << " nodes "
                                    << s.topology.nodes << " slots " << s.topology.slots
                                    << " groups " << s.topology.groups << " experts " << s.experts);
    ASSERT_TRUE(p->CheckEveryExpertPlaced().ok());
    const int group_size = s.experts / s.topology.groups;
    const int slots_per_node = s.topology.slots / s.topology.nodes;
    for (int l = 0; l < s.layers; ++l) {
      int total = 0;
      for (int e = 0; e < s.experts; ++e) {
        total += p->logcnt(l, e);
        for (int k = 0; k < p->max_replicas(); ++k) {
          const int32_t slot = p->log2phy(l, e, k);
          if (k < p->logcnt(l, e)) {
            ASSERT_GE(slot, 0);
            ASSERT_EQ(p->phy2log(l, slot), e);
            if (k > 0) {
              ASSERT_LT(p->log2phy(l, e, k - 1), slot);
            }
          } else {
            ASSERT_EQ(slot, -1);
          }
        }
      }
      ASSERT_EQ(total, s.topology.slots);
      for (int slot = 0; slot < s.topology.slots; ++slot) ASSERT_GE(p->phy2log(l, slot), 0);
      if (IsHierarchical(s.topology)) {  // a group's experts all live on one node
        std::vector<std::set<int>> nodes_of_group(s.topology.groups);
        for (int slot = 0; slot < s.topology.slots; ++slot) {
          nodes_of_group[p->phy2log(l, slot) / group_size].insert(slot / slots_per_node);
        }
        for (const auto& n : nodes_of_group) ASSERT_EQ(n.size(), 1u);
      }
    }
    Result<Placement> again = Plan(load, s.topology);
    ASSERT_TRUE(again.ok());
    ASSERT_EQ(*again, *p);  // deterministic
  }
}

// DeepSeek-V3 shape: 58 layers x 256 experts -> 288 slots on 32 ranks / 4 nodes / 8 groups.
// DeepSeekNodes planned node by node, in any order, is DeepSeekLayer's result (the balanced
// policy's never-worse check plans deepseek's nodes heaviest first and may stop early), and
// node_load is the weight of the experts the layer puts on each node.
TEST(DeepSeekInternalTest, NodesPlannedInAnyOrderGiveTheLayer) {
  std::mt19937_64 rng(21);
  for (int iter = 0; iter < 300; ++iter) {
    const int nodes = 1 + static_cast<int>(rng() % 4);
    const int groups = nodes * (1 + static_cast<int>(rng() % 3));
    const int experts = groups * (1 + static_cast<int>(rng() % 6));
    const int ranks = nodes * (1 + static_cast<int>(rng() % 4));
    const int slots = ranks * ((experts + ranks - 1) / ranks + static_cast<int>(rng() % 3));
    std::vector<float> weight(static_cast<size_t>(experts));
    for (float& w : weight) w = static_cast<float>(rng() % 4 == 0 ? 0 : rng() % 1000);
    std::vector<int32_t> want(static_cast<size_t>(slots)), want_cnt(weight.size());
    internal::DeepSeekLayer(weight, slots, groups, nodes, ranks, want, want_cnt);
    std::vector<int32_t> got(want.size(), -1), got_cnt(weight.size(), -1);
    internal::DeepSeekNodes planner(weight, slots, groups, nodes, ranks, got, got_cnt);
    std::vector<int> order(static_cast<size_t>(nodes));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    for (int node : order) planner.Plan(node);
    ASSERT_EQ(got, want) << "iteration " << iter;
    ASSERT_EQ(got_cnt, want_cnt) << "iteration " << iter;
    std::vector<double> on_node(static_cast<size_t>(nodes), 0.0);
    std::vector<bool> seen(weight.size(), false);
    for (int s = 0; s < slots; ++s) {
      const int32_t e = want[s];
      if (!seen[e]) on_node[s / (slots / nodes)] += weight[e];
      seen[e] = true;
    }
    for (int n = 0; n < nodes; ++n)
      EXPECT_NEAR(planner.node_load(n), on_node[n], 1e-6 * (1 + on_node[n])) << "node " << n;
  }
}

TEST(DeepSeekTest, DeepSeekV3Shape) {
  std::mt19937_64 rng(7);
  std::vector<double> v(58 * 256);
  for (double& x : v) x = std::uniform_int_distribution<int>(0, 5000)(rng);
  LoadMatrix load = *LoadMatrix::Create(58, 256, v);
  Topology t{.ranks = 32, .nodes = 4, .slots = 288, .groups = 8};
  Result<Placement> p = Plan(load, t);
  ASSERT_TRUE(p.ok());
  Result<Balance> b = ComputeBalance(*p, load, 32);
  ASSERT_TRUE(b.ok());
  EXPECT_GT(b->total, 0.5);
  EXPECT_LE(b->total, 1.0);
}

struct BadInput {
  const char* name;
  Topology topology;
  int experts;
  const char* message;
};

TEST(DeepSeekTest, RejectsEveryInvalidTopologyWithAClearMessage) {
  const std::vector<BadInput> cases = {
      {"slots not multiple of ranks",
       {.ranks = 4, .nodes = 1, .slots = 10, .groups = 1},
       8,
       "slots (10) is not a multiple of ranks (4)"},
      {"ranks not multiple of nodes",
       {.ranks = 6, .nodes = 4, .slots = 12, .groups = 1},
       8,
       "ranks (6) is not a multiple of nodes (4)"},
      {"experts not multiple of groups",
       {.ranks = 4, .nodes = 1, .slots = 12, .groups = 3},
       8,
       "experts (8) is not a multiple of groups (3)"},
      {"too few slots",
       {.ranks = 4, .nodes = 1, .slots = 4, .groups = 1},
       8,
       "slots (4) is less than experts (8)"},
      {"zero ranks", {.ranks = 0, .nodes = 1, .slots = 8, .groups = 1}, 8, "ranks is 0"},
      {"negative nodes", {.ranks = 4, .nodes = -2, .slots = 8, .groups = 1}, 8, "nodes is -2"},
      {"zero slots", {.ranks = 4, .nodes = 1, .slots = 0, .groups = 1}, 8, "slots is 0"},
      {"zero groups", {.ranks = 4, .nodes = 1, .slots = 8, .groups = 0}, 8, "groups is 0"},
  };
  for (const BadInput& c : cases) {
    std::vector<double> v(static_cast<size_t>(c.experts), 1.0);
    LoadMatrix load = *LoadMatrix::Create(1, c.experts, v);
    Result<Placement> p = Plan(load, c.topology);
    ASSERT_FALSE(p.ok()) << c.name;
    EXPECT_EQ(p.status().code(), Code::kInvalidArgument) << c.name;
    EXPECT_NE(p.status().message().find(c.message), std::string::npos)
        << c.name << ": " << p.status().message();
  }
}

TEST(DeepSeekTest, RejectsBadLoads) {
  const double inf = std::numeric_limits<double>::infinity();
  struct Case {
    std::vector<std::vector<double>> rows;
    const char* message;
  };
  const std::vector<Case> cases = {
      {{}, "load is empty"},
      {{{}}, "load is empty"},
      {{{1, 2}, {3}}, "layer 1 has 1 experts but layer 0 has 2"},
      {{{1, -1}}, "layer 0, expert 1: load is -1"},
      {{{1, 2}, {inf, 0}}, "layer 1, expert 0: load is inf"},
      {{{std::nan(""), 0}}, "layer 0, expert 0: load is nan"},
      {{{1e39, 0}}, "load is 1e+39"},
  };
  for (const Case& c : cases) {
    Result<LoadMatrix> load = LoadMatrix::FromRows(c.rows);
    ASSERT_FALSE(load.ok()) << c.message;
    EXPECT_NE(load.status().message().find(c.message), std::string::npos)
        << load.status().message();
  }
}

TEST(PolicyTest, ParsesNames) {
  EXPECT_EQ(*ParsePolicy("deepseek"), Policy::kDeepSeek);
  Result<Policy> bad = ParsePolicy("greedy");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("unknown policy 'greedy'"), std::string::npos);
  EXPECT_EQ(PolicyName(Policy::kDeepSeek), "deepseek");
}

}  // namespace
}  // namespace eplbx
