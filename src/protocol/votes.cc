#include "protocol/votes.h"

#include <algorithm>

namespace eplbx::protocol {

Votes::Votes(uint64_t id, uint32_t layers, uint32_t world, uint32_t self)
    : id_(id), layers_(layers), world_(world), self_(self), finals_(world), final_step_(world, 0) {}

void Votes::Take(uint32_t from, const Record& vote) {
  if (vote.generation < id_ || from >= world_) return;
  const int64_t step = vote.layer;
  if (vote.generation == id_ && step < floor_) {  // a forgotten step: only a final vote counts
    if (Final(vote) && !finals_[from]) {
      finals_[from] = vote;
      final_step_[from] = step;
    }
    forgotten_failure_ = forgotten_failure_ || vote.reader != 0;
    return;
  }
  auto& v = votes_[{vote.generation, step}];
  v.resize(world_);
  if (!v[from]) v[from] = vote;  // a duplicate changes nothing
}

void Votes::Forget(int64_t step) {
  if (step <= floor_) return;
  for (auto it = votes_.lower_bound({id_, 0});
       it != votes_.end() && it->first.first == id_ && it->first.second < step;) {
    for (uint32_t r = 0; r < it->second.size() && r < world_; ++r) {
      const std::optional<Record>& v = it->second[r];
      if (v && Final(*v) && !finals_[r]) {
        finals_[r] = *v;
        final_step_[r] = it->first.second;
      }
      forgotten_failure_ = forgotten_failure_ || (v && v->reader != 0);
    }
    it = votes_.erase(it);
  }
  floor_ = step;
}

void Votes::TakeLater(Votes& earlier) {
  for (auto& [key, v] : earlier.votes_) {
    if (key.first < id_) continue;
    auto& mine = votes_[key];
    mine.resize(world_);
    for (uint32_t r = 0; r < v.size() && r < world_; ++r) {
      if (!mine[r]) mine[r] = std::move(v[r]);
    }
  }
}

const Record* Votes::Of(int64_t step, uint32_t r) const {
  auto it = votes_.find({id_, step});
  if (it != votes_.end() && r < it->second.size() && it->second[r]) return &*it->second[r];
  // A rank sends no vote after its final one, so at most one of its earlier votes is final.
  for (auto f = votes_.lower_bound({id_, 1});
       f != votes_.end() && f->first.first == id_ && f->first.second < step; ++f) {
    if (r < f->second.size() && f->second[r] && Final(*f->second[r])) return &*f->second[r];
  }
  if (r < world_ && finals_[r] && final_step_[r] < step) return &*finals_[r];
  return nullptr;
}

bool Votes::End(int64_t step, const std::vector<bool>& members) const {
  if (step < 1) return false;
  bool all_ready = true, failed = false;
  for (uint32_t r = 0; r < world_; ++r) {
    if (!IsMember(members, r)) continue;
    const Record* v = Of(step, r);
    if (v == nullptr) return false;
    all_ready = all_ready && v->expert >= layers_;
    failed = failed || v->reader != 0;
  }
  return all_ready || failed;
}

int Votes::Missing(int64_t step, const std::vector<bool>& members) const {
  for (uint32_t r = 0; r < world_; ++r) {
    if (IsMember(members, r) && Of(step, r) == nullptr) return static_cast<int>(r);
  }
  return -1;
}

std::optional<Record> Votes::Cast(int64_t step, uint32_t ready, std::string_view failure,
                                  uint64_t epoch, const std::vector<bool>& members) {
  if (final_sent_ != 0 || End(step - 1, members)) return std::nullopt;
  Record mine;
  mine.kind = RecordKind::kVote;
  mine.generation = id_;
  mine.epoch = epoch;
  mine.layer = static_cast<uint32_t>(step);
  mine.expert = std::min(ready, layers_);
  mine.source = self_;
  mine.reader = failure.empty() ? 0 : 1;
  mine.reason = std::string(failure.substr(0, kMaxReasonBytes));
  auto& v = votes_[{id_, step}];
  v.resize(world_);
  v[self_] = mine;
  vote_sent_ = step;
  voted_ready_ = mine.expert;
  if (Final(mine)) final_sent_ = step;
  return mine;
}

Votes::Outcome Votes::Agreed(int64_t step, const std::vector<bool>& members) const {
  Outcome out;
  out.ready = layers_;
  for (uint32_t r = 0; r < world_; ++r) {
    if (!IsMember(members, r)) continue;
    const Record* v = Of(step - 1, r);
    if (v == nullptr) return Outcome{};  // (not all here: nothing is agreed)
    out.ready = std::min(out.ready, v->expert);
    if (v->reader != 0 && out.failed == nullptr) out.failed = v;
  }
  return out;
}

bool Votes::Due(uint32_t applied, const std::vector<bool>& members) const {
  if (forgotten_failure_) return true;  // a rank failed: every rank ends
  // The latest vote known of every rank (by step, in order).
  std::vector<const Record*> latest(world_, nullptr);
  for (uint32_t r = 0; r < world_; ++r) {  // a final vote among the forgotten steps
    if (finals_[r]) latest[r] = &*finals_[r];
  }
  for (auto it = votes_.lower_bound({id_, 0}); it != votes_.end() && it->first.first == id_; ++it) {
    for (uint32_t r = 0; r < it->second.size() && r < world_; ++r) {
      if (!it->second[r]) continue;
      if (it->second[r]->reader != 0) return true;  // a rank failed: every rank ends
      latest[r] = &*it->second[r];
      // A rank that voted step t waits in its Commit() for every vote of step t - 1: this
      // rank's, when it has not sent it yet (its final vote, once sent, stands for it).
      if (final_sent_ == 0 && it->first.second >= vote_sent_ + 2) return true;
    }
  }
  uint32_t low = layers_;
  for (uint32_t r = 0; r < world_; ++r) {
    if (!IsMember(members, r)) continue;
    low = latest[r] == nullptr ? 0 : std::min(low, latest[r]->expert);
  }
  return low > applied;  // a Commit() applies another layer
}

}  // namespace eplbx::protocol
