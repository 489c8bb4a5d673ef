// Internal: the state behind Rearranger and EplbCommunicator. The synchronous layer loop is
// in rearranger.cc, the asynchronous pipeline in pipeline.cc (docs/protocol.md).
#ifndef EPLBX_SRC_REARRANGE_REARRANGER_IMPL_H_
#define EPLBX_SRC_REARRANGE_REARRANGER_IMPL_H_

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "eplbx/rearrange.h"
#include "protocol/layer_protocol.h"
#include "protocol/records.h"
#include "protocol/votes.h"

namespace eplbx::internal {

// The event loop's longest sleep: it wakes on every event, so this only paces deadline
// checks (deadlines are seconds).
constexpr int kTickMs = 10;

using protocol::IsMember;  // (src/protocol/votes.h)

class RearrangerImpl {
 public:
  Agent* agent = nullptr;
  Bootstrap* boot = nullptr;
  RankLayout layout;
  std::vector<RankLayout> all;
  RearrangeOptions options;
  Env* env = Env::Default();    // options.env or Env::Default()
  std::vector<PeerId> peer_of;  // by rank; self unused
  // The peers Setup connected: disconnected when this goes, so that a Rearranger made again
  // on the same agent (after the member set changed) can connect them anew.
  std::vector<PeerId> connected;
  std::vector<bool> linked;  // by rank: connected by Setup (kept by a rebuild while a member)
  std::map<std::string, uint32_t> rank_of_name;
  // Staging buffers of one layer each: [0] for the synchronous loop, more for the pipeline.
  std::vector<RegisteredRegion> staging;
  // EplbCommunicator reads into the caller's rows: no staging buffer (Setup allocates none).
  bool caller_rows = false;
  bool failed = false;
  std::string failure;
  uint64_t generation = 0;
  // The id of the last asynchronous rearrangement begun (ids 1, 2, ...; its VOTEs carry it):
  // Setup goes on from the members' highest, so a rank that joins later votes with the same
  // id as the others.
  uint64_t pipeline_id = 0;
  std::deque<std::pair<uint32_t, protocol::Record>> deferred;
  // Every rank's row tables in force, [rank][layer][slot] -> row (from the layouts; they
  // change only when a layer commits, the same way on every rank).
  std::vector<std::vector<std::vector<uint32_t>>> tables;

  // Where one rank's new experts of one layer go in swap mode (docs/protocol.md, "Commit
  // modes"), computed alike by every rank for every rank from the plan and the tables.
  struct RowPlan {
    bool swap = false;               // the rank's new rows fit in rows no slot uses
    std::vector<uint32_t> table;     // its table after the commit (swap)
    std::vector<uint32_t> read_row;  // per READ into the rank (plan order): the row it lands in
    struct Copy {
      uint32_t src = 0, dst = 0;  // rows, copied at the commit
    };
    std::vector<Copy> copies;
  };
  RowPlan PlanRows(uint32_t rank, uint32_t layer, const LayerMigration& m) const;

  uint32_t self() const { return layout.rank; }
  uint32_t world() const { return static_cast<uint32_t>(all.size()); }

