// The settle machine (src/serve/settle.h) over thousands of random worlds: members lost at
// any point (while gathering, while placing, between rounds), processes joining (new ranks
// and lost ranks coming back), placements failing with and without a loss, members that
// learn a new epoch late. A world is a model of the coordinator's rounds (a round completes
// once every member at the current epoch contributed; a loss or a join moves the epoch and
// fails the round for everyone in it; a contribution at an older epoch is refused) and of
// members running the machine. A member that fails leaves the group, as its process would.
// Members that had settled settle again when the set moves once more (their next step's
// collective fails). Each world checks: every member left in the group ends settled, all at
// the coordinator's epoch, at the same step, having placed from the same round; no member
// acts without end.
#include "serve/settle.h"

#include <gtest/gtest.h>

#include <map>
#include <optional>
#include <random>
#include <set>
#include <vector>

namespace eplbx::internal {
namespace {

struct Member {
  Settle settle{4};
  SettleAction next;         // what it does when it is its turn
  uint64_t epoch = 0;        // the epoch it knows
  int step = -1;             // -1: a joiner
  bool contributed = false;  // its contribution is in the round in progress
  uint64_t contributed_at = 0, placed_at = 0;
  bool placing = false;
  uint64_t place_round = 0;   // the round its placement in progress is from
  uint64_t last_round = 0;    // the last round it gathered
  uint64_t placed_round = 0;  // the round its last successful placement was from
  int actions = 0;
  std::optional<SettleAction> end;
};

struct World {
  std::mt19937_64 rng;
  uint64_t epoch = 1;
  uint64_t round = 0;             // rounds completed
  std::map<int, Member> members;  // the coordinator's member set
  std::set<int> gone;             // lost or failed (may come back)
  int next_rank = 0;
  int losses_left = 0, joins_left = 0;
  int failed = 0;  // members that gave up (and left)
  std::vector<std::string> log;

  explicit World(uint64_t seed) : rng(seed) {}
  bool Chance(double p) { return std::uniform_real_distribution<double>(0, 1)(rng) < p; }

  // The member set moves: rounds in progress fail for everyone in them (they learn the epoch);
  // members that had settled notice at their next step's collective and settle again.
  void Move() {
    ++epoch;
    for (auto& [r, m] : members) {
      if (m.end && m.end->kind == SettleActionKind::kDone) {
        m.end.reset();
        m.next = m.settle.Start();
        continue;
      }
      if (m.contributed) {
        m.contributed = false;
        Result<SettleRound> refused = Status::Aborted("member set changed");
        const uint64_t before = m.epoch;
        m.epoch = epoch;
        m.next = m.settle.OnGathered(refused, before, epoch);
        Finish(m);
      }
    }
  }
  void Finish(Member& m) {
    ++m.actions;
    if (m.next.kind == SettleActionKind::kDone || m.next.kind == SettleActionKind::kFailed)
      m.end = m.next;
  }
  void Lose(int r) {
    members.erase(r);
    gone.insert(r);
    log.push_back("lose " + std::to_string(r));
    Move();
  }
  void Join() {
    int r;
    if (!gone.empty() && Chance(0.5)) {  // a lost rank's process comes back
      r = *std::next(gone.begin(), static_cast<long>(rng() % gone.size()));
      gone.erase(r);
    } else {
      r = next_rank++;
    }
    log.push_back("join " + std::to_string(r));
    Member m;
    m.next = m.settle.Start();
    members.emplace(r, std::move(m));
    Move();
    members.at(r).epoch = epoch;  // admitted at the new epoch
  }

  // The round completes once every member contributed at the current epoch.
  void MaybeComplete() {
    if (members.empty()) return;
    for (auto& [r, m] : members) {
      if (!m.contributed) return;
    }
    ++round;
    SettleRound out;
    bool first = true;
    out.all_placed = true;
    for (auto& [r, m] : members) {
      if (m.step >= 0) out.step = m.step;
      if (m.contributed_at == 0 || (!first && m.contributed_at != out.placed_at))
        out.all_placed = false;
      if (m.contributed_at == 0) out.not_placed += "rank " + std::to_string(r) + " ";
      if (first) out.placed_at = m.contributed_at;
      first = false;
    }
    for (auto& [r, m] : members) {
      m.contributed = false;
      m.last_round = round;
      m.next = m.settle.OnGathered(out, m.epoch, m.epoch);
      Finish(m);
      if (m.next.kind == SettleActionKind::kDone) m.step = m.next.step;
      if (m.next.kind == SettleActionKind::kPlace) m.step = m.next.step;  // a joiner learns it
    }
  }

