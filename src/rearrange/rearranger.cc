#include "eplbx/rearrange.h"

#include <cstring>
#include <deque>
#include <map>

#include "common/bytes.h"
#include "common/strings.h"
#include "eplbx/migration.h"
#include "protocol/layer_protocol.h"
#include "protocol/records.h"

namespace eplbx {
namespace internal {

using protocol::Action;
using protocol::ActionKind;
using protocol::Clock;
using protocol::LayerProtocol;
using protocol::LayerState;
using protocol::ReadTask;

class RearrangerImpl {
 public:
  Agent* agent = nullptr;
  Bootstrap* boot = nullptr;
  RankLayout layout;
  std::vector<RankLayout> all;
  RearrangeOptions options;
  std::vector<PeerId> peer_of;  // by rank; self unused
  std::map<std::string, uint32_t> rank_of_name;
  RegisteredRegion staging;
  bool failed = false;
  std::string failure;
  uint64_t generation = 0;
  std::deque<std::pair<uint32_t, protocol::Record>> deferred;
  std::function<void(uint32_t)> hook;

  uint32_t self() const { return layout.rank; }
  uint32_t world() const { return static_cast<uint32_t>(all.size()); }

  Status Setup();
  LayerOutcome RunLayer(uint32_t l, const LayerMigration& m);

