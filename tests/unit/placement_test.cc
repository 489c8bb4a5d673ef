#include "eplbx/placement.h"

#include <gtest/gtest.h>

namespace eplbx {
namespace {

TEST(PlacementTest, BuildsLog2PhyAndLogcnt) {
  // 1 layer, 6 slots, 4 experts: expert 1 twice, one empty slot.
  Result<Placement> p = Placement::FromPhy2Log(1, 6, 4, {1, 0, 1, 3, -1, 2});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->max_replicas(), 2);
  EXPECT_EQ(p->logcnt(0, 1), 2);
  EXPECT_EQ(p->logcnt(0, 0), 1);
  EXPECT_EQ(p->log2phy(0, 1, 0), 0);
  EXPECT_EQ(p->log2phy(0, 1, 1), 2);
  EXPECT_EQ(p->log2phy(0, 3, 0), 3);
  EXPECT_EQ(p->log2phy(0, 3, 1), -1);
  EXPECT_TRUE(p->CheckEveryExpertPlaced().ok());
}

TEST(PlacementTest, RejectsBadIdsAndShapes) {
  Result<Placement> p = Placement::FromPhy2Log(1, 3, 2, {0, 2, 1});
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("layer 0, slot 1: expert id 2 is out of range"),
            std::string::npos)
      << p.status().message();
  EXPECT_FALSE(Placement::FromPhy2Log(1, 3, 2, {0, -2, 1}).ok());
  EXPECT_FALSE(Placement::FromPhy2Log(2, 3, 2, {0, 1, 1}).ok());
  EXPECT_FALSE(Placement::FromPhy2Log(0, 3, 2, {}).ok());
}

TEST(PlacementTest, DetectsUnplacedExperts) {
  Result<Placement> p = Placement::FromPhy2Log(1, 2, 3, {0, 2});
  ASSERT_TRUE(p.ok());
  Status s = p->CheckEveryExpertPlaced();
  EXPECT_EQ(s.message(), "layer 0: expert 1 has no replica in any slot");
}

TEST(BalanceTest, RankLoadDividesLoadByReplicas) {
  // 2 ranks x 2 slots. Expert 0 (load 10) twice, experts 1 and 2 once (loads 4, 6).
  Placement p = *Placement::FromPhy2Log(1, 4, 3, {0, 1, 0, 2});
  LoadMatrix load = *LoadMatrix::FromRows({{10, 4, 6}});
  std::vector<double> loads = RankLoads(p, load, 0, 2);
  EXPECT_DOUBLE_EQ(loads[0], 5 + 4);
  EXPECT_DOUBLE_EQ(loads[1], 5 + 6);
  Result<Balance> b = ComputeBalance(p, load, 2);
  ASSERT_TRUE(b.ok());
  EXPECT_DOUBLE_EQ(b->per_layer[0], 10.0 / 11.0);
  EXPECT_DOUBLE_EQ(b->total, 10.0 / 11.0);
}

TEST(BalanceTest, TotalIsSumOfMeansOverSumOfMaxes) {
  Placement p = *Placement::FromPhy2Log(2, 2, 2, {0, 1, 0, 1});
  LoadMatrix load = *LoadMatrix::FromRows({{1, 3}, {0, 0}});
  Result<Balance> b = ComputeBalance(p, load, 2);
  ASSERT_TRUE(b.ok());
  EXPECT_DOUBLE_EQ(b->per_layer[0], 2.0 / 3.0);
  EXPECT_DOUBLE_EQ(b->per_layer[1], 1.0);  // an all-zero layer counts as balanced
  EXPECT_DOUBLE_EQ(b->total, 2.0 / 3.0);
}

TEST(BalanceTest, RejectsMismatchedShapes) {
  Placement p = *Placement::FromPhy2Log(1, 2, 2, {0, 1});
  LoadMatrix load = *LoadMatrix::FromRows({{1, 3, 4}});
  Result<Balance> b = ComputeBalance(p, load, 2);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), Code::kMismatch);
  EXPECT_FALSE(ComputeBalance(p, *LoadMatrix::FromRows({{1, 3}}), 3).ok());
}

TEST(TopologyTest, Accessors) {
  Topology t{.ranks = 8, .nodes = 2, .slots = 32, .groups = 4};
  ASSERT_TRUE(t.Validate(16).ok());
  EXPECT_EQ(t.slots_per_rank(), 4);
  EXPECT_EQ(t.ranks_per_node(), 4);
  EXPECT_EQ(t.rank_of_slot(13), 3);
  EXPECT_EQ(t.node_of_rank(5), 1);
}

}  // namespace
}  // namespace eplbx