  // One member's turn.
  void Act(int r) {
    Member& m = members.at(r);
    if (m.end || m.contributed) return;
    if (m.placing) {  // the placement ends
      m.placing = false;
      // A move fails when the member set moved under it (most of the time), or now and then
      // on its own (a flaky path); the member may or may not have learned the new epoch.
      const bool moved = epoch != m.next.epoch;
      const bool fails = (moved && Chance(0.7)) || Chance(0.03);
      if (moved && Chance(0.5)) m.epoch = epoch;
      if (!fails) m.placed_round = m.place_round;
      m.next =
          m.settle.OnPlaced(fails ? Status::Unavailable("move failed") : Status::OK(), m.epoch);
      Finish(m);
      return;
    }
    switch (m.next.kind) {
      case SettleActionKind::kGather:
        if (m.epoch != epoch) {  // refused at once: an older epoch
          const uint64_t before = m.epoch;
          m.epoch = epoch;
          m.next = m.settle.OnGathered(Status::Aborted("old epoch"), before, epoch);
          Finish(m);
          return;
        }
        m.contributed = true;
        m.contributed_at = m.next.placed_at;
        MaybeComplete();
        return;
      case SettleActionKind::kPlace:
        m.placing = true;
        m.place_round = m.last_round;
        return;
      default:
        return;
    }
  }

