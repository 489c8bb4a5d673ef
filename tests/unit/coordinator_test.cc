// The coordinator's rounds and membership (src/bootstrap/coordinator.h) over thousands of
// random worlds, without a socket: ranks contribute at the epoch they know, leave (their
// connection ends), stop (they miss rounds until the timeout), come back as new processes,
// send reports; time passes. Each world checks, after every event: the epoch never goes
// back and the member set changes only with it; a completed round went to exactly the
// members of the epoch it names, each of which contributed at that epoch, all with the same
// bytes; a refusal names the epoch in force; nothing is sent to a connection that ended.
// At the end (time past the round timeout) no member waits for an answer.
#include "bootstrap/coordinator.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "bootstrap/frames.h"
#include "common/bytes.h"

namespace eplbx::internal {
namespace {

using Clock = CoordinatorCore::Clock;

struct Proc {
  bool alive = true;     // its connection is open
  bool stopped = false;  // alive but silent (SIGSTOP)
  bool waiting = false;  // contributed, no answer yet
  uint64_t epoch = 1;
  int seq = 0;
};

std::string Contribution(uint64_t epoch, const std::string& payload) {
  ByteWriter w;
  w.U64(epoch);
  w.Raw(payload);
  return w.Take();
}

// The head of kGatheredAt / kRefused: epoch and member flags.
uint64_t EpochOf(const std::string& body, std::vector<bool>* members) {
  ByteReader r(body, "test");
  uint64_t epoch = 0;
  uint32_t n = 0;
  EXPECT_TRUE(r.U64("epoch", &epoch) && r.U32("n", &n));
  members->assign(n, false);
  for (uint32_t i = 0; i < n; ++i) {
    uint8_t m = 0;
    EXPECT_TRUE(r.U8("m", &m));
    (*members)[i] = m != 0;
  }
  return epoch;
}

TEST(CoordinatorTest, RoundsAndMembershipHoldInRandomWorlds) {
  int completed = 0, refused = 0, lost = 0, joined = 0;
  for (uint64_t seed = 1; seed <= 3000; ++seed) {
    std::mt19937_64 rng(seed);
    auto chance = [&](double p) { return std::uniform_real_distribution<double>(0, 1)(rng) < p; };
    const size_t n = 2 + rng() % 6;
    const auto timeout = std::chrono::milliseconds(100);
    CoordinatorCore core(std::vector<bool>(n, true), /*membership=*/true, timeout);
    std::vector<Proc> procs(n);
    Clock::time_point now{};
    uint64_t epoch = 1;
    std::vector<bool> members(n, true);
    const std::string where = "seed " + std::to_string(seed);
    // Carries out the core's sends, checking each.
    auto deliver = [&] {
      std::string result;  // the bytes of the round completed by this event (if any)
      std::vector<bool> got(n, false);
      for (const CoordinatorSend& s : core.TakeSends()) {
        Proc& p = procs[s.rank];
        ASSERT_TRUE(p.alive || s.type == kFailed) << where << ": a send to a closed rank";
        if (s.type == kGatheredAt) {
          std::vector<bool> m;
          const uint64_t e = EpochOf(s.body, &m);
          ASSERT_EQ(e, core.epoch()) << where;
          ASSERT_EQ(m, core.members()) << where;
          ASSERT_TRUE(p.waiting) << where << ": an answer nobody asked for";
          ASSERT_EQ(p.epoch, e) << where << ": rank " << s.rank << " contributed at another epoch";
          if (result.empty()) result = s.body;
          ASSERT_EQ(s.body, result) << where << ": members got different rounds";
          got[s.rank] = true;
          p.waiting = false;
        } else if (s.type == kRefused) {
          std::vector<bool> m;
          ASSERT_EQ(EpochOf(s.body, &m), core.epoch()) << where << ": a refusal names an old epoch";
          p.epoch = core.epoch();
          p.waiting = false;
          ++refused;
        } else if (s.type == kFailed) {
          p.alive = false;  // declared lost: it exits (it may come back as a new process)
          p.waiting = false;
        }
      }
      if (!result.empty()) {
        ++completed;
        for (size_t r = 0; r < n; ++r) {
          ASSERT_EQ(got[r], static_cast<bool>(core.members()[r]))
              << where << ": a round's result went to rank " << r << " (member "
              << core.members()[r] << ")";
        }
      }
      for (uint32_t r : core.TakeLost()) {
        (void)r;
        ++lost;
      }
      (void)core.TakeMessages();
      // The epoch never goes back; the member set moves only with it.
      ASSERT_GE(core.epoch(), epoch) << where;
      if (core.members() != members) {
        ASSERT_GT(core.epoch(), epoch) << where;
      }
      epoch = core.epoch();
      members = core.members();
    };
    for (int event = 0; event < 200; ++event) {
      const size_t r = rng() % n;
      Proc& p = procs[r];
      const double x = std::uniform_real_distribution<double>(0, 1)(rng);
      if (x < 0.55) {  // contribute (a live, running rank with no answer pending)
        if (p.alive && !p.stopped && !p.waiting) {
          p.waiting = true;
          core.Frame(r, kContributeAt,
                     Contribution(p.epoch, std::to_string(r) + ":" + std::to_string(p.seq++)));
        }
      } else if (x < 0.62) {  // a report
        if (p.alive && !p.stopped) core.Frame(r, kMessage, "report");
      } else if (x < 0.67) {  // its process dies
        if (p.alive) {
          p.alive = false;
          p.waiting = false;
          core.Closed(r);
        }
      } else if (x < 0.70) {  // it stops (SIGSTOP): silent until the round timeout
        if (p.alive) p.stopped = true;
      } else if (x < 0.76) {  // a new process for a rank that is gone
        if (!p.alive || (chance(0.2) && p.stopped)) {
          if (core.Join(r).empty()) {
            p = Proc{};
            p.epoch = 1;  // a new process knows no epoch yet
            ++joined;
          }
        } else if (core.members()[r]) {
          // A second process for a member is refused by name.
          ASSERT_NE(core.Join(r), "") << where;
        }
      } else {  // time passes
        now += std::chrono::milliseconds(rng() % 60);
        core.Tick(now);
      }
      deliver();
      if (HasFatalFailure()) return;
    }
    // Time past the round timeout: every member waiting was answered (or lost).
    for (int k = 0; k < 3; ++k) {
      now += timeout * 2;
      core.Tick(now);
      deliver();
      if (HasFatalFailure()) return;
    }
    for (size_t r = 0; r < n; ++r) {
      if (core.members()[r] && procs[r].alive && !procs[r].stopped) {
        EXPECT_FALSE(procs[r].waiting) << where << ": rank " << r << " waits for ever";
      }
    }
  }
  EXPECT_GT(completed, 10000);
  EXPECT_GT(refused, 1000);
  EXPECT_GT(lost, 1000);
  EXPECT_GT(joined, 1000);
}

// Without membership every rank contributes to every round and a rank that leaves fails the
// round for the others, by name.
TEST(CoordinatorTest, WithoutMembershipALeavingRankFailsTheRound) {
  CoordinatorCore core({true, true, true}, /*membership=*/false, std::chrono::milliseconds(0));
  core.Frame(0, kContributeAt, Contribution(1, "a"));
  EXPECT_TRUE(core.TakeSends().empty());
  core.Closed(2);
  std::vector<CoordinatorSend> sends = core.TakeSends();
  ASSERT_EQ(sends.size(), 1u);
  EXPECT_EQ(sends[0].rank, 0u);
  EXPECT_EQ(sends[0].type, kFailed);
  EXPECT_EQ(sends[0].body, "rank 2 left before the all-gather completed");
  EXPECT_EQ(core.Join(2), "this coordinator does not track membership: no rank can join");
}

}  // namespace
}  // namespace eplbx::internal