 private:
  struct Pending {
    TransferId id;
    ReadTask task;
  };
  struct LayerRun {
    uint32_t layer = 0;
    const LayerMigration* m = nullptr;
    std::vector<uint64_t> offset;  // staging offset of each tensor
    std::map<std::pair<uint32_t, uint32_t>, const RemoteRead*> read_of;  // (expert, source)
    std::vector<Pending> pending;
    LayerOutcome outcome;
  };
  void Execute(LayerProtocol& p, LayerRun& run, std::vector<Action> actions);
  void Commit(LayerRun& run);
  uint8_t* StageRow(const LayerRun& run, size_t t, int row) const {
    return static_cast<uint8_t*>(staging.data()) + run.offset[t] + static_cast<uint64_t>(row) * layout.layers[run.layer][t].bytes_per_expert;
  }
  uint8_t* WeightRow(const LayerRun& run, size_t t, int row) const {
    const TensorSpec& s = layout.layers[run.layer][t];
    return reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(s.base)) + static_cast<uint64_t>(row) * s.bytes_per_expert;
  }
};

Status RearrangerImpl::Setup() {
  ByteWriter w;
  w.Str32(agent->Metadata());
  w.Str32(EncodeLayout(layout));
  Result<std::vector<std::string>> gathered = boot->AllGather(w.Take(), options.deadline);
  if (!gathered.ok()) return gathered.status().WithPrefix(StrCat("rank ", self(), ": exchanging metadata"));
  std::vector<std::string> blobs(gathered->size());
  all.resize(gathered->size());
  for (uint32_t r = 0; r < gathered->size(); ++r) {
    ByteReader in((*gathered)[r], "rank contribution");
    std::string layout_bytes;
    if (!in.Str32("agent_metadata", 16u << 20, &blobs[r]) || !in.Str32("layout", 64u << 20, &layout_bytes)) {
      return in.status().WithPrefix(StrCat("rank ", r));
    }
    Result<RankLayout> decoded = DecodeLayout(layout_bytes);
    if (!decoded.ok()) return decoded.status().WithPrefix(StrCat("rank ", r, " sent a bad layout"));
    all[r] = std::move(*decoded);
  }
  EPLBX_RETURN_IF_ERROR(ValidateLayouts(all, self()));
  peer_of.assign(world(), 0);
  for (uint32_t r = 0; r < world(); ++r) {
    if (r == self()) continue;
    Result<PeerId> p = agent->Connect(blobs[r]);
    if (!p.ok()) return p.status().WithPrefix(StrCat("rank ", self(), ": connecting to rank ", r));
    peer_of[r] = *p;
    rank_of_name[agent->Peer(*p)->name] = r;
  }
  uint64_t most = 0;
  for (const auto& tensors : layout.layers) {
    uint64_t bytes = 0;
    for (const TensorSpec& t : tensors) bytes += static_cast<uint64_t>(t.rows) * t.bytes_per_expert;
    most = std::max(most, bytes);
  }
  Result<RegisteredRegion> s = agent->AllocateShared(std::max<uint64_t>(most, 1));
  if (!s.ok()) return s.status().WithPrefix(StrCat("rank ", self(), ": staging buffer of one layer"));
  staging = std::move(*s);
  return Status::OK();
}

void RearrangerImpl::Execute(LayerProtocol& p, LayerRun& run, std::vector<Action> actions) {
  std::deque<Action> work(actions.begin(), actions.end());
  auto more = [&](std::vector<Action> next) { work.insert(work.end(), next.begin(), next.end()); };
  while (!work.empty()) {
    Action a = std::move(work.front());
    work.pop_front();
    switch (a.kind) {
      case ActionKind::kSend: {
        Status s = agent->Notify(peer_of[a.peer], protocol::EncodeRecord(a.record));
        if (!s.ok() && a.record.kind != protocol::RecordKind::kAbort) more(p.OnPeerFailed(a.peer, s));
        break;
      }
      case ActionKind::kPostRead: {
        const RemoteRead* rr = run.read_of.at({a.read.expert, a.read.source});
        const auto& tensors = layout.layers[run.layer];
        std::vector<Descriptor> local, remote;
        for (size_t t = 0; t < tensors.size(); ++t) {
          const TensorSpec& theirs = all[a.read.source].layers[run.layer][t];
          local.push_back(Descriptor::Of(StageRow(run, t, rr->dst_row), tensors[t].bytes_per_expert));
          remote.push_back({theirs.base + static_cast<uint64_t>(rr->src_row) * theirs.bytes_per_expert,
                            theirs.bytes_per_expert});
          run.outcome.bytes_read += tensors[t].bytes_per_expert;
        }
        Result<TransferId> id = agent->Read(peer_of[a.read.source], local, remote, protocol::EncodeRecord(a.record));
        if (id.ok()) {
          run.pending.push_back({*id, a.read});
        } else {
          more(p.OnReadComplete(a.read, id.status()));
        }
        break;
      }
      case ActionKind::kCommit: Commit(run); break;
      case ActionKind::kAbort: break;
    }
  }
}

void RearrangerImpl::Commit(LayerRun& run) {
  const auto& tensors = layout.layers[run.layer];
  std::vector<int> changed;
  for (const RemoteRead& r : run.m->transfers) {
    if (r.dst == static_cast<int32_t>(self())) changed.push_back(r.dst_row);
  }
  // Copies from old rows first (weights are still the old ones), then from rows just read.
  for (CopySource pass : {CopySource::kOld, CopySource::kNew}) {
    for (const LocalCopy& c : run.m->local_copies) {
      if (c.rank != static_cast<int32_t>(self()) || c.source != pass) continue;
      for (size_t t = 0; t < tensors.size(); ++t) {
        const uint8_t* from = pass == CopySource::kOld ? WeightRow(run, t, c.src_row) : StageRow(run, t, c.src_row);
        std::memcpy(StageRow(run, t, c.dst_row), from, tensors[t].bytes_per_expert);
        run.outcome.bytes_copied += tensors[t].bytes_per_expert;
      }
      if (pass == CopySource::kOld) changed.push_back(c.dst_row);
      if (pass == CopySource::kNew) changed.push_back(c.dst_row);
    }
  }
  for (int row : changed) {
    for (size_t t = 0; t < tensors.size(); ++t) {
      std::memcpy(WeightRow(run, t, row), StageRow(run, t, row), tensors[t].bytes_per_expert);
    }
  }
  run.outcome.committed = true;
}

LayerOutcome RearrangerImpl::RunLayer(uint32_t l, const LayerMigration& m) {
  LayerRun run;
  run.layer = l;
  run.m = &m;
  run.outcome.layer = l;
  uint64_t at = 0;
  for (const TensorSpec& t : layout.layers[l]) {
    run.offset.push_back(at);
    at += static_cast<uint64_t>(t.rows) * t.bytes_per_expert;
  }
  protocol::LayerStep step;
  step.generation = ++generation;
  step.layer = l;
  step.self = self();
  step.world = world();
  for (const RemoteRead& r : m.transfers) {
    if (r.dst == static_cast<int32_t>(self())) {
      step.reads.push_back({static_cast<uint32_t>(r.expert), static_cast<uint32_t>(r.src)});
      run.read_of[{static_cast<uint32_t>(r.expert), static_cast<uint32_t>(r.src)}] = &r;
    }
    if (r.src == static_cast<int32_t>(self())) {
      step.serves.push_back({static_cast<uint32_t>(r.expert), static_cast<uint32_t>(r.dst)});
    }
  }
  LayerProtocol p(step, Clock::now(), options.deadline);
  Execute(p, run, p.Start());
  // Records that arrived early, during an earlier layer.
  std::deque<std::pair<uint32_t, protocol::Record>> later;
  for (auto& [from, rec] : deferred) {
    bool again = false;
    Execute(p, run, p.OnRecord(from, rec, Clock::now(), &again));
    if (again) later.push_back({from, rec});
  }
  deferred.swap(later);
  if (hook) hook(l);
  while (p.state() == LayerState::kRunning) {
    for (Notification& n : agent->WaitNotifications(std::chrono::milliseconds(1))) {
      auto who = rank_of_name.find(n.peer);
      if (who == rank_of_name.end()) continue;  // not a member of this group
      Result<protocol::Record> rec = protocol::DecodeRecord(n.payload);
      if (!rec.ok()) {
        Execute(p, run, p.OnMalformed(who->second, rec.status()));
        continue;
      }
      bool later_gen = false;
      Execute(p, run, p.OnRecord(who->second, *rec, Clock::now(), &later_gen));
      if (later_gen) deferred.push_back({who->second, *rec});
    }
    for (size_t i = 0; i < run.pending.size();) {
      TransferStatus s = agent->GetStatus(run.pending[i].id);
      if (s.state == TransferState::kInProgress) {
        ++i;
        continue;
      }
      (void)agent->Release(run.pending[i].id);
      const ReadTask task = run.pending[i].task;
      run.pending.erase(run.pending.begin() + static_cast<long>(i));
      Execute(p, run, p.OnReadComplete(task, s.state == TransferState::kDone ? Status::OK() : s.error));
    }
    for (uint32_t r = 0; r < world() && p.state() == LayerState::kRunning; ++r) {
      if (r == self()) continue;
      Result<PeerInfo> info = agent->Peer(peer_of[r]);
      if (info.ok() && !info->reachable) Execute(p, run, p.OnPeerFailed(r, Status::Unavailable(info->failure)));
    }
    Execute(p, run, p.OnTick(Clock::now()));
  }
  // Nothing of this layer may land in staging after we return.
  for (const Pending& pending : run.pending) {
    (void)agent->Cancel(pending.id);
    (void)agent->Release(pending.id);
  }
  if (p.state() == LayerState::kAborted) run.outcome.error = p.error();
  return run.outcome;
}

}  // namespace internal

