// WorkTurns (src/cli/work_turns.h): how the rank processes of `eplbx demo --serve` time their
// expert work together. The waiting rule alone, random worlds of it, and real processes.
#include "cli/work_turns.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <random>
#include <vector>

namespace eplbx::cli {
namespace {

constexpr int64_t kStale = 200'000'000;
constexpr int64_t kNot = WorkTurns::kNotServing, kDone = WorkTurns::kDone;

bool Waits(std::vector<int64_t> at, int me, int64_t index, int64_t now,
           std::vector<PeerSeen>* seen) {
  return MeetingWaits(at, *seen, me, index, now, kStale);
}

TEST(WorkTurnsTest, ARankWaitsForEveryServingRankBehindItUntilItGoesStale) {
  std::vector<PeerSeen> seen(4);
  // Rank 0 at layer 5: rank 1 is behind, rank 2 at it, rank 3 ahead.
  EXPECT_TRUE(Waits({5, 4, 5, 6}, 0, 5, 0, &seen));
  EXPECT_FALSE(Waits({5, 5, 5, 6}, 0, 5, 1, &seen));
  // Not serving yet, or done (finished, left): nobody waits for it.
  EXPECT_FALSE(Waits({5, kNot, 5, kDone}, 0, 5, 2, &seen));
  // A rank behind that moved recently is waited for; one that has not moved for kStale
  // (killed, stopped, or inside a long Step) is not, until it moves again.
  seen.assign(4, {});
  EXPECT_TRUE(Waits({5, 3, 5, 5}, 0, 5, 1'000, &seen));
  EXPECT_TRUE(Waits({5, 3, 5, 5}, 0, 5, 1'000 + kStale - 1, &seen));
  EXPECT_FALSE(Waits({5, 3, 5, 5}, 0, 5, 1'000 + kStale, &seen));
  EXPECT_FALSE(Waits({5, 3, 5, 5}, 0, 5, 1'000 + 10 * kStale, &seen));
  EXPECT_TRUE(Waits({5, 4, 5, 5}, 0, 5, 1'000 + 10 * kStale + 1, &seen));
  // The rank itself never counts, whatever its own entry says.
  EXPECT_FALSE(Waits({2, 5, 5, 5}, 0, 5, 0, &seen));
}

// Random worlds: ranks step through layers under the rule, some killed, some slowed for
// longer than kStale (a recovery inside a Step), on a virtual clock. Every rank left alive
// finishes (nothing waits forever), and a rank starts a layer only after every other rank
// that moved within kStale (as it saw them) got to it.
TEST(WorkTurnsTest, RandomWorldsFinishAndMeetAtEveryLayer) {
  std::mt19937_64 rng(34);
  for (int world = 0; world < 2000; ++world) {
    const int n = 2 + static_cast<int>(rng() % 7);
    const int64_t layers = 5 + static_cast<int64_t>(rng() % 40);
    std::vector<int64_t> at(n, kNot);       // what the shared WorkTurns holds
    std::vector<int64_t> next(n, 0);        // the layer each rank works on next
    std::vector<int64_t> busy_until(n, 0);  // virtual time its work (or a stall) ends
    std::vector<bool> dead(n, false);
    std::vector<std::vector<PeerSeen>> seen(n, std::vector<PeerSeen>(n));
    const int victim = rng() % 3 == 0 ? static_cast<int>(rng() % n) : -1;
    const int64_t victim_layer = static_cast<int64_t>(rng() % layers);
    int64_t now = 0;
    for (int guard = 0; guard < 1'000'000; ++guard) {
      bool all_done = true;
      for (int r = 0; r < n; ++r) all_done = all_done && (dead[r] || at[r] == kDone);
      if (all_done) break;
      const int r = static_cast<int>(rng() % n);
      if (dead[r] || at[r] == kDone || now < busy_until[r]) {
        now += 1 + static_cast<int64_t>(rng() % 2'000'000);  // up to 2 ms pass
        continue;
      }
      if (r == victim && next[r] == victim_layer) {  // killed: its `at` stays where it was
        dead[r] = true;
        continue;
      }
      if (next[r] == layers) {
        at[r] = kDone;
        continue;
      }
      at[r] = next[r];  // Begin: announce the layer
      if (Waits(at, r, next[r], now, &seen[r])) {
        now += 1 + static_cast<int64_t>(rng() % 1'000'000);
        continue;
      }
      // Starts layer next[r]: every other rank is at it or past it, done, not serving, or has
      // not moved within kStale.
      for (int q = 0; q < n; ++q) {
        if (q == r || at[q] == kNot || at[q] == kDone || at[q] >= next[r]) continue;
        ASSERT_GE(now - seen[r][q].since_ns, kStale)
            << "world " << world << ": rank " << r << " started layer " << next[r] << " while rank "
            << q << " (at " << at[q] << ") was live and behind";
      }
      // Its work takes a few ms; now and then a stall far past kStale.
      busy_until[r] =
          now + (rng() % 50 == 0 ? 3 * kStale : 1 + static_cast<int64_t>(rng() % 4'000'000));
      ++next[r];
    }
    for (int r = 0; r < n; ++r) {
      ASSERT_TRUE(dead[r] || at[r] == kDone)
          << "world " << world << ": rank " << r << " never finished (at " << at[r] << ")";
    }
  }
}

// What the children record, in shared memory: for each rank and layer, when it announced the
// layer, when it got the turn and when it gave it back.
struct Log {
  static constexpr int kRanks = 4, kLayers = 120;
  std::atomic<int> arrived;  // the start barrier
  int64_t announced[kRanks][kLayers];
  int64_t started[kRanks][kLayers];
  int64_t ended[kRanks][kLayers];
};

// Real processes, one WorkTurns: `kill_rank` (if >= 0) dies at `kill_layer` without a word.
void RunRanks(Log* log, int kill_rank, int kill_layer) {
  Result<WorkTurns*> turns = CreateWorkTurns();
  ASSERT_TRUE(turns.ok()) << turns.status().message();
  std::vector<pid_t> kids;
  for (int r = 0; r < Log::kRanks; ++r) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      Meeting meeting(*turns, r, Log::kRanks, /*meet=*/true);
      // As the demo's ranks do: say where it starts, then a barrier (a child forked late would
      // otherwise not be serving yet, so not waited for, while the others ran ahead).
      log->announced[r][0] = MonotonicNs();
      meeting.Arrive(0);
      log->arrived.fetch_add(1);
      while (log->arrived.load() < Log::kRanks) usleep(100);
      for (int l = 0; l < Log::kLayers; ++l) {
        if (r == kill_rank && l == kill_layer) _exit(0);
        if (l > 0) log->announced[r][l] = MonotonicNs();
        meeting.Begin(l);
        log->started[r][l] = MonotonicNs();
        // Work of uneven length: rank r takes (r + 1) x 0.2 ms, layer by layer.
        const int64_t until = MonotonicNs() + (r + 1) * 200'000;
        while (MonotonicNs() < until) {
        }
        log->ended[r][l] = MonotonicNs();
        meeting.End();
        if (r == 0 && l % 7 == 0) usleep(1'000);  // a rank that dawdles between layers
      }
      meeting.Leave();
      _exit(0);
    }
    kids.push_back(pid);
  }
  for (pid_t pid : kids) {
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
}

Log* SharedLog() {
  void* p = mmap(nullptr, sizeof(Log), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  EXPECT_NE(p, MAP_FAILED);
  return new (p) Log{};
}

TEST(WorkTurnsTest, RanksTakeTurnsAndMeetAtEveryLayer) {
  Log* log = SharedLog();
  RunRanks(log, -1, -1);
  for (int l = 0; l < Log::kLayers; ++l) {
    for (int r = 0; r < Log::kRanks; ++r) {
      for (int q = 0; q < Log::kRanks; ++q) {
        if (q == r) continue;
        // Nobody starts a layer before every rank announced it (the meeting)...
        EXPECT_GE(log->started[r][l], log->announced[q][l]) << "rank " << r << " layer " << l;
        // ...nor works beside another rank (the turn).
        for (int m = 0; m < Log::kLayers; ++m) {
          const bool apart =
              log->ended[r][l] <= log->started[q][m] || log->ended[q][m] <= log->started[r][l];
          ASSERT_TRUE(apart) << "rank " << r << " layer " << l << " and rank " << q << " layer "
                             << m << " worked at the same time";
        }
      }
    }
  }
  munmap(log, sizeof(Log));
}

TEST(WorkTurnsTest, ARankKilledMidwayHoldsTheOthersOnlyUntilItIsStale) {
  Log* log = SharedLog();
  RunRanks(log, 2, 40);
  // The survivors finished every layer, after waiting for the dead rank at the layer it
  // never announced (up to kStale after they last saw it move).
  for (int r : {0, 1, 3}) EXPECT_GT(log->ended[r][Log::kLayers - 1], 0) << "rank " << r;
  int64_t longest = 0;
  for (int r : {0, 1, 3}) {
    for (int l = 0; l < Log::kLayers; ++l)
      longest = std::max(longest, log->started[r][l] - log->announced[r][l]);
  }
  EXPECT_GE(longest, Meeting::kStaleNs / 2);
  munmap(log, sizeof(Log));
}

}  // namespace
}  // namespace eplbx::cli
