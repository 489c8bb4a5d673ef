// The serving runtime: what an engine calls around its forward passes to rebalance experts
// while serving and to go on through any change of its member set (docs/architecture.md,
// "Serving: ServingGroup"; docs/deploy.md, "Membership and epochs").
//
// A ServingGroup owns a Balancer (window, trigger, plans, asynchronous rearrangements) and
// the Rearranger that moves this rank's weights, and it settles the group whenever the
// bootstrap's member set changes: a rank lost (its process died or hung), a rank drained
// (Drain), a rank taken in (a new process, or a lost rank's process coming back, through
// Join). Settling: every member ends the rebalance in flight, the members agree on the
// placement in force from what each one's slots hold, the Rearranger is rebuilt over the
// members, a plan over them is moved (survivors read from survivors; experts no member holds
// come from the backup sources), and the Balancer goes on over them with its window and
// report. Any number of changes in any order; one during settling starts the settling again
// from what each member holds then. Every member ends at the same epoch with the same
// placement, or every member fails with the reason; placement() never names a row that
// does not hold its expert.
//
// Membership comes from the Bootstrap: its epoch() and members() (SocketBootstrap over the
// built-in coordinator; an engine's own through a Bootstrap that reports its process
// group's epoch and members). A membership change is noticed when a round over the
// bootstrap fails with a new epoch: in Sync() (the step's collective), or when the engine
// calls OnMembershipChanged() after its own collective failed.
//
// Lifetime and threads: one ServingGroup per rank, used from one thread (the engine's
// serving loop). It borrows the Agent, the Bootstrap and the backup sources, which must
// outlive it. The weights the layout names stay where they are; their rows change only
// inside Step, Commit, Sync, OnMembershipChanged and Drain.
#ifndef EPLBX_SERVING_H_
#define EPLBX_SERVING_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "eplbx/backup.h"
#include "eplbx/balancer.h"
#include "eplbx/bootstrap.h"
#include "eplbx/layout.h"
#include "eplbx/placement.h"
#include "eplbx/rearrange.h"
#include "eplbx/status.h"
#include "eplbx/transfer.h"

namespace eplbx {

struct ServingOptions {
  // Topology, policy, window, trigger, mode, budget. `balancer.live`: the members at
  // Create (empty: the bootstrap's members()).
  BalancerOptions balancer;
  // The Rearranger's deadlines and paths (for rebalances and for settling alike); its
  // exchange_deadline, when 0, becomes round_wait.
  RearrangeOptions rearrange;
  // How long a member waits for one round over the bootstrap (the step's collective, the
  // members' maps). With the built-in coordinator: twice its round timeout, so a member
  // hears the coordinator name a missing member rather than give up first.
  std::chrono::milliseconds round_wait{4000};
  // A joiner's first round waits this many round_waits (the members reach the step at
  // which they ask for it, then take it in).
  int join_wait_rounds = 5;
  // Placements over a member set that keeps moving before settling gives up (>= 1).
  int max_placements = 4;
  // Called on this rank as each placement's move among the members begins (1: the first of
  // a settling), for drills and tests that strike there; null: nothing.
  std::function<void(int placement)> before_move;
};

// One settling of the group (a loss, a join, a drain), as this rank saw it.
struct RecoveryRecord {
  std::string kind;   // "loss", "join", "drain" (a change seen through a failed round: "loss"
                      // when members left, "join" when members came)
  int64_t step = -1;  // the step it happened at (settled at)
  uint64_t epoch_before = 0, epoch = 0;
  std::vector<int> members;  // at `epoch`
  std::string interrupted;   // how the rebalance in flight ended ("" when none was)
  double recovery_s = 0;     // from the call that noticed it until serving again
  // Of recovery_s: ending the rebalance in flight, rounds of the members' maps, the
  // Rearranger over the members, planning, moving among members, restoring from backups,
  // the Balancer over the members.
  double end_s = 0, gather_s = 0, setup_s = 0, plan_s = 0, move_s = 0, restore_s = 0,
         balancer_s = 0;
  int64_t experts_recovered = 0;  // experts no member held, restored from a backup
  int64_t rows_recovered = 0;
  uint64_t bytes_moved = 0;  // read by this rank from members
  int placements = 0;
  std::vector<std::string> restarts;  // why each placement after the first was needed
};

class ServingGroup {
 public:
  // A member from the start: `initial` is in force and this rank's rows already hold it
  // (other ranks' slots of non-members empty). Collective over the members (creates the
  // Rearranger). `backups`: where experts no member holds come from (a host backup, the
  // checkpoint); none: such experts are named unrecoverable and the settling fails.
  static Result<std::unique_ptr<ServingGroup>> Create(
      Agent* agent, Bootstrap* bootstrap, RankLayout layout, Placement initial,
      ServingOptions options, std::vector<const BackupSource*> backups = {});
  // A new process for a rank that is no member (never was, was drained, or was lost and
  // comes back): asks the coordinator to be taken in, then settles with the members where
  // they are (its slots are filled from them and from `backups`). Returns once serving;
  // step() is the members' step. `experts`: logical experts per layer.
  static Result<std::unique_ptr<ServingGroup>> Join(Agent* agent, Bootstrap* bootstrap,
                                                    RankLayout layout, int experts,
                                                    ServingOptions options,
                                                    std::vector<const BackupSource*> backups = {});
  ~ServingGroup();
  ServingGroup(const ServingGroup&) = delete;
  ServingGroup& operator=(const ServingGroup&) = delete;

