// The Balancer: the EPLB loop (window -> trigger -> plan -> migration plan -> rearrangement)
// driven like an engine drives it, with ranks as threads on loopback agents.
#include "eplbx/balancer.h"

#include <cmath>
#include <thread>

#include <gtest/gtest.h>

#include "eplbx/simulate.h"
#include "eplbx/survivors.h"
#include "rank_fixture.h"

namespace eplbx {
namespace {

using namespace eplbx::fixture;  // NOLINT: the fixture

// Tokens per logical expert at `step`: Zipf over a permutation redrawn every 60 steps (the
// hot experts move), the same on every rank.
std::vector<double> Load(int step) {
  std::vector<double> out;
  for (int l = 0; l < kLayers; ++l) {
    std::mt19937 rng(static_cast<uint32_t>(l * 7919 + step / 60));
    std::vector<int> perm(kExperts);
    for (int e = 0; e < kExperts; ++e) perm[e] = e;
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<double> layer(kExperts);
    for (int k = 0; k < kExperts; ++k) layer[perm[k]] = std::round(1000.0 / (k + 1));
    out.insert(out.end(), layer.begin(), layer.end());
  }
  return out;
}

struct BalancerLog {
  std::vector<std::vector<int32_t>> maps;  // per step: the placement in force
  std::vector<double> balancedness;
  BalancerReport report;
  std::string prometheus;
  uint64_t rows_checked = 0;
};

// `polls`: Poll() calls during each forward pass (one after each of that many "layers" of
// about a millisecond).
void RunRank(Rank& rank, Bootstrap& boot, BalancerMode mode, int steps, BalancerLog* log,
             int polls = 0, int target_steps = 3) {
  auto re = Rearranger::Create(rank.agent.get(), &boot, rank.layout);
  ASSERT_TRUE(re.ok()) << re.status().ToString();
  std::vector<int32_t> first(static_cast<size_t>(kLayers) * kRanks * kRows);
  for (size_t s = 0; s < first.size(); ++s)
    first[s] = static_cast<int32_t>(s % (kRanks * kRows) % kExperts);
  auto initial = Placement::FromPhy2Log(kLayers, kRanks * kRows, kExperts, first);
  ASSERT_TRUE(initial.ok());
  BalancerOptions o;
  o.topology = {.ranks = kRanks, .nodes = 1, .slots = kRanks * kRows, .groups = 1};
  o.policy = Policy::kBalanced;
  o.window = 20;
  o.trigger.interval = 20;
  o.mode = mode;
  o.async.target_steps = target_steps;
  auto b = Balancer::Create(*initial, o, re->get());
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  const uint32_t r = rank.layout.rank;
  std::vector<std::vector<uint32_t>> tables(kLayers);  // slot -> row in force (empty: layout's)
  for (int step = 0; step < steps; ++step) {
    const Placement& p = (*b)->placement();
    for (int l = 0; l < kLayers; ++l) {
      for (int t = 0; t < 2; ++t) {
        for (int row = 0; row < kRows; ++row) {
          const int32_t e = p.phy2log(l, static_cast<int>(r) * kRows + row);
          ASSERT_EQ(rank.SlotRow(l, t, row, tables[l])[5], Byte(l, e, t, 5))
              << "rank " << r << " step " << step << " layer " << l << " row " << row;
          ++log->rows_checked;
        }
      }
    }
    log->maps.emplace_back(p.phy2log().begin(), p.phy2log().end());
    for (int k = 0; k < polls; ++k) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      (*b)->Poll();
    }
    auto s = (*b)->Step(Load(step));
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    log->balancedness.push_back(s->balancedness);
    BalancerCommit c = (*b)->Commit();
    for (const CommittedLayer& cl : c.layers) tables[cl.layer] = cl.row_of_slot;
    if (c.finished) {
      ASSERT_TRUE(c.status.ok()) << c.status.ToString();
    }
  }
  while ((*b)->progress().rebalancing) (void)(*b)->Commit();
  log->report = (*b)->report();
  log->prometheus = PrometheusText((*b)->report(), (*b)->progress());
}

std::vector<BalancerLog> RunBalancers(BalancerMode mode, int steps, uint32_t spare = 0,
                                      int polls = 0, int target_steps = 3) {
  std::vector<std::vector<int32_t>> maps(kLayers);
  for (int l = 0; l < kLayers; ++l) {
    for (int s = 0; s < kRanks * kRows; ++s) maps[l].push_back(s % kExperts);
  }
  auto ranks = MakeRanks(maps, -1, nullptr, spare);
  std::vector<BalancerLog> logs(kRanks);
  OnThreads([&](uint32_t r, Bootstrap& boot) {
    RunRank(*ranks[r], boot, mode, steps, &logs[r], polls, target_steps);
  });
  return logs;
}

// The engine's loop: forward pass on the placement in force (every row checked), Step with
// the step's load, Commit at the safe point. Rebalances happen when the hot experts move,
// every rank has the same placement at every step, and balance improves over the uniform
// start.
// With spare rows (swap commit mode) the forward pass reads every slot through the row table
// each commit hands out.
TEST(BalancerTest, AsynchronousAndSynchronousRebalanceWhileServing) {
  for (const auto& [mode, spare] :
       {std::pair{BalancerMode::kAsynchronous, 0u}, std::pair{BalancerMode::kSynchronous, 0u},
        std::pair{BalancerMode::kAsynchronous, static_cast<uint32_t>(kRows)},
        std::pair{BalancerMode::kSynchronous, static_cast<uint32_t>(kRows)}}) {
    SCOPED_TRACE(std::string(mode == BalancerMode::kAsynchronous ? "asynchronous" : "synchronous") +
                 (spare ? ", swap" : ", in place"));
    const int steps = 400;
    auto logs = RunBalancers(mode, steps, spare);
    for (uint32_t r = 0; r < kRanks; ++r) {
      EXPECT_EQ(logs[r].maps, logs[0].maps) << "rank " << r;
      EXPECT_EQ(logs[r].rows_checked, static_cast<uint64_t>(steps) * kLayers * 2 * kRows);
      EXPECT_EQ(logs[r].report.rebalances.size(), logs[0].report.rebalances.size());
    }
    const BalancerReport& rep = logs[0].report;
    EXPECT_GE(rep.rebalances.size(), 5u);
    EXPECT_EQ(rep.failed, 0);
    EXPECT_EQ(rep.considered, steps / 20);
    for (const RebalanceRecord& x : rep.rebalances) {
      EXPECT_TRUE(x.status.ok()) << x.status.ToString();
      EXPECT_EQ(x.layers_committed, static_cast<uint32_t>(kLayers));
      // With a spare row per slot every rank-layer swaps; without, none.
      EXPECT_EQ(x.layers_swapped, spare ? x.layers_committed : 0u);
      uint64_t from_nodes = 0;
      for (uint64_t n : x.bytes_from_node) from_nodes += n;
      EXPECT_EQ(from_nodes, x.bytes_read);
      if (x.bytes_read > 0) {
        EXPECT_EQ(x.bytes_from_node.size(), 1u);  // one node
      }
      EXPECT_GT(x.window_after, x.window_before);
      if (mode == BalancerMode::kSynchronous) {
        EXPECT_EQ(x.finished_step, x.step);
        EXPECT_GT(x.rearrange_s, 0);
      } else {
        EXPECT_GT(x.finished_step, x.step);  // it spans steps: the engine served meanwhile
        EXPECT_EQ(x.rearrange_s, 0);
      }
    }
    uint64_t read = 0;
    for (uint32_t r = 0; r < kRanks; ++r) {
      for (const RebalanceRecord& x : logs[r].report.rebalances) read += x.bytes_read;
    }
    EXPECT_GT(read, 0u);
    // Balance after the first rebalance beats the uniform start on average.
    const size_t first = static_cast<size_t>(rep.rebalances[0].finished_step + 1);
    double before = 0, after = 0;
    for (size_t i = 0; i < first; ++i) before += logs[0].balancedness[i];
    for (size_t i = first; i < logs[0].balancedness.size(); ++i) after += logs[0].balancedness[i];
    EXPECT_GT(after / static_cast<double>(steps - first), before / static_cast<double>(first));
    EXPECT_NE(logs[0].prometheus.find("eplbx_rebalances_total " +
                                      std::to_string(rep.rebalances.size()) + "\n"),
              std::string::npos)
        << logs[0].prometheus;
    EXPECT_NE(logs[0].prometheus.find("# TYPE eplbx_bytes_in_flight gauge"), std::string::npos);
    // The engines' style (issue 32, item 5): balancedness, rebalance seconds, bytes per path.
    EXPECT_NE(logs[0].prometheus.find("\neplbx_balancedness 0."), std::string::npos)
        << logs[0].prometheus;
    EXPECT_NE(logs[0].prometheus.find("eplbx_rebalance_seconds_count " +
                                      std::to_string(rep.rebalances.size()) + "\n"),
              std::string::npos);
    uint64_t moved = 0;
    for (const RebalanceRecord& x : rep.rebalances) {
      for (const PathTotals& t : x.bytes_by_path) moved += t.bytes;
    }
    ASSERT_GT(moved, 0u);
    const size_t at = logs[0].prometheus.find("eplbx_bytes_moved_total{path=\"");
    ASSERT_NE(at, std::string::npos) << logs[0].prometheus;
  }
}

// Polls between the layers of the forward pass (Balancer::Poll) let an asynchronous rebalance
// finish in fewer steps: without them it needs a call of every rank per protocol hop (about
// four steps plus the budget's); with them its layers are ready within the step they began
// in and commit a step later. Every rank still has the same placement at every step, every
// row checked.
TEST(BalancerTest, PollsBetweenLayersFinishAnAsynchronousRebalanceInFewerSteps) {
  const int steps = 100;
  double mean_steps[2] = {0, 0};
  for (int polls : {0, 8}) {
    SCOPED_TRACE(polls);
    auto logs = RunBalancers(BalancerMode::kAsynchronous, steps, 0, polls, /*target_steps=*/1);
    for (uint32_t r = 0; r < kRanks; ++r) {
      EXPECT_EQ(logs[r].maps, logs[0].maps) << "rank " << r;
      EXPECT_EQ(logs[r].rows_checked, static_cast<uint64_t>(steps) * kLayers * 2 * kRows);
    }
    const BalancerReport& rep = logs[0].report;
    ASSERT_GE(rep.rebalances.size(), 2u);
    EXPECT_EQ(rep.failed, 0);
    for (const RebalanceRecord& x : rep.rebalances) {
      EXPECT_EQ(x.layers_committed, static_cast<uint32_t>(kLayers));
      mean_steps[polls > 0] += static_cast<double>(x.finished_step - x.step) /
                               static_cast<double>(rep.rebalances.size());
    }
  }
  EXPECT_LT(mean_steps[1], mean_steps[0]);
  EXPECT_GE(mean_steps[1], 1.0);  // committed a step after it was ready, at the earliest
}

// Without a Rearranger the Balancer only plans: what eplbx simulate replays.
TEST(BalancerTest, PlanOnlyIsWhatSimulateReplays) {
  SynthOptions so;
  so.layers = 2;
  so.experts = 16;
  so.steps = 300;
  so.phase_steps = 100;
  auto trace = SynthTrace(so);
  ASSERT_TRUE(trace.ok());
  SimulateOptions sim;
  sim.topology = {.ranks = 4, .nodes = 1, .slots = 20, .groups = 1};
  sim.window = 50;
  sim.trigger.interval = 50;
  auto r = Simulate(*trace, sim);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_GE(r->rebalances, 1);
  EXPECT_EQ(r->considered, 6);
  ASSERT_EQ(r->events.size(), static_cast<size_t>(r->rebalances));
  for (const RebalanceEvent& e : r->events) {
    EXPECT_TRUE(r->steps[static_cast<size_t>(e.step)].rebalanced);
    EXPECT_EQ((e.step + 1) % 50, 0);
  }
}

// After a lost rank the Balancer goes on over the members (BalancerOptions::live): no plan
// ever puts an expert on the lost rank's slots, every expert keeps a replica, balance is
// measured over the members, and it still rebalances as the hot experts move.
TEST(BalancerTest, OverTheMembersNoPlanUsesALostRanksSlots) {
  const Topology topo{.ranks = 4, .nodes = 1, .slots = 20, .groups = 1};
  const std::vector<bool> live = {true, true, false, true};
  const Topology members = MembersTopology(topo, live);
  EXPECT_EQ(members.ranks, 3);
  EXPECT_EQ(members.slots, 15);
  const int layers = 2, experts = 12;
  std::vector<int32_t> flat;
  for (int l = 0; l < layers; ++l) {
    for (int s = 0; s < 15; ++s) flat.push_back(s % experts);
  }
  auto compact = Placement::FromPhy2Log(layers, 15, experts, flat);
  ASSERT_TRUE(compact.ok());
  auto initial = SpreadOverMembers(*compact, topo, live);
  ASSERT_TRUE(initial.ok()) << initial.status().ToString();
  for (int s = 10; s < 15; ++s) EXPECT_EQ(initial->phy2log(0, s), -1);
  auto back = CompactToMembers(*initial, topo, live);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->phy2log(), compact->phy2log());

