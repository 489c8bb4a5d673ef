// One mode of `eplbx demo --serve` on one rank: the expert work and the report. See
// serve_mode.h.
#include "cli/serve_mode.h"

#include <signal.h>
#include <time.h>

#include <algorithm>
#include <cstring>

#include "common/strings.h"

namespace eplbx::cli {

using internal::StrCat;

namespace {

double ThreadCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// Tokens of each slot of this rank in `layer`: each expert's count split over its replicas
// in slot order (the first count % replicas replicas get one more).
std::vector<int64_t> SlotTokens(const Placement& p, std::span<const double> counts, int layer,
                                int rank, int rows) {
  std::vector<int64_t> out(rows, 0);
  for (int row = 0; row < rows; ++row) {
    const int slot = rank * rows + row;
    const int32_t e = p.phy2log(layer, slot);
    if (e < 0) continue;
    const int64_t c = static_cast<int64_t>(counts[static_cast<size_t>(layer) * p.experts() + e]);
    const int reps = p.logcnt(layer, e);
    int k = 0;
    for (int s = 0; s < slot; ++s) k += p.phy2log(layer, s) == e;
    out[row] = c / reps + (k < c % reps ? 1 : 0);
  }
  return out;
}

// One settling of the group, as the report lists it.
nlohmann::json RecordJson(const RecoveryRecord& r) {
  return {{"kind", r.kind},
          {"step", r.step - 1},  // the step it was settled at (0-based, like the trace)
          {"epoch", r.epoch},
          {"members", r.members},
          {"recovery_s", r.recovery_s},
          {"interrupted", r.interrupted},
          {"experts_recovered", r.experts_recovered},
          {"rows_recovered", r.rows_recovered},
          {"bytes_moved", r.bytes_moved},
          {"placements", r.placements},
          {"restarts", r.restarts}};
}

}  // namespace

void Mode::TakeRowTables() {
  if (w.spare == 0 || group == nullptr) return;
  for (int l = 0; l < static_cast<int>(w.row_of_slot.size()); ++l)
    w.SetRows(l, group->RowTable(static_cast<uint32_t>(l)));
  w.layout.row_of_slot = w.row_of_slot;
}

// The expert work of one step on `mode`'s weights: every row this rank holds, each routed
// token over `work` bytes of tensor 0 (which `segments` cycle through), checked against the
// pattern of the expert the placement in force names; after each layer, a Poll of the
// rebalance in flight.
void Work(const DemoOptions& o, int rank, int step, std::span<const double> counts, Mode& mode,
          int mode_index, uint64_t work, uint64_t segments, Meeting* meeting) {
  const int modes = static_cast<int>(o.mode_list.size());
  const Weights& w = mode.w;
  const Placement& p = mode.group->placement();
  const uint64_t row0 = w.bytes[0];
  uint64_t sink = 0;
  for (int l = 0; l < o.layers; ++l) {
    if (meeting != nullptr) meeting->Begin(LayerIndex(step, mode_index, modes, l, o.layers));
    const double cpu0 = ThreadCpuSeconds();
    const std::vector<int64_t> tokens = SlotTokens(p, counts, l, rank, w.rows);
    const TensorSpec& t0 = w.layout.layers[l][0];
    for (int row = 0; row < w.rows; ++row) {
      const uint32_t e = static_cast<uint32_t>(p.phy2log(l, rank * w.rows + row));
      const uint64_t key = PatternKey(static_cast<uint32_t>(l), e, 0);
      const uint8_t* base = reinterpret_cast<const uint8_t*>(t0.base) + w.Row(l, row) * row0;
      bool bad = false;
      uint64_t acc = 0;
      // A row without tokens is still checked (one word); one with tokens at every word its
      // tokens touch.
      const int64_t n = std::max<int64_t>(tokens[row], 0);
      for (int64_t i = 0; i < n; ++i) {
        const uint64_t off = ((static_cast<uint64_t>(step) * 131 + i) % segments) * work;
        for (uint64_t j = 0; j + 8 <= work; j += 8) {
          uint64_t v;
          std::memcpy(&v, base + off + j, 8);
          // A dependent chain (as a dot product's accumulation is): the work per token is the
          // same whether the row is in cache or not.
          acc = Mix(acc ^ v);
          bad |= v != PatternWord(key, off + j);
        }
      }
      if (n == 0) {
        uint64_t v;
        std::memcpy(&v, base, 8);
        bad = v != PatternWord(key, 0);
      }
      sink += acc;
      ++mode.m.rows_checked;
      if (bad && mode.m.bad_rows++ == 0) {
        mode.m.first_bad = StrCat("rank ", rank, " step ", step, " layer ", l, " row ", row,
                                  " does not hold expert ", e, ", which its map says");
      }
    }
    // Between layers the engine's thread drives the rebalance in flight (asynchronous mode;
    // nothing otherwise): its cost counts in the layer's time.
    mode.group->Poll();
    mode.m.cpu_s.push_back(ThreadCpuSeconds() - cpu0);
    if (meeting != nullptr) meeting->End();
  }
  mode.m.checksum += sink;
}

nlohmann::json ModeReport(Mode& mode) {
  ModeRun& m = mode.m;
  static const BalancerReport kNone;
  const BalancerReport& br = mode.group != nullptr ? mode.group->report() : kNone;
  uint64_t bytes_read = 0, bytes_copied = 0;
  nlohmann::json rebalances = nlohmann::json::array();
  const std::vector<RebalanceRecord>& all = br.rebalances;
  for (const RebalanceRecord& x : all) {
    bytes_read += x.bytes_read;
    bytes_copied += x.bytes_copied;
    nlohmann::json paths = nlohmann::json::object();
    for (const PathTotals& pt : x.bytes_by_path) {
      if (pt.bytes > 0) paths[pt.path] = pt.bytes;
    }
    rebalances.push_back({{"step", x.step},
                          {"finished_step", x.finished_step},
                          {"ok", x.status.ok()},
                          {"window_before", x.window_before},
                          {"window_after", x.window_after},
                          {"layers_committed", x.layers_committed},
                          {"layers_swapped", x.layers_swapped},
                          {"bytes_read", x.bytes_read},
                          {"bytes_copied", x.bytes_copied},
                          {"bytes_by_path", paths},
                          {"bytes_from_rank", x.bytes_from_rank},
                          {"plan_s", x.plan_s},
                          {"migration_plan_s", x.migration_plan_s},
                          {"plan_wait_s", x.plan_wait_s},
                          {"rearrange_s", x.rearrange_s},
                          {"poll_s", x.poll_s},
                          {"wait_s", x.wait_s},
                          {"commit_s", x.commit_s}});
  }
  return {{"cpu_s", m.cpu_s},
          {"enter_ns", m.enter_ns},
          {"exit_ns", m.exit_ns},
          {"balancedness", m.balancedness},
          {"rebalancing", m.rebalancing},
          {"committed", m.committed},
          {"rows_checked", m.rows_checked},
          {"bad_rows", m.bad_rows},
          {"work_checksum", m.checksum},
          {"bytes_read", bytes_read},
          {"bytes_copied", bytes_copied},
          {"rebalances", rebalances},
          {"failed", br.failed},
          {"error", m.error},
          {"verified", m.verified}};
}

Result<std::unique_ptr<HostBackup>> DemoBackup(const DemoOptions& o, Bootstrap& boot,
                                               const Weights& w, const Placement& initial,
                                               bool joiner, std::chrono::milliseconds wait) {
  const std::vector<TensorSpec>& tensors = w.layout.layers[0];
  ExpertLoader load = [&tensors](int l, int e, const std::string& name, uint8_t* dst, uint64_t n) {
    uint32_t t = 0;
    while (t + 1 < tensors.size() && tensors[t].name != name) ++t;
    Pattern(dst, n, static_cast<uint32_t>(l), static_cast<uint32_t>(e), t);
  };
  if (joiner) return LoadHostBackup(o.backup_dir, w.layout, o.experts, load);
  return SetUpNodeBackup(boot, o.survive ? NodeName() : std::string("node"), o.backup_dir, w.layout,
                         o.experts, initial, wait, o.survive ? load : nullptr);
}

Result<LoadTrace> DemoTrace(const DemoOptions& o) {
  SynthOptions so;
  so.layers = o.layers;
  so.experts = o.experts;
  so.steps = o.steps;
  so.seed = o.seed;
  so.zipf = 1.0;
  so.drift = 0.05;
  so.reversion = 0.01;
  so.phase_steps = std::max<int64_t>(o.interval * 2, o.steps / 3);
  so.tokens = o.tokens;
  so.top_k = o.top_k;
  return SynthTrace(so);
}

ServingOptions ModeOptions(const DemoOptions& o, int rank, const std::string& mode, Policy policy,
                           const std::vector<bool>& live, const std::vector<Mode>& modes) {
  ServingOptions so;
  BalancerOptions& bo = so.balancer;
  bo.topology = Topology{o.ranks, 1, o.ranks * o.slots_per_rank, 1};
  bo.policy = policy;
  bo.window = o.window > 0 ? o.window : o.interval;
  bo.trigger.min_gain = o.min_gain;
  bo.trigger.skip_above = o.skip_above;
  bo.async.target_steps = o.async_steps;
  bo.plan_lag_steps = o.plan_lag;
  // Staging buffers (in place, a layer's rows each) for the layers in flight of both modes.
  bo.async.max_layers_in_flight = StagingLayers(o);
  bo.tolerance = o.tolerance;
  bo.trigger.interval = mode == "off" ? o.steps + 1 : o.interval;
  bo.mode = mode == "sync" ? BalancerMode::kSynchronous : BalancerMode::kAsynchronous;
  bo.bytes_per_expert = o.expert_bytes_value;
  bo.live = live;
  so.rearrange.deadline = std::chrono::milliseconds(static_cast<int64_t>(o.deadline_s * 1000));
  so.round_wait =
      std::chrono::milliseconds(static_cast<int64_t>((o.deadline_s * 2 + o.lease_s * 3) * 1000));
  // `--inject ...,KIND:RANK@recovery`: strikes as the first move of the recovery from the
  // event before it begins.
  so.before_move = [&o, &modes, rank](int placement) {
    if (placement != 1 || modes.empty() || modes[0].group == nullptr) return;
    const int settled = static_cast<int>(modes[0].group->recoveries().size());
    for (const DemoOptions::Event& e : o.events) {
      if (e.step < 0 && e.rank == rank && e.after == settled)
        raise(e.kind == "kill" ? SIGKILL : SIGSTOP);
    }
  };
  return so;
}

Status StrikeEvents(const DemoOptions& o, int rank, int step, int64_t step_t0,
                    const std::function<Status(const std::string&)>& send, int64_t* asked_ns) {
  for (const DemoOptions::Event& e : o.events) {
    if (e.step != step) continue;
    if ((e.kind == "kill" || e.kind == "stop") && e.rank == rank) {
      raise(e.kind == "kill" ? SIGKILL : SIGSTOP);  // as a crash or a hung host would
    }
    if (e.kind != "add") continue;
    // The operator scales up: the coordinator starts the new rank's process; the members
    // serve on until it asks to join. The lowest member asks.
    *asked_ns = step_t0;
    const std::vector<bool> now = MembersAt(o, step);
    const int asker = static_cast<int>(std::find(now.begin(), now.end(), true) - now.begin());
    if (rank != asker) continue;
    if (Status asked = send(nlohmann::json{{"spawn", e.rank}}.dump()); !asked.ok())
      return Status::Unavailable(StrCat("asking for rank ", e.rank, ": ", asked.message()));
  }
  return Status::OK();
}

nlohmann::json DrillReport(const ServingGroup& g, const DrillLog& log, uint64_t backup_bytes) {
  const std::vector<RecoveryRecord>& recs = g.recoveries();
  static const RecoveryRecord kNone;
  const RecoveryRecord& first = recs.empty() ? kNone : recs.front();
  int64_t rows_recovered = 0;
  nlohmann::json events = nlohmann::json::array();
  for (const RecoveryRecord& r : recs) {
    rows_recovered += r.rows_recovered;
    events.push_back(RecordJson(r));
  }
  std::vector<int> members;
  const std::vector<bool> now = g.members();
  for (size_t r = 0; r < now.size(); ++r) {
    if (now[r]) members.push_back(static_cast<int>(r));
  }
  return {{"detected_step", log.detected_step},
          {"detect_wait_s", log.detect_wait_s},
          {"recovery_s", first.recovery_s},
          {"drain_s", first.end_s + first.gather_s},
          {"setup_s", first.setup_s},
          {"balancer_s", first.balancer_s},
          {"plan_s", first.plan_s},
          {"move_s", first.move_s},
          {"restore_s", first.restore_s},
          {"epoch", g.epoch()},
          {"members", members},
          {"interrupted", first.interrupted},
          {"experts_recovered", first.experts_recovered},
          {"rows_recovered", rows_recovered},
          {"bytes_moved", first.bytes_moved},
          {"backup_bytes", backup_bytes},
          {"placements", first.placements},
          {"restarts", first.restarts},
          {"events", events},
          {"step_ns", log.step_ns}};
}

}  // namespace eplbx::cli
