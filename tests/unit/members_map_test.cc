// The members' map exchange (issue 33, item 5): what each member sends after a member-set
// change, and the placement in force assembled from it; every malformed blob a peer could
// send is a named error.
#include "serve/members_map.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
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

// Every member plans from the lowest member's window (a joiner sends none), so a joiner
// plans as the members do.
TEST(MembersMapTest, TheLowestMembersWindowIsTheOneEveryMemberPlansFrom) {
  std::vector<double> w0(kLayers * kExperts, 2.5), w2(kLayers * kExperts, 7.0);
  w0[3] = 1e9;
  const std::vector<std::string> all = {
      EncodeMembersMap(-1, 0, std::vector<int32_t>(6, -1)),  // a joiner: no window
      EncodeMembersMap(12, 3, Own(1), w0), "", EncodeMembersMap(12, 3, Own(3), w2)};
  Result<MembersRound> round = DecodeMembersRound(all, kLayers, kRows, kExperts);
  ASSERT_TRUE(round.ok()) << round.status().ToString();
  EXPECT_EQ(round->window, w0);
  EXPECT_EQ(round->step, 12);
  Result<MembersRound> none = DecodeMembersRound(
      {EncodeMembersMap(-1, 0, std::vector<int32_t>(6, -1))}, kLayers, kRows, kExperts);
  ASSERT_TRUE(none.ok()) << none.status().ToString();
  EXPECT_TRUE(none->window.empty());
  EXPECT_EQ(none->step, -1);
}

// An expert is recoverable only where every member's backups hold it (a member with none
// makes none recoverable).
TEST(MembersMapTest, ExpertsAreBackedWhereEveryMembersBackupsHoldThem) {
  std::vector<uint8_t> a(kLayers * kExperts, 1), b(kLayers * kExperts, 1);
  a[2] = 0;
  b[7] = 0;
  std::vector<std::string> all = {EncodeMembersMap(5, 0, Own(0), {}, a), "",
                                  EncodeMembersMap(5, 0, Own(2), {}, b)};
  Result<MembersRound> round = DecodeMembersRound(all, kLayers, kRows, kExperts);
  ASSERT_TRUE(round.ok()) << round.status().ToString();
  std::vector<uint8_t> both(kLayers * kExperts, 1);
  both[2] = both[7] = 0;
  EXPECT_EQ(round->backed, both);
  all.push_back(EncodeMembersMap(-1, 0, std::vector<int32_t>(6, -1)));  // a joiner, no backup
  round = DecodeMembersRound(all, kLayers, kRows, kExperts);
  ASSERT_TRUE(round.ok()) << round.status().ToString();
  EXPECT_EQ(round->backed, std::vector<uint8_t>(kLayers * kExperts, 0));
}

TEST(MembersMapTest, EveryMalformedMapIsANamedError) {
  const std::string good = EncodeMembersMap(7, 1, Own(0));
  auto with = [&](const std::string& blob) {
    return DecodeMembersRound({good, blob}, kLayers, kRows, kExperts).status();
  };
  // A map with `w` window loads (the values given).
  auto raw = [](uint8_t version, uint32_t step, uint32_t n, const std::vector<uint32_t>& slots,
                uint32_t w = 0, const std::vector<double>& loads = {},
                const std::vector<uint8_t>& flags = {}) {
    ByteWriter b;
    b.U8(version);
    b.U32(step);
    b.U64(1);
    b.U32(n);
    for (uint32_t e : slots) b.U32(e);
    b.U32(w);
    for (double v : loads) b.U64(std::bit_cast<uint64_t>(v));
    b.U32(static_cast<uint32_t>(flags.size()));
    for (uint8_t f : flags) b.U8(f);
    return b.Take();
  };
  const std::vector<uint32_t> six(6, 1);
  const std::vector<double> ten(10, 1.0), nan_load = {1, 1, 1, 1, 1, 1, 1, std::nan(""), 1, 1},
                                          negative = {1, 1, 1, 1, 1, 1, 1, 1, 1, -3};
  const std::pair<std::string, std::string> cases[] = {
      {raw(1, 8, 6, six), "rank 1's map is version 1; this build reads version 2"},
      {raw(2, 8, 5, six), "rank 1's map has 5 slots in 49 bytes; 6 expected (2 layers x 3 rows)"},
      {raw(2, 8, 6, {1, 1, 1}), "has 6 slots in 37 bytes"},
      {raw(2, 0x80000000u, 6, six), "rank 1's map says step 2147483648: not a step"},
      {raw(2, 0xFFFFFFFFu, 6, six), "not a step"},
      {raw(2, 8, 6, {1, 1, 1, 1, 1, 5}), "layer 1 row 2 holds expert 5 (expected -1 .. 4)"},
      {raw(2, 8, 6, {1, 1, 0xFFFFFFFEu, 1, 1, 1}), "layer 0 row 2 holds expert -2"},
      {raw(2, 9, 6, six), "rank 1 is at step 8, rank 0 at step 7: the members are not in step"},
      {good.substr(0, 7), "rank 1's map"},
      {raw(2, 8, 0xFFFFFFFFu, six), "has 4294967295 slots"},
      {raw(2, 8, 6, six, 9, ten), "rank 1's map has a window of 9 loads in 84 bytes; 0 or 10"},
      {raw(2, 8, 6, six, 10, {1, 2}), "has a window of 10 loads in 20 bytes"},
      {raw(2, 8, 6, six, 0, {1}), "rank 1's map has 0 backup flags in 8 bytes"},
      {raw(2, 8, 6, six, 0, {}, {1, 1}), "rank 1's map has 2 backup flags in 2 bytes; 0 or 10"},
      {raw(2, 8, 6, six, 0, {}, {1, 1, 1, 1, 1, 1, 1, 1, 1, 2}), "backup flag 9 is 2"},
      {raw(2, 8, 6, six, 10, nan_load), "the window's load of layer 1 expert 2 is nan"},
      {raw(2, 8, 6, six, 10, negative), "the window's load of layer 1 expert 4 is -3"},
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
