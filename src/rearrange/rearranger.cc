#include "eplbx/rearrange.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>

#include "common/bytes.h"
#include "common/strings.h"
#include "eplbx/migration.h"
#include "protocol/layer_protocol.h"
#include "protocol/records.h"
#include "rearrange/rearranger_impl.h"
#include "transfer/device_memory.h"

namespace eplbx {
namespace internal {

using protocol::Action;
using protocol::ActionKind;
using protocol::Clock;
using protocol::LayerProtocol;
using protocol::LayerState;
using protocol::ReadTask;

Status RearrangerImpl::CheckShapes(const Placement& from, const Placement& to) const {
  const int layers = static_cast<int>(layout.layers.size());
  if (from.layers() != layers || to.layers() != layers || from.slots() != to.slots()) {
    return Status::InvalidArgument(StrCat(
        "rank ", self(), ": placements have ", from.layers(), " and ", to.layers(), " layers, ",
        from.slots(), " and ", to.slots(), " slots; the layout has ", layers, " layers"));
  }
  for (int l = 0; l < layers; ++l) {
    const uint64_t rows = layout.slots(l);
    if (rows * world() != static_cast<uint64_t>(from.slots())) {
      return Status::InvalidArgument(
          StrCat("rank ", self(), ": layer ", l, " has ", rows, " slots per rank",
                 layout.spare_rows ? StrCat(" (besides ", layout.spare_rows, " spare rows)") : "",
                 " x ", world(), " ranks, the placements have ", from.slots(), " slots"));
    }
  }
  return Status::OK();
}

Status RearrangerImpl::CheckPlan(const Placement& from, const Placement& to,
                                 const MigrationPlan& plan) const {
  const int layers = from.layers(), slots = from.slots();
  if (static_cast<int>(plan.layers.size()) != layers) {
    return Status::InvalidArgument(StrCat("rank ", self(), ": the migration plan has ",
                                          plan.layers.size(), " layers, the placements ", layers));
  }
  for (int l = 0; l < layers; ++l) {
    const std::vector<int32_t> before(from.phy2log().begin() + static_cast<long>(l) * slots,
                                      from.phy2log().begin() + static_cast<long>(l + 1) * slots);
    Result<std::vector<int32_t>> after =
        ApplyMigration(before, plan.layers[l], static_cast<int>(world()));
    if (!after.ok()) {
      return after.status().WithPrefix(StrCat("rank ", self(), ": the migration plan of layer ", l,
                                              " does not fit the old placement"));
    }
    const int rows = slots / static_cast<int>(world());
    for (int s = 0; s < slots; ++s) {
      if ((*after)[s] == to.phy2log(l, s)) continue;
      return Status::InvalidArgument(StrCat("rank ", self(), ": the migration plan of layer ", l,
                                            " leaves slot ", s, " (rank ", s / rows, ", row ",
                                            s % rows, ") holding expert ", (*after)[s],
                                            " but the new placement has expert ", to.phy2log(l, s),
                                            " there; plan with PlanMigration(from, to)"));
    }
  }
  return Status::OK();
}

uint64_t RearrangerImpl::StagingBytes() const {
  uint64_t most = 1;
  for (const auto& tensors : layout.layers) {
    uint64_t bytes = 0;
    for (const TensorSpec& t : tensors) bytes += static_cast<uint64_t>(t.rows) * t.bytes_per_expert;
    most = std::max(most, bytes);
  }
  return most;
}

bool RearrangerImpl::MayStage() const {
  if (layout.spare_rows == 0) return true;
  for (size_t l = 0; l < layout.layers.size(); ++l) {
    if (layout.spare_rows < layout.slots(l)) return true;
  }
  return false;
}

Status RearrangerImpl::EnsureStaging(size_t count, bool touch) {
  while (staging.size() < count) {
    Result<RegisteredRegion> s = agent->AllocateShared(StagingBytes());
    if (!s.ok()) {
      return s.status().WithPrefix(
          StrCat("rank ", self(), ": staging buffer ", staging.size() + 1, " of ", count));
    }
    if (touch) std::memset(s->data(), 0, StagingBytes());
    staging.push_back(std::move(*s));
  }
  return Status::OK();
}

Status RearrangerImpl::Setup() {
  // Our row tables in force go out with the layout (after commits in swap mode they are no
  // longer the ones we were created with).
  if (layout.spare_rows > 0 && tables.size() > self()) layout.row_of_slot = tables[self()];
  ByteWriter w;
  w.Str32(agent->Metadata());
  w.Str32(EncodeLayout(layout));
  w.U64(generation);
  w.U64(pipeline_id);
  const std::chrono::milliseconds wait = std::max(options.deadline, options.exchange_deadline);
  Result<std::vector<std::string>> gathered = boot->AllGather(w.Take(), wait);
  if (!gathered.ok())
    return gathered.status().WithPrefix(StrCat("rank ", self(), ": exchanging metadata"));
  std::vector<std::string> blobs(gathered->size());
  all.resize(gathered->size());
  uint64_t highest = generation, highest_pipeline = pipeline_id;
  // Over a changed member set (the store's epochs, docs/deploy.md): a rank that is not a
  // member contributed nothing and is neither connected to nor read from; its layout stands
  // in as ours (its slots hold nothing a plan over the members may use), with identity row
  // tables, the same on every member (they compare every slot's row in the layer protocol).
  const std::vector<bool> members = boot->members();
  for (uint32_t r = 0; r < gathered->size(); ++r) {
    if (!IsMember(members, r)) {
      all[r] = layout;
      all[r].rank = r;
      all[r].row_of_slot.clear();
      continue;
    }
    ByteReader in((*gathered)[r], "rank contribution");
    std::string layout_bytes;
    uint64_t their_generation = 0, their_pipeline = 0;
    if (!in.Str32("agent_metadata", 16u << 20, &blobs[r]) ||
        !in.Str32("layout", 64u << 20, &layout_bytes) || !in.U64("generation", &their_generation) ||
        !in.U64("pipeline_id", &their_pipeline)) {
      return in.status().WithPrefix(StrCat("rank ", r));
    }
    highest = std::max(highest, their_generation);
    highest_pipeline = std::max(highest_pipeline, their_pipeline);
    Result<RankLayout> decoded = DecodeLayout(layout_bytes);
    if (!decoded.ok()) return decoded.status().WithPrefix(StrCat("rank ", r, " sent a bad layout"));
    all[r] = std::move(*decoded);
  }
  EPLBX_RETURN_IF_ERROR(ValidateLayouts(all, self()));
  tables.assign(world(), {});
  for (uint32_t r = 0; r < world(); ++r) {
    tables[r].resize(layout.layers.size());
    for (size_t l = 0; l < layout.layers.size(); ++l) {
      for (uint32_t slot = 0; slot < layout.slots(l); ++slot)
        tables[r][l].push_back(all[r].RowOf(l, slot));
    }
  }
  // Every member goes on from the highest generation any of them used, so no new layer
  // reuses a generation a peer saw before (records of the old member set are refused by
  // their epoch anyway).
  generation = highest;
  pipeline_id = highest_pipeline;
  peer_of.resize(world(), 0);
  linked.resize(world(), false);
  for (uint32_t r = 0; r < world(); ++r) {
    if (r == self()) continue;
    if (!IsMember(members, r)) {  // no longer a member: forget it
      if (linked[r]) {
        (void)agent->Disconnect(peer_of[r]);
        connected.erase(std::remove(connected.begin(), connected.end(), peer_of[r]),
                        connected.end());
        linked[r] = false;
      }
      continue;
    }
    if (linked[r]) continue;  // a member we are still connected to
    Result<PeerId> p = agent->Connect(blobs[r]);
    if (!p.ok()) return p.status().WithPrefix(StrCat("rank ", self(), ": connecting to rank ", r));
    peer_of[r] = *p;
    linked[r] = true;
    connected.push_back(*p);
    rank_of_name[agent->Peer(*p)->name] = r;
  }
  // A layer that lands in staging needs one buffer at least (PlanRows never asks for it
  // when MayStage is false: a spare row per slot holds every new row).
  if (!caller_rows && MayStage()) EPLBX_RETURN_IF_ERROR(EnsureStaging(1, /*touch=*/false));
  // Nobody starts moving bytes before every rank is connected to every other.
  Status ready = boot->Barrier(wait);
  if (!ready.ok())
    return ready.WithPrefix(StrCat("rank ", self(), ": waiting for every rank to connect"));
  return Status::OK();
}

void RearrangerImpl::Execute(Run& run, std::vector<Action> actions) {
  LayerJob& job = run.job;
  for (Action& a : actions) {
    switch (a.kind) {
      case ActionKind::kSend:
        Queue(run, a.peer, a.record.kind, protocol::EncodeRecord(a.record));
        break;
      case ActionKind::kPostRead: {
        if (hold_sends > 0 && !flushing) {
          posts.emplace_back(&run, std::move(a));
          break;
        }
        if (run.gate != nullptr && !(*run.gate)(RowBytes(job.layer))) {
          run.held.push_back(std::move(a));
          break;
        }
        Agent::ReadRequest request = PrepareRead(run, a);
        Result<TransferId> id = agent->Read(peer_of[a.read.source], request.local, request.remote);
        Posted(run, a, std::move(id));
        break;
      }
      case ActionKind::kCommit:
        if (run.defer_commit) break;  // the pipeline applies it once the ranks agree
        if (job.commit) run.outcome.bytes_copied += job.commit();
        run.outcome.committed = true;
        run.outcome.swapped = job.swap;
        break;
      case ActionKind::kAbort:
        break;
    }
  }
  if (hold_sends == 0) Flush();
}

Agent::ReadRequest RearrangerImpl::PrepareRead(Run& run, const Action& a) {
  const LayerJob& job = run.job;
  const JobRead* jr = nullptr;
  for (const JobRead& r : job.reads) {
    if (r.task.expert == a.read.expert && r.task.source == a.read.source) jr = &r;
  }
  const auto& tensors = layout.layers[job.layer];
  Agent::ReadRequest request;
  request.peer = peer_of[a.read.source];
  LayerOutcome& outcome = run.outcome;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const TensorSpec& theirs = all[a.read.source].layers[job.layer][t];
    request.local.push_back(Descriptor::Of(jr->dst[t], tensors[t].bytes_per_expert));
    request.remote.push_back(
        {theirs.base + jr->src_row * theirs.bytes_per_expert, theirs.bytes_per_expert});
    outcome.bytes_read += tensors[t].bytes_per_expert;
    outcome.bytes_from_rank.resize(world(), 0);
    outcome.bytes_from_rank[a.read.source] += tensors[t].bytes_per_expert;
    if (options.node_of_rank.size() == world() &&
        options.node_of_rank[a.read.source] != options.node_of_rank[self()]) {
      outcome.bytes_cross_node += tensors[t].bytes_per_expert;
    }
  }
  ++outcome.experts_read;
  return request;
}

void RearrangerImpl::Posted(Run& run, const Action& a, Result<TransferId> id) {
  if (id.ok()) {
    run.pending.push_back({*id, a.read, RowBytes(run.job.layer)});
  } else {
    Execute(run, run.protocol->OnReadComplete(a.read, id.status()));
  }
}

void RearrangerImpl::Queue(Run& run, uint32_t peer, protocol::RecordKind kind, std::string bytes) {
  if (outbox.size() < world()) outbox.resize(world());
  outbox[peer].push_back({&run, kind, std::move(bytes)});
}

void RearrangerImpl::Flush() {
  if (flushing) return;  // a failure below queued more: the loop takes it
  flushing = true;
  for (bool more = true; more;) {
    more = false;
    for (uint32_t peer = 0; peer < outbox.size(); ++peer) {
      if (outbox[peer].empty()) continue;
      std::vector<Outgoing> batch;
      batch.swap(outbox[peer]);
      std::vector<std::string> payloads;
      payloads.reserve(batch.size());
      for (Outgoing& o : batch) payloads.push_back(std::move(o.bytes));
      std::vector<Status> sent = agent->NotifyMany(peer_of[peer], std::move(payloads));
      for (size_t i = 0; i < batch.size() && i < sent.size(); ++i) {
        if (sent[i].ok() || batch[i].kind == protocol::RecordKind::kAbort) continue;
        if (batch[i].run == nullptr) {  // a VOTE (no layer's): the pipeline fails on it
          if (unsent_vote.empty())
            unsent_vote =
                StrCat("rank ", self(), ": rank ", peer, " unreachable: ", sent[i].message());
          continue;
        }
        Run& run = *batch[i].run;
        Result<PeerInfo> info = agent->Peer(peer_of[peer]);
        if (info.ok() && info->reachable) {
          // The peer is there and waits for this record, so the layer commits nowhere: fail
          // it now. (As a lost peer, a peer whose DONE arrived while the record waited in
          // the outbox would let this rank commit while the peer waits for its deadline.)
          // (A peer whose loss the agent has not registered yet is named as unreachable,
          // as the ranks that register it first name it.)
          const std::string lost =
              sent[i].code() == Code::kUnavailable ? StrCat(" (rank ", peer, " unreachable)") : "";
          Execute(run,
                  run.protocol->Fail(StrCat(protocol::KindName(batch[i].kind), " to rank ", peer,
                                            " could not leave", lost, ": ", sent[i].message())));
        } else {
          Execute(run, run.protocol->OnPeerFailed(peer, sent[i]));
        }
        more = true;
      }
    }
    if (!more && !posts.empty()) {
      std::vector<std::pair<Run*, Action>> now;
      now.swap(posts);
      std::stable_sort(now.begin(), now.end(), [](const auto& a, const auto& b) {
        return a.first->protocol->generation() < b.first->protocol->generation();
      });
      // A layer that failed meanwhile posts nothing more.
      std::erase_if(
          now, [](const auto& p) { return p.first->protocol->state() != LayerState::kRunning; });
      std::vector<Agent::ReadRequest> requests;
      std::vector<std::pair<Run*, Action>> batch;
      for (auto& [run, a] : now) {
        if (run->gate == nullptr) {
          requests.push_back(PrepareRead(*run, a));
          batch.emplace_back(run, std::move(a));
          continue;
        }
        // The pipeline's budget counts the bytes in flight: each READ it lets go is posted
        // before the next is asked; one it holds back waits in its run (Poll posts it later).
        if (!(*run->gate)(RowBytes(run->job.layer))) {
          run->held.push_back(std::move(a));
          continue;
        }
        std::vector<Agent::ReadRequest> one = {PrepareRead(*run, a)};
        Posted(*run, a, std::move(agent->ReadMany(one, caller_idle).front()));
      }
      // (the synchronous loop's: it waits for them and has nothing else to do)
      std::vector<Result<TransferId>> ids = agent->ReadMany(requests, /*caller_waits=*/true);
      for (size_t i = 0; i < batch.size(); ++i) Posted(*batch[i].first, batch[i].second, ids[i]);
      more = true;  // a READ that could not be posted may have queued records
    }
  }
  flushing = false;
}

void RearrangerImpl::Handle(std::vector<Notification> notes,
                            const std::function<Run*(uint64_t)>& route,
                            const std::function<void(uint32_t, const protocol::Record&)>& vote) {
  for (Notification& n : notes) {
    auto who = rank_of_name.find(n.peer);
    if (who == rank_of_name.end()) continue;  // not a member of this group
    Result<protocol::Record> rec = protocol::DecodeRecord(n.payload);
    if (!rec.ok()) {
      // Nothing in it can be trusted, not even its generation: every running layer fails.
      for (uint64_t g = 0; Run* run = route(g); g = run->protocol->generation() + 1)
        Execute(*run, run->protocol->OnMalformed(who->second, rec.status()));
      continue;
    }
    if (rec->kind == protocol::RecordKind::kVote) {
      if (vote) vote(who->second, *rec);
      continue;
    }
    Run* run = route(rec->generation);
    if (run == nullptr || run->protocol->generation() != rec->generation) {
      if (run == nullptr) deferred.push_back({who->second, *rec});  // a later layer's
      continue;                                                     // else stale
    }
    bool later = false;
    Execute(*run, run->protocol->OnRecord(who->second, *rec, env->Now(), &later));
  }
}

void RearrangerImpl::Reap(Run& run) {
  for (size_t i = 0; i < run.pending.size();) {
    TransferStatus s = agent->GetStatus(run.pending[i].id);
    if (s.state == TransferState::kInProgress) {
      ++i;
      continue;
    }
    (void)agent->Release(run.pending[i].id);
    const ReadTask task = run.pending[i].task;
    run.pending.erase(run.pending.begin() + static_cast<long>(i));
    Execute(run, run.protocol->OnReadComplete(
                     task, s.state == TransferState::kDone ? Status::OK() : s.error));
  }
}

void RearrangerImpl::CheckPeers(
    const std::vector<Run*>& runs, const std::function<Run*(uint64_t)>& route,
    const std::function<void(uint32_t, const protocol::Record&)>& vote) {
  for (uint32_t r = 0; r < world(); ++r) {
    if (r == self()) continue;
    Result<PeerInfo> info = agent->Peer(peer_of[r]);
    if (!info.ok() || info->reachable) continue;
    // What the peer sent before it was lost (its DONE, say) is queued by now: take it
    // first, so that a peer that finished and exited does not fail the layer.
    Handle(agent->PollNotifications(), route, vote);
    for (Run* run : runs) {
      if (run->protocol->state() == LayerState::kRunning)
        Execute(*run, run->protocol->OnPeerFailed(r, Status::Unavailable(info->failure)));
    }
  }
}

void RearrangerImpl::CancelPending(Run& run) {
  // Nothing of this layer may land in a destination row after this.
  for (const Pending& left : run.pending) {
    (void)agent->Cancel(left.id);
    (void)agent->Release(left.id);
  }
  run.pending.clear();
}

void RearrangerImpl::StartRun(Run& run, uint64_t generation_of_run, bool hold_done,
                              bool end_round) {
  protocol::LayerStep step;
  step.generation = generation_of_run;
  step.epoch = boot->epoch();
  step.members = boot->members();
  step.layer = run.job.layer;
  step.self = self();
  step.world = world();
  for (const JobRead& r : run.job.reads) step.reads.push_back(r.task);
  step.serves = run.job.serves;
  step.old_map = run.job.old_map;
  step.new_map = run.job.new_map;
  step.row_map = run.job.row_map;
  step.hold_done = hold_done;
  step.end_round = end_round;
  run.protocol = std::make_unique<LayerProtocol>(step, env->Now(), options.deadline);
  LayerProtocol& p = *run.protocol;
  if (!run.job.refused.ok()) {
    std::string why = run.job.refused.message();
    const std::string mine = StrCat("rank ", self(), ": ");
    if (why.rfind(mine, 0) == 0) why = why.substr(mine.size());  // Fail names this rank itself
    Execute(run, p.Fail(why));
    return;
  }
  Execute(run, p.Start());
  // Records that arrived early, during an earlier layer or call.
  std::deque<std::pair<uint32_t, protocol::Record>> later;
  for (auto& [from, rec] : deferred) {
    if (rec.generation == step.generation) {
      bool again = false;
      Execute(run, p.OnRecord(from, rec, env->Now(), &again));
    } else if (rec.generation > step.generation) {
      later.push_back({from, rec});
    }
  }
  deferred.swap(later);
}

LayerOutcome RearrangerImpl::RunJob(LayerJob& job) {
  std::vector<LayerOutcome> out = RunJobs(
      1, 1, [](uint32_t) { return false; }, [&job](uint32_t, int) { return std::move(job); },
      nullptr);
  return std::move(out.front());
}

std::vector<LayerOutcome> RearrangerImpl::RunJobs(
    uint32_t count, size_t in_flight, const std::function<bool(uint32_t)>& staged,
    const std::function<LayerJob(uint32_t, int)>& make, std::string* end_error) {
  // runs[i] is the i-th job; every generation of this call is first + i on every rank, and
  // the end round's first + count.
  std::vector<std::unique_ptr<Run>> runs;
  ++hold_sends;  // records leave once a turn (Flush before each wait and at the end)
  const uint64_t first = generation + 1;
  generation += count + (end_error != nullptr ? 1 : 0);
  std::vector<int> free_slots;
  for (int slot = static_cast<int>(staging.size()) - 1; slot >= 0; --slot)
    free_slots.push_back(slot);
  size_t applied = 0;    // jobs [0, applied) are over: applied or failed
  bool stopped = false;  // a job failed: nothing more starts, nothing after it is applied
  std::string stop_reason;
  // The end round: started once every job was (records of jobs not started yet stay deferred
  // until they start), or at once to fail when this rank stops first, so every rank hears;
  // its DONE held until every job was applied here; the call ends once it is over.
  std::unique_ptr<Run> end;
  auto end_running = [&] { return end && end->protocol->state() == LayerState::kRunning; };
  auto running = [&] {
    std::vector<Run*> out;
    for (size_t i = applied; i < runs.size(); ++i) {
      if (runs[i]->protocol->state() == LayerState::kRunning) out.push_back(runs[i].get());
    }
    if (end_running()) out.push_back(end.get());
    return out;
  };
  auto route = [&](uint64_t g) -> Run* {
    for (const auto& r : runs) {
      if (r->protocol->generation() >= g) return r.get();
    }
    // Records of a job not started yet wait (nullptr: deferred), not the end round's.
    if (end && end->protocol->generation() == g) return end.get();
    return nullptr;
  };
  auto start = [&](uint32_t i, int slot) {
    auto run = std::make_unique<Run>();
    run->slot = slot;
    run->defer_commit = true;  // applied below, in order
    run->job = make(i, slot);
    run->outcome.layer = run->job.layer;
    // Its DONE waits until the job before it committed here (ReleaseDone below).
    Run& r = *run;
    runs.push_back(std::move(run));
    StartRun(r, first + i, i > applied);
  };
  while (true) {
    // Apply the leading jobs that are over, in order.
    while (applied < runs.size() && runs[applied]->protocol->state() != LayerState::kRunning) {
      Run& r = *runs[applied];
      CancelPending(r);
      if (r.protocol->state() == LayerState::kCommitted && !stopped) {
        if (r.job.commit) r.outcome.bytes_copied += r.job.commit();
        r.outcome.committed = true;
        r.outcome.swapped = r.job.swap;
      } else if (r.protocol->state() == LayerState::kAborted) {
        r.outcome.error = r.protocol->error();
      } else {
        r.outcome.error =
            StrCat("not applied: layer ", runs[applied - 1]->job.layer, " before it failed");
      }
      if (!r.outcome.committed && !stopped) {
        stopped = true;  // the rest fail with it: every rank is told (ABORT), with the cause
        stop_reason = StrCat("layer ", r.job.layer, " failed before it: ", r.outcome.error);
        for (Run* other : running()) Execute(*other, other->protocol->Fail(stop_reason));
      }
      if (staged(static_cast<uint32_t>(applied))) free_slots.push_back(r.slot);
      ++applied;
      if (!stopped && applied < runs.size()) {
        Execute(*runs[applied], runs[applied]->protocol->ReleaseDone(env->Now()));
      } else if (!stopped && applied == count && end) {
        Execute(*end, end->protocol->ReleaseDone(env->Now()));  // every job applied here
      }
    }
    // Start jobs while the window and the staging buffers allow.
    while (!stopped && runs.size() < count && runs.size() - applied < in_flight) {
      const uint32_t i = static_cast<uint32_t>(runs.size());
      if (!staged(i)) {
        start(i, 0);
      } else if (!free_slots.empty()) {
        start(i, free_slots.back());
        free_slots.pop_back();
      } else {
        break;
      }
    }
    if (end_error != nullptr && !end && (stopped || runs.size() == count)) {
      end = std::make_unique<Run>();
      end->defer_commit = true;
      end->job.layer = count;
      end->outcome.layer = count;
      StartRun(*end, first + count, /*hold_done=*/applied < count, /*end_round=*/true);
      if (stopped) Execute(*end, end->protocol->Fail(stop_reason));
    }
    const bool jobs_over = applied == runs.size() && (stopped || runs.size() == count);
    if (jobs_over && !end_running()) break;
    if (!jobs_over && runs[applied]->protocol->state() != LayerState::kRunning) {
      continue;  // over at its start
    }
    if (!stopped && options.dones_ahead) ReleaseDonesAhead(runs, applied);
    // Wakes on a notification, a finished READ or a lost peer; the timeout only paces
    // deadline checks. This turn's records leave first, each peer's together.
    Flush();
    Handle(agent->WaitEvents(std::chrono::milliseconds(kTickMs)), route, {});
    for (Run* run : running()) Reap(*run);
    CheckPeers(running(), route, {});
    const auto now = env->Now();
    for (Run* run : running()) {
      // The end round's deadline runs once it is released (it waits for this rank's jobs).
      if (run != end.get() || applied == count) Execute(*run, run->protocol->OnTick(now));
    }
  }
  Flush();  // ABORTs and DONEs of the last turn
  --hold_sends;
  if (end && end->protocol->state() == LayerState::kAborted) *end_error = end->protocol->error();
  std::vector<LayerOutcome> out;
  for (auto& r : runs) out.push_back(std::move(r->outcome));
  return out;
}

void RearrangerImpl::ReleaseDonesAhead(const std::vector<std::unique_ptr<Run>>& runs,
                                       size_t applied) {
  std::vector<LayerProtocol*> open;
  for (size_t i = applied; i < runs.size(); ++i) open.push_back(runs[i]->protocol.get());
  for (auto& [i, actions] : protocol::ReleaseDonesAhead(open, env->Now()))
    Execute(*runs[applied + i], std::move(actions));
}

RearrangerImpl::RowPlan RearrangerImpl::PlanRows(uint32_t rank, uint32_t layer,
                                                 const LayerMigration& m) const {
  RowPlan out;
  if (layout.spare_rows == 0) return out;
  const std::vector<uint32_t>& old = tables[rank][layer];
  const uint32_t rows = layout.layers[layer][0].rows;
  // One allocation for the flags (every rank plans every rank's rows for every layer):
  // rows used, rows claimed, slots changed.
  std::vector<uint8_t> flags(2 * static_cast<size_t>(rows) + old.size(), 0);
  uint8_t* const used = flags.data();
  uint8_t* const claimed = used + rows;
  uint8_t* const changed = claimed + rows;
  for (uint32_t row : old) used[row] = 1;
  std::vector<uint32_t> free;  // rows no slot uses, lowest first
  free.reserve(rows - std::min<size_t>(rows, old.size()));
  for (uint32_t row = 0; row < rows; ++row) {
    if (!used[row]) free.push_back(row);
  }
  size_t next = 0;
  const int32_t me = static_cast<int32_t>(rank);
  for (const RemoteRead& r : m.transfers) {
    if (r.dst == me) changed[r.dst_row] = 1;
  }
  for (const LocalCopy& c : m.local_copies) {
    if (c.rank == me) changed[c.dst_row] = 1;
  }
  out.table = old;
  for (const RemoteRead& r : m.transfers) {
    if (r.dst != me) continue;
    if (next == free.size()) return RowPlan{};  // more new rows than spare: in place
    out.table[r.dst_row] = free[next];
    out.read_row.push_back(free[next++]);
  }
  // Copies from old rows first (a row its slot gives up is taken over as it is, once), then
  // copies of rows just read, as the in-place commit orders them.
  for (CopySource pass : {CopySource::kOld, CopySource::kNew}) {
    for (const LocalCopy& c : m.local_copies) {
      if (c.rank != me || c.source != pass) continue;
      const uint32_t src = pass == CopySource::kOld ? old[c.src_row] : out.table[c.src_row];
      if (pass == CopySource::kOld && changed[c.src_row] && !claimed[src]) {
        claimed[src] = 1;
        out.table[c.dst_row] = src;
        continue;
      }
      if (next == free.size()) return RowPlan{};
      out.copies.push_back({src, free[next]});
      out.table[c.dst_row] = free[next++];
    }
  }
  out.swap = true;
  return out;
}

RearrangerImpl::LayerJob RearrangerImpl::MakeLayerJob(uint32_t l, const LayerMigration& m,
                                                      const Placement& from, const Placement& to,
                                                      int slot) {
  LayerJob job;
  job.layer = l;
  job.old_map.reserve(static_cast<size_t>(from.slots()));
  job.new_map.reserve(static_cast<size_t>(from.slots()));
  for (int s = 0; s < from.slots(); ++s) {
    job.old_map.push_back(from.phy2log(static_cast<int>(l), s));
    job.new_map.push_back(to.phy2log(static_cast<int>(l), s));
  }
  const size_t tensors = layout.layers[l].size();
  // Swap mode: every rank's rows after this layer, computed alike on every rank.
  std::vector<RowPlan> plans;
  if (layout.spare_rows != 0) {
    plans.reserve(world());
    job.row_map.reserve(static_cast<size_t>(from.slots()));
    for (uint32_t r = 0; r < world(); ++r) {
      plans.push_back(PlanRows(r, l, m));
      for (uint32_t row : tables[r][l]) job.row_map.push_back(static_cast<int32_t>(row));
    }
    job.swap = plans[self()].swap;
  }
  const std::vector<uint32_t>& rows_of = tables[self()][l];
  std::vector<int> changed;
  size_t reads_in = 0;
  for (const RemoteRead& r : m.transfers) {
    if (r.dst == static_cast<int32_t>(self())) {
      JobRead jr;
      jr.task = {static_cast<uint32_t>(r.expert), static_cast<uint32_t>(r.src)};
      jr.src_row = tables[r.src][l][r.src_row];
      for (size_t t = 0; t < tensors; ++t) {
        jr.dst.push_back(job.swap ? WeightRow(l, t, plans[self()].read_row[reads_in])
                                  : StageRow(slot, l, t, r.dst_row));
      }
      ++reads_in;
      job.reads.push_back(std::move(jr));
      changed.push_back(r.dst_row);
    }
    if (r.src == static_cast<int32_t>(self())) {
      job.serves.push_back({static_cast<uint32_t>(r.expert), static_cast<uint32_t>(r.dst)});
    }
  }
  // The work within this rank at the commit; then every rank that swaps gets its new table
  // (each rank computes every rank's alike; an in-place rank's stays).
  std::function<uint64_t()> local;
  if (job.swap) {
    // The READs landed in rows no slot uses; copy what the plan copies within this rank
    // into more such rows.
    local = [this, l, tensors, copies = plans[self()].copies]() -> uint64_t {
      uint64_t copied = 0;
      for (const RowPlan::Copy& c : copies) {
        for (size_t t = 0; t < tensors; ++t) {
          std::memcpy(WeightRow(l, t, c.dst), WeightRow(l, t, c.src),
                      layout.layers[l][t].bytes_per_expert);
          copied += layout.layers[l][t].bytes_per_expert;
        }
      }
      return copied;
    };
  } else {
    std::vector<LocalCopy> copies;
    for (const LocalCopy& c : m.local_copies) {
      if (c.rank == static_cast<int32_t>(self())) copies.push_back(c);
    }
    local = [this, l, tensors, slot, rows_of, copies = std::move(copies),
             changed = std::move(changed)]() mutable -> uint64_t {
      // Copies from old rows first (the weights are still the old ones), then from rows just
      // read; then every changed row goes from staging to the weights.
      uint64_t copied = 0;
      for (CopySource pass : {CopySource::kOld, CopySource::kNew}) {
        for (const LocalCopy& c : copies) {
          if (c.source != pass) continue;
          for (size_t t = 0; t < tensors; ++t) {
            const uint8_t* src = pass == CopySource::kOld ? WeightRow(l, t, rows_of[c.src_row])
                                                          : StageRow(slot, l, t, c.src_row);
            std::memcpy(StageRow(slot, l, t, c.dst_row), src, layout.layers[l][t].bytes_per_expert);
            copied += layout.layers[l][t].bytes_per_expert;
          }
          changed.push_back(c.dst_row);
        }
      }
      for (int row : changed) {
        for (size_t t = 0; t < tensors; ++t) {
          std::memcpy(WeightRow(l, t, rows_of[row]), StageRow(slot, l, t, row),
                      layout.layers[l][t].bytes_per_expert);
          copied += layout.layers[l][t].bytes_per_expert;
        }
      }
      return copied;
    };
  }
  job.commit = [this, l, local = std::move(local), plans = std::move(plans)]() -> uint64_t {
    const uint64_t copied = local();
    for (uint32_t r = 0; r < plans.size(); ++r) {
      if (plans[r].swap) tables[r][l] = plans[r].table;
    }
    return copied;
  };
  return job;
}

}  // namespace internal

