// Re-placement over the surviving ranks (issue 20, item 2): only live ranks' slots are used,
// every expert is served again, the migration reads only from survivors, and experts no
// survivor held are recovered from a backup, or named.
#include "eplbx/survivors.h"

#include <gtest/gtest.h>

#include <random>
#include <set>

namespace eplbx {
namespace {

struct World {
  Topology topo;
  LoadMatrix load;
  Placement in_force;
};

// `ranks` ranks of `per_rank` slots on `nodes` nodes, `experts` experts with a skewed load.
// In force: slot s holds expert s % experts, so with ranks x per_rank = 2 x experts and
// experts a multiple of per_rank every expert has replicas on two ranks (of other nodes when
// nodes = 2).
World MakeWorld(int ranks, int per_rank, int experts, int nodes, int layers, uint32_t seed) {
  World w;
  w.topo = {.ranks = ranks, .nodes = nodes, .slots = ranks * per_rank, .groups = 1};
  std::mt19937 rng(seed);
  std::vector<double> values;
  for (int i = 0; i < layers * experts; ++i) values.push_back(1.0 + rng() % 100);
  w.load = *LoadMatrix::Create(layers, experts, values);
  std::vector<int32_t> map;
  for (int l = 0; l < layers; ++l) {
    for (int s = 0; s < ranks * per_rank; ++s) map.push_back(s % experts);
  }
  w.in_force = *Placement::FromPhy2Log(layers, ranks * per_rank, experts, map);
  return w;
}

std::vector<bool> LiveExcept(int ranks, std::set<int> lost) {
  std::vector<bool> live(ranks, true);
  for (int r : lost) live[r] = false;
  return live;
}

// The plan is what it says: only live slots hold experts, every expert is served, the
// migration reads only from survivors and turns `sources` into `interim`, and `interim` plus
// the recovered slots is `placement`.
void ExpectConsistent(const World& w, const SurvivorPlan& p, const std::vector<bool>& live) {
  const int per_rank = w.topo.slots_per_rank();
  ASSERT_TRUE(p.placement.CheckEveryExpertPlaced().ok())
      << p.placement.CheckEveryExpertPlaced().ToString();
  for (int l = 0; l < w.load.layers(); ++l) {
    for (int s = 0; s < w.topo.slots; ++s) {
      if (!live[s / per_rank]) {
        EXPECT_EQ(p.placement.phy2log(l, s), -1) << "layer " << l << " slot " << s;
        EXPECT_EQ(p.sources.phy2log(l, s), -1);
      } else {
        EXPECT_EQ(p.sources.phy2log(l, s), w.in_force.phy2log(l, s));
      }
    }
    std::vector<int32_t> before(p.sources.phy2log().begin() + l * w.topo.slots,
                                p.sources.phy2log().begin() + (l + 1) * w.topo.slots);
    Result<std::vector<int32_t>> after =
        ApplyMigration(before, p.migration.layers[l], w.topo.ranks);
    ASSERT_TRUE(after.ok()) << after.status().ToString();
    for (const RemoteRead& r : p.migration.layers[l].transfers) {
      EXPECT_TRUE(live[r.src]) << "a READ from lost rank " << r.src;
      EXPECT_TRUE(live[r.dst]);
    }
    for (int s = 0; s < w.topo.slots; ++s) {
      EXPECT_EQ((*after)[s], p.interim.phy2log(l, s)) << "layer " << l << " slot " << s;
    }
  }
  std::vector<int32_t> final_map = p.interim.phy2log();
  for (const RecoveredSlot& r : p.recovered) {
    EXPECT_NE(w.in_force.phy2log(r.layer, r.slot), r.expert);  // no survivor held it
    final_map[static_cast<size_t>(r.layer) * w.topo.slots + r.slot] = r.expert;
  }
  EXPECT_EQ(final_map, p.placement.phy2log());
}

// Every expert has a replica on a survivor: nothing to recover; the survivors keep most of
// what they hold (incremental), and the balance over them is close to a fresh plan's.
TEST(SurvivorsTest, ALostRankIsReplacedFromSurvivingReplicas) {
  World w = MakeWorld(4, 8, 16, 1, 3, 7);  // 32 slots for 16 experts: two replicas each
  for (int lost = 0; lost < 4; ++lost) {
    SCOPED_TRACE("lost rank " + std::to_string(lost));
    const std::vector<bool> live = LiveExcept(4, {lost});
    Result<SurvivorPlan> p = PlanSurvivors(w.in_force, w.load, w.topo, live);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    EXPECT_EQ(p->lost_ranks, std::vector<int>{lost});
    EXPECT_TRUE(p->recovered.empty());
    ExpectConsistent(w, *p, live);
    // Incremental: at most the lost rank's slots' worth of new copies per layer, and then some
    // for balance; far fewer than replanning every slot.
    EXPECT_LT(p->migration.summary.remote_transfers + p->migration.summary.local_copies,
              static_cast<int64_t>(w.load.layers()) * 3 * 8 / 2);
    Result<Balance> b = ComputeBalance(p->placement, w.load, 4);
    ASSERT_TRUE(b.ok());
    // Three of four ranks work: the best balancedness counting the empty rank is 0.75.
    EXPECT_GT(b->total, 0.75 * 0.9);
    // Losing a second rank (of the other pair) still leaves a replica of everything.
    const int second = (lost + 1) % 4;
    const std::vector<bool> two = LiveExcept(4, {lost, second});
    Result<SurvivorPlan> q = PlanSurvivors(w.in_force, w.load, w.topo, two);
    ASSERT_TRUE(q.ok()) << q.status().ToString();
    ExpectConsistent(w, *q, two);
    EXPECT_EQ(q->lost_ranks.size(), 2u);
  }
}

// An expert whose every replica was on the lost ranks: without a backup the plan fails naming
// the ranks and the experts; with one, the new placement gives it slots on survivors, the
// migration leaves those slots alone and the recovery fills them.
TEST(SurvivorsTest, ExpertsOnlyTheLostRanksHeldAreRecoveredOrNamed) {
  // 3 ranks x 2 slots, 4 experts: rank 2 alone holds experts 2 and 3 in layer 0.
  const Topology topo{.ranks = 3, .nodes = 1, .slots = 6, .groups = 1};
  const Placement in_force =
      *Placement::FromPhy2Log(2, 6, 4, {0, 1, 0, 1, 2, 3, /* layer 1 */ 0, 1, 2, 3, 2, 3});
  const LoadMatrix load = *LoadMatrix::Create(2, 4, {4, 3, 2, 1, 1, 2, 3, 4});
  const std::vector<bool> live = LiveExcept(3, {2});
  Result<SurvivorPlan> none = PlanSurvivors(in_force, load, topo, live);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().message(),
            "rank 2 was lost with the only replicas of 2 experts (layer 0: 2, 3) and no backup "
            "source holds them; register a host backup or the checkpoint "
            "(SurvivorOptions::backup)");
  SurvivorOptions o;
  o.backup = [](int layer, int expert) { return layer == 0 && expert == 2; };
  Result<SurvivorPlan> partial = PlanSurvivors(in_force, load, topo, live, o);
  ASSERT_FALSE(partial.ok());
  EXPECT_NE(partial.status().message().find("only replicas of 1 expert (layer 0: 3)"),
            std::string::npos)
      << partial.status().ToString();
  o.backup = [](int, int) { return true; };
  Result<SurvivorPlan> p = PlanSurvivors(in_force, load, topo, live, o);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->experts_recovered, 2);
  std::set<int> recovered;
  for (const RecoveredSlot& r : p->recovered) {
    EXPECT_EQ(r.layer, 0);
    EXPECT_LT(r.slot, 4);  // on a survivor
    recovered.insert(r.expert);
  }
  EXPECT_EQ(recovered, (std::set<int>{2, 3}));
  World w{topo, load, in_force};
  ExpectConsistent(w, *p, live);
}

