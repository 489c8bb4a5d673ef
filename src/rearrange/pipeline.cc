// The asynchronous, pipelined rearrangement (docs/protocol.md, "Asynchronous commits").
//
// Each layer runs the same protocol as the synchronous loop (MAPS, READY, READ, DONE),
// into its own staging buffer; up to max_layers_in_flight layers run at once. A layer this
// rank vouches for (its DONE sent: its reads landed; every rank's maps matched) is *ready*
// here; it is applied only when every rank voted it ready (every rank vouches for it: every
// read of it landed). Votes (the rule: src/protocol/votes.h): at each Commit()
// call (step s) a rank sends VOTE(s, how many leading layers are ready here, failed?) to
// every rank, then applies the layers that every rank's VOTE(s - 1) says are ready. The vote
// of the previous step was sent a whole step earlier, so it is normally there already; the
// commit of a layer lags its readiness by one step, and every rank applies the same layers
// at the same step. A failure on any rank reaches every rank in the next VOTE: all of them
// end the rearrangement at the same step with the same layers committed. A rank's final vote
// (every layer ready here) stands for every later step: it votes no more.
//
// Who drives: the engine's thread, in Poll() and Commit() (non-blocking but for the vote
// wait). The bytes move on the data paths' threads (shm and cma copy threads, UCX's progress
// thread) between calls; records are handled only inside calls, so a layer needs a few
// calls from each rank (MAPS and READY, then DONE once its READs landed).
#include <algorithm>
#include <optional>

#include "common/strings.h"
#include "rearrange/rearranger_impl.h"

namespace eplbx::internal {

using protocol::Action;
using protocol::LayerState;
using protocol::Record;
using protocol::RecordKind;

struct RearrangerImpl::Pipeline {
  uint64_t id = 0;     // the same on every rank: the n-th Begin
  uint64_t epoch = 0;  // the membership epoch it began at
  // Layer l runs as generation first_generation + l on every rank, however far each got.
  uint64_t first_generation = 0;
  Placement from, to;
  MigrationPlan plan;
  AsyncOptions opt;
  uint64_t budget = 0, cap = 0;
  std::vector<std::unique_ptr<Run>> runs;  // started layers; runs[i] is layer i
  uint32_t layers = 0, applied = 0;
  int64_t step = 0, last_commit_step = 0;
  uint64_t posted_this_step = 0;
  // The votes (src/protocol/votes.h); those of a later pipeline are kept for it (a faster
  // peer may vote in the next one before this rank began it).
  protocol::Votes votes{0, 0, 1, 0};
  std::string refused_note;  // the first VOTE of another epoch, for the deadline error
  bool active = false;
  Status failure;  // this rank failed: its next vote says so
  protocol::Clock::time_point deadline, started;
  std::vector<int> free_slots;
  std::vector<bool> staged;  // per layer: lands in a staging buffer on this rank
  RearrangeReport report;
  std::vector<PathTotals> paths_before;
  std::function<bool(uint64_t)> gate;