using internal::StrCat;

void AddBytesFrom(const LayerOutcome& o, RearrangeReport* report) {
  if (o.bytes_from_rank.empty()) return;
  report->bytes_from_rank.resize(o.bytes_from_rank.size(), 0);
  for (size_t r = 0; r < o.bytes_from_rank.size(); ++r)
    report->bytes_from_rank[r] += o.bytes_from_rank[r];
}

Rearranger::Rearranger(std::unique_ptr<internal::RearrangerImpl> impl) : impl_(std::move(impl)) {}
Rearranger::~Rearranger() = default;

Result<std::unique_ptr<Rearranger>> Rearranger::Create(Agent* agent, Bootstrap* bootstrap,
                                                       RankLayout layout,
                                                       RearrangeOptions options) {
  if (agent == nullptr || bootstrap == nullptr)
    return Status::InvalidArgument("Rearranger: null agent or bootstrap");
  if (layout.rank != bootstrap->rank()) {
    return Status::InvalidArgument(StrCat("Rearranger: layout is for rank ", layout.rank,
                                          " but the bootstrap says rank ", bootstrap->rank()));
  }
  // Local copies and staging are CPU memcpy here: device rows would fault, so say so first.
  for (size_t l = 0; l < layout.layers.size(); ++l) {
    for (size_t t = 0; t < layout.layers[l].size(); ++t) {
      const TensorSpec& spec = layout.layers[l][t];
      if (spec.rows > 0 && internal::IsCudaDevicePointer(spec.base)) {
        return Status::InvalidArgument(StrCat(
            "Rearranger: rank ", layout.rank, " layer ", l, " tensor ", t, " ('", spec.name,
            "') lives in CUDA device memory; the Rearranger copies and stages rows on the CPU, so "
            "it moves host memory only: move device weights with EplbCommunicator (Python: "
            "eplbx.vllm.EplbxCommunicator), which leaves local copies to the engine"));
      }
    }
  }
  auto impl = std::make_unique<internal::RearrangerImpl>();
  impl->agent = agent;
  impl->boot = bootstrap;
  impl->layout = std::move(layout);
  impl->options = options;
  impl->env = EnvOrDefault(options.env);
  EPLBX_RETURN_IF_ERROR(impl->Setup());
  return std::unique_ptr<Rearranger>(new Rearranger(std::move(impl)));
}

