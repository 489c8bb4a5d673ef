// The EPLB loop in one object: load window -> trigger -> plan -> migration plan ->
// rearrangement, committed at the engine's safe points (docs/architecture.md, "Balancer").
//
//   auto b = *eplbx::Balancer::Create(initial, options, rearranger);  // rearranger: optional
//   for (;;) {
//     ... forward pass with b->placement() ...
//     b->Step(token_counts);        // after the step: load per logical expert
//     eplbx::BalancerCommit c = b->Commit();  // safe point: layers whose new rows are in place
//     for (auto& l : c.layers) engine.SetMap(l.layer, l.phy2log);
//   }
//
// Every rank of a group calls Step and Commit the same number of times with the same load
// (the engine's all-reduced counts), so every rank decides the same rebalances at the same
// steps and commits the same layers at the same step. Without a Rearranger the Balancer only
// plans (what-if replays: eplbx simulate): a new placement takes effect at the next Commit.
#ifndef EPLBX_BALANCER_H_
#define EPLBX_BALANCER_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "eplbx/load.h"
#include "eplbx/placement.h"
#include "eplbx/policy.h"
#include "eplbx/rearrange.h"
#include "eplbx/status.h"

namespace eplbx {

enum class BalancerMode {
  kAsynchronous,  // Begin at the trigger, READs while serving, layers commit at safe points
  kSynchronous,   // the whole rearrangement runs inside Step (the engine stalls)
};

struct BalancerOptions {
  Topology topology;
  Policy policy = Policy::kDeepSeek;
  double tolerance = 0.002;  // incremental only
  int window = 1000;         // steps of load a plan is built from
  TriggerOptions trigger;
  BalancerMode mode = BalancerMode::kAsynchronous;
  // The asynchronous mode's options; in both modes the Rearranger reserves
  // async.max_layers_in_flight staging buffers (Rearranger::Reserve), so a synchronous
  // rebalance in place also runs that many layers at once (RearrangeOptions::layers_in_flight).
  AsyncOptions async;
  // Asynchronous mode: the plan and the migration plan are computed on a thread of their
  // own from the step the trigger is due, and the rebalance begins plan_lag_steps steps
  // later (every rank at the same step; a rank whose plan is not ready by then waits for
  // it there). 0: planned inside Step, as in the other modes.
  int plan_lag_steps = 2;
  // For the migration planner's estimates (the Rearranger moves the layout's real rows).
  uint64_t bytes_per_expert = 44040192;
  double link_gbps = 400.0;
  // The ranks that serve (empty: every rank). After ranks were lost (docs/deploy.md, "After
  // a lost rank") the survivors go on over the members: the other ranks' slots stay empty
  // (-1) in the initial placement and in every plan, balance is measured over the members,
  // and plans are made on the members' topology (MembersTopology) incremental from what
  // they hold. One flag per rank of `topology`.
  std::vector<bool> live;
};

// One rebalance, as this rank saw it.
struct RebalanceRecord {
  int64_t step = 0;           // the step whose Step() decided it (began it, asynchronous)
  int64_t finished_step = 0;  // the step whose Commit() (or Step(), synchronous) ended it
  double window_before = 0, window_after = 0;  // balancedness on the window
  int64_t copies = 0;                          // (rank, expert) pairs gained remotely, all ranks
  uint64_t bytes = 0;                          // bytes the plan moves, all ranks
  double stall_estimate_s = 0;                 // the migration's lower bound at link_gbps
  Status status;                               // how it ended
  uint32_t layers_committed = 0;
  uint32_t layers_swapped = 0;  // of those, committed by a new row table (swap mode)
  // Seconds on this rank: planning, migration planning (on the planning thread when
  // plan_lag_steps > 0), waiting for that thread at the begin step, the synchronous
  // rearrangement (the stall), and for an asynchronous one the time inside Poll (posting
  // READs, taking records), waiting for votes, committing (applying layers).
  double plan_s = 0, migration_plan_s = 0, plan_wait_s = 0, rearrange_s = 0, poll_s = 0, wait_s = 0,
         commit_s = 0;
  uint64_t bytes_read = 0;  // by this rank from peers
  // Within this rank: staging -> weights and local copies in place; local copies only in
  // swap mode (READs land where they stay).
  uint64_t bytes_copied = 0;
  std::vector<PathTotals> bytes_by_path;
  std::vector<uint64_t> bytes_from_rank;  // of bytes_read, per source rank
  // Of bytes_read, per source node (nodes of the topology: rank r on node r / ranks per
  // node); with this rank's node, the node pairs the bytes crossed.
  std::vector<uint64_t> bytes_from_node;
};

struct BalancerReport {
  int64_t steps = 0;
  int64_t considered = 0, skipped_balanced = 0, skipped_small_gain = 0;
  int64_t failed = 0;  // rebalances that ended with an error (old maps kept where uncommitted)
  std::vector<RebalanceRecord> rebalances;
};

struct BalancerProgress {
  // A rebalance is in flight: Commit() calls (one per step, every rank) finish it.
  bool rebalancing = false;
  // A plan is being computed (asynchronous); it begins at a later Step. An engine that
  // stops serving may drop it.
  bool planning = false;
  AsyncProgress rearrangement;  // of the rebalance in flight (or the last)
  int64_t steps = 0;
  int64_t steps_since_commit = 0;  // since a layer last changed its map (or since the start)
  int64_t layers_committed = 0;    // over all rebalances
  double balancedness = 1.0;       // of the placement in force, on the last Step's load
};

struct BalancerStep {
  double balancedness = 1.0;  // of the placement in force, on this step's load
  TriggerDecision decision = TriggerDecision::kNotDue;
  bool began = false;  // a rebalance began (asynchronous) or ran (synchronous, plan only)
};

struct BalancerCommit {
  std::vector<CommittedLayer> layers;  // whose new rows are in place: use these maps now
  bool finished = false;               // a rebalance ended at this call
  Status status;                       // how, when finished
};

class Balancer {
 public:
  // `initial`: the placement in force. `rearranger` (optional, not owned) moves the weights;
  // without it the Balancer only plans. Errors: a topology that does not fit the placement,
  // window or interval < 1.
  static Result<std::unique_ptr<Balancer>> Create(Placement initial, BalancerOptions options,
                                                  Rearranger* rearranger = nullptr);
  ~Balancer();

