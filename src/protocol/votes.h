// Internal: the votes of one asynchronous rearrangement (docs/protocol.md, "Asynchronous
// commits"), as pure state: it takes VOTE records and this rank's state, and says which
// vote to send, what a Commit() applies and whether one is due; it never blocks or sends,
// so the rule is tested over thousands of random worlds (tests/unit/votes_test.cc).
//
// The rule. At Commit() number s a rank sends VOTE(s, n, failed?) — n leading layers ready
// here (the rearranger's meaning: this rank vouches for the layer, its DONE sent and every
// rank's maps matched; src/rearrange/pipeline.cc) — to every member, then applies the layers
// that every member's VOTE(s - 1) says are ready. Two exceptions send no vote: when the
// votes of s - 1 already end the rearrangement (every one says every layer is ready, or one
// says its rank failed), and after this rank's *final* vote (every layer ready, not failed).
// Readiness never goes back, so a final vote stands as that rank's vote of every later
// step: the last rank to be ready applies at its next Commit() without waiting for a round
// of the others' votes back.
#ifndef EPLBX_SRC_PROTOCOL_VOTES_H_
#define EPLBX_SRC_PROTOCOL_VOTES_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "protocol/records.h"

namespace eplbx::protocol {

// Whether rank r is a member in a bootstrap's members() (ranks past its end are: a bootstrap
// without membership says nothing of them).
inline bool IsMember(const std::vector<bool>& members, uint32_t r) {
  return r >= members.size() || members[r];
}

class Votes {
 public:
  // Rearrangement `id` (the same on every rank) of `layers` layers, among `world` ranks.
  Votes(uint64_t id, uint32_t layers, uint32_t world, uint32_t self);

  uint64_t id() const { return id_; }
  // Keeps rank `from`'s VOTE (its generation is the rearrangement's id, its layer the step);
  // a vote of an earlier rearrangement, or a duplicate, changes nothing. Votes of a later
  // rearrangement (a faster peer began it) are kept for it: TakeLater.
  void Take(uint32_t from, const Record& vote);
  // The votes of rearrangements after this one's, kept by `earlier`.
  void TakeLater(Votes& earlier);
  // Forgets the votes of this rearrangement's steps before `step` (after a Commit() number s
  // no rule reads a vote before s - 1 again), keeping each rank's final vote among them, which
  // stands for every later step, and whether one said its rank failed: what is kept grows
  // with how far peers vote ahead, not with the steps a rearrangement takes. A vote of a
  // forgotten step that comes later changes nothing unless it is final or failed.
  void Forget(int64_t step);
  // Steps kept, of this rearrangement and later ones (for tests).
  size_t kept() const { return votes_.size(); }

  // Whether `vote` is final: every layer ready, not failed.
  bool Final(const Record& vote) const { return vote.expert >= layers_ && vote.reader == 0; }
  // Rank r's vote of `step`: the one it sent at that step, else its final vote of an earlier
  // step; nullptr while neither is here.
  const Record* Of(int64_t step, uint32_t r) const;
  // Every member's vote of `step` is here, and they end the rearrangement.
  bool End(int64_t step, const std::vector<bool>& members) const;
  // The lowest member whose vote of `step` is not here; -1 when all are.
  int Missing(int64_t step, const std::vector<bool>& members) const;

  // This rank's vote at Commit() number `step` (`ready` leading layers ready here; a
  // non-empty `failure` says this rank failed): the record to send to every other member,
  // also kept as this rank's; nullopt when none is sent (see the rule above).
  std::optional<Record> Cast(int64_t step, uint32_t ready, std::string_view failure, uint64_t epoch,
                             const std::vector<bool>& members);

  // What Commit() number `step` applies, once Missing(step - 1) is -1: the leading layers
  // every member's vote of step - 1 says are ready, and the first vote (lowest rank) that
  // says its rank failed (nullptr: none).
  struct Outcome {
    uint32_t ready = 0;
    const Record* failed = nullptr;
  };
  Outcome Agreed(int64_t step, const std::vector<bool>& members) const;

  // Whether a Commit() is due on the votes alone: one applies a layer beyond `applied`, a
  // rank failed, or a member voted a step whose Commit() waits for this rank's vote.
  bool Due(uint32_t applied, const std::vector<bool>& members) const;

  int64_t vote_sent() const { return vote_sent_; }       // 0: none yet
  uint32_t voted_ready() const { return voted_ready_; }  // what that vote said
  bool final_sent() const { return final_sent_ != 0; }

 private:
  uint64_t id_;
  uint32_t layers_, world_, self_;
  // By (rearrangement, step), per rank.
  std::map<std::pair<uint64_t, int64_t>, std::vector<std::optional<Record>>> votes_;
  // Forget: steps before `floor_` are gone; each rank's final vote among them, and its step.
  int64_t floor_ = 0;
  std::vector<std::optional<Record>> finals_;
  std::vector<int64_t> final_step_;
  bool forgotten_failure_ = false;  // a vote that said its rank failed was among them
  int64_t vote_sent_ = 0, final_sent_ = 0;
  uint32_t voted_ready_ = 0;
};

}  // namespace eplbx::protocol

#endif  // EPLBX_SRC_PROTOCOL_VOTES_H_