Status Rearranger::Rebuild() {
  internal::RearrangerImpl& d = *impl_;
  if (d.Busy()) {
    return Status::InProgress(StrCat("rank ", d.self(),
                                     ": an asynchronous rearrangement is running; end it "
                                     "(Commit() until it finishes) before rebuilding"));
  }
  d.deferred.clear();
  EPLBX_RETURN_IF_ERROR(d.Setup());
  d.failed = false;
  d.failure.clear();
  return Status::OK();
}

RearrangeReport Rearranger::Rearrange(const Placement& from, const Placement& to) {
  internal::RearrangerImpl& d = *impl_;
  MigrationPlan plan;
  // A failed Rearranger or placements that do not fit are reported by the call below.
  if (!d.failed && d.CheckShapes(from, to).ok()) {
    MigrationOptions mo;
    mo.ranks = static_cast<int>(d.world());
    mo.nodes = d.options.nodes;
    Result<MigrationPlan> planned = PlanMigration(from, to, mo);
    if (!planned.ok()) {
      RearrangeReport report;
      report.status =
          planned.status().WithPrefix(StrCat("rank ", d.self(), ": planning the migration"));
      return report;
    }
    plan = std::move(*planned);
  }
  return Rearrange(from, to, plan);
}

RearrangeReport Rearranger::Rearrange(const Placement& from, const Placement& to,
                                      const MigrationPlan& plan) {
  internal::RearrangerImpl& d = *impl_;
  RearrangeReport report;
  const auto t0 = impl_->env->Now();
  if (d.failed) {
    report.status = Status::Aborted(StrCat("rank ", d.self(), ": this Rearranger failed earlier (",
                                           d.failure, "); build a new one"));
    return report;
  }
  if (d.Busy()) {
    report.status =
        Status::InProgress(StrCat("rank ", d.self(),
                                  ": an asynchronous rearrangement is running; Commit() until it "
                                  "finishes"));
    return report;
  }
  report.status = d.CheckShapes(from, to);
  if (!report.status.ok()) return report;
  const int layers = static_cast<int>(d.layout.layers.size());
  report.status = d.CheckPlan(from, to, plan);
  if (!report.status.ok()) return report;
  const std::vector<PathTotals> paths_before = d.agent->PathBytes();
  // Layers run together, up to layers_in_flight at once; a layer that lands in staging (in
  // place, or a rank whose new rows do not fit its spare rows) takes one of the staging
  // buffers, so in place they run one at a time unless Reserve() allocated more.
  std::vector<bool> staged(static_cast<size_t>(layers), true);
  for (int l = 0; l < layers && d.layout.spare_rows != 0; ++l)
    staged[l] = !d.PlanRows(d.self(), static_cast<uint32_t>(l), plan.layers[l]).swap;
  std::string end_error;
  std::vector<LayerOutcome> outcomes = d.RunJobs(
      static_cast<uint32_t>(layers), static_cast<size_t>(std::max(d.options.layers_in_flight, 1)),
      [&](uint32_t l) { return staged[l]; },
      [&](uint32_t l, int slot) { return d.MakeLayerJob(l, plan.layers[l], from, to, slot); },
      &end_error);
  for (LayerOutcome& o : outcomes) {
    report.bytes_read += o.bytes_read;
    report.experts_read += o.experts_read;
    report.bytes_cross_node += o.bytes_cross_node;
    AddBytesFrom(o, &report);
    if (!o.committed && report.status.ok()) {
      d.failed = true;
      d.failure = o.error;
      report.status = Status::Aborted(
          StrCat("rank ", d.self(), ": ", d.failure, "; this layer kept its old weights and map"));
    }
    report.layers.push_back(std::move(o));
  }
  if (report.status.ok() && !end_error.empty()) {
    // Every layer is new here, but some rank did not say it applied them all: the ranks may
    // disagree (docs/protocol.md, "The end round").
    d.failed = true;
    d.failure = end_error;
    report.status = Status::Aborted(
        StrCat("rank ", d.self(), ": every layer is committed here, but not known to be on every ",
               "rank: ", end_error));
  }
  report.bytes_by_path = d.agent->PathBytes();
  for (size_t i = 0; i < report.bytes_by_path.size() && i < paths_before.size(); ++i) {
    report.bytes_by_path[i].bytes -= paths_before[i].bytes;
    report.bytes_by_path[i].transfers -= paths_before[i].transfers;
  }
  report.seconds = std::chrono::duration<double>(impl_->env->Now() - t0).count();
  return report;
}