  // After a forward step: its token counts per logical expert (layers x experts,
  // row-major). Records them, drives a rebalance in flight, and when the trigger is due
  // plans and begins (or, synchronous, runs) a rebalance. Errors: a bad count, named
  // (nothing is recorded then), or the planner's problem (the step is recorded).
  Result<BalancerStep> Step(std::span<const double> expert_counts);
  // The same with counts per physical slot (layers x slots) under the placement in force;
  // every slot's count must be finite and >= 0 (the error names layer, slot and value).
  Result<BalancerStep> StepSlots(std::span<const double> slot_counts);
  // At a safe point between forward passes, once per step: the layers to switch to now.
  BalancerCommit Commit();
  // Between the layers of a forward pass, as often as the engine likes (on the thread that
  // calls Step and Commit): drives the asynchronous rebalance in flight (takes the peers'
  // records, posts READs within the step's budget), so that it completes in fewer steps;
  // never switches a layer (that happens in Commit). Returns at once when nothing is in
  // flight. The time it takes counts as the rebalance's poll_s.
  void Poll();

  // The member set changed (eplbx/serving.h does this for an engine): from now on
  // `placement` is in force over the ranks `live` flags (empty: every rank; as
  // BalancerOptions::live, checked the same way). The rebalance in flight must have ended
  // (Commit() until progress().rebalancing is false; else kInProgress); a plan
  // being computed is dropped. The window starts again from `window` (what the members
  // agreed on: LoadRecorder::Seed) and the Balancer counts `steps` steps served, so a
  // joiner's trigger falls due with the members'. The report is kept. On error nothing
  // changed.
  Status SetMembers(Placement placement, std::vector<bool> live, const LoadMatrix& window,
                    int64_t steps);
  // The load of the window (the last min(window, steps) steps' counts summed).
  Result<LoadMatrix> window() const;

  const Placement& placement() const;  // in force (committed layers only)
  BalancerProgress progress() const;
  const BalancerReport& report() const;

 private:
  struct State;
  explicit Balancer(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// The report and progress in Prometheus' text format (counters and gauges named eplbx_*).
std::string PrometheusText(const BalancerReport& report, const BalancerProgress& progress);

}  // namespace eplbx

#endif  // EPLBX_BALANCER_H_
