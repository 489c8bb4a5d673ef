// Internal: the coordinator's rounds and membership as a pure state machine
// (ServeSocketBootstrap drives it over sockets; docs/deploy.md, "Membership and epochs").
// Events in: a process joining for a rank, a connection ending, a frame from a rank, time
// passing. Out: the frames to send (in order), the ranks lost, the messages to hand on. It
// never reads, writes, sleeps or closes anything, so every path is tested over thousands of
// random worlds (coordinator_test).
//
// Rules. Without membership every rank must contribute to every round; a rank that leaves
// fails the round in progress. With membership the group starts at epoch 1 with the ranks
// that have a connection: a member that leaves or misses a round's timeout is lost (the
// epoch goes up by one, the round in progress fails for everyone in it with the new epoch
// and member set); a contribution at another epoch is refused with the current one; a
// process taken in for a rank that is no member asks to join with its first contribution
// (the epoch goes up, the round in progress fails, its contribution is refused so that it
// contributes again at the new epoch with the members); a lost rank is not heard any more
// ("rejoin as a new member"). A round completes when every member contributed.
#ifndef EPLBX_SRC_BOOTSTRAP_COORDINATOR_H_
#define EPLBX_SRC_BOOTSTRAP_COORDINATOR_H_

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/bytes.h"

namespace eplbx::internal {

struct CoordinatorSend {
  size_t rank = 0;
  uint8_t type = 0;  // a FrameType
  std::string body;
};

class CoordinatorCore {
 public:
  using Clock = std::chrono::steady_clock;

  // `open[r]`: rank r has a connection at the start (with membership: it is a member).
  CoordinatorCore(std::vector<bool> open, bool membership, std::chrono::milliseconds round_timeout);

  // A new process for `rank`: "" when it is taken in (its connection replaces any old one of
  // a rank declared lost), else why not (send it kFailed and close it).
  std::string Join(size_t rank);
  // `rank`'s connection ended (EOF, error).
  void Closed(size_t rank);
  // A frame from `rank` (kContributeAt and kMessage count; others are ignored).
  void Frame(size_t rank, uint8_t type, std::string body);
  // Time passes: a round open for longer than the round timeout fails, naming the late.
  void Tick(Clock::time_point now);

  // What to do since the last call, in order.
  std::vector<CoordinatorSend> TakeSends() { return std::exchange(sends_, {}); }
  std::vector<uint32_t> TakeLost() { return std::exchange(lost_, {}); }
  std::vector<std::pair<uint32_t, std::string>> TakeMessages() {
    return std::exchange(messages_, {});
  }

  bool open(size_t rank) const { return open_[rank]; }
  size_t open_count() const { return open_count_; }
  uint64_t epoch() const { return epoch_; }
  const std::vector<bool>& members() const { return member_; }
  bool pending() const;  // a round is in progress

 private:
  void Refuse(size_t rank, const std::string& why);
  void FailRound(const std::string& why);
  void DeclareLost(size_t rank, const std::string& why);
  void CompleteRound();
  void Contribute(size_t rank, std::string body);
  void Shut(size_t rank);  // not heard any more

  size_t n_;
  bool membership_;
  std::chrono::milliseconds round_timeout_;
  std::vector<bool> open_;
  size_t open_count_ = 0;
  uint64_t epoch_ = 1;
  std::vector<bool> member_, joining_;
  std::vector<uint64_t> lost_at_;
  std::vector<std::optional<std::string>> round_;
  Clock::time_point round_started_{};
  std::vector<CoordinatorSend> sends_;
  std::vector<uint32_t> lost_;
  std::vector<std::pair<uint32_t, std::string>> messages_;
};

// [u64 epoch][u32 n][u8 member] x n: the membership head of kGatheredAt and kRefused.
void WriteMembership(ByteWriter& w, uint64_t epoch, const std::vector<bool>& members);
// "0, 1, 3" ("none")
std::string MemberList(const std::vector<bool>& members);

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_BOOTSTRAP_COORDINATOR_H_
