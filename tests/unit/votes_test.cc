// The asynchronous rearrangement's votes (src/protocol/votes.h), sans I/O: the rule on
// hand-built votes, then thousands of random worlds (ranks getting ready and failing at
// random, votes delivered in any order but per peer FIFO, Commit() called at any time or
// only when due) in which every rank must apply the same layers at the same step, only
// layers ready everywhere, end at the same step the same way, and never wait forever.
#include "protocol/votes.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <random>
#include <string>
#include <vector>

namespace eplbx::protocol {
namespace {

Record VoteRecord(uint64_t id, int64_t step, uint32_t from, uint32_t ready, bool failed = false) {
  Record r;
  r.kind = RecordKind::kVote;
  r.generation = id;
  r.layer = static_cast<uint32_t>(step);
  r.expert = ready;
  r.source = from;
  r.reader = failed ? 1 : 0;
  r.reason = failed ? "boom" : "";
  return r;
}

// A final vote stands for every later step: the rank that is ready last applies at its next
// Commit() on the others' final votes, without a vote of theirs at its own step.
TEST(VotesTest, AFinalVoteStandsForEveryLaterStep) {
  const std::vector<bool> all;
  Votes v(7, /*layers=*/3, /*world=*/3, /*self=*/2);
  v.Take(0, VoteRecord(7, 1, 0, 3));  // rank 0: every layer ready at step 1
  v.Take(1, VoteRecord(7, 1, 1, 1));
  v.Take(1, VoteRecord(7, 2, 1, 3));  // rank 1: at step 2
  ASSERT_TRUE(v.Cast(1, 1, "", 0, all).has_value());
  EXPECT_EQ(v.Missing(1, all), -1);
  EXPECT_EQ(v.Agreed(2, all).ready, 1u);  // step 1's votes: one layer everywhere
  const std::optional<Record> last = v.Cast(2, 3, "", 0, all);
  ASSERT_TRUE(last.has_value());
  EXPECT_TRUE(v.final_sent());
  // Step 3 applies every layer on step 2's votes: rank 0's is its final vote of step 1.
  EXPECT_EQ(v.Missing(2, all), -1);
  EXPECT_EQ(v.Of(2, 0)->layer, 1u);
  EXPECT_EQ(v.Agreed(3, all).ready, 3u);
  EXPECT_EQ(v.Agreed(3, all).failed, nullptr);
  // No vote after a final one, whatever happens here.
  EXPECT_FALSE(v.Cast(3, 3, "a failure after the final vote", 0, all).has_value());
  EXPECT_EQ(v.vote_sent(), 2);
  // A vote that is not final stands for its own step only.
  EXPECT_EQ(v.Of(3, 1)->layer, 2u);
  Votes w(7, 3, 3, 0);
  w.Take(1, VoteRecord(7, 1, 1, 2));
  EXPECT_EQ(w.Of(2, 1), nullptr);
  EXPECT_EQ(w.Missing(2, all), 0);
}

TEST(VotesTest, AFailedVoteEndsEveryRankAndNoVoteFollowsTheEnd) {
  const std::vector<bool> all;
  Votes v(1, 4, 3, 0);
  ASSERT_TRUE(v.Cast(1, 2, "", 0, all).has_value());
  v.Take(1, VoteRecord(1, 1, 1, 1, /*failed=*/true));
  EXPECT_TRUE(v.Due(0, all));  // a rank failed: every rank ends
  EXPECT_EQ(v.Missing(1, all), 2);
  v.Take(2, VoteRecord(1, 1, 2, 4));
  EXPECT_TRUE(v.End(1, all));
  const Votes::Outcome o = v.Agreed(2, all);
  EXPECT_EQ(o.ready, 1u);
  ASSERT_NE(o.failed, nullptr);
  EXPECT_EQ(o.failed->source, 1u);
  EXPECT_FALSE(v.Cast(2, 2, "", 0, all).has_value());  // step 1's votes end it
}

TEST(VotesTest, NonMembersVoteNotAndOtherRearrangementsCountNot) {
  const std::vector<bool> members = {true, false, true};
  Votes v(5, 2, 3, 0);
  ASSERT_TRUE(v.Cast(1, 2, "", 0, members).has_value());
  v.Take(2, VoteRecord(4, 1, 2, 2));  // an earlier rearrangement's: dropped
  EXPECT_EQ(v.Missing(1, members), 2);
  v.Take(2, VoteRecord(6, 1, 2, 0));  // a later one's: kept for it
  v.Take(2, VoteRecord(5, 1, 2, 2));
  v.Take(2, VoteRecord(5, 1, 2, 0));  // a duplicate changes nothing
  EXPECT_EQ(v.Missing(1, members), -1);
  EXPECT_EQ(v.Agreed(2, members).ready, 2u);
  Votes next(6, 2, 3, 0);
  next.TakeLater(v);
  EXPECT_NE(next.Of(1, 2), nullptr);
  EXPECT_EQ(next.Of(1, 0), nullptr);
}

// Whether a Commit() is due: a final rank answers no vote of the others (its final vote
// stands for it), one that is not final must answer a rank two steps ahead of its own vote.
TEST(VotesTest, DueOnTheVotes) {
  const std::vector<bool> all;
  Votes v(1, 2, 2, 0);
  EXPECT_FALSE(v.Due(0, all));
  ASSERT_TRUE(v.Cast(1, 1, "", 0, all).has_value());
  v.Take(1, VoteRecord(1, 1, 1, 0));
  EXPECT_FALSE(v.Due(0, all));  // nothing to apply
  v.Take(1, VoteRecord(1, 2, 1, 0));
  EXPECT_FALSE(v.Due(0, all));
  v.Take(1, VoteRecord(1, 3, 1, 1));  // rank 1 waits for this rank's vote of step 2
  EXPECT_TRUE(v.Due(0, all));
  Votes f(1, 2, 2, 0);
  ASSERT_TRUE(f.Cast(1, 2, "", 0, all).has_value());  // final
  f.Take(1, VoteRecord(1, 1, 1, 0));
  f.Take(1, VoteRecord(1, 2, 1, 0));
  f.Take(1, VoteRecord(1, 3, 1, 0));
  EXPECT_FALSE(f.Due(0, all));  // it waits for nothing of this rank
  f.Take(1, VoteRecord(1, 4, 1, 1));
  EXPECT_TRUE(f.Due(0, all));  // a layer to apply
}

// A rearrangement that takes thousands of steps keeps the votes of two (a final vote of a
// forgotten step stands on); a late vote of a forgotten step changes nothing unless it is
// final or failed.
TEST(VotesTest, ForgottenStepsKeepWhatStandsAndNothingElse) {
  const std::vector<bool> all;
  Votes v(3, /*layers=*/2, /*world=*/3, /*self=*/0);
  v.Take(2, VoteRecord(3, 1, 2, 0));
  v.Take(2, VoteRecord(3, 2, 2, 2));  // rank 2: final at step 2
  for (int64_t s = 1; s <= 5000; ++s) {
    ASSERT_TRUE(v.Cast(s, 0, "", 0, all).has_value()) << s;
    v.Take(1, VoteRecord(3, s, 1, 1));
    if (s == 1) continue;
    ASSERT_EQ(v.Missing(s - 1, all), -1) << s;
    ASSERT_NE(v.Of(s - 1, 2), nullptr) << s;
    EXPECT_EQ(v.Of(s - 1, 2)->layer, s - 1 < 2 ? 1u : 2u) << s;
    ASSERT_EQ(v.Agreed(s, all).ready, 0u) << s;
    v.Forget(s - 1);
    ASSERT_LE(v.kept(), 2u) << s;
  }
  EXPECT_FALSE(v.Due(0, all));
  Votes late(3, 2, 3, 0);
  late.Forget(10);
  late.Take(1, VoteRecord(3, 4, 1, 1));
  EXPECT_EQ(late.kept(), 0u);
  EXPECT_EQ(late.Of(11, 1), nullptr);
  late.Take(1, VoteRecord(3, 5, 1, 2));
  ASSERT_NE(late.Of(11, 1), nullptr);
  EXPECT_EQ(late.Of(11, 1)->layer, 5u);
  EXPECT_EQ(late.Of(5, 1), nullptr);  // step 5 itself is forgotten (no rule asks for it)
  EXPECT_FALSE(late.Due(0, all));
  late.Take(2, VoteRecord(3, 6, 2, 0, /*failed=*/true));
  EXPECT_TRUE(late.Due(0, all));
  EXPECT_EQ(late.kept(), 0u);
}

// One random world: ranks whose leading ready layers grow at random (a rank may fail), votes in
// flight per (sender, receiver) in order, delivered at random, and Commit() started at random times
// (`drained`: only when due, as Rearranger::AwaitCommit does) and finished once the votes it waits
// for are here.
struct VotesWorld {
  struct RankState {
    Votes votes{1, 0, 1, 0};
    // The same votes never forgotten (Forget after every Commit() that goes on): every
    // answer must be the same from both.
    Votes all{1, 0, 1, 0};
    size_t most_kept = 0;
    uint32_t ready = 0;
    bool failed = false, waiting = false, finished = false, ended_failed = false;
    int64_t step = 0;
    uint32_t applied = 0;
    std::vector<uint32_t> applied_at;  // after each Commit(): the layers applied so far
    int votes_after_final = 0;
  };
  uint32_t world, layers;
  uint32_t window;  // layers in flight: a layer gets ready only after all but window - 1
                    // before it were applied here (AsyncOptions::max_layers_in_flight)
  std::vector<bool> members;
  std::vector<RankState> rank;
  std::vector<std::deque<Record>> net;  // from * world + to
  bool drained;
  int64_t end_step = -1;

