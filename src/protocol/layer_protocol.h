// Internal: the per-layer rearrangement protocol of one rank, as a pure state machine
// (docs/protocol.md). It takes events (start, records, READ completions, peer failures,
// clock ticks) with the time they happen and returns the actions to perform; it never
// blocks, sleeps or touches memory, so every path is unit-tested with a fake clock.
//
// One generation per layer step. A source sends READY(expert, reader) to every reader of
// its rows (they are stable: nothing is overwritten before commit). A reader posts its READ
// on READY. A rank whose READs completed (the data landed) sends DONE to every rank; a rank
// commits (staging -> weights, new map published) once DONE came from all, so once every
// READ of every rank's rows completed. (Before protocol version 6 a reader also sent the
// source READ_DONE per READ and a source's DONE waited for them: a hop and a record per
// READ that told the commit nothing DONE does not.)
// Any failure sends ABORT(reason) to every rank; the layer then keeps its old bytes and map.
// Before any of that, every rank sends its maps of the layer (MAPS) to every other rank, and
// nothing is read from a rank whose maps differ from this rank's.
#ifndef EPLBX_SRC_PROTOCOL_LAYER_PROTOCOL_H_
#define EPLBX_SRC_PROTOCOL_LAYER_PROTOCOL_H_

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "eplbx/status.h"
#include "protocol/records.h"

namespace eplbx::protocol {

using Clock = std::chrono::steady_clock;

struct ReadTask {
  uint32_t expert = 0;
  uint32_t source = 0;
};
struct ServeTask {
  uint32_t expert = 0;
  uint32_t reader = 0;
};

struct LayerStep {
  uint64_t generation = 0;
  uint32_t layer = 0;
  uint32_t self = 0;
  uint32_t world = 1;
  std::vector<ReadTask> reads;    // this rank reads these
  std::vector<ServeTask> serves;  // these read from this rank
  // The layer's maps as this rank has them (slot -> logical expert; new_map may be empty).
  // Every rank sends them to every other first (MAPS); a READ from a source is posted only
  // after the source's maps matched this rank's, and the layer commits only after every
  // rank's did, so a rank with a stale map fails the layer on every rank, naming the slot.
  std::vector<int32_t> old_map;
  std::vector<int32_t> new_map;
  // Swap commit mode: every rank's row table of the layer in force (slot -> row, ranks in
  // order; empty: in place). Agreed like the maps: a READ's source row comes from it.
  // REQUIRES new_map when set.
  std::vector<int32_t> row_map;
  // The membership epoch this rank acts in: every record sent carries it, and records of
  // another epoch are refused (counted, the first named in the layer's error).
  uint64_t epoch = 0;
  // Which ranks are members at that epoch (empty: every rank). An absent rank is sent
  // nothing and expected for nothing (no MAPS, DONE or vote); a plan that reads from it or
  // serves it fails the layer at Start, naming it; its records are refused.
  std::vector<bool> members;
  // DONE waits for ReleaseDone(): this rank's reads and serves go on meanwhile, but no rank
  // commits the layer before it is released here. Layers run together in the synchronous
  // loop release layer k + 1 once layer k committed on this rank, so a rank's DONE of a
  // layer still says it committed every layer before (as when they ran one after another),
  // or, with DONEs ahead (ReleaseDonesAhead), once its DONE of layer k left.
  bool hold_done = false;
  // The end round of a Rearrange() call (after its last layer; no reads, serves or maps): its
  // DONE says this rank applied every layer of the call, so a rank returns success only once
  // every rank has. Errors name it instead of a layer.
  bool end_round = false;
};

enum class ActionKind {
  kSend,      // send `record` to rank `peer`
  kPostRead,  // READ `read` (OnReadComplete when it completed)
  kCommit,    // every rank is done: commit the layer
  kAbort,     // the layer failed (`reason`); ABORT records were already emitted as kSend
};

struct Action {
  ActionKind kind = ActionKind::kSend;
  uint32_t peer = 0;
  Record record;
  ReadTask read;
  std::string reason;
};

enum class LayerState { kRunning, kCommitted, kAborted };

class LayerProtocol {
 public:
  LayerProtocol(LayerStep step, Clock::time_point now, Clock::duration deadline);

