// Expert load over time: a sliding window of per-step token counts, and the rules that
// decide when a rebalance is worth it.
//
//   eplbx::LoadRecorder rec = *eplbx::LoadRecorder::Create(layers, experts, /*window=*/1000);
//   rec.RecordSlots(placement, slot_counts);   // every step, counts per physical slot
//   if (eplbx::Due(trigger, step)) { ... plan on rec.Window() ... eplbx::Decide(...) }
#ifndef EPLBX_LOAD_H_
#define EPLBX_LOAD_H_

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "eplbx/placement.h"
#include "eplbx/status.h"

namespace eplbx {

// The logical load of the last `window` steps: per layer, per logical expert, the sum of
// the tokens routed to it. Steps older than the window fall out one by one.
class LoadRecorder {
 public:
  // Errors unless layers, experts and window are >= 1.
  static Result<LoadRecorder> Create(int layers, int experts, int window);

  // One step's token counts per physical slot (layers x placement.slots(), row-major) under
  // the placement that was in force for that step; each slot's count goes to its expert.
  // Errors (nothing recorded) on a shape mismatch or a negative or non-finite count.
  Status RecordSlots(const Placement& placement, std::span<const double> slot_counts);
  // One step's counts per logical expert (layers x experts, row-major). Same errors.
  Status Record(std::span<const double> expert_counts);

  // Sum over the last min(window, steps) steps. Kept incrementally and re-summed from the
  // ring every `window` steps, so rounding never drifts (a sum is never below 0). Fails when
  // a sum passes what a LoadMatrix holds (float32's range).
  Result<LoadMatrix> Window() const;
  // Starts the window again from `window` (a sum of earlier steps, as Window() returns):
  // it counts as one recorded step that leaves the window, whole, `window` steps later.
  // How members that agreed on a window carry it across a member-set change (a joiner
  // included). Errors (nothing changed) on a shape mismatch or a negative or non-finite value.
  Status Seed(const LoadMatrix& window);
  int64_t steps() const { return steps_; }
  int window() const { return window_; }

 private:
  LoadRecorder(int layers, int experts, int window);

  int layers_, experts_, window_;
  int64_t steps_ = 0;
  std::vector<std::vector<double>> ring_;  // window entries, layers x experts each
  std::vector<double> sum_;
};

// When to rebalance. A rebalance is considered every `interval` steps (after steps
// interval, 2 * interval, ...); it is skipped when the current placement's balancedness on
// the window is already >= skip_above (SGLang's utilisation gate; > 1 disables it), or
// when the new plan's predicted balancedness on the window does not beat the current one,
// or by less than min_gain. Balancer::Create refuses min_gain outside [0, 1] and
// skip_above outside [0, 2] (NaN and infinities included), as the CLI's flags do.
struct TriggerOptions {
  int interval = 1000;
  double min_gain = 0.0;
  double skip_above = 1.01;
};

enum class TriggerDecision { kNotDue, kSkipBalanced, kSkipSmallGain, kRebalance };

std::string_view TriggerDecisionName(TriggerDecision decision);

// Is a rebalance considered after `steps_done` steps?
bool Due(const TriggerOptions& options, int64_t steps_done);
// The decision for a due step, given balancedness on the window of the current placement
// and of the candidate plan (`predicted`; ignored when the gate skips first).
TriggerDecision Decide(const TriggerOptions& options, double current, double predicted);

}  // namespace eplbx

#endif  // EPLBX_LOAD_H_