  uint64_t InFlight() const {
    uint64_t b = 0;
    for (const auto& r : runs) {
      for (const Pending& p : r->pending) b += p.bytes;
    }
    return b;
  }
  bool Fits(uint64_t bytes) const {
    const uint64_t flight = InFlight();
    return (posted_this_step == 0 || posted_this_step + bytes <= budget) &&
           (flight == 0 || flight + bytes <= cap);
  }
  // The leading layers at their commit point here (DONE from every rank): reported only.
  uint32_t ReadyPrefix() const {
    uint32_t n = applied;
    while (n < runs.size() && runs[n]->protocol->state() == LayerState::kCommitted) ++n;
    return n;
  }
  // What this rank's vote says: the leading layers it vouches for — it sent its DONE (its
  // READs of the layer landed) and every rank's maps matched its own. Both are facts that
  // never go back, and a layer every rank vouches for is safe to apply everywhere: every
  // READ of it has landed, so no rank still reads a row that a commit overwrites, and every
  // rank has the same maps (docs/protocol.md, "Asynchronous commits").
  uint32_t VouchedPrefix() const {
    uint32_t n = applied;
    while (n < runs.size() && runs[n]->protocol->done_sent() && runs[n]->protocol->maps_agreed())
      ++n;
    return n;
  }
  // The layers not applied whose protocol runs (an applied layer may still wait for a DONE
  // the votes made unnecessary: it is left alone).
  std::vector<Run*> Running() const {
    std::vector<Run*> out;
    for (size_t l = applied; l < runs.size(); ++l) {
      if (runs[l]->protocol->state() == LayerState::kRunning) out.push_back(runs[l].get());
    }
    return out;
  }
  void TakeVote(uint32_t from, const Record& r, uint64_t epoch) {
    if (r.epoch != epoch && r.generation >= id) {  // another member set's counts for nothing
      if (refused_note.empty()) {
        refused_note = StrCat("a VOTE from rank ", from, " at epoch ", r.epoch,
                              " was refused (this rank is at epoch ", epoch, ")");
      }
      return;
    }
    votes.Take(from, r);
  }
  // The run with the smallest generation >= g.
  Run* Route(uint64_t g) const {
    for (const auto& r : runs) {
      if (r->protocol->generation() >= g) return r.get();
    }
    return nullptr;
  }
};

RearrangerImpl::RearrangerImpl() = default;
RearrangerImpl::~RearrangerImpl() {
  for (PeerId p : connected) (void)agent->Disconnect(p);
}

bool RearrangerImpl::Busy() const { return pipe != nullptr && pipe->active; }

Status RearrangerImpl::Begin(const Placement& from, const Placement& to, const MigrationPlan& plan,
                             const AsyncOptions& opt) {
  if (failed) {
    return Status::Aborted(StrCat("rank ", self(), ": this Rearranger failed earlier (", failure,
                                  "); build a new one"));
  }
  if (Busy()) {
    return Status::InProgress(
        StrCat("rank ", self(), ": an asynchronous rearrangement is running (", pipe->applied,
               " of ", pipe->layers, " layers committed); call Commit() until it finishes"));
  }
  if (opt.target_steps < 1 || opt.max_layers_in_flight < 1) {
    return Status::InvalidArgument(StrCat("rank ", self(), ": AsyncOptions target_steps ",
                                          opt.target_steps, " and max_layers_in_flight ",
                                          opt.max_layers_in_flight, " must be >= 1"));
  }
  EPLBX_RETURN_IF_ERROR(CheckShapes(from, to));
  EPLBX_RETURN_IF_ERROR(CheckPlan(from, to, plan));
  auto p = std::make_unique<Pipeline>();
  p->id = std::max(pipeline_id, pipe ? pipe->id : 0) + 1;
  pipeline_id = p->id;
  p->epoch = boot->epoch();
  p->from = from;
  p->to = to;
  p->plan = plan;
  p->opt = opt;
  p->layers = static_cast<uint32_t>(layout.layers.size());
  p->votes = protocol::Votes(p->id, p->layers, world(), self());
  if (pipe) p->votes.TakeLater(pipe->votes);
  unsent_vote.clear();
  p->first_generation = generation + 1;
  generation += p->layers;
  // The default budget: the busiest rank's bytes over target_steps (every rank computes the
  // same from the same plan).
  std::vector<uint64_t> in(world(), 0);
  for (uint32_t l = 0; l < p->layers; ++l) {
    for (const RemoteRead& r : plan.layers[l].transfers) in[r.dst] += RowBytes(l);
  }
  const uint64_t busiest = *std::max_element(in.begin(), in.end());
  p->budget = opt.step_budget_bytes != 0
                  ? opt.step_budget_bytes
                  : std::max<uint64_t>(1, (busiest + opt.target_steps - 1) / opt.target_steps);
  p->cap = opt.max_bytes_in_flight != 0 ? opt.max_bytes_in_flight : 2 * p->budget;
  // A layer that lands in staging (in place, or a rank whose new rows do not fit its spare
  // rows) takes a staging buffer while it runs; one that swaps takes none, so with a spare
  // row per slot every layer in flight runs without one. (MakeLayerJob decides the same
  // later: a layer's row tables change only at its own commit.)
  p->staged.assign(p->layers, true);
  for (uint32_t l = 0; l < p->layers && layout.spare_rows != 0; ++l)
    p->staged[l] = !PlanRows(self(), l, plan.layers[l]).swap;
  const size_t slots =
      std::min(static_cast<size_t>(opt.max_layers_in_flight),
               static_cast<size_t>(std::count(p->staged.begin(), p->staged.end(), true)));
  EPLBX_RETURN_IF_ERROR(EnsureStaging(slots, /*touch=*/true));
  for (size_t i = 0; i < slots; ++i) p->free_slots.push_back(static_cast<int>(slots - 1 - i));
  Pipeline* raw = p.get();
  p->gate = [raw](uint64_t bytes) {
    if (!raw->Fits(bytes)) return false;
    raw->posted_this_step += bytes;
    return true;
  };
  p->started = env->Now();
  p->deadline = p->started + opt.deadline;
  p->paths_before = agent->PathBytes();
  p->active = true;
  pipe = std::move(p);
  (void)Poll();  // a failure from here on reaches every rank through the votes (Commit)
  return Status::OK();
}

Status RearrangerImpl::Reserve(const AsyncOptions& opt) {
  // With a spare row per slot no layer ever lands in staging: nothing to reserve.
  if (caller_rows || !MayStage()) return Status::OK();
  return EnsureStaging(std::min<size_t>(std::max(opt.max_layers_in_flight, 1),
                                        std::max<size_t>(layout.layers.size(), 1)),
                       /*touch=*/true);
}

namespace {

// Marks every running layer failed (ABORT to the peers) and stops its READs.
void StopRuns(RearrangerImpl& d, RearrangerImpl::Pipeline& p, const std::string& why) {
  for (RearrangerImpl::Run* run : p.Running()) d.Execute(*run, run->protocol->Fail(why));
  for (auto& run : p.runs) {
    d.CancelPending(*run);
    run->held.clear();
  }
}

// Queues this rank's VOTE of `step` (how many leading layers are ready here, failed?) for
// every other member, to leave with the turn's records (Flush), unless none is to be sent
// (Votes::Cast: the votes of the step before end the rearrangement, or this rank's final
// vote stands).
void QueueVote(RearrangerImpl& d, RearrangerImpl::Pipeline& p, int64_t step,
               const std::vector<bool>& members) {
  const std::optional<Record> mine = p.votes.Cast(
      step, p.VouchedPrefix(), p.failure.ok() ? "" : p.failure.message(), d.boot->epoch(), members);
  if (!mine) return;
  const std::string wire = protocol::EncodeRecord(*mine);
  // Votes go to and come from the members at this epoch only.
  if (d.outbox.size() < d.world()) d.outbox.resize(d.world());
  for (uint32_t r = 0; r < d.world(); ++r) {
    if (r == d.self() || !IsMember(members, r)) continue;
    d.outbox[r].push_back({nullptr, RecordKind::kVote, wire});
  }
}

// This rank failed if a layer of it aborted or the rearrangement's deadline passed: its
// next vote says so, and its running layers stop.
// After its final vote a rank has nothing left to fail but the wait for the others' votes
// (Commit's own deadline), and that vote stands: nothing is noted.
void NoteFailure(RearrangerImpl& d, RearrangerImpl::Pipeline& p, protocol::Clock::time_point now) {
  if (p.votes.final_sent()) return;
  if (p.failure.ok()) {
    for (const auto& run : p.runs) {
      if (run->protocol->state() == LayerState::kAborted) {
        p.failure = Status::Aborted(StrCat("rank ", d.self(), ": ", run->protocol->error()));
        break;
      }
    }
  }
  if (p.failure.ok() && !d.unsent_vote.empty()) p.failure = Status::Unavailable(d.unsent_vote);
  if (p.failure.ok() && now > p.deadline) {
    p.failure = Status::Timeout(StrCat(
        "rank ", d.self(), ": the rearrangement passed its deadline of ", p.opt.deadline.count(),
        " ms after ", p.step, " steps with ", p.applied, " of ", p.layers, " layers committed (",
        p.ReadyPrefix(), " ready here)", p.refused_note.empty() ? "" : "; ", p.refused_note));
  }
  if (!p.failure.ok()) StopRuns(d, p, p.failure.message());
}

}  // namespace

Status RearrangerImpl::Poll() {
  if (!Busy()) return Status::OK();
  Pipeline& p = *pipe;
  // This call's records leave together, each peer's as one message, and its READs are
  // posted together (Flush), as in the synchronous loop's turns; a record that cannot leave
  // fails its layer there, before the checks below.
  ++hold_sends;
  PollTurn();
  Flush();
  --hold_sends;
  NoteFailure(*this, p, env->Now());
  return p.failure;
}

void RearrangerImpl::PollTurn() {
  Pipeline& p = *pipe;
  auto route = [&p](uint64_t g) { return p.Route(g); };
  auto vote = [&p, this](uint32_t from, const Record& r) { p.TakeVote(from, r, boot->epoch()); };
  // Start layers, in order, while fewer than max_layers_in_flight are started and not
  // committed, and a layer that lands in staging has a buffer.
  while (p.failure.ok() && p.runs.size() < p.layers &&
         p.runs.size() - p.applied < static_cast<size_t>(p.opt.max_layers_in_flight)) {
    const uint32_t l = static_cast<uint32_t>(p.runs.size());
    if (p.staged[l] && p.free_slots.empty()) break;
    auto run = std::make_unique<Run>();
    if (p.staged[l]) {
      run->slot = p.free_slots.back();
      p.free_slots.pop_back();
    }
    run->job = MakeLayerJob(l, p.plan.layers[l], p.from, p.to, run->slot);
    run->defer_commit = true;
    run->gate = &p.gate;
    run->outcome.layer = l;
    Run& r = *run;
    p.runs.push_back(std::move(run));
    // Its DONE waits for the DONE of the layer before (dones_ahead: ReleaseDonesAhead below),
    // so the DONEs of layers whose copies end together leave together, as in Rearrange().
    StartRun(r, p.first_generation + l, /*hold_done=*/l > 0 && options.dones_ahead);
  }
  Handle(agent->PollNotifications(), route, vote);
  for (Run* run : p.Running()) Reap(*run);
  CheckPeers(p.Running(), route, vote);
  const auto now = env->Now();
  for (Run* run : p.Running()) Execute(*run, run->protocol->OnTick(now));
  if (options.dones_ahead) ReleaseDonesAhead(p.runs, 0);
  // READs the budget held back, oldest layer first (Flush asks the budget for each).
  for (Run* run : p.Running()) {
    while (!run->held.empty() && p.Fits(RowBytes(run->job.layer))) {
      Action a = std::move(run->held.front());
      run->held.pop_front();
      Execute(*run, {std::move(a)});
    }
  }
}

CommitResult RearrangerImpl::Commit() {
  CommitResult out;
  if (!Busy()) return out;
  Pipeline& p = *pipe;
  // This turn's records and the vote leave together, each peer's as one message (Flush).
  ++hold_sends;
  PollTurn();
  NoteFailure(*this, p, env->Now());
  ++p.step;
  // `agreed`: every rank ends the same way at this step, so the Rearranger stays usable;
  // otherwise (a vote missing) the ranks may disagree and it must be rebuilt.
  auto finish = [&](Status status, bool agreed) {
    out.finished = true;
    out.status = status;
    if (!status.ok()) StopRuns(*this, p, status.message());
    if (!agreed) {
      failed = true;
      failure = status.message();
    }
    for (const auto& run : p.runs) {
      if (run->protocol->state() == LayerState::kAborted && run->outcome.error.empty())
        run->outcome.error = run->protocol->error();
    }
    p.report = PipelineReport();
    p.report.status = status;
    p.active = false;
  };
  // The member set changed under it (a rank was lost, docs/deploy.md "After a lost rank"):
  // no vote of this pipeline can complete any more, so it ends here at once, the layers
  // committed so far staying (a survivor may have committed one more or one fewer than
  // another: each rank's own slots say which, and the survivors go on from that).
  if (boot->epoch() != p.epoch) {
    finish(
        Status::Aborted(StrCat("rank ", self(),
                               ": the member set changed under the "
                               "rearrangement (epoch ",
                               p.epoch, " -> ", boot->epoch(), "); committed ", p.applied, " of ",
                               p.layers, " layers, the rest keep their old weights and maps")),
        false);
    Flush();  // the ABORTs
    --hold_sends;
    return out;
  }
  // No vote is sent when the votes of the step before are all here and end the
  // rearrangement (every layer ready everywhere, or a rank failed): every rank ends at this
  // step on those same votes, and no rank waits for one of this step. Nor after this rank's
  // final vote (every layer ready here): it stands for every later step, so the last rank
  // to be ready applies at its next Commit() without a round of the others' votes back.
  const std::vector<bool> members = boot->members();
  QueueVote(*this, p, p.step, members);
  Flush();
  --hold_sends;
  p.posted_this_step = 0;             // the turn's READs count against the step before
  NoteFailure(*this, p, env->Now());  // a record or the vote that could not leave
  if (p.step == 1) {
    (void)Poll();
    return out;
  }
  // The votes of the previous step, from every rank.
  const auto t0 = env->Now();
  const auto wait_until = t0 + options.deadline;  // a failure by deadline comes in a vote
  auto route = [&p](uint64_t g) { return p.Route(g); };
  auto vote = [&p, this](uint32_t from, const Record& r) { p.TakeVote(from, r, boot->epoch()); };
  Status lost;
  for (;;) {
    const int missing = p.votes.Missing(p.step - 1, members);
    if (missing < 0) break;
    Result<PeerInfo> info = agent->Peer(peer_of[missing]);
    if (info.ok() && !info->reachable) {
      Handle(agent->PollNotifications(), route, vote);
      if (p.votes.Of(p.step - 1, static_cast<uint32_t>(missing)) != nullptr) continue;
      lost = Status::Unavailable(StrCat("rank ", self(), ": rank ", missing,
                                        " unreachable before its vote of step ", p.step - 1, ": ",
                                        info->failure));
      break;
    }
    if (env->Now() > wait_until) {
      lost = Status::Timeout(StrCat("rank ", self(),
                                    ": deadline passed waiting for the vote of "
                                    "step ",
                                    p.step - 1, " from rank ", missing));
      break;
    }
    // As in Poll: the records this wait's events call for leave together, each peer's as
    // one message, and its READs are posted together (a lone READ would be copied on this
    // thread, which then hears of nothing else until it is done).
    ++hold_sends;
    Handle(agent->WaitEvents(std::chrono::milliseconds(kTickMs)), route, vote);
    for (Run* run : p.Running()) Reap(*run);
    if (options.dones_ahead) ReleaseDonesAhead(p.runs, 0);
    Flush();
    --hold_sends;
  }
  out.wait_seconds = std::chrono::duration<double>(env->Now() - t0).count();
  if (!lost.ok()) {
    // Some ranks may have every vote and commit further (a partition: docs/protocol.md).
    const std::string why = StrCat(lost.message(), "; committed ", p.applied, " of ", p.layers,
                                   " layers, the rest keep their old weights and maps");
    finish(lost.code() == Code::kTimeout ? Status::Timeout(why) : Status::Unavailable(why), false);
    return out;
  }
  const protocol::Votes::Outcome agreed = p.votes.Agreed(p.step, members);
  const Record* failed_vote = agreed.failed;
  for (uint32_t l = p.applied; l < agreed.ready && l < p.runs.size(); ++l) {
    Run& run = *p.runs[l];
    const uint64_t copied = run.job.commit();
    run.outcome.bytes_copied += copied;
    run.outcome.committed = true;
    run.outcome.swapped = run.job.swap;
    out.bytes_copied += copied;
    if (p.staged[l]) p.free_slots.push_back(run.slot);
    CommittedLayer c;
    c.layer = l;
    for (int s = 0; s < p.to.slots(); ++s)
      c.phy2log.push_back(p.to.phy2log(static_cast<int>(l), s));
    c.row_of_slot = tables[self()][l];
    out.layers.push_back(std::move(c));
    p.applied = l + 1;
    p.last_commit_step = p.step;
  }
  if (p.applied == p.layers) {
    finish(Status::OK(), true);
  } else if (failed_vote != nullptr) {
    const std::string who = failed_vote->source == self()
                                ? failed_vote->reason
                                : StrCat("rank ", self(), ": rank ", failed_vote->source,
                                         " failed (", failed_vote->reason, ")");
    finish(Status::Aborted(StrCat(who, "; committed ", p.applied, " of ", p.layers,
                                  " layers, the rest keep their old weights and maps")),
           true);
  } else {
    p.votes.Forget(p.step - 1);  // no rule reads the steps before again
    (void)Poll();
  }
  return out;
}

bool RearrangerImpl::CommitDue() const {
  const Pipeline& p = *pipe;
  if (boot->epoch() != p.epoch || !p.failure.ok() || !unsent_vote.empty()) return true;
  // After its final vote nothing of this rank's own ends the rearrangement (NoteFailure), so
  // past its deadline a Commit() is due: it waits for the votes still missing until the layer
  // deadline, or finds their rank unreachable, and ends there (a caller that commits only
  // when one is due would otherwise wait forever for a vote that never comes).
  if (p.votes.final_sent() && env->Now() > p.deadline) return true;
  // News of this rank (its next vote would say more than its last), once every layer
  // started is vouched for here and no other can start before a commit: without forward passes in
  // between, committing the first layers a round earlier gains nothing, and each vote round
  // costs every rank a wake-up per message.
  const uint32_t ready = p.VouchedPrefix();
  const size_t started = p.runs.size();
  const bool blocked =
      ready == started && (started == p.layers ||
                           started - p.applied >= static_cast<size_t>(p.opt.max_layers_in_flight) ||
                           (p.staged[started] && p.free_slots.empty()));
  if (blocked && ready > p.votes.voted_ready()) return true;
  for (const auto& run : p.runs) {
    if (!run->held.empty()) return true;  // the budget of this step is spent
  }
  return p.votes.Due(p.applied, boot->members());
}

bool RearrangerImpl::AwaitCommit(std::chrono::milliseconds timeout) {
  if (!Busy()) return false;
  Pipeline& p = *pipe;
  const auto until = env->Now() + timeout;
  auto route = [&p](uint64_t g) { return p.Route(g); };
  auto vote = [&p, this](uint32_t from, const Record& r) { p.TakeVote(from, r, boot->epoch()); };
  caller_idle = true;  // (until this returns)
  struct Idle {
    bool& flag;
    ~Idle() { flag = false; }
  } idle{caller_idle};
  for (;;) {
    (void)Poll();
    if (CommitDue()) return true;
    const auto now = env->Now();
    if (now >= until) return false;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - now);
    ++hold_sends;
    Handle(agent->WaitEvents(
               std::clamp(left, std::chrono::milliseconds(1), std::chrono::milliseconds(kTickMs))),
           route, vote);
    --hold_sends;  // Poll above sends what this wait's records call for, with its own
  }
}