  VotesWorld(std::mt19937& rng, bool drained_mode) : drained(drained_mode) {
    world = 2 + rng() % 5;
    layers = 1 + rng() % 6;
    window = 1 + rng() % layers;
    members.assign(world, true);
    if (rng() % 4 == 0) members[rng() % world] = false;  // a rank that is not a member
    if (std::count(members.begin(), members.end(), true) < 2) members.assign(world, true);
    rank.resize(world);
    for (uint32_t r = 0; r < world; ++r) {
      rank[r].votes = Votes(9, layers, world, r);
      rank[r].all = Votes(9, layers, world, r);
    }
    net.resize(static_cast<size_t>(world) * world);
  }

  bool member(uint32_t r) const { return members[r]; }

  // The most layers rank r can have ready now.
  uint32_t Started(uint32_t r) const { return std::min(layers, rank[r].applied + window); }

  bool Due(uint32_t r) const {
    const RankState& s = rank[r];
    if (!drained) return true;
    if (s.failed && !s.votes.final_sent()) return true;  // its failure: the next vote says so
    // News, once no other layer can get ready before a commit (RearrangerImpl::CommitDue).
    if (s.ready == Started(r) && s.ready > s.votes.voted_ready()) return true;
    const bool due = s.votes.Due(s.applied, members);
    EXPECT_EQ(due, s.all.Due(s.applied, members)) << "rank " << r << " at step " << s.step;
    return due;
  }

