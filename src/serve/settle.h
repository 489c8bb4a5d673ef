// Internal: how one member settles the group after its member set changed, as a pure state
// machine (docs/architecture.md, "Serving: ServingGroup"). It takes events (a round of the
// members' maps gathered or refused, a placement over the members done or failed) with the
// epoch this member is at, and says what to do next; it never blocks, sends or moves a
// byte, so every path is tested over thousands of random worlds (settle_test).
//
// The protocol. Every member (a joiner included) runs rounds of: gather every member's map
// (the step it is at, the epoch its last placement over the members succeeded at, what its
// own slots hold); if the round shows every member placed at the epoch this member is at,
// the group is settled; else place over the members from the maps (a deterministic plan
// from the same round: every member places the same way) and gather again. A gather refused
// because the member set moved is tried again (at most kMaxGathers in a row); a placement
// that failed with nobody lost since it began fails the settling on every member (they all
// see the same round); a member set that moves during each of `max_placements` placements
// aborts it. Every member ends at the same epoch with the same placement, or every member
// says why not.
#ifndef EPLBX_SRC_SERVE_SETTLE_H_
#define EPLBX_SRC_SERVE_SETTLE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "eplbx/status.h"

namespace eplbx::internal {

// What a gathered round said (DecodeMembersRound's summary).
struct SettleRound {
  int step = -1;            // the members' step (-1: no member said one)
  bool all_placed = false;  // every member placed, all at `placed_at`
  uint64_t placed_at = 0;
  std::string not_placed;  // "rank 2, 3"
};

enum class SettleActionKind {
  kGather,  // contribute this member's map (with `placed_at`) to a round; report OnGathered
  kPlace,   // rebuild over the members at this epoch and place from the last round; OnPlaced
  kDone,    // settled: serve on from `step` at `epoch`
  kFailed,  // give up: `status` says why (every member gives up the same way)
};

struct SettleAction {
  SettleActionKind kind = SettleActionKind::kGather;
  uint64_t placed_at = 0;  // kGather: what to contribute
  int step = -1;           // kPlace / kDone: the members' step
  uint64_t epoch = 0;      // kPlace: the epoch placed at; kDone: the epoch settled at
  Status status;           // kFailed
};

class Settle {
 public:
  static constexpr int kMaxGathers = 6;  // gathers in a row refused by a moving member set

  // `max_placements` >= 1: placements over a moving member set before giving up.
  explicit Settle(int max_placements = 4) : max_placements_(max_placements) {}

  // The first action: gather (placed at nothing yet).
  SettleAction Start();
  // A gather ended: `round` when it completed (ok), else why not; `epoch_before` / `epoch`:
  // this member's epoch when it contributed / now.
  SettleAction OnGathered(const Result<SettleRound>& round, uint64_t epoch_before, uint64_t epoch);
  // The placement of the last kPlace ended (`placed`), with this member now at `epoch`.
  SettleAction OnPlaced(const Status& placed, uint64_t epoch);

  int placements() const { return placements_; }
  // Why each placement after the first was needed ("epoch 3 -> 4: ...").
  const std::vector<std::string>& restarts() const { return restarts_; }
  bool finished() const { return finished_; }

 private:
  SettleAction Gather();
  SettleAction Fail(Status s);

  int max_placements_;
  int placements_ = 0;
  int gathers_in_a_row_ = 0;
  uint64_t placed_at_ = 0;  // the epoch the last placement succeeded at (0: none)
  uint64_t tried_at_ = 0;   // the epoch the last placement began at
  Status last_;             // how the last placement ended
  std::vector<std::string> restarts_;
  bool finished_ = false;
};

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_SERVE_SETTLE_H_
