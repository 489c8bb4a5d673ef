// The members' map exchange (issue 33, item 5): what each member sends after a member-set
// change, and the placement in force assembled from it; every malformed blob a peer could
// send is a named error.
#include "serve/members_map.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/bytes.h"

namespace eplbx::internal {
namespace {

constexpr int kLayers = 2, kRows = 3, kExperts = 5;

std::vector<int32_t> Own(int rank) {  // layers x rows
  std::vector<int32_t> out;
  for (int l = 0; l < kLayers; ++l) {
    for (int row = 0; row < kRows; ++row) out.push_back((rank * kRows + row + l) % kExperts);
  }
  return out;
}

TEST(MembersMapTest, TheMembersMapsAssembleThePlacementInForce) {
  // Rank 1 is no member (empty), rank 3 a joiner (no step, nothing placed, empty slots).
  std::vector<std::string> all = {EncodeMembersMap(41, 2, Own(0)), "",
                                  EncodeMembersMap(41, 2, Own(2)),
                                  EncodeMembersMap(-1, 0, std::vector<int32_t>(6, -1))};
  Result<MembersRound> round = DecodeMembersRound(all, kLayers, kRows, kExperts);
  ASSERT_TRUE(round.ok()) << round.status().ToString();
  EXPECT_EQ(round->step, 41);
  EXPECT_FALSE(round->all_placed);
  EXPECT_EQ(round->not_placed, "rank 3");
  EXPECT_EQ(round->in_force.slots(), 4 * kRows);
  for (int l = 0; l < kLayers; ++l) {
    for (int row = 0; row < kRows; ++row) {
      EXPECT_EQ(round->in_force.phy2log(l, 0 * kRows + row), Own(0)[l * kRows + row]);
      EXPECT_EQ(round->in_force.phy2log(l, 1 * kRows + row), -1);  // no member
      EXPECT_EQ(round->in_force.phy2log(l, 2 * kRows + row), Own(2)[l * kRows + row]);
      EXPECT_EQ(round->in_force.phy2log(l, 3 * kRows + row), -1);
    }
  }
  all[3] = EncodeMembersMap(41, 2, Own(3));
  round = DecodeMembersRound(all, kLayers, kRows, kExperts);
  ASSERT_TRUE(round.ok());
  EXPECT_TRUE(round->all_placed);
  EXPECT_EQ(round->placed_at, 2u);
}

TEST(MembersMapTest, EveryMalformedMapIsANamedError) {
  const std::string good = EncodeMembersMap(7, 1, Own(0));
  auto with = [&](const std::string& blob) {
    return DecodeMembersRound({good, blob}, kLayers, kRows, kExperts).status();
  };
  auto raw = [](uint8_t version, uint32_t step, uint32_t n, const std::vector<uint32_t>& slots) {
    ByteWriter w;
    w.U8(version);
    w.U32(step);
    w.U64(1);
    w.U32(n);
    for (uint32_t e : slots) w.U32(e);
    return w.Take();
  };
  const std::vector<uint32_t> six(6, 1);
  const std::pair<std::string, std::string> cases[] = {
      {raw(2, 8, 6, six), "rank 1's map is version 2; this build reads version 1"},
      {raw(1, 8, 5, six), "rank 1's map has 5 slots in 41 bytes; 6 expected (2 layers x 3 rows)"},
      {raw(1, 8, 6, {1, 1, 1}), "has 6 slots in 29 bytes"},
      {raw(1, 0x80000000u, 6, six), "rank 1's map says step 2147483648: not a step"},
      {raw(1, 0xFFFFFFFFu, 6, six), "not a step"},
      {raw(1, 8, 6, {1, 1, 1, 1, 1, 5}), "layer 1 row 2 holds expert 5 (expected -1 .. 4)"},
      {raw(1, 8, 6, {1, 1, 0xFFFFFFFEu, 1, 1, 1}), "layer 0 row 2 holds expert -2"},
      {raw(1, 9, 6, six), "rank 1 is at step 8, rank 0 at step 7: the members are not in step"},
      {good.substr(0, 7), "rank 1's map"},
      {raw(1, 8, 0xFFFFFFFFu, six), "has 4294967295 slots"},
  };
  for (const auto& [blob, want] : cases) {
    const Status s = with(blob);
    EXPECT_FALSE(s.ok()) << want;
    EXPECT_NE(s.message().find(want), std::string::npos) << want << ": " << s.ToString();
  }
  EXPECT_FALSE(DecodeMembersRound({}, kLayers, kRows, kExperts).ok());
  EXPECT_FALSE(DecodeMembersRound({good}, 0, kRows, kExperts).ok());
}

}  // namespace
}  // namespace eplbx::internal