  // Exchanges layouts over the members and connects to them; again after the member set
  // changed (Rebuild): connections to members and the staging buffers are kept, peers no
  // longer members are disconnected, generations and pipeline ids continue from the members'
  // highest.
  Status Setup();
  // The placements' shape against the layout; the plan against the placements.
  Status CheckShapes(const Placement& from, const Placement& to) const;
  Status CheckPlan(const Placement& from, const Placement& to, const MigrationPlan& plan) const;
  // One layer of reads (from a migration plan, or from a communicator's add_recv calls).
  struct JobRead {
    protocol::ReadTask task;
    uint64_t src_row = 0;
    std::vector<uint8_t*> dst;  // one destination row per tensor
  };
  struct LayerJob {
    uint32_t layer = 0;
    std::vector<JobRead> reads;
    std::vector<protocol::ServeTask> serves;
    std::vector<int32_t> old_map, new_map;  // checked against every rank's before any READ
    // Runs when every rank is done with the layer (synchronous) or when the ranks agreed
    // to commit it (pipeline); returns the bytes copied within this rank.
    std::function<uint64_t()> commit;
    Status refused;                // set: this rank refuses the layer (peers are told)
    bool swap = false;             // this rank commits by publishing a new row table
    std::vector<int32_t> row_map;  // every rank's row table in force (swap mode configured)
  };
  struct Pending {
    TransferId id;
    protocol::ReadTask task;
    uint64_t bytes = 0;
  };
  // A layer's protocol and what it has in flight.
  struct Run {
    LayerJob job;
    std::unique_ptr<protocol::LayerProtocol> protocol;
    std::vector<Pending> pending;
    LayerOutcome outcome;
    bool defer_commit = false;          // pipeline: kCommit marks the layer ready, Commit() applies
    std::deque<protocol::Action> held;  // READs waiting for the budget (pipeline)
    int slot = 0;                       // staging buffer
    // Pipeline: may a READ of this many bytes be posted now? (null: always)
    const std::function<bool(uint64_t)>* gate = nullptr;
  };
  // Makes run.job's protocol (generation, DONE held or not) and starts it: a job this rank
  // refused fails at once (its peers told); records that came early are handed to it.
  void StartRun(Run& run, uint64_t generation_of_run, bool hold_done, bool end_round = false);
  LayerOutcome RunJob(LayerJob& job);
  // Runs `count` jobs, make(i, slot) the i-th (generations first + i on every rank), up to
  // `in_flight` at once; a job for which staged(i) holds takes a staging buffer (`slot`) and
  // waits for a free one. Jobs are applied (their commits run) in order; after the first
  // that fails nothing more starts, the running ones fail (every rank is told) and none after
  // it is applied. With `end_error` (Rearrange), an end round follows the jobs: the call ends
  // only once every rank said it applied every job, else `end_error` says why not. Returns
  // the outcomes of the jobs started, in order.
  std::vector<LayerOutcome> RunJobs(uint32_t count, size_t in_flight,
                                    const std::function<bool(uint32_t)>& staged,
                                    const std::function<LayerJob(uint32_t, int)>& make,
                                    std::string* end_error);
  // RearrangeOptions::dones_ahead: releases the held DONEs of runs[applied + 1, ...) that can
  // leave with (or after) the DONE this rank sent of the layer before them.
  void ReleaseDonesAhead(const std::vector<std::unique_ptr<Run>>& runs, size_t applied);
  // The job of layer `l` of `m`, reading into staging buffer `slot`.
  LayerJob MakeLayerJob(uint32_t l, const LayerMigration& m, const Placement& from,
                        const Placement& to, int slot);
  uint64_t RowBytes(uint32_t layer) const {
    uint64_t b = 0;
    for (const TensorSpec& t : layout.layers[layer]) b += t.bytes_per_expert;
    return b;
  }
  // Bytes of one staging buffer (the largest layer).
  uint64_t StagingBytes() const;
  // Whether a layer of this rank can ever land in staging: in place, or a layer with fewer
  // spare rows than slots (its new rows may not all fit). With a spare row per slot in every
  // layer, every rank-layer swaps and no staging buffer is ever needed.
  bool MayStage() const;
  // Allocates staging buffers until there are `count`; `touch`: writes every page of the new
  // ones, so that their pages exist before serving needs them.
  Status EnsureStaging(size_t count, bool touch);

  // ---- pipeline (pipeline.cc) ----
  struct Pipeline;
  std::unique_ptr<Pipeline> pipe;
  Status Begin(const Placement& from, const Placement& to, const MigrationPlan& plan,
               const AsyncOptions& options);
  Status Poll();
  void PollTurn();  // Poll's turn: starts, records, READs (held until Poll flushes them)
  Status Reserve(const AsyncOptions& options);
  CommitResult Commit();
  bool AwaitCommit(std::chrono::milliseconds timeout);
  bool CommitDue() const;
  AsyncProgress Progress() const;
  RearrangeReport PipelineReport() const;
  bool Busy() const;
  RearrangerImpl();
  ~RearrangerImpl();