TEST(SurvivorsTest, BadInputIsNamed) {
  World w = MakeWorld(4, 4, 8, 2, 1, 3);
  auto message = [&](std::vector<bool> live) {
    return PlanSurvivors(w.in_force, w.load, w.topo, live).status().message();
  };
  EXPECT_EQ(message({true, true}),
            "survivor planning: 2 liveness flags for 4 ranks (one per rank)");
  EXPECT_NE(message({false, false, false, false}).find("every one of the 4 ranks is lost"),
            std::string::npos);
  EXPECT_NE(message({true, false, false, false})
                .find("the 1 surviving ranks have 4 slots (4 each) for 8 experts"),
            std::string::npos);
  const LoadMatrix other = *LoadMatrix::Create(2, 8, std::vector<double>(16, 1.0));
  EXPECT_NE(PlanSurvivors(w.in_force, other, w.topo, LiveExcept(4, {1}))
                .status()
                .message()
                .find("they must agree"),
            std::string::npos);
}

// Two nodes of two ranks: one rank lost on each node (planned over two nodes of one rank),
// a whole node lost (planned over one node), one rank lost (over one node).
TEST(SurvivorsTest, LossesAcrossNodesAreReplacedToo) {
  World w = MakeWorld(4, 6, 12, 2, 2, 5);  // node 0: ranks 0, 1 (experts 0-11), node 1 alike
  for (const std::set<int>& lost : {std::set<int>{0, 3}, std::set<int>{1}, std::set<int>{0, 1}}) {
    const std::vector<bool> live = LiveExcept(4, lost);
    Result<SurvivorPlan> p = PlanSurvivors(w.in_force, w.load, w.topo, live);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    ExpectConsistent(w, *p, live);
    EXPECT_TRUE(p->recovered.empty());
  }
}