Status Rearranger::Begin(const Placement& from, const Placement& to, const MigrationPlan& plan,
                         AsyncOptions options) {
  return impl_->Begin(from, to, plan, options);
}
Status Rearranger::Poll() { return impl_->Poll(); }
Status Rearranger::Reserve(const AsyncOptions& options) { return impl_->Reserve(options); }
CommitResult Rearranger::Commit() { return impl_->Commit(); }
bool Rearranger::AwaitCommit(std::chrono::milliseconds timeout) {
  return impl_->AwaitCommit(timeout);
}
AsyncProgress Rearranger::progress() const { return impl_->Progress(); }
bool Rearranger::busy() const { return impl_->Busy(); }
uint64_t Rearranger::staging_bytes() const { return impl_->staging.size() * impl_->StagingBytes(); }
RearrangeReport Rearranger::async_report() const { return impl_->PipelineReport(); }

bool Rearranger::failed() const { return impl_->failed; }

std::vector<uint32_t> Rearranger::RowTable(uint32_t layer) const {
  const internal::RearrangerImpl& d = *impl_;
  if (layer >= d.layout.layers.size()) return {};
  return d.tables[d.self()][layer];
}

Result<PeerId> Rearranger::peer(uint32_t rank) const {
  if (rank >= impl_->world() || rank == impl_->self()) {
    return Status::InvalidArgument(StrCat("no peer for rank ", rank));
  }
  return impl_->peer_of[rank];
}