  // Runs `actions` of `run`: queues records (outbox), posts READs (through run.gate when
  // set: a READ it refuses waits in run.held), commits. The records leave at its end, unless
  // a loop holds them (hold_sends) to send once a turn.
  void Execute(Run& run, std::vector<protocol::Action> actions);
  // Sends what the outbox holds: each peer's records as one NotifyMany, in order (over UCX
  // one message instead of one per record: on a busy host every message costs a wake-up of
  // three threads). A record that cannot leave is its run's lost peer, as before.
  void Flush();
  // Adds a record of `run` for `peer` to the outbox.
  void Queue(Run& run, uint32_t peer, protocol::RecordKind kind, std::string bytes);
  // A READ's request (its bytes counted in run's outcome), and what follows its post: pending
  // (until Reap finds it landed), or failed at once.
  Agent::ReadRequest PrepareRead(Run& run, const protocol::Action& a);
  void Posted(Run& run, const protocol::Action& a, Result<TransferId> id);
  struct Outgoing {
    Run* run = nullptr;  // null: a VOTE, no layer's record
    protocol::RecordKind kind = protocol::RecordKind::kReady;
    std::string bytes;
  };
  std::vector<std::vector<Outgoing>> outbox;  // per rank
  // READs held with the records (hold_sends), posted by Flush after the records left,
  // oldest layer first: a turn takes the READYs of many layers from one source before the
  // next source's, and a rank's copies run in the order posted, so the first layers'
  // READs end first everywhere and their commits overlap the later layers' READs.
  std::vector<std::pair<Run*, protocol::Action>> posts;
  // > 0: Execute leaves records in the outbox (RunJobs flushes before it waits and before
  // it returns, so a turn's records to a peer travel together).
  int hold_sends = 0;
  bool flushing = false;
  // The caller waits in AwaitCommit with nothing else to do: the pipeline's READs posted
  // meanwhile are posted as the synchronous loop's are (Agent::ReadMany's caller_waits).
  bool caller_idle = false;
  // The first VOTE that could not leave (Flush), for the pipeline to fail on: its reason.
  std::string unsent_vote;
  // Handles the records in `notes`: route(g) is the run with the smallest generation >= g
  // (null: none started yet). A record goes to the run of its generation; one later than
  // every run is deferred; an older one is stale. Votes go to `vote` when set.
  void Handle(std::vector<Notification> notes, const std::function<Run*(uint64_t)>& route,
              const std::function<void(uint32_t, const protocol::Record&)>& vote);
  // Polls `run`'s READs; finished ones go to its protocol.
  void Reap(Run& run);
  // Lost peers fail `run` (after their last records are taken).
  void CheckPeers(const std::vector<Run*>& runs, const std::function<Run*(uint64_t)>& route,
                  const std::function<void(uint32_t, const protocol::Record&)>& vote);
  void CancelPending(Run& run);

 private:
  uint8_t* StageRow(int slot, uint32_t layer, size_t t, int row) const {
    uint64_t at = 0;
    for (size_t k = 0; k < t; ++k)
      at += static_cast<uint64_t>(layout.layers[layer][k].rows) *
            layout.layers[layer][k].bytes_per_expert;
    return static_cast<uint8_t*>(staging[slot].data()) + at +
           static_cast<uint64_t>(row) * layout.layers[layer][t].bytes_per_expert;
  }
  // `row` is a row of the tensor (a slot's row is tables[self()][layer][slot]).
  uint8_t* WeightRow(uint32_t layer, size_t t, uint64_t row) const {
    const TensorSpec& s = layout.layers[layer][t];
    return reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(s.base)) +
           static_cast<uint64_t>(row) * s.bytes_per_expert;
  }
};

}  // namespace eplbx::internal

namespace eplbx {
// Adds a layer's bytes per source rank to a report's.
void AddBytesFrom(const LayerOutcome& o, RearrangeReport* report);
}  // namespace eplbx

#endif  // EPLBX_SRC_REARRANGE_REARRANGER_IMPL_H_
