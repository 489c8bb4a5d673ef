// Internal: how the rank processes of one `eplbx demo --serve` time their expert work
// together (serve_mode.cc): a turn each, and a meeting at every layer. Not installed.
#ifndef EPLBX_SRC_CLI_WORK_TURNS_H_
#define EPLBX_SRC_CLI_WORK_TURNS_H_

#include <semaphore.h>

#include <atomic>
#include <cstdint>
#include <span>
#include <vector>

#include "eplbx/status.h"

namespace eplbx::cli {

int64_t MonotonicNs();  // CLOCK_MONOTONIC: the same clock in every process

// What the rank processes of one `eplbx demo --serve` share to time their expert work (the
// demo maps it before forking; none for `eplbx worker --serve`, whose ranks may be on other
// hosts). Ranks work one at a time (`turn`), so that a rank's CPU time is not inflated by its
// core sibling; and they work on each layer of a step close together in time, as an engine's
// ranks do (the layer's all-to-all waits for every rank): before a layer a rank waits until
// every rank still serving has got to it (`MeetingWaits`). This machine's speed drifts by
// several percent over tens of milliseconds (docs/perf.md): ranks left to drift apart (they
// were a second apart, several steps) each met a different spell, and the slowest rank of a
// layer, which the step model takes, was slow by chance more than by load.
struct WorkTurns {
  static constexpr int kMaxRanks = 64;
  static constexpr int64_t kNotServing = -1;   // not started yet, or restarted and not in yet
  static constexpr int64_t kDone = INT64_MAX;  // finished, or left: nobody waits for it
  sem_t turn;                                  // value 1
  std::atomic<uint32_t> moved;                 // bumped (and woken on) whenever an `at` moves
  std::atomic<int64_t> at[kMaxRanks];          // each rank's layer (LayerIndex), or the above
};
static_assert(std::atomic<int64_t>::is_always_lock_free &&
                  std::atomic<uint32_t>::is_always_lock_free,
              "WorkTurns is shared between processes");

// A new WorkTurns in memory shared with the processes forked after (every rank kNotServing).
Result<WorkTurns*> CreateWorkTurns();

// A running index of the layers a rank works on: step, then mode, then layer.
inline int64_t LayerIndex(int step, int mode, int modes, int layer, int layers) {
  return (static_cast<int64_t>(step) * modes + mode) * layers + layer;
}

// What a rank last read of another's `at`, and when it first read that value.
struct PeerSeen {
  int64_t at = WorkTurns::kNotServing;
  int64_t since_ns = 0;
};

// Whether rank `me`, about to work on layer `index`, waits (pure: `at` as read at `now_ns`;
// `seen`, one entry per rank, is brought up to date). It waits for a rank that serves
// (neither kNotServing nor kDone) and is behind `index`, unless that rank's `at` has not moved
// for `stale_ns`: a rank killed or stopped never moves again, and one slowed down for that
// long (a recovery inside its Step) is worked beside rather than waited for. Waiting only
// moves the work's timing closer; it never decides anything, so it must never hang.
bool MeetingWaits(std::span<const int64_t> at, std::span<PeerSeen> seen, int me, int64_t index,
                  int64_t now_ns, int64_t stale_ns);

// This rank's part in WorkTurns. `Arrive` says which layer the rank will work on first,
// without waiting (before the ranks' start barrier, so that nobody starts without it).
// `Begin` sets its `at` to the layer it is about to work on, waits until it may (MeetingWaits,
// blocked on `moved` between looks, at most 10 ms), then for its turn (at most kStaleNs: a
// rank killed inside its turn never gives it back). `End` gives the turn back; `Leave` marks
// the rank done (it serves no more). Without `meet`, Begin only waits for the turn.
class Meeting {
 public:
  // Stale after 200 ms (a layer takes a few milliseconds a rank).
  static constexpr int64_t kStaleNs = 200'000'000;
  Meeting(WorkTurns* turns, int rank, int ranks, bool meet);
  void Arrive(int64_t index);
  void Begin(int64_t index);
  void End();
  void Leave();

 private:
  void Set(int64_t value);
  WorkTurns* turns_;
  int rank_;
  bool meet_;
  bool have_turn_ = false;
  std::vector<PeerSeen> seen_;
  std::vector<int64_t> at_;
};

}  // namespace eplbx::cli

#endif  // EPLBX_SRC_CLI_WORK_TURNS_H_
