// One rank of `eplbx demo --serve`: an expert-parallel forward loop over real weights.
//
// Every step, a gate routes `tokens` x `top_k` tokens per layer to logical experts (the
// simulator's Zipf + drift trace, the same on every rank); an expert's tokens are split over
// its replicas; for each routed token the rank works over `work_bytes` of the expert's
// row (it recomputes the pattern the row must hold and compares: real work over the
// weights, and a check of every row it uses against the map it read). The work is timed
// in this thread's CPU time per layer, one rank at a time (a semaphore the coordinator
// shares), so ranks sharing cores do not distort it. After the work the
// rank calls the Balancer's Step and Commit (its safe point) and records when it entered and
// left them (CLOCK_MONOTONIC, the same clock in every process): the coordinator models a
// step as the slowest rank's work plus the Balancer's cost, from the last rank entering to
// the last leaving (serve_report.cc). Each layer is its own synchronisation point (its
// dispatch and combine all-to-all): a step's work is the sum over layers of the slowest
// rank's work on that layer.
#include <semaphore.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstring>

#include <nlohmann/json.hpp>

#include "cli/demo.h"
#include "common/bytes.h"
#include "common/strings.h"
#include "eplbx/balancer.h"
#include "eplbx/rearrange.h"
#include "eplbx/simulate.h"
#include "eplbx/survivors.h"
#include "eplbx/backup.h"
#include "serve/members_map.h"

