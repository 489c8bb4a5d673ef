// Layer-atomic rearrangement of expert weights between ranks (docs/protocol.md).
//
// Every rank creates a Rearranger over its Agent, a Bootstrap and its RankLayout; Create
// exchanges agent metadata and layouts, validates the layouts on every rank before any
// byte moves, and connects the agents. Rearrange(from, to) then runs every MoE layer: the
// migration planner decides who reads which expert from whom (same placement on every
// rank gives the same plan), readers READ the sources' weight rows directly into a staging
// buffer of the layer (or spare rows, swap mode), and each layer commits (staging ->
// weights, new map) only when every rank's reads for it are complete. Several layers run at
// once (RearrangeOptions::layers_in_flight) and commit in order. On any failure the layer
// and the ones after it keep their old bytes and old maps, every peer is told (ABORT), and
// the Rearranger refuses further use.
#ifndef EPLBX_REARRANGE_H_
#define EPLBX_REARRANGE_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "eplbx/bootstrap.h"
#include "eplbx/env.h"
#include "eplbx/layout.h"
#include "eplbx/migration.h"
#include "eplbx/placement.h"
#include "eplbx/status.h"
#include "eplbx/transfer.h"

namespace eplbx {

struct RearrangeOptions {
  // Deadline of every phase: metadata exchange, and each layer's protocol.
  std::chrono::milliseconds deadline{300000};
  // The metadata exchange and the barrier after it (Create, Rebuild) wait this long instead
  // when it is longer (0: `deadline`). ServingGroup sets it to its round wait: over etcd a
  // lost member is seen only when its lease runs out, and a round right after the member set
  // changed may take that long.
  std::chrono::milliseconds exchange_deadline{0};
  int nodes = 1;  // for the migration planner's same-node-first source choice
  // Node of every rank (optional): bytes read from another node are counted separately.
  std::vector<uint32_t> node_of_rank;
  // The clock deadlines are measured on (null: Env::Default()).
  Env* env = nullptr;
  // Rearrange(): layers whose protocols run at once (their MAPS, READY, READs and DONE
  // overlap; each is still committed whole, in layer order). A layer that lands in a staging
  // buffer (in place) needs one of its own: in place, layers run one at a time unless
  // Reserve() allocated more buffers; in swap mode READs land in spare rows and need none.
  int layers_in_flight = 8;
  // With layers in flight, a rank's DONE of layer k + 1 leaves once it sent its DONE of
  // layer k and its reads and serves of k + 1 are over, without waiting to commit k: the
  // DONEs of layers whose copies ended together travel in one message, and the commits that
  // follow take one round instead of one a layer. The cost is the window a lost DONE or a
  // peer lost mid-commit opens (docs/protocol.md): the ranks may then disagree on every layer
  // whose DONE went ahead, not on one. false: DONE of k + 1 waits until k committed here.
  bool dones_ahead = true;
};

struct LayerOutcome {
  uint32_t layer = 0;
  bool committed = false;
  uint64_t experts_read = 0;  // expert rows this rank read from peers
  uint64_t bytes_read = 0;    // by this rank from peers
  uint64_t bytes_copied = 0;  // within this rank
  bool swapped = false;       // committed by publishing a new row table (swap mode), not in place
  uint64_t bytes_cross_node = 0;          // of bytes_read, from ranks on other nodes
  std::vector<uint64_t> bytes_from_rank;  // of bytes_read, per source rank (empty: none)
  std::string error;                      // when rolled back
};

struct RearrangeReport {
  Status status;                          // OK when every layer committed
  std::vector<LayerOutcome> layers;       // layers run so far, in order
  uint64_t experts_read = 0;              // this rank, all layers
  uint64_t bytes_read = 0;                // this rank, all layers
  uint64_t bytes_cross_node = 0;          // of bytes_read, from other nodes
  std::vector<uint64_t> bytes_from_rank;  // of bytes_read, per source rank (empty: none)
  // Bytes this rank's transfers moved per data path (shm, cma, ucx), this call only.
  std::vector<PathTotals> bytes_by_path;
  double seconds = 0;
};

// Asynchronous, pipelined rearrangement (docs/protocol.md, "Asynchronous commits"): Begin
// starts it, the engine's thread drives it with Poll() whenever it likes (non-blocking) and
// calls Commit() once per forward step, at a safe point, on every rank. READs run on the
// data paths' own threads between calls; several layers are in flight at once.
struct AsyncOptions {
  // Bytes of READs this rank may post per step (between two Commit calls); 0: the busiest
  // rank's bytes of this rearrangement / target_steps, so a full rebalance spreads over
  // about target_steps steps. At least one READ is posted per step whatever the budget.
  uint64_t step_budget_bytes = 0;
  int target_steps = 5;
  // Posted but not yet landed; 0: twice the step budget. At least one READ is in flight.
  uint64_t max_bytes_in_flight = 0;
  // Layers started and not yet committed. Each that lands in staging (in place, or a rank
  // whose new rows do not fit its spare rows) holds one staging buffer of a layer while it
  // runs; one that swaps into spare rows holds none.
  int max_layers_in_flight = 4;
  // The whole rearrangement (each layer also has RearrangeOptions::deadline); past it the
  // rearrangement fails by name, ABORTs its peers and keeps the old maps in force.
  std::chrono::milliseconds deadline{600000};
};

struct CommittedLayer {
  uint32_t layer = 0;
  std::vector<int32_t> phy2log;  // the layer's new map, slot -> logical expert
  // This rank's row table of the layer from now on, local slot -> row: switch to it with
  // the map (it changes only in swap mode, RankLayout::spare_rows > 0; identity without).
  std::vector<uint32_t> row_of_slot;
};

// What Commit() did at this step.
struct CommitResult {
  std::vector<CommittedLayer> layers;  // committed now: new rows in place, use these maps
  bool finished = false;               // the rearrangement is over (status says how)
  Status status;                       // not OK when it failed: uncommitted layers keep the old
  // Seconds this call spent waiting for the peers' votes of the previous step (normally 0).
  double wait_seconds = 0;
  uint64_t bytes_copied = 0;  // staging -> weights and local copies, this call
};

// Progress of the rearrangement in flight (or the last one).
struct AsyncProgress {
  bool active = false;
  uint32_t layers = 0;            // in the rearrangement
  uint32_t layers_started = 0;    // protocol started on this rank
  uint32_t layers_ready = 0;      // every rank's reads done (leading layers, in order)
  uint32_t layers_committed = 0;  // agreed and applied
  uint64_t bytes_in_flight = 0;   // posted READs not yet landed
  uint64_t bytes_read = 0;        // landed, by this rank
  uint64_t bytes_held = 0;        // READs waiting for the budget
  int64_t steps = 0;              // Commit calls since Begin
  int64_t steps_since_commit = 0;
};

namespace internal {
class RearrangerImpl;
}  // namespace internal

class Rearranger {
 public:
  // REQUIRES: every tensor's rows [base, base + rows * bytes_per_expert) lie in memory
  // registered with `agent`; `agent` and `bootstrap` outlive the Rearranger.
  // Fails with kMismatch (layout), kUnavailable / kTimeout (a rank missing or unreachable).
  // With a bootstrap that tracks membership (docs/deploy.md, "After a lost rank"), only the
  // members are connected and expected; a round refused because the member set changed
  // fails Create with the bootstrap's epoch moved on: create it again. The Rearranger
  // connects `agent` to the other members and disconnects them when it goes.
  static Result<std::unique_ptr<Rearranger>> Create(Agent* agent, Bootstrap* bootstrap,
                                                    RankLayout layout,
                                                    RearrangeOptions options = {});
  ~Rearranger();