AsyncProgress RearrangerImpl::Progress() const {
  AsyncProgress a;
  if (!pipe) return a;
  const Pipeline& p = *pipe;
  a.active = p.active;
  a.layers = p.layers;
  a.layers_started = static_cast<uint32_t>(p.runs.size());
  a.layers_ready = p.ReadyPrefix();
  a.layers_committed = p.applied;
  a.bytes_in_flight = p.InFlight();
  for (const auto& run : p.runs) {
    uint64_t pending = 0;
    for (const Pending& x : run->pending) pending += x.bytes;
    a.bytes_read += run->outcome.bytes_read - pending;
    a.bytes_held += run->held.size() * RowBytes(run->job.layer);
  }
  a.steps = p.step;
  a.steps_since_commit = p.step - p.last_commit_step;
  return a;
}

RearrangeReport RearrangerImpl::PipelineReport() const {
  RearrangeReport report;
  if (!pipe) return report;
  const Pipeline& p = *pipe;
  if (!p.active) return p.report;
  for (const auto& run : p.runs) {
    report.layers.push_back(run->outcome);
    report.bytes_read += run->outcome.bytes_read;
    report.experts_read += run->outcome.experts_read;
    report.bytes_cross_node += run->outcome.bytes_cross_node;
    AddBytesFrom(run->outcome, &report);
  }
  report.status = p.failure;
  report.bytes_by_path = agent->PathBytes();
  for (size_t i = 0; i < report.bytes_by_path.size() && i < p.paths_before.size(); ++i) {
    report.bytes_by_path[i].bytes -= p.paths_before[i].bytes;
    report.bytes_by_path[i].transfers -= p.paths_before[i].transfers;
  }
  report.seconds = std::chrono::duration<double>(env->Now() - p.started).count();
  return report;
}

}  // namespace eplbx::internal