namespace eplbx::cli {
namespace {

using internal::StrCat;

double ThreadCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

int64_t MonotonicNs() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
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

struct ModeRun {
  std::vector<double> cpu_s;  // steps x layers: this rank's work on each layer
  std::vector<double> balancedness;
  std::vector<int64_t> enter_ns, exit_ns;
  std::vector<int> rebalancing;  // 1 while a rebalance was in flight during the step
  std::vector<int> committed;    // layers whose map changed at this step's Commit
  uint64_t rows_checked = 0, bad_rows = 0;
  uint64_t checksum = 0;  // of the work (reported, so the compiler keeps it)
  std::string first_bad, error;
  bool verified = false;
  // A drill rebuilds the Balancer: what the one before the loss did, and the step the new
  // one's step 0 is.
  std::vector<RebalanceRecord> earlier;
  int failed_earlier = 0;
  int64_t step_offset = 0;
};

// One mode's world on this rank: its own weights (and agent and Rearranger when it moves
// weights), its Balancer, what it measured.
struct Mode {
  std::string name;
  std::unique_ptr<Agent> agent;
  Weights w;
  std::unique_ptr<Rearranger> rearranger;
  std::unique_ptr<Balancer> balancer;
  BalancerOptions options;  // what it was created with (a drill rebuilds it over the members)
  ModeRun m;
};

// The expert work of one step on `mode`'s weights: every row this rank holds, each routed
// token over `work` bytes of tensor 0 (which `segments` cycle through), checked against the
// pattern of the expert the placement in force names.
void Work(const DemoOptions& o, int rank, int step, std::span<const double> counts, Mode& mode,
          uint64_t work, uint64_t segments) {
  const Weights& w = mode.w;
  const Placement& p = mode.balancer->placement();
  const uint64_t row0 = w.bytes[0];
  uint64_t sink = 0;
  for (int l = 0; l < o.layers; ++l) {
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
    mode.m.cpu_s.push_back(ThreadCpuSeconds() - cpu0);
  }
  mode.m.checksum += sink;
}

nlohmann::json ModeReport(Mode& mode) {
  ModeRun& m = mode.m;
  static const BalancerReport kNone;
  const BalancerReport& br = mode.balancer != nullptr ? mode.balancer->report() : kNone;
  uint64_t bytes_read = 0, bytes_copied = 0;
  nlohmann::json rebalances = nlohmann::json::array();
  std::vector<RebalanceRecord> all = m.earlier;
  for (RebalanceRecord x : br.rebalances) {
    x.step += m.step_offset;
    x.finished_step += m.step_offset;
    all.push_back(std::move(x));
  }
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
          {"failed", br.failed + m.failed_earlier},
          {"error", m.error},
          {"verified", m.verified}};
}

// The kill / stop drill of `--serve --inject KIND:RANK@STEP` (docs/cli.md, "Serving through a
// lost rank"): what this survivor saw and did.
struct DrillLog {
  int detected_step = -1;
  double detect_wait_s = 0;  // from the start of that step until the loss was known here
  double recovery_s = 0;     // from then until serving again with every expert present
  double drain_s = 0, release_s = 0, setup_s = 0, plan_s = 0, move_s = 0, restore_s = 0,
         balancer_s = 0;
  uint64_t epoch = 0;
  std::vector<int> members;
  std::string interrupted;  // how the rebalance in flight ended ("" when none was)
  int64_t experts_recovered = 0, rows_recovered = 0;
  uint64_t bytes_moved = 0;
  uint64_t backup_bytes = 0;          // the host backup's memory cost (rows held)
  int attempts = 0;                   // placements over the members tried
  std::vector<std::string> restarts;  // why each placement after the first was needed
  std::vector<int64_t> step_ns;       // wall-clock time of every step here, recovery included
};

// How long a member waits for a round over the coordinator: twice the deadline (the
// coordinator fails a round a member misses after 0.8 x the deadline).
std::chrono::milliseconds RoundWait(const DemoOptions& o) {
  return std::chrono::milliseconds(static_cast<int64_t>(o.deadline_s * 2000));
}

double SecondsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// The load of the last window up to `step`, as the Balancer would plan from it.
Result<LoadMatrix> WindowLoad(const DemoOptions& o, const LoadTrace& trace, int step) {
  std::vector<double> sum(static_cast<size_t>(o.layers) * o.experts, 0.0);
  for (int k = std::max(0, step - o.interval + 1); k <= step; ++k) {
    const std::span<const double> c = trace.step(k);
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += c[i];
  }
  return LoadMatrix::Create(o.layers, o.experts, sum);
}

// Ends the rebalance in flight (every rank at the same step).
void EndRebalance(Mode& mode, DrillLog& log) {
  while (mode.balancer->progress().rebalancing) {
    BalancerCommit c = mode.balancer->Commit();
    for (const CommittedLayer& cl : c.layers)
      mode.w.SetRows(static_cast<int>(cl.layer), cl.row_of_slot);
    if (c.finished) log.interrupted = c.status.ok() ? "finished" : c.status.message();
  }
}

// After a Rearrange in swap mode: this rank's row tables in force, in the weights and layout.
void TakeRowTables(const DemoOptions& o, Mode& mode) {
  if (mode.w.spare == 0) return;
  for (int l = 0; l < o.layers; ++l)
    mode.w.SetRows(l, mode.rearranger->RowTable(static_cast<uint32_t>(l)));
  mode.w.layout.row_of_slot = mode.w.row_of_slot;
}

// The group's member set changed: the Balancer goes (what it did is kept for the report) and
// the Rearranger is rebuilt over the members (connections to members and staging buffers
// kept; again if the member set moves meanwhile). The Balancer is made again by
// BalancerOverMembers once the placement is set.
Status RearrangerOverMembers(int step, Bootstrap& boot, Mode& mode, DrillLog& log) {
  mode.m.step_offset = step + 1;  // the new Balancer's first Step is the next step
  auto t = std::chrono::steady_clock::now();
  if (mode.balancer != nullptr) {  // (gone already when a placement is tried again)
    for (const RebalanceRecord& x : mode.balancer->report().rebalances) mode.m.earlier.push_back(x);
    mode.m.failed_earlier += mode.balancer->report().failed;
    mode.balancer.reset();
  }
  log.release_s += SecondsSince(t);
  t = std::chrono::steady_clock::now();
  Status rebuilt = Status::Internal("not rebuilt");
  for (int attempt = 0; attempt < 4; ++attempt) {
    const uint64_t epoch = boot.epoch();
    rebuilt = mode.rearranger->Rebuild();
    if (rebuilt.ok() || boot.epoch() == epoch) break;
  }
  if (!rebuilt.ok()) return rebuilt.WithPrefix("the Rearranger over the members");
  if (mode.w.spare > 0) {  // the row tables in force, for the recovery's writes
    for (int l = 0; l < static_cast<int>(mode.w.row_of_slot.size()); ++l)
      mode.w.SetRows(l, mode.rearranger->RowTable(static_cast<uint32_t>(l)));
    mode.w.layout.row_of_slot = mode.w.row_of_slot;
  }
  log.setup_s += SecondsSince(t);
  log.epoch = boot.epoch();
  log.members.clear();
  const std::vector<bool> live = boot.members();
  for (size_t r = 0; r < live.size(); ++r) {
    if (live[r]) log.members.push_back(static_cast<int>(r));
  }
  return Status::OK();
}

// The Balancer again, over the members, from `placement` (the other ranks' slots empty).
Status BalancerOverMembers(Bootstrap& boot, Mode& mode, const Placement& placement, DrillLog& log) {
  const auto t = std::chrono::steady_clock::now();
  mode.options.live = boot.members();
  Result<std::unique_ptr<Balancer>> b =
      Balancer::Create(placement, mode.options, mode.rearranger.get());
  if (!b.ok()) return b.status().WithPrefix("a Balancer over the members");
  mode.balancer = std::move(*b);
  log.balancer_s = SecondsSince(t);
  return Status::OK();
}

// `--resize remove:RANK@STEP`, on every rank at that step: ends the rebalance in flight,
// plans the drain of RANK (PlanResize: its experts go to the others, incremental from what
// they hold; RANK is a source only) and runs it with the Rearranger over every member. Then
// RANK leaves (its report sent) and the others go on over the members (the serving loop).
Status DrainRank(const DemoOptions& o, int step, const LoadTrace& trace, const Topology& topo,
                 Mode& mode, DrillLog& log, Placement* after) {
  auto t = std::chrono::steady_clock::now();
  EndRebalance(mode, log);
  log.drain_s = SecondsSince(t);
  t = std::chrono::steady_clock::now();
  EPLBX_ASSIGN_OR_RETURN(LoadMatrix window, WindowLoad(o, trace, step));
  ResizeRequest request;
  request.remove = {o.fault_rank};
  SurvivorOptions so;
  so.policy = Policy::kIncremental;
  so.migration.bytes_per_expert = o.expert_bytes_value;
  Result<ResizePlan> plan = PlanResize(mode.balancer->placement(), window, topo, request, so);
  if (!plan.ok()) return plan.status();
  log.plan_s = SecondsSince(t);
  t = std::chrono::steady_clock::now();
  // The leaving rank's rows are only read: through the move they keep what they hold (the
  // placement after has them empty, since nobody will serve from them).
  std::vector<int32_t> kept = plan->placement.phy2log();
  const int per_rank = topo.slots_per_rank();
  for (int l = 0; l < o.layers; ++l) {
    for (int i = 0; i < per_rank; ++i) {
      const int slot = o.fault_rank * per_rank + i;
      kept[static_cast<size_t>(l) * topo.slots + slot] = plan->sources.phy2log(l, slot);
    }
  }
  EPLBX_ASSIGN_OR_RETURN(Placement interim,
                         Placement::FromPhy2Log(o.layers, topo.slots, o.experts, kept));
  RearrangeReport moved = mode.rearranger->Rearrange(plan->sources, interim, plan->migration);
  if (!moved.status.ok()) return moved.status.WithPrefix(StrCat("draining rank ", o.fault_rank));
  log.bytes_moved = moved.bytes_read;
  TakeRowTables(o, mode);
  log.move_s = SecondsSince(t);
  *after = plan->placement;
  return Status::OK();
}

// This rank's own slots, layers x slots per rank, as `p` has them.
std::vector<int32_t> OwnSlots(const Placement& p, int rank, int rows) {
  std::vector<int32_t> out;
  for (int l = 0; l < p.layers(); ++l) {
    for (int row = 0; row < rows; ++row) out.push_back(p.phy2log(l, rank * rows + row));
  }
  return out;
}

// One round of settling the members after a member-set change (serve/members_map.h).
using internal::MembersRound;
Result<MembersRound> GatherMaps(const DemoOptions& o, const Topology& topo, Bootstrap& boot,
                                int step, uint64_t placed_at, const std::vector<int32_t>& own,
                                std::chrono::milliseconds first_wait) {
  const std::string mine = internal::EncodeMembersMap(step, placed_at, own);
  Result<std::vector<std::string>> all = Status::Internal("not gathered");
  // Again while the member set moves (a joiner's first contribution is refused: it learns the
  // epoch and member set, then contributes with the members).
  for (int attempt = 0; attempt < 6; ++attempt) {
    const uint64_t epoch = boot.epoch();
    all = boot.AllGather(mine, attempt == 0 ? first_wait : RoundWait(o));
    if (all.ok() || boot.epoch() == epoch) break;
  }
  if (!all.ok()) return all.status().WithPrefix("gathering the members' maps");
  if (all->size() != static_cast<size_t>(topo.ranks)) {
    return Status::Internal(
        StrCat("the members' maps came from ", all->size(), " ranks; the group has ", topo.ranks));
  }
  return internal::DecodeMembersRound(*all, o.layers, o.slots_per_rank, o.experts);
}

// Plans over the members from the placement in force and moves there: among the members
// (a joiner's empty slots filled from the others), then the experts no member holds from the
// host backup (`backup` null: there must be none). `own` follows what this rank's slots hold
// as layers commit (a move that fails half way leaves the layers before it committed). A
// drill's second fault (`--inject ...,KIND:RANK@recovery`) strikes here, as the move begins.
Status PlaceOverMembers(const DemoOptions& o, int step, const LoadTrace& trace,
                        const Topology& topo, const Placement& in_force, Bootstrap& boot,
                        Mode& mode, const HostBackup* backup, DrillLog& log,
                        std::vector<int32_t>* own, Placement* placed) {
  using Clock = std::chrono::steady_clock;
  const std::vector<bool> live = boot.members();
  const int rank = static_cast<int>(boot.rank()), rows = o.slots_per_rank;
  auto t = Clock::now();
  EPLBX_ASSIGN_OR_RETURN(LoadMatrix window, WindowLoad(o, trace, step));
  SurvivorOptions so;
  so.policy = Policy::kIncremental;
  if (backup != nullptr) so.backup = [backup](int l, int e) { return backup->Holds(l, e); };
  so.migration.bytes_per_expert = o.expert_bytes_value;
  Result<SurvivorPlan> plan = PlanSurvivors(in_force, window, topo, live, so);
  if (!plan.ok()) return plan.status();
  log.experts_recovered = plan->experts_recovered;  // the last plan's
  log.plan_s += SecondsSince(t);
  t = Clock::now();
  if (rank == o.fault2_rank && log.attempts == 1) {
    raise(o.fault2 == "kill" ? SIGKILL : SIGSTOP);
  }
  RearrangeReport moved = mode.rearranger->Rearrange(plan->sources, plan->interim, plan->migration);
  log.bytes_moved += moved.bytes_read;
  TakeRowTables(o, mode);
  const std::vector<int32_t> interim = OwnSlots(plan->interim, rank, rows);
  for (const LayerOutcome& lo : moved.layers) {
    if (!lo.committed) continue;
    for (int row = 0; row < rows; ++row) {
      const size_t i = static_cast<size_t>(lo.layer) * rows + row;
      (*own)[i] = interim[i];
    }
  }
  log.move_s += SecondsSince(t);
  if (!moved.status.ok()) return moved.status.WithPrefix("moving among the members");
  t = Clock::now();
  // (Without a backup PlanSurvivors names every expert no member holds; nothing to recover.)
  if (!plan->recovered.empty()) {
    EPLBX_RETURN_IF_ERROR(backup->Check());
    Result<int64_t> restored = RecoverSlots(*plan, mode.w.layout, *backup);
    if (!restored.ok()) return restored.status().WithPrefix("restoring from the host backup");
    log.rows_recovered += *restored;
  }
  *own = OwnSlots(plan->placement, rank, rows);
  log.restore_s += SecondsSince(t);
  *placed = plan->placement;
  return Status::OK();
}

// After the group's member set changed (the step's collective failed with a new epoch: a
// member was lost, or a new one joined), every member at the same step, a joiner included
// (`joiner`: its Rearranger is created here and it learns the step; `own`: what this rank's
// slots hold, once the rebalance in flight ended; a joiner's are empty): rounds of (agree on
// the maps, Rearranger over the members, place over them) until a round finds every member
// placed at the epoch it is at (a member lost during the placement moves the epoch: the next
// round goes again from what each member's slots hold then); then the Balancer over the
// members. Returns the step.
Result<int> SettleMembers(const DemoOptions& o, int step, const LoadTrace& trace,
                          const Topology& topo, Bootstrap& boot, Mode& mode,
                          const HostBackup* backup, DrillLog& log, std::vector<int32_t> own,
                          bool joiner) {
  using Clock = std::chrono::steady_clock;
  auto t = Clock::now();
  uint64_t placed_at = 0, tried_at = 0;
  Placement placed;
  Status last = Status::OK();
  for (log.attempts = 0;;) {
    t = Clock::now();
    // A joiner's first contribution asks to join and waits to be taken in: up to 10 x the
    // deadline (`eplbx worker`: a standby started before the members ask for it).
    const auto wait = RoundWait(o) * (joiner && log.attempts == 0 && step < 0 ? 5 : 1);
    EPLBX_ASSIGN_OR_RETURN(MembersRound round,
                           GatherMaps(o, topo, boot, step, placed_at, own, wait));
    log.drain_s += SecondsSince(t);
    if (round.step < 0) return Status::Internal("no member said which step it is at");
    step = round.step;  // (this rank's own, unless it joins: they all agree)
    if (round.all_placed && round.placed_at == boot.epoch()) break;  // settled
    if (log.attempts > 0 && boot.epoch() == tried_at) {
      // Nobody was lost, yet a placement failed: going again would not help.
      return Status::Internal(StrCat("placing over the members failed on ", round.not_placed,
                                     " with no member lost",
                                     last.ok() ? "" : StrCat(" (here: ", last.message(), ")")));
    }
    if (log.attempts == 4) {
      return Status::Aborted(StrCat("the member set changed during each of ", log.attempts,
                                    " placements over the members (now epoch ", boot.epoch(), ")"));
    }
    if (log.attempts > 0) {
      log.restarts.push_back(
          StrCat("epoch ", tried_at, " -> ", boot.epoch(), ": ",
                 last.ok() ? std::string("placed here, not everywhere") : last.message()));
    }
    ++log.attempts;
    if (joiner && mode.rearranger == nullptr) {
      t = Clock::now();
      RearrangeOptions ro;
      ro.deadline = std::chrono::milliseconds(static_cast<int64_t>(o.deadline_s * 1000));
      Result<std::unique_ptr<Rearranger>> r =
          Rearranger::Create(mode.agent.get(), &boot, mode.w.layout, ro);
      if (!r.ok()) return r.status().WithPrefix("a Rearranger with the members");
      mode.rearranger = std::move(*r);
      log.setup_s += SecondsSince(t);
      mode.m.step_offset = step + 1;
    } else {
      EPLBX_RETURN_IF_ERROR(RearrangerOverMembers(step, boot, mode, log));
    }
    placed_at = 0;
    tried_at = boot.epoch();
    last = PlaceOverMembers(o, step, trace, topo, round.in_force, boot, mode, backup, log, &own,
                            &placed);
    if (last.ok()) placed_at = tried_at;
  }
  log.epoch = boot.epoch();
  log.members.clear();
  const std::vector<bool> live = boot.members();
  for (size_t k = 0; k < live.size(); ++k) {
    if (live[k]) log.members.push_back(static_cast<int>(k));
  }
  EPLBX_RETURN_IF_ERROR(BalancerOverMembers(boot, mode, placed, log));
  return step;
}

}  // namespace

