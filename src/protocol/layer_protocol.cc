#include "protocol/layer_protocol.h"

#include <algorithm>

#include "common/strings.h"

namespace eplbx::protocol {

using internal::StrCat;

namespace {

Action MakeAction(ActionKind kind, uint32_t peer = 0, Record record = {}, ReadTask read = {},
                  std::string reason = {}) {
  Action a;
  a.kind = kind;
  a.peer = peer;
  a.record = std::move(record);
  a.read = read;
  a.reason = std::move(reason);
  return a;
}

}  // namespace

LayerProtocol::LayerProtocol(LayerStep step, Clock::time_point now, Clock::duration deadline)
    : step_(std::move(step)),
      deadline_(now + deadline),
      span_(deadline),
      held_(step_.hold_done),
      ready_(step_.reads.size(), false),
      read_done_(step_.reads.size(), false),
      done_from_(step_.world, false),
      posted_(step_.reads.size(), false),
      maps_ok_(step_.world, false),
      chunk_seen_(step_.world, std::vector<bool>(chunks(), false)) {
  if (step_.self < step_.world) maps_ok_[step_.self] = true;
  if (step_.end_round) maps_ok_.assign(step_.world, true);  // it has no maps
  for (uint32_t r = 0; r < step_.world; ++r) {
    if (!member(r)) maps_ok_[r] = done_from_[r] = true;  // nothing is expected from it
  }
}

void LayerProtocol::Refuse(uint32_t from, const Record& r, std::string why) {
  if (refused_++ == 0) {
    refused_note_ =
        StrCat(KindName(r.kind), " from rank ", from, " at epoch ", r.epoch, "; ", std::move(why));
  }
}

size_t LayerProtocol::chunks() const {
  return std::max<size_t>(1, (step_.old_map.size() + chunk_slots() - 1) / chunk_slots());
}

Record LayerProtocol::Make(RecordKind kind, uint32_t expert, uint32_t source,
                           uint32_t reader) const {
  Record r;
  r.kind = kind;
  r.generation = step_.generation;
  r.epoch = step_.epoch;
  r.layer = step_.layer;
  r.expert = expert;
  r.source = source;
  r.reader = reader;
  return r;
}

int LayerProtocol::FindRead(uint32_t expert, uint32_t source) const {
  for (size_t i = 0; i < step_.reads.size(); ++i) {
    if (step_.reads[i].expert == expert && step_.reads[i].source == source)
      return static_cast<int>(i);
  }
  return -1;
}

std::vector<Action> LayerProtocol::Start() {
  std::vector<Action> out;
  if (started_ || state_ != LayerState::kRunning) return out;
  started_ = true;
  if (!step_.new_map.empty() && step_.new_map.size() != step_.old_map.size()) {
    return Abort(StrCat("this rank's new map has ", step_.new_map.size(), " slots and its old map ",
                        step_.old_map.size()),
                 true);
  }
  if (!step_.row_map.empty() &&
      (step_.new_map.empty() || step_.row_map.size() != step_.old_map.size())) {
    return Abort(
        StrCat("this rank's row tables have ", step_.row_map.size(), " slots, its old map ",
               step_.old_map.size(), " and its new map ", step_.new_map.size()),
        true);
  }
  for (const ReadTask& t : step_.reads) {
    if (!member(t.source)) {
      return Abort(StrCat("the plan reads expert ", t.expert, " from rank ", t.source,
                          ", which is not a member at epoch ", step_.epoch,
                          " (plan over the members: PlanSurvivors)"),
                   true);
    }
  }
  for (const ServeTask& t : step_.serves) {
    if (!member(t.reader)) {
      return Abort(StrCat("the plan has rank ", t.reader, " read expert ", t.expert,
                          ", and it is not a member at epoch ", step_.epoch,
                          " (plan over the members: PlanSurvivors)"),
                   true);
    }
  }
  const size_t slots = step_.old_map.size(), per = chunk_slots();
  for (size_t c = 0; c < chunks() && !step_.end_round; ++c) {
    Record m = Make(RecordKind::kMaps, static_cast<uint32_t>(c * per), step_.self, map_count());
    m.map_slots = static_cast<uint32_t>(slots);
    const size_t first = c * per, n = std::min(per, slots - std::min(slots, first));
    m.maps.clear();
    for (uint32_t k = 0; k < map_count(); ++k)
      m.maps.insert(m.maps.end(), MapAt(k).begin() + first, MapAt(k).begin() + first + n);
    for (uint32_t r = 0; r < step_.world; ++r) {
      if (r != step_.self && member(r)) out.push_back(MakeAction(ActionKind::kSend, r, m));
    }
  }
  for (const ServeTask& s : step_.serves) {
    out.push_back(MakeAction(ActionKind::kSend, s.reader,
                             Make(RecordKind::kReady, s.expert, step_.self, s.reader)));
  }
  MaybeDone(&out);
  return out;
}

std::vector<Action> LayerProtocol::ReleaseDone(Clock::time_point now) {
  std::vector<Action> out;
  if (!held_) return out;
  held_ = false;
  // The layer's deadline runs again from here: it waited on the layers before it.
  deadline_ = std::max(deadline_, now + span_);
  MaybeDone(&out);
  return out;
}

bool LayerProtocol::PartOver() const {
  return std::all_of(read_done_.begin(), read_done_.end(), [](bool b) { return b; });
}

bool LayerProtocol::maps_agreed() const {
  return std::all_of(maps_ok_.begin(), maps_ok_.end(), [](bool b) { return b; });
}

bool LayerProtocol::held_and_ready() const {
  return held_ && state_ == LayerState::kRunning && started_ && !done_sent() && PartOver();
}

void LayerProtocol::MaybeDone(std::vector<Action>* out) {
  if (state_ != LayerState::kRunning || !started_) return;
  if (!done_from_[step_.self]) {
    if (held_) return;
    if (!PartOver()) return;
    done_from_[step_.self] = true;
    for (uint32_t r = 0; r < step_.world; ++r) {
      if (r != step_.self && member(r))
        out->push_back(MakeAction(ActionKind::kSend, r, Make(RecordKind::kDone, 0, step_.self, 0)));
    }
  }
  if (std::all_of(done_from_.begin(), done_from_.end(), [](bool b) { return b; }) &&
      std::all_of(maps_ok_.begin(), maps_ok_.end(), [](bool b) { return b; })) {
    state_ = LayerState::kCommitted;
    out->push_back(MakeAction(ActionKind::kCommit));
  }
}

std::vector<Action> LayerProtocol::Abort(std::string reason, bool broadcast) {
  std::vector<Action> out;
  if (state_ != LayerState::kRunning) return out;
  state_ = LayerState::kAborted;
  error_ = StrCat(step_.end_round ? "the end of the rearrangement" : StrCat("layer ", step_.layer),
                  " (generation ", step_.generation, "): ", reason);
  if (refused_ > 0) {
    error_ += StrCat("; ", refused_, " record", refused_ == 1 ? "" : "s",
                     " of another epoch refused, the first: ", refused_note_);
  }
  if (broadcast) {
    Record abort = Make(RecordKind::kAbort, 0, step_.self, 0);
    abort.reason = StrCat("rank ", step_.self, ": ", reason).substr(0, kMaxReasonBytes);
    for (uint32_t r = 0; r < step_.world; ++r) {
      if (r != step_.self && member(r)) out.push_back(MakeAction(ActionKind::kSend, r, abort));
    }
  }
  out.push_back(MakeAction(ActionKind::kAbort, 0, {}, {}, error_));
  return out;
}

std::vector<Action> LayerProtocol::OnRecord(uint32_t from, const Record& r, Clock::time_point now,
                                            bool* deferred) {
  *deferred = false;
  if (r.epoch != step_.epoch) {
    // Another member set: a rank declared lost that still talks (older epoch) or one that
    // learned of a change this rank has not seen yet (newer). Nothing of it is acted on.
    Refuse(from, r,
           StrCat("this rank is at epoch ", step_.epoch,
                  r.epoch < step_.epoch
                      ? " (the sender was declared lost: it must rejoin as a new member)"
                      : " (the member set changed and this rank has not learned it yet)"));
    return {};
  }
  if (from < step_.world && !member(from)) {
    Refuse(from, r, StrCat("rank ", from, " is not a member at epoch ", step_.epoch));
    return {};
  }
  if (r.generation < step_.generation) {
    ++ignored_;  // stale: a record of a step that is over
    return {};
  }
  if (r.generation > step_.generation) {
    *deferred = true;  // a faster peer is already at a later step
    return {};
  }
  if (state_ != LayerState::kRunning) {
    ++ignored_;
    return {};
  }
  if (from >= step_.world) return Abort(StrCat("a record claims to come from rank ", from), true);
  if (r.layer != step_.layer) {
    return Abort(
        StrCat("rank ", from, " sent ", KindName(r.kind), " for layer ", r.layer, " in generation ",
               r.generation, " of layer ", step_.layer, " (misrouted record)"),
        true);
  }
  std::vector<Action> out;
  switch (r.kind) {
    case RecordKind::kReady: {
      if (r.source != from || r.reader != step_.self) {
        return Abort(StrCat("rank ", from, " sent a misrouted READY (source ", r.source,
                            ", reader ", r.reader, ")"),
                     true);
      }
      const int i = FindRead(r.expert, from);
      if (i < 0) {
        return Abort(StrCat("rank ", from, " sent READY for expert ", r.expert,
                            ", which this rank does not read from it (plans differ across ranks?)"),
                     true);
      }
      if (ready_[i]) {
        ++ignored_;
        return {};
      }
      ready_[i] = true;
      if (maps_ok_[from]) PostRead(static_cast<size_t>(i), &out);
      break;
    }
    case RecordKind::kDone:
      if (r.source != from || from == step_.self) {
        return Abort(StrCat("rank ", from, " sent a misrouted DONE (source ", r.source, ")"), true);
      }
      if (done_from_[from]) {
        ++ignored_;
        return {};
      }
      done_from_[from] = true;
      break;
    case RecordKind::kAbort:
      return Abort(StrCat("aborted by rank ", from, " (", r.reason, ")"), false);
    case RecordKind::kVote:  // the pipeline takes votes before any layer sees them
      return Abort(StrCat("rank ", from, " sent a VOTE into the layer (misrouted record)"), true);
    case RecordKind::kMaps: {
      if (step_.end_round) {
        return Abort(StrCat("rank ", from, " sent MAPS into the end round (misrouted record)"),
                     true);
      }
      if (r.source != from || from == step_.self) {
        return Abort(StrCat("rank ", from, " sent misrouted MAPS (source ", r.source, ")"), true);
      }
      out = OnMaps(from, r);
      if (state_ != LayerState::kRunning) return out;
      break;
    }
  }
  MaybeDone(&out);
  if (state_ == LayerState::kRunning) {
    auto tick = OnTick(now);
    out.insert(out.end(), tick.begin(), tick.end());
  }
  return out;
}

void LayerProtocol::PostRead(size_t i, std::vector<Action>* out) {
  if (posted_[i]) return;
  posted_[i] = true;
  const ReadTask& t = step_.reads[i];
  out->push_back(MakeAction(ActionKind::kPostRead, t.source, {}, t));
}

std::vector<Action> LayerProtocol::OnMaps(uint32_t from, const Record& r) {
  const size_t slots = step_.old_map.size(), per = chunk_slots();
  const uint32_t me = step_.self;
  if (r.reader != map_count()) {
    // 1: the old map; 2: and the new one; 3: and the row tables (swap commit mode).
    auto what = [](uint32_t n) {
      return n == 1 ? "only the old map" : n == 2 ? "the old and new maps" : "maps and row tables";
    };
    return Abort(StrCat("rank ", from, " passed ", what(r.reader), " of the layer and rank ", me,
                        " ", what(map_count()),
                        "; every rank must pass the same maps (and use the same commit mode)"),
                 true);
  }
  if (r.map_slots != slots) {
    return Abort(StrCat("the map of the layer has ", r.map_slots, " slots on rank ", from, " and ",
                        slots, " on rank ", me, "; every rank must pass the same map"),
                 true);
  }
  const size_t first = r.expert, n = r.maps.size() / map_count();
  if (first % per != 0 || first / per >= chunks() ||
      n != std::min(per, slots - std::min(slots, first))) {
    return Abort(StrCat("rank ", from, " sent MAPS for slots ", first, "..", first + n,
                        " of a layer of ", slots, " slots (malformed chunk)"),
                 true);
  }
  std::vector<bool>& seen = chunk_seen_[from];
  if (seen[first / per]) {
    ++ignored_;
    return {};
  }
  for (uint32_t m = 0; m < map_count(); ++m) {
    const std::vector<int32_t>& mine = MapAt(m);
    for (size_t i = 0; i < n; ++i) {
      const int32_t theirs = r.maps[m * n + i];
      if (theirs == mine[first + i]) continue;
      if (m == 2) {
        return Abort(StrCat("row table of the layer differs between rank ", me, " and rank ", from,
                            " at slot ", first + i, " (rank ", me, ": row ", mine[first + i],
                            ", rank ", from, ": row ", theirs,
                            "); the ranks disagree on where an expert lies (rebuild the "
                            "Rearranger with every rank's row tables in force)"),
                     true);
      }
      return Abort(StrCat(m == 0 ? "old" : "new", " map of the layer differs between rank ", me,
                          " and rank ", from, " at slot ", first + i, " (rank ", me, ": expert ",
                          mine[first + i], ", rank ", from, ": expert ", theirs,
                          "); every rank must pass the same map (a stale or reordered map on "
                          "one of them)"),
                   true);
    }
  }
  seen[first / per] = true;
  std::vector<Action> out;
  if (std::all_of(seen.begin(), seen.end(), [](bool b) { return b; })) {
    maps_ok_[from] = true;
    for (size_t i = 0; i < step_.reads.size(); ++i) {
      if (step_.reads[i].source == from && ready_[i]) PostRead(i, &out);
    }
  }
  return out;
}

std::vector<Action> LayerProtocol::OnMalformed(uint32_t from, const Status& why) {
  return Abort(StrCat("rank ", from, " sent a malformed notification: ", why.message()), true);
}

std::vector<Action> LayerProtocol::OnReadComplete(const ReadTask& task, const Status& status) {
  const int i = FindRead(task.expert, task.source);
  if (i < 0 || state_ != LayerState::kRunning) return {};
  if (!status.ok()) {
    const std::string who = status.code() == Code::kUnavailable
                                ? StrCat("rank ", task.source, " unreachable: ")
                                : std::string();
    return Abort(StrCat(who, "READ of expert ", task.expert, " from rank ", task.source,
                        " failed: ", status.message()),
                 true);
  }
  read_done_[i] = true;
  std::vector<Action> out;
  MaybeDone(&out);
  return out;
}

std::vector<Action> LayerProtocol::OnPeerFailed(uint32_t rank, const Status& why) {
  // A peer that sent DONE has finished its part of the layer: its READs completed. Losing
  // it now (it may simply have finished and exited) takes nothing from this layer that its
  // loss could still spoil unseen: a READ of its rows still under way here fails (or passes
  // the deadline) and fails the layer itself; a reader elsewhere that cannot finish never
  // sends its DONE, so the layer commits nowhere.
  // An absent rank (not a member at this epoch) is expected for nothing either.
  if (rank < step_.world && rank != step_.self && done_from_[rank]) return {};
  return Abort(StrCat("rank ", rank, " unreachable: ", why.message()), true);
}

std::vector<Action> LayerProtocol::OnTick(Clock::time_point now) {
  if (state_ != LayerState::kRunning || now < deadline_) return {};
  // Name the first thing still missing.
  for (uint32_t r = 0; r < step_.world; ++r) {
    if (!maps_ok_[r]) return Abort(StrCat("deadline passed waiting for MAPS from rank ", r), true);
  }
  for (size_t i = 0; i < step_.reads.size(); ++i) {
    if (!ready_[i]) {
      return Abort(StrCat("deadline passed waiting for READY of expert ", step_.reads[i].expert,
                          " from rank ", step_.reads[i].source),
                   true);
    }
    if (!read_done_[i]) {
      return Abort(StrCat("deadline passed waiting for the READ of expert ", step_.reads[i].expert,
                          " from rank ", step_.reads[i].source),
                   true);
    }
  }
  for (uint32_t r = 0; r < step_.world; ++r) {
    if (!done_from_[r])
      return Abort(StrCat("deadline passed waiting for DONE from rank ", r), true);
  }
  return {};
}

std::vector<std::pair<size_t, std::vector<Action>>> ReleaseDonesAhead(
    std::span<LayerProtocol* const> layers, Clock::time_point now) {
  std::vector<std::pair<size_t, std::vector<Action>>> out;
  for (size_t i = 0; i + 1 < layers.size(); ++i) {
    const LayerProtocol& before = *layers[i];
    if (before.state() == LayerState::kAborted || !before.done_sent()) break;
    LayerProtocol& p = *layers[i + 1];
    if (p.held_and_ready()) out.emplace_back(i + 1, p.ReleaseDone(now));
  }
  return out;
}

}  // namespace eplbx::protocol