// ---- EplbCommunicator -------------------------------------------------------------------

struct EplbCommunicator::State {
  std::unique_ptr<internal::RearrangerImpl> impl;
  std::vector<int32_t> old_map, new_map;
  bool kept_rows_copied = false;  // the caller copied out the rows whose expert stays here
  bool has_context = false;
  internal::RearrangerImpl::LayerJob job;

  Status Check() const {
    if (impl->failed) {
      return Status::Aborted(StrCat("rank ", impl->self(), ": this communicator failed earlier (",
                                    impl->failure, "); build a new one"));
    }
    if (!has_context)
      return Status::InvalidArgument("call SetTransferContext(old_phy2log, layer) first");
    return Status::OK();
  }
  // The row of `rank` that holds `expert` in the old map, or -1.
  int RowOf(uint32_t rank, uint32_t expert) const {
    const uint32_t rows = impl->layout.layers[job.layer][0].rows;
    for (uint32_t i = 0; i < rows; ++i) {
      if (old_map[rank * rows + i] == static_cast<int32_t>(expert)) return static_cast<int>(i);
    }
    return -1;
  }
  // Refuses receive rows that would overwrite memory the layer still needs (see AddRecv).
  Status CheckReceiveRows() const;
  // A bad argument once the layer's context is set: this rank cannot run the layer. Its
  // peers are told at once (ABORT), so none waits for the deadline; nothing has moved.
  Status Refuse(Status why) {
    job.refused = why;
    LayerOutcome o = impl->RunJob(job);
    has_context = false;
    impl->failed = true;
    impl->failure = o.error;
    return why;
  }
};