  // Moves the weights from placement `from` to `to` (same layers and slots; slots =
  // ranks x rows). Stops at the first failed layer; layers after it are not started. Returns
  // OK only once every rank said it applied every layer (the end round, docs/protocol.md): a
  // rank whose layers are all committed while another rank failed one reports kAborted too.
  RearrangeReport Rearrange(const Placement& from, const Placement& to);
  // Runs `plan` as given (from PlanMigration(from, to, ...), possibly edited: the plan a user
  // computes is the plan executed). Before any byte moves every layer of it is checked to
  // turn `from` into `to` (ApplyMigration): a plan that does not fails with kInvalidArgument
  // naming the layer and the first slot that would hold the wrong expert. REQUIRES: every
  // rank passes the same plan (a rank with another plan fails its peers' layer, by name).
  RearrangeReport Rearrange(const Placement& from, const Placement& to, const MigrationPlan& plan);

  // Starts an asynchronous rearrangement of `plan` (checked as above; the same on every
  // rank, begun at the same step). Fails when one is already running or the Rearranger
  // failed. Then: Poll() from the engine's thread whenever convenient, Commit() once per
  // step on every rank.
  Status Begin(const Placement& from, const Placement& to, const MigrationPlan& plan,
               AsyncOptions options = {});
  // Allocates (and touches) the staging buffers an asynchronous rearrangement with `options`
  // may need (max_layers_in_flight, one layer each; none with a spare row per slot in every
  // layer), so that the first Begin does not pay for them while serving; Rearrange() in
  // place then runs that many layers at once. Optional.
  Status Reserve(const AsyncOptions& options);
  // Non-blocking: takes the records that arrived, posts the READs the budget allows,
  // starts layers as staging frees up, checks deadlines.
  Status Poll();
  // At a safe point between forward passes, on every rank at the same steps: votes which
  // leading layers are ready here (this rank's READs of them landed and every rank's maps
  // matched), and applies the layers every rank voted ready one step earlier (the vote of
  // the previous step is normally there already; else it waits, up to the layer deadline).
  // Every rank commits the same layers at the same step. Once its vote says every layer is
  // ready, a rank votes no more: that vote stands for the later steps. With no
  // rearrangement running it returns at once with nothing.
  CommitResult Commit();
  // For a caller with no forward steps of its own (the demo; an engine draining a
  // rearrangement): blocks, driving the rearrangement as Poll() does, until a Commit() now
  // makes progress, or `timeout` passes (false). Due: every layer started here is ready and
  // none can start before a commit (and this rank's last vote says fewer); the latest vote
  // known of every rank lets another layer be applied, or says a rank failed; a rank waits
  // for this rank's vote of a step; this rank failed; READs wait for the next step's
  // budget; the member set changed; the rearrangement's deadline passed after this rank's
  // final vote (the Commit() then waits for the missing votes and ends). Commit() back to
  // back instead sends a vote round per call while nothing changes (each a message to every
  // rank). False at once when no rearrangement is running.
  bool AwaitCommit(std::chrono::milliseconds timeout);
  AsyncProgress progress() const;
  bool busy() const;  // an asynchronous rearrangement is running
  // Host memory held in staging buffers (a layer's rows each): one from the start in place,
  // more as Reserve or Begin ask; none when every layer has a spare row per slot (swap mode:
  // no layer ever lands in staging).
  uint64_t staging_bytes() const;
  // Totals of the current (or last) asynchronous rearrangement.
  RearrangeReport async_report() const;

