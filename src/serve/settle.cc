#include "serve/settle.h"

#include "common/strings.h"

namespace eplbx::internal {

SettleAction Settle::Start() {
  placements_ = 0;
  gathers_in_a_row_ = 0;
  placed_at_ = tried_at_ = 0;
  last_ = Status::OK();
  restarts_.clear();
  finished_ = false;
  return Gather();
}

SettleAction Settle::Gather() {
  SettleAction a;
  a.kind = SettleActionKind::kGather;
  a.placed_at = placed_at_;
  return a;
}

SettleAction Settle::Fail(Status s) {
  finished_ = true;
  SettleAction a;
  a.kind = SettleActionKind::kFailed;
  a.status = std::move(s);
  return a;
}

SettleAction Settle::OnGathered(const Result<SettleRound>& round, uint64_t epoch_before,
                                uint64_t epoch) {
  if (finished_) return Fail(Status::Internal("settling already ended"));
  if (!round.ok()) {
    // A round refused because the member set moved: learn it, contribute again.
    if (epoch != epoch_before && ++gathers_in_a_row_ < kMaxGathers) return Gather();
    return Fail(round.status().WithPrefix("gathering the members' maps"));
  }
  gathers_in_a_row_ = 0;
  if (round->step < 0) {
    // Only joiners contributed: the members ended serving (or were lost) before taking them in.
    return Fail(Status::Unavailable(
        "no member said which step it is at: every rank in the round is joining (the members "
        "ended serving, or were lost, before taking this rank in)"));
  }
  if (round->all_placed && round->placed_at == epoch) {
    finished_ = true;
    SettleAction a;
    a.kind = SettleActionKind::kDone;
    a.step = round->step;
    a.epoch = epoch;
    return a;
  }
  if (placements_ > 0 && epoch == tried_at_) {
    // Nobody was lost, yet a placement failed somewhere: going again would not help.
    return Fail(Status::Internal(
        StrCat("placing over the members failed on ", round->not_placed, " with no member lost",
               last_.ok() ? "" : StrCat(" (here: ", last_.message(), ")"))));
  }
  if (placements_ == max_placements_) {
    return Fail(Status::Aborted(StrCat("the member set changed during each of ", placements_,
                                       " placements over the members (now epoch ", epoch, ")")));
  }
  if (placements_ > 0) {
    restarts_.push_back(
        StrCat("epoch ", tried_at_, " -> ", epoch, ": ",
               last_.ok() ? std::string("placed here, not everywhere") : last_.message()));
  }
  ++placements_;
  placed_at_ = 0;
  tried_at_ = epoch;
  SettleAction a;
  a.kind = SettleActionKind::kPlace;
  a.step = round->step;
  a.epoch = epoch;
  return a;
}

SettleAction Settle::OnPlaced(const Status& placed, uint64_t epoch) {
  if (finished_) return Fail(Status::Internal("settling already ended"));
  last_ = placed;
  // Placed at the epoch it began at only: a member lost meanwhile moved the epoch, and the
  // next round goes again from what each member's slots hold then.
  placed_at_ = placed.ok() && epoch == tried_at_ ? tried_at_ : 0;
  return Gather();
}

}  // namespace eplbx::internal