Status EplbCommunicator::State::CheckReceiveRows() const {
  const auto& d = *impl;
  const uint32_t me = d.self(), layer = job.layer, rows = d.layout.layers[layer][0].rows;
  struct Span {
    uint64_t begin, end;
    std::string what;
  };
  auto overlaps = [](const Span& a, uint64_t b, uint64_t e) { return a.begin < e && b < a.end; };
  std::vector<Span> recv;
  for (const auto& r : job.reads) {
    for (size_t t = 0; t < r.dst.size(); ++t) {
      const uint64_t b = reinterpret_cast<uintptr_t>(r.dst[t]);
      recv.push_back(
          {b, b + d.layout.layers[layer][t].bytes_per_expert,
           StrCat("rank ", me, ": the receive row of expert ", r.task.expert, " (tensor ", t, " '",
                  d.layout.layers[layer][t].name, "') of layer ", layer)});
    }
  }
  // What each of this layer's rows is for: read by a peer, kept, or free to overwrite.
  std::vector<std::string> why_live(rows);
  for (const protocol::ServeTask& sv : job.serves) {
    const int row = RowOf(me, sv.expert);
    if (row >= 0)
      why_live[row] = StrCat("which rank ", sv.reader, " reads (expert ", sv.expert, ")");
  }
  for (uint32_t row = 0; row < rows; ++row) {
    if (!why_live[row].empty()) continue;
    const int32_t e = old_map[me * rows + row];
    if (new_map.empty()) {
      why_live[row] = StrCat("a live weight row (expert ", e,
                             "; without the new map every row counts as kept: receive into a "
                             "buffer, or pass the new map)");
      continue;
    }
    for (uint32_t k = 0; k < rows && !kept_rows_copied; ++k) {
      if (e >= 0 && new_map[me * rows + k] == e)
        why_live[row] = StrCat("which holds expert ", e, ", kept by this rank");
    }
  }
  for (const Span& r : recv) {
    for (uint32_t l = 0; l < d.layout.layers.size(); ++l) {
      for (size_t t = 0; t < d.layout.layers[l].size(); ++t) {
        const TensorSpec& spec = d.layout.layers[l][t];
        if (!overlaps(r, spec.base, spec.base + spec.rows * spec.bytes_per_expert)) continue;
        for (uint32_t row = 0; row < spec.rows; ++row) {
          const uint64_t b = spec.base + row * spec.bytes_per_expert;
          if (!overlaps(r, b, b + spec.bytes_per_expert)) continue;
          if (l != layer) {
            return Status::InvalidArgument(
                StrCat(r.what, " overlaps row ", row, " of layer ", l, " tensor '", spec.name,
                       "' (live weights of another layer); receive into a buffer"));
          }
          if (!why_live[row].empty()) {
            return Status::InvalidArgument(StrCat(r.what, " overlaps weight row ", row,
                                                  " of tensor '", spec.name, "', ", why_live[row]));
          }
        }
      }
    }
  }
  for (size_t i = 0; i < recv.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (overlaps(recv[i], recv[j].begin, recv[j].end)) {
        return Status::InvalidArgument(StrCat(recv[i].what, " overlaps",
                                              recv[j].what.substr(recv[j].what.find(':') + 1),
                                              "; every receive row needs its own memory"));
      }
    }
  }
  return Status::OK();
}