  void Run() {
    for (int tick = 0; tick < 100000; ++tick) {
      // A failed member leaves (its process reports and exits).
      for (auto it = members.begin(); it != members.end();) {
        if (it->second.end && it->second.end->kind == SettleActionKind::kFailed) {
          const int r = it->first;
          ++it;
          ++failed;
          Lose(r);
          it = members.begin();
        } else {
          ++it;
        }
      }
      std::vector<int> runnable;
      for (auto& [r, m] : members) {
        if (!m.end && !m.contributed) runnable.push_back(r);
      }
      const bool fault = Chance(0.04);
      if (fault && losses_left > 0 && members.size() > 1) {
        --losses_left;
        auto it = std::next(members.begin(), static_cast<long>(rng() % members.size()));
        Lose(it->first);
        continue;
      }
      if (fault && joins_left > 0) {
        --joins_left;
        Join();
        continue;
      }
      if (runnable.empty()) return;
      Act(runnable[rng() % runnable.size()]);
    }
    ADD_FAILURE() << "the world never quiesced";
  }
};

TEST(SettleTest, EveryMemberLeftEndsSettledTogetherInRandomWorlds) {
  int settled = 0, failed_members = 0, placements = 0;
  for (uint64_t seed = 1; seed <= 4000; ++seed) {
    World w(seed);
    const int n = 2 + static_cast<int>(w.rng() % 7);
    w.losses_left = static_cast<int>(w.rng() % 4);
    w.joins_left = static_cast<int>(w.rng() % 3);
    w.next_rank = n;
    for (int r = 0; r < n; ++r) {
      Member m;
      m.epoch = 1;
      m.step = 57;
      m.next = m.settle.Start();
      w.members.emplace(r, std::move(m));
    }
    // The event that starts settling: one member lost (or a join), before anyone acts.
    if (w.Chance(0.8)) {
      w.Lose(static_cast<int>(w.rng() % n));
    } else {
      w.Join();
    }
    w.Run();
    std::string where = "seed " + std::to_string(seed) + ":";
    for (const std::string& e : w.log) where += " " + e;
    std::optional<SettleAction> done;
    uint64_t round = 0;
    for (auto& [r, m] : w.members) {
      ASSERT_TRUE(m.end.has_value()) << where << ": rank " << r << " never finished";
      ASSERT_LE(m.actions, 200) << where;
      if (m.end->kind == SettleActionKind::kFailed) {
        ++failed_members;
        continue;
      }
      // Settled at the coordinator's epoch, at the members' step, from one round.
      EXPECT_EQ(m.end->epoch, w.epoch) << where << ": rank " << r;
      if (!done) {
        done = m.end;
        round = m.placed_round;
      }
      EXPECT_EQ(m.end->step, done->step) << where;
      EXPECT_EQ(m.placed_round, round) << where << ": rank " << r << " placed from another round";
      EXPECT_EQ(m.end->step, 57) << where;
      placements += m.settle.placements();
    }
    if (done) ++settled;
    failed_members += w.failed;
  }
  // The worlds exercise settling, restarts and failures alike.
  EXPECT_GT(settled, 3000);
  EXPECT_GT(failed_members, 0);
  EXPECT_GT(placements, settled);
}

TEST(SettleTest, APlacementThatFailsWithNobodyLostFailsAtTheNextRound) {
  Settle s;
  ASSERT_EQ(s.Start().kind, SettleActionKind::kGather);
  SettleRound r{.step = 9, .all_placed = false, .placed_at = 0, .not_placed = "rank 0, 1"};
  SettleAction a = s.OnGathered(r, 2, 2);
  ASSERT_EQ(a.kind, SettleActionKind::kPlace);
  EXPECT_EQ(a.step, 9);
  EXPECT_EQ(a.epoch, 2u);
  a = s.OnPlaced(Status::Unavailable("the path broke"), 2);
  ASSERT_EQ(a.kind, SettleActionKind::kGather);
  EXPECT_EQ(a.placed_at, 0u);
  r.not_placed = "rank 1";
  a = s.OnGathered(r, 2, 2);
  ASSERT_EQ(a.kind, SettleActionKind::kFailed);
  EXPECT_NE(a.status.message().find("failed on rank 1 with no member lost (here: the path broke)"),
            std::string::npos)
      << a.status.message();
}

TEST(SettleTest, AMemberSetMovingDuringEveryPlacementAbortsAfterTheLimit) {
  Settle s(2);
  s.Start();
  SettleRound r{.step = 3, .all_placed = false};
  ASSERT_EQ(s.OnGathered(r, 2, 2).kind, SettleActionKind::kPlace);
  ASSERT_EQ(s.OnPlaced(Status::OK(), 3).kind, SettleActionKind::kGather);  // moved under it
  ASSERT_EQ(s.OnGathered(r, 3, 3).kind, SettleActionKind::kPlace);
  ASSERT_EQ(s.restarts().size(), 1u);
  EXPECT_EQ(s.restarts()[0], "epoch 2 -> 3: placed here, not everywhere");
  ASSERT_EQ(s.OnPlaced(Status::OK(), 4).kind, SettleActionKind::kGather);
  const SettleAction a = s.OnGathered(r, 4, 4);
  ASSERT_EQ(a.kind, SettleActionKind::kFailed);
  EXPECT_EQ(a.status.code(), Code::kAborted);
}

TEST(SettleTest, GathersRefusedByAMovingMemberSetAreBounded) {
  Settle s;
  s.Start();
  for (int i = 1; i < Settle::kMaxGathers; ++i)
    ASSERT_EQ(s.OnGathered(Status::Aborted("moved"), i, i + 1).kind, SettleActionKind::kGather);
  EXPECT_EQ(s.OnGathered(Status::Aborted("moved"), 9, 10).kind, SettleActionKind::kFailed);
  // A refusal with the epoch unchanged (a timeout) fails at once.
  Settle t;
  t.Start();
  const SettleAction a = t.OnGathered(Status::Timeout("rank 3 did not contribute"), 5, 5);
  ASSERT_EQ(a.kind, SettleActionKind::kFailed);
  EXPECT_EQ(a.status.message(), "gathering the members' maps: rank 3 did not contribute");
}

// A round with no member's step (only joiners contributed: the members ended serving or were
// lost before taking them in) fails at once, saying so.
TEST(SettleTest, ARoundOfJoinersOnlyFailsSayingTheMembersAreGone) {
  Settle s;
  s.Start();
  const SettleAction a = s.OnGathered(SettleRound{.step = -1, .all_placed = false}, 5, 5);
  ASSERT_EQ(a.kind, SettleActionKind::kFailed);
  EXPECT_EQ(a.status.code(), Code::kUnavailable);
  EXPECT_EQ(a.status.message(),
            "no member said which step it is at: every rank in the round is joining (the "
            "members ended serving, or were lost, before taking this rank in)");
}

}  // namespace
}  // namespace eplbx::internal