  void StartCommit(uint32_t r) {
    RankState& s = rank[r];
    ++s.step;
    const bool was_final = s.votes.final_sent();
    const std::optional<Record> v =
        s.votes.Cast(s.step, s.ready, s.failed ? "failed here" : "", 0, members);
    const std::optional<Record> u =
        s.all.Cast(s.step, s.ready, s.failed ? "failed here" : "", 0, members);
    EXPECT_EQ(v.has_value(), u.has_value()) << "rank " << r << " at step " << s.step;
    if (v && u) {
      EXPECT_EQ(EncodeRecord(*v), EncodeRecord(*u));
    }
    if (v) {
      if (was_final) ++s.votes_after_final;
      for (uint32_t to = 0; to < world; ++to) {
        if (to != r && member(to)) net[static_cast<size_t>(r) * world + to].push_back(*v);
      }
    }
    if (s.step == 1) {
      s.applied_at.push_back(s.applied);
      return;
    }
    s.waiting = true;
  }

  // Finishes rank r's Commit() if the votes it waits for are here; false otherwise.
  bool TryFinish(uint32_t r, const std::string& where) {
    RankState& s = rank[r];
    const int missing = s.votes.Missing(s.step - 1, members);
    EXPECT_EQ(missing, s.all.Missing(s.step - 1, members)) << where << ": rank " << r;
    if (missing >= 0) return false;
    const Votes::Outcome o = s.votes.Agreed(s.step, members);
    const Votes::Outcome o_all = s.all.Agreed(s.step, members);
    EXPECT_EQ(o.ready, o_all.ready) << where << ": rank " << r;
    EXPECT_EQ(o.failed == nullptr, o_all.failed == nullptr) << where << ": rank " << r;
    if (o.failed != nullptr && o_all.failed != nullptr) {
      EXPECT_EQ(o.failed->source, o_all.failed->source) << where << ": rank " << r;
    }
    for (uint32_t l = s.applied; l < o.ready; ++l) {
      for (uint32_t q = 0; q < world; ++q) {  // only a layer ready everywhere is applied
        if (member(q)) {
          EXPECT_GT(rank[q].ready, l) << where << ": rank " << r << " applied layer " << l;
        }
      }
    }
    s.applied = std::max(s.applied, o.ready);
    s.applied_at.push_back(s.applied);
    s.waiting = false;
    if (s.applied == layers || o.failed != nullptr) {
      s.finished = true;
      s.ended_failed = s.applied < layers;
    } else {
      s.votes.Forget(s.step - 1);  // as the pipeline does after a Commit() that goes on
      // Only the steps from s.step - 1 to the furthest any rank voted are kept.
      int64_t furthest = s.step;
      for (const RankState& q : rank) furthest = std::max(furthest, q.step);
      EXPECT_LE(s.votes.kept(), static_cast<size_t>(furthest - (s.step - 1) + 1))
          << where << ": rank " << r;
      s.most_kept = std::max(s.most_kept, s.all.kept());
    }
    return true;
  }