// ---- Elastic resize (issue 20, item 4) ----------------------------------------------------

// The resize plan is what it says: the sources are what the old ranks hold (added ranks
// empty), the placement uses exactly the members' slots and serves every expert, the
// migration turns one into the other reading only from old ranks (the leaving ones included)
// and writing only to members, and `after` is the placement renumbered by `members`.
void ExpectResizeConsistent(const World& w, const ResizePlan& p) {
  const int per_rank = w.topo.slots_per_rank();
  const int span_ranks = w.topo.ranks + static_cast<int>(p.added_ranks.size());
  const int span_slots = span_ranks * per_rank;
  std::set<int> members(p.members.begin(), p.members.end());
  ASSERT_EQ(p.placement.slots(), span_slots);
  ASSERT_TRUE(p.placement.CheckEveryExpertPlaced().ok())
      << p.placement.CheckEveryExpertPlaced().ToString();
  ASSERT_EQ(p.after.slots(), static_cast<int>(p.members.size()) * per_rank);
  ASSERT_TRUE(p.after.CheckEveryExpertPlaced().ok());
  EXPECT_EQ(p.topology.ranks, static_cast<int>(p.members.size()));
  for (int l = 0; l < w.load.layers(); ++l) {
    for (int s = 0; s < span_slots; ++s) {
      const int r = s / per_rank;
      EXPECT_EQ(p.sources.phy2log(l, s), r < w.topo.ranks ? w.in_force.phy2log(l, s) : -1);
      if (!members.count(r)) {
        EXPECT_EQ(p.placement.phy2log(l, s), -1) << "slot " << s;
      }
    }
    for (size_t k = 0; k < p.members.size(); ++k) {
      for (int i = 0; i < per_rank; ++i) {
        EXPECT_EQ(p.after.phy2log(l, static_cast<int>(k) * per_rank + i),
                  p.placement.phy2log(l, p.members[k] * per_rank + i));
      }
    }
    std::vector<int32_t> before(p.sources.phy2log().begin() + l * span_slots,
                                p.sources.phy2log().begin() + (l + 1) * span_slots);
    Result<std::vector<int32_t>> after = ApplyMigration(before, p.migration.layers[l], span_ranks);
    ASSERT_TRUE(after.ok()) << after.status().ToString();
    for (int s = 0; s < span_slots; ++s) {
      // Members end with the new placement; leaving ranks keep their rows (they leave).
      EXPECT_EQ((*after)[s],
                members.count(s / per_rank) ? p.placement.phy2log(l, s) : p.sources.phy2log(l, s))
          << "layer " << l << " slot " << s;
    }
    for (const RemoteRead& r : p.migration.layers[l].transfers) {
      EXPECT_LT(r.src, w.topo.ranks) << "a READ from a rank that held nothing";
      EXPECT_TRUE(members.count(r.dst)) << "a READ into leaving rank " << r.dst;
    }
  }
}

// One rank joins a 4-rank deployment with empty slots: the plan fills them, moving only what
// the new rank's share needs (incremental: old ranks keep most rows), and the load spreads
// over five ranks.
TEST(ResizeTest, AnAddedRankTakesItsShareOfExperts) {
  World w = MakeWorld(4, 8, 16, 1, 3, 7);
  Result<ResizePlan> p = PlanResize(w.in_force, w.load, w.topo, {.add = 1});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->added_ranks, std::vector<int>{4});
  EXPECT_TRUE(p->removed_ranks.empty());
  EXPECT_EQ(p->members, (std::vector<int>{0, 1, 2, 3, 4}));
  ExpectResizeConsistent(w, *p);
  int filled = 0;
  for (int l = 0; l < w.load.layers(); ++l) {
    for (int i = 0; i < 8; ++i) filled += p->placement.phy2log(l, 4 * 8 + i) >= 0;
  }
  EXPECT_EQ(filled, w.load.layers() * 8);  // the new rank serves from all its slots
  // Incremental: per layer at most the new rank's 8 slots plus a few rebalancing moves.
  EXPECT_LE(p->migration.summary.remote_transfers + p->migration.summary.local_copies,
            int64_t{w.load.layers()} * 12);
  Result<Balance> b = ComputeBalance(p->after, w.load, 5);
  ASSERT_TRUE(b.ok());
  EXPECT_GT(b->total, 0.8);
}