  std::vector<Action> Start();
  // `deferred` is set for a record of a later generation: keep it for the next step.
  std::vector<Action> OnRecord(uint32_t from, const Record& r, Clock::time_point now,
                               bool* deferred);
  // A notification from `from` that did not decode.
  std::vector<Action> OnMalformed(uint32_t from, const Status& why);
  std::vector<Action> OnReadComplete(const ReadTask& task, const Status& status);
  // Aborts unless `rank` already sent DONE for this layer (then nothing depends on it).
  std::vector<Action> OnPeerFailed(uint32_t rank, const Status& why);
  std::vector<Action> OnTick(Clock::time_point now);
  // Lets DONE go (LayerStep::hold_done): at once if this rank's READs are over.
  // The layer's deadline is then at least `now` + its deadline (it waited on others).
  std::vector<Action> ReleaseDone(Clock::time_point now);
  // This rank cannot take part (bad arguments found before anything moved): abort and tell
  // every rank, so nobody waits for the deadline.
  std::vector<Action> Fail(const std::string& reason) { return Abort(reason, true); }

  // DONE is held (LayerStep::hold_done, not yet released) and would leave at once if
  // released: this rank's READs are over.
  bool held_and_ready() const;
  // This rank sent its DONE of the layer.
  bool done_sent() const { return step_.self < done_from_.size() && done_from_[step_.self]; }
  // Every rank's maps of the layer arrived and matched this rank's.
  bool maps_agreed() const;

  LayerState state() const { return state_; }
  const std::string& error() const { return error_; }
  uint64_t generation() const { return step_.generation; }
  // Records ignored as stale or duplicate (for reports and tests).
  uint64_t ignored() const { return ignored_; }
  // Records refused for another epoch, and what the first one was.
  uint64_t refused() const { return refused_; }
  const std::string& refused_note() const { return refused_note_; }

 private:
  std::vector<Action> Abort(std::string reason, bool broadcast);
  void MaybeDone(std::vector<Action>* out);
  // This rank's READs completed.
  bool PartOver() const;
  int FindRead(uint32_t expert, uint32_t source) const;
  std::vector<Action> OnMaps(uint32_t from, const Record& r);
  void PostRead(size_t i, std::vector<Action>* out);
  uint32_t map_count() const {
    return 1u + (step_.new_map.empty() ? 0u : 1u) + (step_.row_map.empty() ? 0u : 1u);
  }
  const std::vector<int32_t>& MapAt(uint32_t m) const {
    return m == 0 ? step_.old_map : m == 1 ? step_.new_map : step_.row_map;
  }
  size_t chunk_slots() const { return kMaxMapEntries / map_count(); }
  bool member(uint32_t rank) const {
    return step_.members.empty() || (rank < step_.members.size() && step_.members[rank]);
  }
  void Refuse(uint32_t from, const Record& r, std::string why);
  size_t chunks() const;
  Record Make(RecordKind kind, uint32_t expert, uint32_t source, uint32_t reader) const;

  const LayerStep step_;
  Clock::time_point deadline_;
  const Clock::duration span_;
  LayerState state_ = LayerState::kRunning;
  std::string error_;
  bool held_;                    // DONE waits for ReleaseDone()
  std::vector<bool> ready_;      // per read: READY received
  std::vector<bool> read_done_;  // per read: our READ completed
  std::vector<bool> done_from_;  // per rank: DONE received (self: sent)
  std::vector<bool> posted_;     // per read: READ posted
  std::vector<bool> maps_ok_;    // per rank: every MAPS chunk received and matched (self: true)
  std::vector<std::vector<bool>> chunk_seen_;  // per rank, per MAPS chunk
  bool started_ = false;
  uint64_t ignored_ = 0;
  uint64_t refused_ = 0;
  std::string refused_note_;
};

// Layers run together in the synchronous loop (RearrangeOptions::layers_in_flight), each
// holding its DONE (LayerStep::hold_done) until the layer before it was applied here. With
// DONEs going ahead (RearrangeOptions::dones_ahead) a held DONE also goes once this rank sent
// the DONE of the layer before it and that layer has not failed here, provided the layer's own
// READs are over (so its DONE leaves at once, with the one before it when both
// became possible in the same turn). `layers`: the layers not yet applied here, oldest first.
// Releases those DONEs (ReleaseDone) and returns each one's actions with its index in
// `layers`, in order.
std::vector<std::pair<size_t, std::vector<Action>>> ReleaseDonesAhead(
    std::span<LayerProtocol* const> layers, Clock::time_point now);

}  // namespace eplbx::protocol

#endif  // EPLBX_SRC_PROTOCOL_LAYER_PROTOCOL_H_