EplbCommunicator::EplbCommunicator(std::unique_ptr<State> state) : state_(std::move(state)) {}
EplbCommunicator::~EplbCommunicator() = default;

Result<std::unique_ptr<EplbCommunicator>> EplbCommunicator::Create(Agent* agent,
                                                                   Bootstrap* bootstrap,
                                                                   RankLayout layout,
                                                                   RearrangeOptions options) {
  if (agent == nullptr || bootstrap == nullptr)
    return Status::InvalidArgument("EplbCommunicator: null agent or bootstrap");
  if (layout.rank != bootstrap->rank()) {
    return Status::InvalidArgument(StrCat("EplbCommunicator: layout is for rank ", layout.rank,
                                          " but the bootstrap says rank ", bootstrap->rank()));
  }
  if (layout.spare_rows != 0 || !layout.row_of_slot.empty()) {
    return Status::InvalidArgument(
        StrCat("EplbCommunicator: rank ", layout.rank, "'s layout has ", layout.spare_rows,
               " spare rows and ", layout.row_of_slot.size(),
               " row tables; vLLM's contract moves rows in place (use a Rearranger or the "
               "Balancer for the swap commit mode)"));
  }
  auto state = std::make_unique<State>();
  state->impl = std::make_unique<internal::RearrangerImpl>();
  state->impl->agent = agent;
  state->impl->boot = bootstrap;
  state->impl->layout = std::move(layout);
  state->impl->options = options;
  state->impl->env = EnvOrDefault(options.env);
  state->impl->caller_rows = true;  // reads land in the rows given to AddRecv
  EPLBX_RETURN_IF_ERROR(state->impl->Setup());
  return std::unique_ptr<EplbCommunicator>(new EplbCommunicator(std::move(state)));
}