  BalancerOptions o;
  o.topology = topo;
  o.policy = Policy::kBalanced;
  o.window = 20;
  o.trigger.interval = 20;
  o.live = live;
  auto b = Balancer::Create(*initial, o, nullptr);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  int commits = 0;
  for (int step = 0; step < 240; ++step) {
    std::vector<double> load;
    for (int l = 0; l < layers; ++l) {
      for (int e = 0; e < experts; ++e)
        load.push_back(std::round(1000.0 / (1 + (e + step / 60 * 5) % experts)));
    }
    auto st = (*b)->Step(load);
    ASSERT_TRUE(st.ok()) << st.status().ToString();
    auto lm = LoadMatrix::Create(layers, experts, load);
    ASSERT_TRUE(lm.ok());
    auto c = CompactToMembers((*b)->placement(), topo, live);
    ASSERT_TRUE(c.ok());
    auto bal = ComputeBalance(*c, *lm, 3);
    ASSERT_TRUE(bal.ok());
    EXPECT_DOUBLE_EQ(st->balancedness, bal->total) << "step " << step;
    commits += (*b)->Commit().layers.empty() ? 0 : 1;
    const Placement& p = (*b)->placement();
    for (int l = 0; l < layers; ++l) {
      for (int s = 10; s < 15; ++s) ASSERT_EQ(p.phy2log(l, s), -1) << "step " << step;
      for (int e = 0; e < experts; ++e) ASSERT_GE(p.logcnt(l, e), 1) << "step " << step;
    }
  }
  EXPECT_GE(commits, 2);
  EXPECT_GE((*b)->report().rebalances.size(), 2u);

