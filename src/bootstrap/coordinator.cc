// The coordinator's rounds and membership, sans I/O. See coordinator.h.
#include "bootstrap/coordinator.h"

#include <algorithm>

#include "bootstrap/frames.h"
#include "common/strings.h"

namespace eplbx::internal {

void WriteMembership(ByteWriter& w, uint64_t epoch, const std::vector<bool>& members) {
  w.U64(epoch);
  w.U32(static_cast<uint32_t>(members.size()));
  for (bool m : members) w.U8(m ? 1 : 0);
}

std::string MemberList(const std::vector<bool>& members) {
  std::string out;
  for (size_t i = 0; i < members.size(); ++i) {
    if (members[i]) out += StrCat(out.empty() ? "" : ", ", i);
  }
  return out.empty() ? "none" : out;
}

CoordinatorCore::CoordinatorCore(std::vector<bool> open, bool membership,
                                 std::chrono::milliseconds round_timeout)
    : n_(open.size()),
      membership_(membership),
      round_timeout_(round_timeout),
      open_(std::move(open)),
      member_(open_),
      joining_(n_, false),
      lost_at_(n_, 0),
      round_(n_) {
  open_count_ = static_cast<size_t>(std::count(open_.begin(), open_.end(), true));
}

bool CoordinatorCore::pending() const {
  return std::any_of(round_.begin(), round_.end(), [](const auto& c) { return c.has_value(); });
}

void CoordinatorCore::Shut(size_t rank) {
  if (!open_[rank]) return;
  open_[rank] = false;
  --open_count_;
}

std::string CoordinatorCore::Join(size_t rank) {
  if (!membership_) return "this coordinator does not track membership: no rank can join";
  if (rank >= n_) return StrCat("rank ", rank, " cannot join a group of ", n_, " ranks");
  if (member_[rank] || joining_[rank]) {
    return StrCat("rank ", rank, " cannot join: it is ", member_[rank] ? "a member" : "joining",
                  " already (two processes for one rank?)");
  }
  Shut(rank);  // the connection of a rank declared lost: not heard any more
  open_[rank] = true;
  ++open_count_;
  joining_[rank] = true;
  return "";
}

void CoordinatorCore::Refuse(size_t rank, const std::string& why) {
  ByteWriter w;
  WriteMembership(w, epoch_, member_);
  w.Str32(why);
  sends_.push_back({rank, kRefused, w.Take()});
}

void CoordinatorCore::FailRound(const std::string& why) {
  for (size_t i = 0; i < n_; ++i) {
    if (open_[i] && round_[i]) {
      if (membership_) {
        Refuse(i, why);
      } else {
        sends_.push_back({i, kFailed, why});
      }
    }
    round_[i].reset();
  }
}

// With membership: `rank` is out from the next epoch on; the round in progress fails for the
// members in it, with the new epoch and member set.
void CoordinatorCore::DeclareLost(size_t rank, const std::string& why) {
  lost_.push_back(static_cast<uint32_t>(rank));
  if (!member_[rank]) return;
  member_[rank] = false;
  lost_at_[rank] = ++epoch_;
  round_[rank].reset();
  FailRound(StrCat(why, ": epoch ", epoch_, ", members ", MemberList(member_)));
}

void CoordinatorCore::CompleteRound() {
  for (size_t j = 0; j < n_; ++j) {
    if ((!membership_ || member_[j]) && !round_[j]) return;
  }
  if (!pending()) return;  // (nobody contributed: no round)
  ByteWriter w;
  if (membership_) WriteMembership(w, epoch_, member_);
  w.U32(static_cast<uint32_t>(n_));
  for (auto& c : round_) w.Str32(c ? *c : std::string());
  const std::string all = w.Take();
  for (size_t j = 0; j < n_; ++j) {
    if (open_[j] && round_[j]) sends_.push_back({j, membership_ ? kGatheredAt : kGathered, all});
    round_[j].reset();
  }
  round_started_ = {};
}

void CoordinatorCore::Closed(size_t rank) {
  Shut(rank);
  if (joining_[rank]) {  // went before it asked to join: it never was a member
    joining_[rank] = false;
    return;
  }
  if (membership_) {
    DeclareLost(rank, StrCat("rank ", rank, " left"));
    CompleteRound();
    return;
  }
  lost_.push_back(static_cast<uint32_t>(rank));
  if (pending()) FailRound(StrCat("rank ", rank, " left before the all-gather completed"));
}

void CoordinatorCore::Frame(size_t rank, uint8_t type, std::string body) {
  if (joining_[rank] && type == kContributeAt) {
    // Asks to join: a member from a new epoch; everyone contributes again at it.
    joining_[rank] = false;
    member_[rank] = true;
    ++epoch_;
    const std::string members = MemberList(member_);
    FailRound(StrCat("rank ", rank, " joined: epoch ", epoch_, ", members ", members));
    Refuse(rank, StrCat("rank ", rank, " joined at epoch ", epoch_, " (members ", members,
                        "): contribute again at this epoch"));
    return;
  }
  if (membership_ && !member_[rank] && !joining_[rank]) {
    // Declared lost (it missed a round, stopped): it is not heard any more.
    sends_.push_back({rank, kFailed,
                      StrCat("rank ", rank, " was declared lost at epoch ", lost_at_[rank],
                             " (the group is at epoch ", epoch_, ", members ", MemberList(member_),
                             "): rejoin as a new member")});
    Shut(rank);
    return;
  }
  if (type == kMessage) {
    messages_.push_back({static_cast<uint32_t>(rank), std::move(body)});
    return;
  }
  if (type == kContributeAt) Contribute(rank, std::move(body));
}

void CoordinatorCore::Contribute(size_t rank, std::string body) {
  ByteReader at(body, "contribution");
  uint64_t their = 0;
  if (!at.U64("epoch", &their)) return;
  if (membership_ && their != epoch_) {
    Refuse(rank, StrCat("rank ", rank, " contributed at epoch ", their, "; the group is at epoch ",
                        epoch_, " (members ", MemberList(member_),
                        "): learn the member set and contribute again"));
    return;
  }
  body.erase(0, 8);
  round_[rank] = std::move(body);
  if (!membership_) {
    // A rank that already left can never contribute.
    for (size_t j = 0; j < n_; ++j) {
      if (!open_[j] && !round_[j]) {
        FailRound(StrCat("rank ", j, " left before the all-gather completed"));
        return;
      }
    }
  }
  CompleteRound();
}

void CoordinatorCore::Tick(Clock::time_point now) {
  if (!pending()) {
    round_started_ = {};
    return;
  }
  if (round_started_ == Clock::time_point{}) round_started_ = now;
  if (round_timeout_.count() <= 0 || now - round_started_ < round_timeout_) return;
  std::string missing;
  std::vector<size_t> late;
  for (size_t i = 0; i < n_; ++i) {
    if (round_[i] || (membership_ && !member_[i])) continue;
    missing += StrCat(missing.empty() ? "" : ", ", "rank ", i);
    late.push_back(i);
  }
  const std::string why =
      StrCat(missing, " did not join the all-gather within ", round_timeout_.count(), " ms");
  for (size_t i : late) lost_.push_back(static_cast<uint32_t>(i));
  if (membership_) {
    // Every late rank is out; the survivors hear of it once, at the last epoch.
    for (size_t i : late) {
      member_[i] = false;
      lost_at_[i] = epoch_ + 1;
    }
    ++epoch_;
    FailRound(StrCat(why, ": epoch ", epoch_, ", members ", MemberList(member_)));
  } else {
    FailRound(why);
  }
  round_started_ = {};
}

}  // namespace eplbx::internal