using internal::StrCat;

Rearranger::Rearranger(std::unique_ptr<internal::RearrangerImpl> impl) : impl_(std::move(impl)) {}
Rearranger::~Rearranger() = default;

Result<std::unique_ptr<Rearranger>> Rearranger::Create(Agent* agent, Bootstrap* bootstrap, RankLayout layout,
                                                       RearrangeOptions options) {
  if (agent == nullptr || bootstrap == nullptr) return Status::InvalidArgument("Rearranger: null agent or bootstrap");
  if (layout.rank != bootstrap->rank()) {
    return Status::InvalidArgument(StrCat("Rearranger: layout is for rank ", layout.rank, " but the bootstrap says rank ",
                                          bootstrap->rank()));
  }
  auto impl = std::make_unique<internal::RearrangerImpl>();
  impl->agent = agent;
  impl->boot = bootstrap;
  impl->layout = std::move(layout);
  impl->options = options;
  EPLBX_RETURN_IF_ERROR(impl->Setup());
  return std::unique_ptr<Rearranger>(new Rearranger(std::move(impl)));
}

RearrangeReport Rearranger::Rearrange(const Placement& from, const Placement& to) {
  internal::RearrangerImpl& d = *impl_;
  RearrangeReport report;
  const auto t0 = std::chrono::steady_clock::now();
  if (d.failed) {
    report.status = Status::Aborted(StrCat("rank ", d.self(), ": this Rearranger failed earlier (", d.failure,
                                           "); build a new one"));
    return report;
  }
  const int layers = static_cast<int>(d.layout.layers.size());
  if (from.layers() != layers || to.layers() != layers || from.slots() != to.slots()) {
    report.status = Status::InvalidArgument(StrCat("rank ", d.self(), ": placements have ", from.layers(), " and ",
                                                   to.layers(), " layers, ", from.slots(), " and ", to.slots(),
                                                   " slots; the layout has ", layers, " layers"));
    return report;
  }
  for (int l = 0; l < layers; ++l) {
    const uint64_t rows = d.layout.layers[l].empty() ? 0 : d.layout.layers[l][0].rows;
    if (rows * d.world() != static_cast<uint64_t>(from.slots())) {
      report.status = Status::InvalidArgument(StrCat("rank ", d.self(), ": layer ", l, " has ", rows, " rows x ",
                                                     d.world(), " ranks, the placements have ", from.slots(), " slots"));
      return report;
    }
  }
  MigrationOptions mo;
  mo.ranks = static_cast<int>(d.world());
  mo.nodes = d.options.nodes;
  Result<MigrationPlan> plan = PlanMigration(from, to, mo);
  if (!plan.ok()) {
    report.status = plan.status().WithPrefix(StrCat("rank ", d.self(), ": planning the migration"));
    return report;
  }
  for (int l = 0; l < layers; ++l) {
    LayerOutcome o = d.RunLayer(static_cast<uint32_t>(l), plan->layers[l]);
    report.bytes_read += o.bytes_read;
    const bool ok = o.committed;
    report.layers.push_back(std::move(o));
    if (!ok) {
      d.failed = true;
      d.failure = report.layers.back().error;
      report.status = Status::Aborted(StrCat("rank ", d.self(), ": ", d.failure,
                                             "; this layer kept its old weights and map"));
      break;
    }
  }
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return report;
}

bool Rearranger::failed() const { return impl_->failed; }

Result<PeerId> Rearranger::peer(uint32_t rank) const {
  if (rank >= impl_->world() || rank == impl_->self()) {
    return Status::InvalidArgument(StrCat("no peer for rank ", rank));
  }
  return impl_->peer_of[rank];
}

void Rearranger::set_layer_hook(std::function<void(uint32_t layer)> hook) { impl_->hook = std::move(hook); }

}  // namespace eplbx