Status EplbCommunicator::SetTransferContext(std::span<const int32_t> old_phy2log, uint32_t layer,
                                            std::span<const int32_t> new_phy2log,
                                            bool kept_rows_copied) {
  State& s = *state_;
  const auto& d = *s.impl;
  if (d.failed)
    return Status::Aborted(
        StrCat("rank ", d.self(), ": this communicator failed earlier (", d.failure, ")"));
  if (layer >= d.layout.layers.size() || d.layout.layers[layer].empty()) {
    return Status::InvalidArgument(StrCat("rank ", d.self(), ": layer ", layer,
                                          " is not in the layout (", d.layout.layers.size(),
                                          " layers)"));
  }
  const uint64_t slots = static_cast<uint64_t>(d.layout.layers[layer][0].rows) * d.world();
  if (old_phy2log.size() != slots) {
    return Status::InvalidArgument(StrCat("rank ", d.self(), ": old_phy2log of layer ", layer,
                                          " has ", old_phy2log.size(), " slots, expected ", slots,
                                          " (ranks x rows)"));
  }
  if (!new_phy2log.empty() && new_phy2log.size() != slots) {
    return Status::InvalidArgument(StrCat("rank ", d.self(), ": new_phy2log of layer ", layer,
                                          " has ", new_phy2log.size(), " slots, expected ", slots,
                                          " (ranks x rows)"));
  }
  if (kept_rows_copied && new_phy2log.empty()) {
    return Status::InvalidArgument(
        StrCat("rank ", d.self(), ": layer ", layer, ": kept_rows_copied needs the new map"));
  }
  s.old_map.assign(old_phy2log.begin(), old_phy2log.end());
  s.new_map.assign(new_phy2log.begin(), new_phy2log.end());
  s.kept_rows_copied = kept_rows_copied;
  s.job = {};
  s.job.layer = layer;
  s.has_context = true;
  return Status::OK();
}

Status EplbCommunicator::AddSend(uint32_t dst_rank, uint32_t expert) {
  State& s = *state_;
  EPLBX_RETURN_IF_ERROR(s.Check());
  const auto& d = *s.impl;
  if (dst_rank >= d.world() || dst_rank == d.self()) {
    return s.Refuse(Status::InvalidArgument(
        StrCat("rank ", d.self(), ": add_send to rank ", dst_rank, " (world ", d.world(), ")")));
  }
  if (s.RowOf(d.self(), expert) < 0) {
    return s.Refuse(Status::InvalidArgument(
        StrCat("rank ", d.self(), ": add_send of expert ", expert, " in layer ", s.job.layer,
               ", which this rank does not hold in the old map")));
  }
  s.job.serves.push_back({expert, dst_rank});
  return Status::OK();
}

Status EplbCommunicator::AddRecv(uint32_t src_rank, uint32_t expert,
                                 std::span<const Descriptor> dst_rows) {
  State& s = *state_;
  EPLBX_RETURN_IF_ERROR(s.Check());
  const auto& d = *s.impl;
  if (src_rank >= d.world() || src_rank == d.self()) {
    return s.Refuse(Status::InvalidArgument(
        StrCat("rank ", d.self(), ": add_recv from rank ", src_rank, " (world ", d.world(), ")")));
  }
  const size_t tensors = d.layout.layers[s.job.layer].size();
  if (dst_rows.size() != tensors) {
    return s.Refuse(Status::InvalidArgument(
        StrCat("rank ", d.self(), ": add_recv of expert ", expert, " gives ", dst_rows.size(),
               " rows; layer ", s.job.layer, " has ", tensors, " tensors")));
  }
  for (size_t t = 0; t < tensors; ++t) {
    const TensorSpec& spec = d.layout.layers[s.job.layer][t];
    if (dst_rows[t].bytes != spec.bytes_per_expert) {
      return s.Refuse(Status::InvalidArgument(
          StrCat("rank ", d.self(), ": add_recv of expert ", expert, " in layer ", s.job.layer,
                 ": receive row ", t, " (tensor '", spec.name, "') is ", dst_rows[t].bytes,
                 " bytes, the layout's row is ", spec.bytes_per_expert, " (dtype ", spec.dtype,
                 "); give rows shaped like the weights' rows")));
    }
  }
  const int row = s.RowOf(src_rank, expert);
  if (row < 0) {
    return s.Refuse(Status::InvalidArgument(
        StrCat("rank ", d.self(), ": add_recv of expert ", expert, " from rank ", src_rank,
               ", which does not hold it in layer ", s.job.layer, "'s old map")));
  }
  internal::RearrangerImpl::JobRead jr;
  jr.task = {expert, src_rank};
  jr.src_row = static_cast<uint64_t>(row);
  for (const Descriptor& p : dst_rows)
    jr.dst.push_back(reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(p.addr)));
  s.job.reads.push_back(std::move(jr));
  return Status::OK();
}

Status EplbCommunicator::Execute() {
  State& s = *state_;
  EPLBX_RETURN_IF_ERROR(s.Check());
  Status rows = s.CheckReceiveRows();
  if (!rows.ok()) return s.Refuse(rows);
  s.job.old_map = s.old_map;
  s.job.new_map = s.new_map;
  LayerOutcome o = s.impl->RunJob(s.job);
  s.has_context = false;
  if (!o.committed) {
    s.impl->failed = true;
    s.impl->failure = o.error;
    return Status::Aborted(StrCat("rank ", s.impl->self(), ": ", o.error));
  }
  return Status::OK();
}

Status EplbCommunicator::Abort(std::string_view reason) {
  State& s = *state_;
  EPLBX_RETURN_IF_ERROR(s.Check());
  (void)s.Refuse(Status::Aborted(std::string(reason)));
  return Status::Aborted(StrCat("rank ", s.impl->self(), ": ", reason));
}

bool EplbCommunicator::failed() const { return state_->impl->failed; }

}  // namespace eplbx
