#include "eplbx/load.h"

#include <algorithm>
#include <cmath>

#include "common/strings.h"

namespace eplbx {

using internal::StrCat;

LoadRecorder::LoadRecorder(int layers, int experts, int window)
    : layers_(layers),
      experts_(experts),
      window_(window),
      sum_(static_cast<size_t>(layers) * experts, 0.0) {}

Result<LoadRecorder> LoadRecorder::Create(int layers, int experts, int window) {
  if (layers < 1 || experts < 1 || window < 1) {
    return Status::InvalidArgument(StrCat("load window needs layers, experts and window >= 1 (got ",
                                          layers, ", ", experts, ", ", window, ")"));
  }
  return LoadRecorder(layers, experts, window);
}

Status LoadRecorder::Record(std::span<const double> counts) {
  if (counts.size() != sum_.size()) {
    return Status::Mismatch(StrCat("step has ", counts.size(), " counts; expected ", layers_,
                                   " layers x ", experts_, " experts = ", sum_.size()));
  }
  for (size_t i = 0; i < counts.size(); ++i) {
    if (!(counts[i] >= 0) || !std::isfinite(counts[i])) {
      return Status::InvalidArgument(StrCat("step count for layer ", i / experts_, ", expert ",
                                            i % experts_, " is ", counts[i],
                                            " (expected a finite number >= 0)"));
    }
  }
  const size_t slot = static_cast<size_t>(steps_ % window_);
  if (ring_.size() < static_cast<size_t>(window_) && slot == ring_.size()) {
    ring_.emplace_back(sum_.size(), 0.0);
  }
  std::vector<double>& old = ring_[slot];
  for (size_t i = 0; i < sum_.size(); ++i) {
    // Both terms are >= 0 and the true sum is too: rounding (a 1e16 spike leaving the
    // window, fractional loads going idle) must not make it negative.
    sum_[i] = std::max(0.0, sum_[i] + (counts[i] - old[i]));
    old[i] = counts[i];
  }
  ++steps_;
  if (slot + 1 == static_cast<size_t>(window_)) {
    // Once per window: re-sum exactly what is in the ring (O(1) amortized per step).
    std::fill(sum_.begin(), sum_.end(), 0.0);
    for (const std::vector<double>& step : ring_) {
      for (size_t i = 0; i < sum_.size(); ++i) sum_[i] += step[i];
    }
  }
  return Status::OK();
}

Status LoadRecorder::RecordSlots(const Placement& placement, std::span<const double> counts) {
  if (placement.layers() != layers_ || placement.experts() > experts_) {
    return Status::Mismatch(StrCat("placement is ", placement.layers(), " layers x ",
                                   placement.experts(), " experts; the window is ", layers_,
                                   " layers x ", experts_, " experts"));
  }
  const size_t slots = static_cast<size_t>(placement.slots());
  if (counts.size() != static_cast<size_t>(layers_) * slots) {
    return Status::Mismatch(StrCat("step has ", counts.size(), " slot counts; expected ", layers_,
                                   " layers x ", slots, " slots = ", layers_ * slots));
  }
  std::vector<double> logical(sum_.size(), 0.0);
  for (int l = 0; l < layers_; ++l) {
    for (size_t s = 0; s < slots; ++s) {
      const int32_t e = placement.phy2log(l, static_cast<int>(s));
      if (e >= 0) logical[static_cast<size_t>(l) * experts_ + e] += counts[l * slots + s];
    }
  }
  return Record(logical);
}

Status LoadRecorder::Seed(const LoadMatrix& window) {
  if (window.layers() != layers_ || window.experts() != experts_) {
    return Status::Mismatch(StrCat("seed window is ", window.layers(), " layers x ",
                                   window.experts(), " experts; the window is ", layers_,
                                   " layers x ", experts_, " experts"));
  }
  ring_.clear();
  std::fill(sum_.begin(), sum_.end(), 0.0);
  steps_ = 0;
  return Record(window.values());
}

Result<LoadMatrix> LoadRecorder::Window() const {
  Result<LoadMatrix> m = LoadMatrix::Create(layers_, experts_, sum_);
  if (!m.ok()) return m.status().WithPrefix(StrCat("load window of ", window_, " steps"));
  return m;
}

std::string_view TriggerDecisionName(TriggerDecision decision) {
  switch (decision) {
    case TriggerDecision::kNotDue:
      return "not_due";
    case TriggerDecision::kSkipBalanced:
      return "skip_balanced";
    case TriggerDecision::kSkipSmallGain:
      return "skip_small_gain";
    case TriggerDecision::kRebalance:
      return "rebalance";
  }
  return "unknown";
}

bool Due(const TriggerOptions& options, int64_t steps_done) {
  return options.interval > 0 && steps_done > 0 && steps_done % options.interval == 0;
}

TriggerDecision Decide(const TriggerOptions& options, double current, double predicted) {
  if (current >= options.skip_above) return TriggerDecision::kSkipBalanced;
  const double gain = predicted - current;
  if (gain <= 0 || gain < options.min_gain) return TriggerDecision::kSkipSmallGain;
  return TriggerDecision::kRebalance;
}

}  // namespace eplbx