// Rank 2 leaves gracefully: its slots end empty, what only it held is drained from it (the
// migration may read from it), and a deployment serves on the four others renumbered.
TEST(ResizeTest, ALeavingRankIsDrainedFirst) {
  World w = MakeWorld(4, 4, 8, 1, 2, 3);  // 16 slots, 8 experts, two replicas each
  // Layer 0: rank 2 is the only holder of expert 5.
  std::vector<int32_t> map = w.in_force.phy2log();
  const std::vector<int32_t> layer0 = {0, 1, 2, 3, 4, 0, 6, 7, 4, 5, 6, 7, 4, 1, 6, 7};
  std::copy(layer0.begin(), layer0.end(), map.begin());
  w.in_force = *Placement::FromPhy2Log(2, 16, 8, map);
  ASSERT_TRUE(w.in_force.CheckEveryExpertPlaced().ok());
  Result<ResizePlan> p = PlanResize(w.in_force, w.load, w.topo, {.remove = {2}});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->removed_ranks, std::vector<int>{2});
  EXPECT_EQ(p->members, (std::vector<int>{0, 1, 3}));
  ExpectResizeConsistent(w, *p);
  bool drained = false;
  for (const RemoteRead& r : p->migration.layers[0].transfers)
    drained |= r.src == 2 && r.expert == 5;
  EXPECT_TRUE(drained) << "an expert only rank 2 held must be read from rank 2";
  // The drain's interim: the placement after, with rank 2's rows as they were (only read);
  // ApplyMigration from the sources lands on it.
  for (int l = 0; l < 2; ++l) {
    for (int s = 0; s < 16; ++s) {
      EXPECT_EQ(p->interim.phy2log(l, s),
                s / 4 == 2 ? p->sources.phy2log(l, s) : p->placement.phy2log(l, s))
          << "layer " << l << " slot " << s;
    }
  }
  // Adding and removing in one plan: rank 0 leaves, two join.
  Result<ResizePlan> q = PlanResize(w.in_force, w.load, w.topo, {.add = 2, .remove = {0}});
  ASSERT_TRUE(q.ok()) << q.status().ToString();
  EXPECT_EQ(q->members, (std::vector<int>{1, 2, 3, 4, 5}));
  ExpectResizeConsistent(w, *q);
}

// Whole nodes keep ranks per node (the plan and the migration see the nodes); anything else is
// planned as one node.
TEST(ResizeTest, WholeNodesKeepTheirNodes) {
  World w = MakeWorld(4, 6, 12, 2, 2, 5);  // two nodes of two ranks
  Result<ResizePlan> grow = PlanResize(w.in_force, w.load, w.topo, {.add = 2});
  ASSERT_TRUE(grow.ok()) << grow.status().ToString();
  EXPECT_EQ(grow->topology.nodes, 3);
  ExpectResizeConsistent(w, *grow);
  Result<ResizePlan> node = PlanResize(w.in_force, w.load, w.topo, {.remove = {2, 3}});
  ASSERT_TRUE(node.ok()) << node.status().ToString();
  EXPECT_EQ(node->topology.nodes, 1);  // one node of two ranks left
  EXPECT_EQ(node->topology.ranks_per_node(), 2);
  ExpectResizeConsistent(w, *node);
  Result<ResizePlan> one = PlanResize(w.in_force, w.load, w.topo, {.add = 1});
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  EXPECT_EQ(one->topology.nodes, 1);
  ExpectResizeConsistent(w, *one);
}

TEST(ResizeTest, BadRequestsAreNamed) {
  World w = MakeWorld(4, 4, 8, 1, 2, 3);
  auto message = [&](ResizeRequest r) {
    return std::string(PlanResize(w.in_force, w.load, w.topo, r).status().message());
  };
  EXPECT_NE(message({.add = -1}).find("-1 ranks to add"), std::string::npos);
  EXPECT_NE(message({.remove = {4}}).find("rank 4 to remove is not a rank (expected 0..3)"),
            std::string::npos);
  EXPECT_NE(message({.remove = {1, 1}}).find("rank 1 listed twice"), std::string::npos);
  EXPECT_NE(message({.remove = {0, 1, 2, 3}}).find("leaves none to serve"), std::string::npos);
  EXPECT_NE(message({.remove = {0, 1, 2}})
                .find("1 ranks after the resize have 4 slots (4 each) for 8 experts"),
            std::string::npos);
}

}  // namespace
}  // namespace eplbx