  // This rank's row table of `layer` in force (local slot -> row of its tensors): the
  // layout's, then as commits left it. Identity without spare rows. Pass it (in the layout)
  // to a Rearranger built after this one failed.
  std::vector<uint32_t> RowTable(uint32_t layer) const;

  // After the group's member set changed (a bootstrap with membership: docs/deploy.md,
  // "After a lost rank"), or after a failure: exchanges layouts again over the bootstrap's
  // current members (with this rank's row tables in force), keeps the connections to peers
  // still members and the staging buffers, disconnects peers no longer members, connects
  // new ones, and clears the failure. Cheaper than creating one anew (no new staging, no
  // reconnection). Every member calls it at the same point; refused while an asynchronous
  // rearrangement runs. Refused because the member set moved again meanwhile (the
  // bootstrap's epoch moved on): call it again.
  Status Rebuild();

  // After a failure the Rearranger refuses Rearrange() with this error until rebuilt.
  bool failed() const;
  // The peer id of `rank` in the agent (for tools that talk to ranks directly).
  Result<PeerId> peer(uint32_t rank) const;

 private:
  explicit Rearranger(std::unique_ptr<internal::RearrangerImpl> impl);
  std::unique_ptr<internal::RearrangerImpl> impl_;
};

// vLLM's EPLB communicator contract, per layer: SetTransferContext, then AddSend for each
// expert this rank serves and AddRecv for each expert it needs, then Execute. Receivers READ
// the source's registered weight row directly into the row given to AddRecv (zero copy on
// the source); Execute returns once every rank's reads for the layer are complete, so no
// rank overwrites rows a peer still reads. Same setup, validation and failure rules as
// Rearranger; after a failure every call fails until the communicator is rebuilt.
class EplbCommunicator {
 public:
  static Result<std::unique_ptr<EplbCommunicator>> Create(Agent* agent, Bootstrap* bootstrap,
                                                          RankLayout layout,
                                                          RearrangeOptions options = {});
  ~EplbCommunicator();

  // `old_phy2log`: the layer's physical slot -> logical expert map in force (all ranks);
  // `new_phy2log` (optional): the map after the rearrangement. Every rank must pass the
  // same maps: Execute compares them across ranks before any READ and fails on every rank,
  // naming both ranks and the first differing slot, when one differs. `kept_rows_copied`
  // (with `new_phy2log`): the caller has already copied out every row whose expert this rank
  // keeps (its local moves are done or staged), so such rows may receive (see AddRecv).
  Status SetTransferContext(std::span<const int32_t> old_phy2log, uint32_t layer,
                            std::span<const int32_t> new_phy2log = {},
                            bool kept_rows_copied = false);
  // `dst_rank` will read this rank's row of `expert` (a no-op on the wire for READ).
  Status AddSend(uint32_t dst_rank, uint32_t expert);
  // READ `expert` from `src_rank` into `dst_rows`: one row per tensor of the layer, each
  // exactly that tensor's bytes_per_expert long (else kInvalidArgument naming the tensor and
  // both sizes), inside memory registered with the agent. A receive row must not overlap
  // another receive row, a weight row of another layer, a row of this layer that a peer
  // reads (AddSend), or a row whose expert this rank keeps (unless the context says those
  // were copied out); without `new_phy2log` every weight row of the layer counts as kept
  // (receive into a buffer, as vLLM does). Those checks run in Execute, before anything moves.
  Status AddRecv(uint32_t src_rank, uint32_t expert, std::span<const Descriptor> dst_rows);
  // Runs the layer's protocol; on return every AddRecv row holds its expert, or the error
  // names the rank that failed (nothing was committed by the protocol either way).
  Status Execute();
  // Gives up the layer whose context is set (the caller found bad input of its own): every
  // peer's Execute fails at once naming this rank and `reason`, nothing moves, and this
  // communicator fails from now on. Returns kAborted with `reason`.
  Status Abort(std::string_view reason);
  bool failed() const;

 private:
  struct State;
  explicit EplbCommunicator(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace eplbx

#endif  // EPLBX_REARRANGE_H_