int RunServeRank(const DemoOptions& o, int rank, SocketBootstrap& boot, nlohmann::json* sent) {
  nlohmann::json report = NewRankReport(rank);
  report["node"] = NodeName();
  auto finish = [&](int code) {
    (void)boot.SendMessage(report.dump());
    if (sent != nullptr) *sent = report;
    return code;
  };
  auto fail = [&](const std::string& why) {
    report["error"] = why;
    return finish(1);
  };
  const auto deadline = std::chrono::milliseconds(static_cast<int64_t>(o.deadline_s * 1000));
  // A round over the coordinator: it fails a round a member misses after 0.8 x the deadline
  // (naming it, under a new epoch); the members wait twice the deadline, so they hear that
  // rather than give up first on a loaded machine.
  const auto round_wait = RoundWait(o);
  // The gate: the simulator's skewed, drifting load, the same on every rank.
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
  Result<LoadTrace> trace = SynthTrace(so);
  if (!trace.ok()) return fail(trace.status().message());
  const Topology topo{o.ranks, 1, o.ranks * o.slots_per_rank, 1};
  const LoadMatrix uniform = *LoadMatrix::Create(
      o.layers, o.experts, std::vector<double>(static_cast<size_t>(o.layers) * o.experts, 1.0));
  // `--resize add:RANK@STEP`: RANK is no member until it joins (its slots empty); its process
  // starts when the members reach STEP.
  const bool drill = o.fault_step >= 0 || o.survive;
  const bool adding = drill && o.fault == "add";
  const bool joiner = adding && rank == o.fault_rank;
  std::vector<bool> live(o.ranks, true);
  if (adding) live[o.fault_rank] = false;
  Result<Placement> initial = Status::Internal("not planned");
  {
    Result<Placement> compact =
        Plan(uniform, MembersTopology(topo, live), {.policy = Policy::kBalanced});
    initial = compact.ok() ? SpreadOverMembers(*compact, topo, live) : compact.status();
  }
  if (!initial.ok()) return fail(initial.status().message());
  Result<Policy> policy = ParsePolicy(o.policy);
  if (!policy.ok()) return fail(policy.status().message());
  // Every mode has its own weights (and agent): the modes run step by step interleaved, so
  // that a slow spell of this machine falls on all of them alike.
  std::vector<Mode> modes(o.mode_list.size());
  for (size_t i = 0; i < modes.size(); ++i) {
    Mode& mode = modes[i];
    mode.name = o.mode_list[i];
    Result<std::unique_ptr<Agent>> agent = MakeDemoAgent(o, rank, false, StrCat("-", mode.name));
    if (!agent.ok()) return fail(agent.status().message());
    mode.agent = std::move(*agent);
    Result<Weights> made = MakeWeights(o, rank, *mode.agent);
    if (!made.ok()) return fail(made.status().message());
    mode.w = std::move(*made);
    report["weights_created"] = true;
    // (A joiner's slots hold nothing until it joins: nothing to write.)
    for (int l = 0; l < o.layers && !joiner; ++l) FillLayer(mode.w, *initial, l, rank);
    BalancerOptions bo;
    bo.topology = topo;
    bo.policy = *policy;
    bo.window = o.interval;
    bo.trigger.interval = mode.name == "off" ? o.steps + 1 : o.interval;
    bo.mode = mode.name == "sync" ? BalancerMode::kSynchronous : BalancerMode::kAsynchronous;
    bo.bytes_per_expert = o.expert_bytes_value;
    if (adding) bo.live = live;
    mode.options = bo;
    if (joiner) continue;               // its Rearranger and Balancer come when it joins
    if (mode.name != "off" || drill) {  // a drill moves weights in any mode
      RearrangeOptions ro;
      ro.deadline = deadline;
      Result<std::unique_ptr<Rearranger>> r =
          Rearranger::Create(mode.agent.get(), &boot, mode.w.layout, ro);
      if (!r.ok()) return fail(StrCat(mode.name, ": ", r.status().message()));
      mode.rearranger = std::move(*r);
    }
    Result<std::unique_ptr<Balancer>> b = Balancer::Create(*initial, bo, mode.rearranger.get());
    if (!b.ok()) return fail(StrCat(mode.name, ": ", b.status().message()));
    mode.balancer = std::move(*b);
  }
  // The drill's host backup (a loss only): rank 0 creates the file, every rank copies in the
  // experts its slots hold (together: every expert), so experts only a lost rank held can be
  // restored.
  DrillLog drill_log;
  const bool removal = drill && o.fault == "remove";
  const bool loss = drill && !removal && !adding;
  bool left = false;  // this rank was drained and left the group (--resize remove)
  std::unique_ptr<HostBackup> backup;
  // A new backup goes to the ranks that open it through the bootstrap; once all opened it
  // (the start barrier), the creator removes the name.
  auto open_shared = [&](int creator) -> Status {
    Result<std::unique_ptr<HostBackup>> b =
        ShareHostBackup(boot, static_cast<uint32_t>(creator), std::move(backup), round_wait);
    if (!b.ok()) return b.status();
    backup = std::move(*b);
    return Status::OK();
  };
  if (loss && o.survive) {
    // `eplbx worker --serve`: every node keeps its own backup of every expert, loaded as from
    // the checkpoint (the demo's weights are a function of layer, expert and tensor) by the
    // node's lowest rank; the node's other ranks map it. A lost node's experts are then in
    // every other node's backup.
    const std::string node = NodeName();
    Result<std::vector<std::string>> nodes = boot.AllGather(node, deadline);
    if (!nodes.ok()) return fail(nodes.status().message());
    int first = rank;
    for (int r = 0; r < rank; ++r) {
      if ((*nodes)[r] == node) {
        first = r;
        break;
      }
    }
    if (rank == first) {
      Result<std::unique_ptr<HostBackup>> b =
          HostBackup::Create(o.backup_dir, modes[0].w.layout, o.experts);
      if (!b.ok()) return fail(b.status().message());
      backup = std::move(*b);
      for (int l = 0; l < o.layers; ++l) {
        const std::vector<TensorSpec>& tensors = modes[0].w.layout.layers[l];
        for (int e = 0; e < o.experts; ++e) {
          Status loaded =
              backup->Load(l, e, [&](const std::string& name, uint8_t* dst, uint64_t n) {
                uint32_t t = 0;
                while (t + 1 < tensors.size() && tensors[t].name != name) ++t;
                Pattern(dst, n, static_cast<uint32_t>(l), static_cast<uint32_t>(e), t);
              });
          if (!loaded.ok()) return fail(loaded.message());
        }
      }
    }
    if (Status opened = open_shared(first); !opened.ok()) return fail(opened.message());
  } else if (loss) {
    if (rank == 0) {
      Result<std::unique_ptr<HostBackup>> b =
          HostBackup::Create(o.backup_dir, modes[0].w.layout, o.experts);
      if (!b.ok()) return fail(b.status().message());
      backup = std::move(*b);
    }
    if (Status opened = open_shared(0); !opened.ok()) return fail(opened.message());
    if (Status c = backup->Capture(*initial, modes[0].w.layout); !c.ok()) return fail(c.message());
  }
  // The joiner joins the members where they are; the members start together.
  int first_step = 0;
  if (joiner) {
    const int64_t t0 = MonotonicNs();
    Result<int> at = SettleMembers(
        o, -1, *trace, topo, boot, modes[0], nullptr, drill_log,
        std::vector<int32_t>(static_cast<size_t>(o.layers) * o.slots_per_rank, -1), true);
    drill_log.recovery_s = static_cast<double>(MonotonicNs() - t0) * 1e-9;
    if (!at.ok())
      return fail(StrCat("joining at step ", o.fault_step, ": ", at.status().message()));
    drill_log.detected_step = *at;
    first_step = *at + 1;
    drill_log.step_ns.assign(static_cast<size_t>(first_step), 0);  // steps before it joined
  } else {
    Status ready = boot.Barrier(round_wait);
    if (!ready.ok()) return fail(ready.message());
  }
  // Every rank of the node has the backup open: no name is left behind, even by a crash.
  if (backup != nullptr) {
    if (Status gone = backup->Unlink(); !gone.ok()) return fail(gone.message());
  }
  uint64_t epoch = boot.epoch();
  // The member that asks for the new rank (`--resize add`): the lowest initial member.
  const int asker = adding && o.fault_rank == 0 ? 1 : 0;
  int64_t add_requested_ns = 0;
  const uint64_t row0 = modes[0].w.bytes[0];
  const uint64_t work = std::max<uint64_t>(8, std::min<uint64_t>(o.work_bytes_value, row0) & ~7ull);
  const uint64_t segments = std::max<uint64_t>(1, row0 / work);
  auto* turn = static_cast<sem_t*>(o.work_turn);
  bool stopped = false;
  bool coordinator_gone = false;  // no round can be answered any more: no final barrier
  for (int step = first_step; step < o.steps && !stopped; ++step) {
    const int64_t step_t0 = MonotonicNs();
    if (loss && rank == o.fault_rank && step == o.fault_step) {
      raise(o.fault == "kill" ? SIGKILL : SIGSTOP);  // as a crash or a hung host would
    }
    if (adding && step == o.fault_step && !joiner) {
      // The operator scales up: the coordinator starts the new rank's process; the members
      // serve on until it asks to join.
      add_requested_ns = step_t0;
      if (rank == asker) {
        if (Status asked = boot.SendMessage(nlohmann::json{{"spawn", o.fault_rank}}.dump());
            !asked.ok()) {
          modes[0].m.error = StrCat("asking for rank ", o.fault_rank, ": ", asked.message());
          break;
        }
      }
    }
    const std::span<const double> counts = trace->step(step);
    for (Mode& mode : modes) {
      ModeRun& m = mode.m;
      while (turn != nullptr && sem_wait(turn) != 0) {
      }
      Work(o, rank, step, counts, mode, work, segments);
      if (turn != nullptr) sem_post(turn);
      Balancer& b = *mode.balancer;
      m.enter_ns.push_back(MonotonicNs());
      Result<BalancerStep> st = b.Step(counts);
      const bool in_flight = b.progress().rebalancing;
      BalancerCommit c = b.Commit();
      for (const CommittedLayer& cl : c.layers)
        mode.w.SetRows(static_cast<int>(cl.layer), cl.row_of_slot);
      m.exit_ns.push_back(MonotonicNs());
      if (!st.ok()) {  // the same load on every rank: every rank stops here
        m.error = st.status().message();
        stopped = true;
        break;
      }
      m.balancedness.push_back(st->balancedness);
      m.rebalancing.push_back(in_flight || (st->began && mode.name == "sync") ? 1 : 0);
      m.committed.push_back(static_cast<int>(c.layers.size()));
      if (c.finished && !c.status.ok()) {
        // In a drill the rebalance the lost rank was in fails (its layers roll back); the
        // step's collective below says why. One that fails once the members re-placed is an
        // error.
        if (drill && drill_log.detected_step < 0) {
          drill_log.interrupted = c.status.message();
        } else if (m.error.empty()) {
          m.error = c.status.message();
        }
      }
    }
    if (drill && !stopped) {
      if (removal && step == o.fault_step) {
        // A graceful removal: every rank drains the leaving one, then it leaves and the
        // others learn the new member set from the next round and go on over it.
        const int64_t t0 = MonotonicNs();
        drill_log.detected_step = step;
        Placement after;
        Status drained = DrainRank(o, step, *trace, topo, modes[0], drill_log, &after);
        if (!drained.ok()) {
          modes[0].m.error =
              StrCat("removing rank ", o.fault_rank, " at step ", step, ": ", drained.message());
          stopped = true;
        } else if (rank == o.fault_rank) {
          left = true;
          stopped = true;
        } else {
          Status round = boot.Barrier(round_wait);  // refused once the drained rank is gone
          Status rebuilt = round.ok() || boot.epoch() == epoch
                               ? Status::Internal(StrCat(
                                     "rank ", o.fault_rank, " was drained but did not leave (",
                                     round.ok() ? "the round completed" : round.message(), ")"))
                               : RearrangerOverMembers(step, boot, modes[0], drill_log);
          if (rebuilt.ok()) rebuilt = BalancerOverMembers(boot, modes[0], after, drill_log);
          epoch = boot.epoch();
          if (!rebuilt.ok()) {
            modes[0].m.error =
                StrCat("going on without rank ", o.fault_rank, ": ", rebuilt.message());
            stopped = true;
          }
        }
        drill_log.recovery_s = static_cast<double>(MonotonicNs() - t0) * 1e-9;
      } else {
        // The step's collective (an engine's all-to-all): a lost member fails it for every
        // survivor with a new epoch, as a new member's asking to join does; then every member
        // re-places over the new set, all at this step. A join is timed from the request.
        Status alive = boot.Barrier(round_wait);
        if (!alive.ok() && boot.epoch() != epoch && drill_log.detected_step < 0) {
          drill_log.detected_step = step;
          drill_log.detect_wait_s =
              static_cast<double>(MonotonicNs() - (adding ? add_requested_ns : step_t0)) * 1e-9;
          const int64_t t0 = MonotonicNs();
          // A rebalance in flight ends at its next Commit (the member set changed under it:
          // the layers committed so far stay); then the members settle over the new set.
          EndRebalance(modes[0], drill_log);
          Status rec =
              SettleMembers(o, step, *trace, topo, boot, modes[0], backup.get(), drill_log,
                            OwnSlots(modes[0].balancer->placement(), rank, o.slots_per_rank), false)
                  .status();
          drill_log.recovery_s = static_cast<double>(MonotonicNs() - t0) * 1e-9;
          epoch = boot.epoch();
          if (!rec.ok()) {
            modes[0].m.error = adding ? StrCat("taking in rank ", o.fault_rank, " at step ", step,
                                               ": ", rec.message())
                                      : StrCat("recovery at step ", step, ": ", rec.message());
            stopped = true;
          }
        } else if (!alive.ok()) {
          // The coordinator fails a round a member misses at 0.8 x the deadline; a member that
          // waited 2 x for the step's collective heard nothing: the coordinator (rank 0's
          // store) is stopped, hung or unreachable, and no later round can be answered.
          coordinator_gone = alive.code() == Code::kTimeout || alive.code() == Code::kUnavailable;
          modes[0].m.error =
              alive.code() == Code::kTimeout
                  ? StrCat("step ", step,
                           ": the coordinator (rank 0's store) did not answer the "
                           "step's collective within ",
                           RoundWait(o).count() / 1000.0,
                           " s (2 x --deadline): rank 0 stopped, hung or unreachable")
                  : StrCat("step ", step, ": ", alive.message());
          stopped = true;
        }
      }
      drill_log.step_ns.push_back(MonotonicNs() - step_t0);
    }
    if (rank == 0 && (step + 1) % 100 == 0) {
      (void)boot.SendMessage(nlohmann::json{
          {"progress",
           StrCat("step ", step + 1, "/", o.steps,
                  " served in every "
                  "mode")}}.dump());
    }
  }
  bool all_ok = true;
  nlohmann::json out = nlohmann::json::object();
  for (Mode& mode : modes) {
    ModeRun& m = mode.m;
    // A rebalance still in flight ends on every rank at the same step.
    while (mode.balancer != nullptr && mode.balancer->progress().rebalancing) {
      BalancerCommit c = mode.balancer->Commit();
      for (const CommittedLayer& cl : c.layers)
        mode.w.SetRows(static_cast<int>(cl.layer), cl.row_of_slot);
      if (c.finished && !c.status.ok() && m.error.empty()) m.error = c.status.message();
    }
    std::string bad;  // (no Balancer: a drill's recovery failed, m.error says how)
    for (int l = 0; l < o.layers && bad.empty() && mode.balancer != nullptr; ++l)
      bad = VerifyLayer(mode.w, mode.balancer->placement(), l, rank);
    if (!bad.empty() && m.error.empty()) m.error = StrCat("final verification: ", bad);
    if (m.bad_rows > 0 && m.error.empty()) m.error = m.first_bad;
    m.verified = m.error.empty();
    all_ok = all_ok && m.verified;
    if (!m.error.empty() && report["error"].get<std::string>().empty())
      report["error"] = StrCat(mode.name, ": ", m.error);
    out[mode.name] = ModeReport(mode);
  }
  // Nobody tears its agents down while a peer may still be finishing (a rank that left is
  // no member any more: it reports and goes).
  Status done = left || coordinator_gone ? Status::OK() : boot.Barrier(round_wait);
  if (!done.ok() && report["error"].get<std::string>().empty()) report["error"] = done.message();
  if (drill) {
    report["left"] = left;
    if (drill_log.detected_step < 0 && o.fault_step >= 0 &&
        report["error"].get<std::string>().empty()) {
      report["error"] = StrCat("the ", o.fault, " of rank ", o.fault_rank, " at step ",
                               o.fault_step, " was never detected");
      all_ok = false;
    }
    drill_log.backup_bytes = backup == nullptr ? 0 : backup->held_bytes();
    report["drill"] = {{"detected_step", drill_log.detected_step},
                       {"detect_wait_s", drill_log.detect_wait_s},
                       {"recovery_s", drill_log.recovery_s},
                       {"drain_s", drill_log.drain_s},
                       {"release_s", drill_log.release_s},
                       {"setup_s", drill_log.setup_s},
                       {"balancer_s", drill_log.balancer_s},
                       {"plan_s", drill_log.plan_s},
                       {"move_s", drill_log.move_s},
                       {"restore_s", drill_log.restore_s},
                       {"epoch", drill_log.epoch},
                       {"members", drill_log.members},
                       {"interrupted", drill_log.interrupted},
                       {"experts_recovered", drill_log.experts_recovered},
                       {"rows_recovered", drill_log.rows_recovered},
                       {"bytes_moved", drill_log.bytes_moved},
                       {"backup_bytes", drill_log.backup_bytes},
                       {"placements", drill_log.attempts},
                       {"restarts", drill_log.restarts},
                       {"step_ns", drill_log.step_ns}};
  }
  report["modes"] = std::move(out);
  report["verified"] = all_ok && done.ok();
  report["weights_intact"] = all_ok;
  return finish(all_ok && done.ok() ? 0 : 1);
}

}  // namespace eplbx::cli