  // After every forward step, on every member: the step's token counts per logical expert
  // (layers x experts; the same on every member). Balancer::Step.
  Result<BalancerStep> Step(std::span<const double> expert_counts);
  // At the engine's safe point, once per step: the layers whose new map (and, in swap
  // mode, row table) are in force from now on.
  BalancerCommit Commit();
  // Between the layers of a forward pass: Balancer::Poll (the rebalance in flight needs
  // fewer steps).
  void Poll();
  // The step's collective over the bootstrap (an engine with a collective of its own calls
  // OnMembershipChanged() when that fails instead). Returns true when the member set had
  // changed and the group settled over the new one (last_recovery() says how), false when
  // nothing changed; an error when the group cannot go on (named: the coordinator silent,
  // a settling that failed).
  Result<bool> Sync();
  // The member set changed (the bootstrap's epoch moved): settle over the new one. Every
  // member calls it at the same step.
  Status OnMembershipChanged();
  // Graceful removal of member `rank`, on every member at the same step: ends the rebalance
  // in flight, moves `rank`'s experts to the others (it is a source only), then `rank`
  // leaves (left() true: close its bootstrap now) and the others go on over the members.
  Status Drain(uint32_t rank);

  const Placement& placement() const;  // in force: never names a row that does not hold it
  // This rank's row of each of its slots in `layer` (swap mode moves rows; in place: the
  // identity).
  std::vector<uint32_t> RowTable(uint32_t layer) const;
  const RankLayout& layout() const;  // with the row tables in force
  int64_t step() const;              // steps served by the group (a joiner's: the members')
  uint64_t epoch() const;            // the placement's: at the start or the last settling
  std::vector<bool> members() const;
  bool left() const;  // this rank was drained
  // Every settling so far, oldest first (empty: none).
  const std::vector<RecoveryRecord>& recoveries() const;
  const BalancerReport& report() const;  // across every settling (the Balancer is kept)
  BalancerProgress progress() const;
  Balancer& balancer();

 private:
  struct State;
  explicit ServingGroup(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// The Balancer's metrics (PrometheusText(report, progress), docs/architecture.md) and the
// serving runtime's: eplbx_recoveries_total{kind="loss"|"join"|"drain"}, the
// eplbx_recovery_seconds summary, eplbx_experts_recovered_total, eplbx_membership_epoch and
// eplbx_members.
std::string PrometheusText(const ServingGroup& group);

}  // namespace eplbx

#endif  // EPLBX_SERVING_H_