  // What does not fit is refused by name.
  BalancerOptions bad = o;
  bad.live = {true, true, false};
  EXPECT_NE(Balancer::Create(*initial, bad, nullptr)
                .status()
                .message()
                .find("3 liveness flags (live) for 4 ranks"),
            std::string::npos);
  std::vector<int32_t> on_lost = initial->phy2log();
  on_lost[11] = 4;
  auto wrong = Placement::FromPhy2Log(layers, 20, experts, on_lost);
  ASSERT_TRUE(wrong.ok());
  EXPECT_NE(Balancer::Create(*wrong, o, nullptr)
                .status()
                .message()
                .find("the initial placement puts expert 4 of layer 0 in slot 11 of rank 2, "
                      "which does not serve (live); its slots must be empty (-1)"),
            std::string::npos);
  bad.live = {true, false, false, false};
  EXPECT_NE(Balancer::Create(*initial, bad, nullptr)
                .status()
                .message()
                .find("the 1 serving ranks have 5 slots for 12 experts"),
            std::string::npos);
}

// Counts per physical slot go to the slot's expert; a wrong count of counts is named.
TEST(BalancerTest, StepSlotsMapsSlotsToExpertsAndRejectsBadInput) {
  auto p = Placement::FromPhy2Log(1, 4, 3, {0, 1, 2, 0});
  ASSERT_TRUE(p.ok());
  BalancerOptions o;
  o.topology = {.ranks = 2, .nodes = 1, .slots = 4, .groups = 1};
  o.window = 4;
  o.trigger.interval = 100;
  auto b = Balancer::Create(*p, o);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  auto bad = (*b)->StepSlots(std::vector<double>{1, 2, 3});
  EXPECT_EQ(bad.status().message(), "step 0: 3 slot counts, expected 4 (1 layers x 4 slots)");
  // Slot 3 is a replica of expert 0: its -2 would vanish in expert 0's sum (5 - 2).
  auto neg = (*b)->StepSlots(std::vector<double>{5, 1, 1, -2});
  EXPECT_EQ(neg.status().message(),
            "step 0: the count of layer 0 slot 3 is -2; counts must be finite and >= 0");
  auto nan = (*b)->StepSlots(std::vector<double>{5, 1, std::nan(""), 1});
  EXPECT_NE(nan.status().message().find("slot 2 is nan"), std::string::npos)
      << nan.status().ToString();
  // Slots 0 and 3 hold expert 0 (replicas): 5 + 5 tokens; ranks {0,1} and {2,0}.
  auto ok = (*b)->StepSlots(std::vector<double>{5, 10, 10, 5});
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_DOUBLE_EQ(ok->balancedness, 1.0);  // 5 + 10 and 10 + 5 tokens
  EXPECT_EQ((*b)->report().steps, 1);       // the bad steps recorded nothing
  auto bad_topology = o;
  bad_topology.topology.slots = 6;
  EXPECT_FALSE(Balancer::Create(*p, bad_topology).ok());
}

}  // namespace
}  // namespace eplbx