  // Runs to the end; false if it stopped with a rank that can never finish.
  bool Run(std::mt19937& rng, const std::string& where) {
    const uint32_t failer = rng() % 3 == 0 ? rng() % world : world;  // world: none fails
    for (int guard = 0; guard < 200000; ++guard) {
      bool all_done = true;
      for (uint32_t r = 0; r < world; ++r) all_done = all_done && (!member(r) || rank[r].finished);
      if (all_done) return true;
      // The events possible now, one chosen at random.
      std::vector<std::pair<int, uint32_t>> events;
      for (uint32_t r = 0; r < world; ++r) {
        if (!member(r) || rank[r].finished) continue;
        RankState& s = rank[r];
        if (!s.failed && s.ready < Started(r)) events.push_back({0, r});
        // (after its final vote too: a failure noted then must not change its vote)
        if (r == failer && !s.failed) events.push_back({1, r});
        if (!s.waiting && Due(r)) events.push_back({2, r});
        if (s.waiting) events.push_back({3, r});
      }
      for (uint32_t k = 0; k < net.size(); ++k) {
        if (!net[k].empty()) events.push_back({4, k});
      }
      if (events.empty()) return false;
      const auto [kind, x] = events[rng() % events.size()];
      switch (kind) {
        case 0:
          ++rank[x].ready;
          break;
        case 1:
          if (rng() % 8 == 0) rank[x].failed = true;  // rarely: most worlds get some way first
          break;
        case 2:
          StartCommit(x);
          break;
        case 3:
          (void)TryFinish(x, where);
          break;
        case 4: {
          const Record v = net[x].front();
          net[x].pop_front();
          rank[x % world].votes.Take(x / world, v);
          rank[x % world].all.Take(x / world, v);
          break;
        }
      }
    }
    return false;
  }
};

void ExpectAgreement(const VotesWorld& w, const std::string& where) {
  int64_t end = -1;
  bool failed = false;
  const VotesWorld::RankState* first = nullptr;
  for (uint32_t r = 0; r < w.world; ++r) {
    if (!w.member(r)) continue;
    const VotesWorld::RankState& s = w.rank[r];
    EXPECT_EQ(s.votes_after_final, 0) << where << ": rank " << r << " voted after its final vote";
    if (first == nullptr) {
      first = &s;
      end = s.step;
      failed = s.ended_failed;
      continue;
    }
    // The same layers at the same step, the same last step, the same ending.
    EXPECT_EQ(s.applied_at, first->applied_at) << where << ": rank " << r;
    EXPECT_EQ(s.step, end) << where << ": rank " << r;
    EXPECT_EQ(s.ended_failed, failed) << where << ": rank " << r;
  }
}

// 3,000 random worlds each way: Commit() at any time (an engine at every forward step, any
// skew between ranks), and only when due (a drained rearrangement).
TEST(VotesTest, RandomWorldsApplyTheSameLayersAtTheSameStepAndEnd) {
  std::mt19937 rng(2026);
  int failed_endings = 0, finals_skipping = 0, forgot = 0;
  for (int trial = 0; trial < 6000; ++trial) {
    const bool drained = trial % 2 == 1;
    const std::string where =
        "trial " + std::to_string(trial) + (drained ? " (drained)" : " (every step)");
    VotesWorld w(rng, drained);
    ASSERT_TRUE(w.Run(rng, where)) << where << ": a rank waits forever";
    ExpectAgreement(w, where);
    if (::testing::Test::HasFailure()) return;
    for (uint32_t r = 0; r < w.world; ++r) {
      if (!w.member(r)) continue;
      failed_endings += w.rank[r].ended_failed;
      // A final vote cast before the last step: later steps went without a vote of its rank.
      finals_skipping +=
          w.rank[r].votes.final_sent() && w.rank[r].votes.vote_sent() < w.rank[r].step - 1;
      forgot += w.rank[r].most_kept > 2;  // the votes never forgotten grew past two steps
    }
  }
  // The worlds reach both endings, and final votes stand in for later ones.
  EXPECT_GT(failed_endings, 500);
  EXPECT_GT(finals_skipping, 1000);
  EXPECT_GT(forgot, 1000);
}

}  // namespace
}  // namespace eplbx::protocol
