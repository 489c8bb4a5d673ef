// The "ucx" data path: get/put on the peer's rkeys over the worker's endpoints (tcp here,
// RDMA where UCX finds it; a put completes with a flush). Its metadata section is one
// packed rkey per region.
#include <memory>
#include <mutex>
#include <set>

#include "common/bytes.h"
#include "transfer/ucx/ucx_path.h"
#include "transfer/ucx/ucx_worker.h"

namespace eplbx::internal {
namespace ucx {

Status UcxWorker::UnpackRkeys(PeerId id, const std::vector<std::string>& rkeys) {
  return RunSync<bool>([&]() -> Result<bool> {
           std::shared_ptr<PeerState> p;
           {
             std::lock_guard<std::mutex> lock(mu_);
             auto it = peers_.find(id);
             if (it == peers_.end()) {
               return Status::NotFound(StrCat("agent '", options_.agent_name, "': no peer ", id));
             }
             p = it->second;
           }
           if (p->ep == nullptr) return Unreachable(*p);
           DestroyRkeys(*p);
           for (size_t i = 0; i < rkeys.size(); ++i) {
             ucp_rkey_h rkey = nullptr;
             if (rkeys[i].empty()) {  // a region UCX does not reach (device memory)
               p->rkeys.push_back(nullptr);
               continue;
             }
             ucs_status_t st = ucp_ep_rkey_unpack(p->ep, rkeys[i].data(), &rkey);
             if (st != UCS_OK) {
               DestroyRkeys(*p);
               return Status::Corruption(StrCat("agent '", options_.agent_name, "': peer '",
                                                p->name, "' region ", i,
                                                ": invalid UCX remote key (", Ucs(st), ")"));
             }
             p->rkeys.push_back(rkey);
           }
           return true;
         })
      .status();
}

Status UcxWorker::PostRma(PathRequest req) {
  Result<std::shared_ptr<PeerState>> p = LivePeer(req.peer);
  if (!p.ok()) return p.status();
  Enqueue(
      [this, p = std::move(*p), req = std::move(req)]() mutable { StartRma(p, std::move(req)); });
  return Status::OK();
}

void UcxWorker::CancelRma(TransferId id) {
  Enqueue([this, id] {
    auto it = ops_.find(id);
    if (it == ops_.end()) return;
    it->second->cancelled = true;
    MaybeFinish(it->second.get());
  });
}

void UcxWorker::StartRma(const std::shared_ptr<PeerState>& p, PathRequest req) {
  auto owned = std::make_unique<Op>();
  Op* op = owned.get();
  op->self = this;
  op->id = req.id;
  op->peer = p;
  op->kind = req.op;
  ops_[req.id] = std::move(owned);
  if (p->failed || p->ep == nullptr) {
    op->error = Unreachable(*p);
  } else {
    for (const Segment& s : req.segments) {
      if (s.remote_region >= p->rkeys.size()) {
        op->error = Status::Internal(StrCat("agent '", options_.agent_name, "': no UCX key for '",
                                            p->name, "' region ", s.remote_region));
        break;
      }
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      param.cb.send = &UcxWorker::OnRmaDone;
      param.user_data = op;
      if (auto m = memh_.find(s.local_region); m != memh_.end()) {
        param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
        param.memh = m->second;
      }
      void* buffer = reinterpret_cast<void*>(static_cast<uintptr_t>(s.local));
      ucp_rkey_h rkey = p->rkeys[s.remote_region];
      void* r = req.op == XferOp::kRead
                    ? ucp_get_nbx(p->ep, buffer, s.bytes, s.remote, rkey, &param)
                    : ucp_put_nbx(p->ep, buffer, s.bytes, s.remote, rkey, &param);
      if (!Track(op, r)) break;
    }
    if (req.op == XferOp::kWrite && op->error.ok()) {
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      param.cb.send = &UcxWorker::OnRmaDone;
      param.user_data = op;
      Track(op, ucp_ep_flush_nbx(p->ep, &param));  // remote completion of every put
    }
  }
  op->posted_all = true;
  MaybeFinish(op);
}

bool UcxWorker::Track(Op* op, void* request) {
  if (request == nullptr) return true;
  if (UCS_PTR_IS_ERR(request)) {
    RmaError(op, UCS_PTR_STATUS(request));
    return false;
  }
  ++op->pending;
  ++inflight_;
  return true;
}

void UcxWorker::RmaError(Op* op, ucs_status_t status) {
  if (!op->error.ok()) return;
  op->error =
      op->peer->failed
          ? Unreachable(*op->peer)
          : Status::IoError(StrCat("agent '", options_.agent_name, "': ", OpName(op->kind),
                                   " with '", op->peer->name, "' failed in UCX: ", Ucs(status)));
}

void UcxWorker::OnRmaDone(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<Op*>(user_data);
  UcxWorker* self = op->self;
  --op->pending;
  --self->inflight_;
  if (status != UCS_OK) self->RmaError(op, status);
  ucp_request_free(request);
  self->MaybeFinish(op);
}

void UcxWorker::MaybeFinish(Op* op) {
  if (!op->posted_all || op->pending > 0) return;
  if (op->error.ok() && op->peer->failed) op->error = Unreachable(*op->peer);
  if (op->error.ok() && op->cancelled) {
    op->error = Status::Aborted(StrCat("agent '", options_.agent_name, "': ", OpName(op->kind),
                                       " with '", op->peer->name, "' cancelled"));
  }
  const TransferId id = op->id;
  Status s = op->error;
  ops_.erase(id);
  rma_listener_->OnDataDone(id, std::move(s));
}

namespace {

class UcxRmaPath final : public DataPath {
 public:
  UcxRmaPath(UcxWorker* worker, std::string agent) : worker_(worker), agent_(std::move(agent)) {}

  std::string_view name() const override { return "ucx"; }
  PathCaps caps() const override {
    PathCaps c;
    c.kinds = (1u << static_cast<unsigned>(MemoryKind::kHost)) |
              (1u << static_cast<unsigned>(MemoryKind::kHostFile));
    // A UCX built with CUDA moves device memory itself (never seen here: Debian's UCX 1.13
    // has no CUDA support, so this stays untested on these machines).
    if (worker_->cuda_memory()) c.kinds |= 1u << static_cast<unsigned>(MemoryKind::kCuda);
    c.local_kinds = c.kinds;
    c.same_host = true;
    c.other_hosts = true;
    return c;
  }

  Status RegisterMemory(const LocalRegionView& region) override {
    void* ptr = reinterpret_cast<void*>(static_cast<uintptr_t>(region.addr));
    Result<std::string> rkey =
        worker_->MapMemory(region.id, ptr, region.bytes, region.kind == MemoryKind::kCuda);
    if (!rkey.ok()) return rkey.status();
    std::lock_guard<std::mutex> lock(mu_);
    rkeys_[region.id] = std::move(*rkey);
    return Status::OK();
  }
  void DeregisterMemory(uint64_t region_id) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      rkeys_.erase(region_id);
    }
    worker_->UnmapMemory(region_id);
  }

  std::string Section(const std::vector<LocalRegionView>& regions) const override {
    std::lock_guard<std::mutex> lock(mu_);
    ByteWriter w;
    w.U32(static_cast<uint32_t>(regions.size()));
    for (const LocalRegionView& r : regions) {
      auto it = rkeys_.find(r.id);
      w.Str32(it == rkeys_.end() ? std::string_view() : std::string_view(it->second));
    }
    return w.Take();
  }

  Status Connect(const PeerView& peer) override {
    if (!peer.has_section) return Status::NotSupported("the peer publishes no ucx section");
    Result<std::vector<std::string>> rkeys =
        DecodeUcxSection(peer.section, peer.regions->size(), peer.name);
    if (!rkeys.ok()) return rkeys.status();
    std::vector<bool> keyless(rkeys->size());
    for (size_t i = 0; i < rkeys->size(); ++i) {
      // Host memory always has a key; device memory has none where the peer's UCX lacks CUDA.
      if (!(*rkeys)[i].empty()) continue;
      if ((*peer.regions)[i].kind != MemoryKind::kCuda) {
        return Status::Corruption(StrCat("peer '", peer.name, "' region ", i, " has no UCX key"));
      }
      keyless[i] = true;
    }
    EPLBX_RETURN_IF_ERROR(worker_->UnpackRkeys(peer.id, *rkeys));
    std::lock_guard<std::mutex> lock(mu_);
    keyless_[peer.id] = std::move(keyless);
    return Status::OK();
  }

  bool Reaches(PeerId peer, uint32_t region, std::string* why) const override {
    if (!worker_->cuda_memory()) return true;  // device regions: "moves no cuda memory"
    std::lock_guard<std::mutex> lock(mu_);
    auto it = keyless_.find(peer);
    if (it != keyless_.end() && region < it->second.size() && it->second[region]) {
      *why = StrCat("the peer's UCX registered no key for its device region ", region,
                    " (a UCX without CUDA support)");
      return false;
    }
    return true;
  }
  void Disconnect(PeerId id) override {  // the worker's endpoint close ends the RMA
    std::lock_guard<std::mutex> lock(mu_);
    keyless_.erase(id);
  }
  Status Post(PathRequest request) override { return worker_->PostRma(std::move(request)); }
  Status Cancel(TransferId id) override {
    worker_->CancelRma(id);
    return Status::OK();
  }

 private:
  UcxWorker* const worker_;
  const std::string agent_;
  mutable std::mutex mu_;
  std::map<uint64_t, std::string> rkeys_;
  std::map<PeerId, std::vector<bool>> keyless_;  // per peer region: published no key
};

}  // namespace
}  // namespace ucx

Result<std::vector<std::string>> DecodeUcxSection(std::string_view section, size_t regions,
                                                  std::string_view peer) {
  const std::string what = StrCat("ucx section of peer '", peer, "'");
  ByteReader r(section, what);
  uint32_t count = 0;
  if (!r.U32("region_count", &count)) return r.status();
  if (count != regions) {
    return Status::Corruption(
        StrCat(what, ": keys for ", count, " regions, the header lists ", regions));
  }
  std::vector<std::string> rkeys(count);
  for (uint32_t i = 0; i < count; ++i) {
    if (!r.Str32(StrCat("rkey[", i, "]"), kMaxRkeyBytes, &rkeys[i])) return r.status();
  }
  if (r.remaining() != 0) {
    return Status::Corruption(StrCat(what, ": ", r.remaining(), " trailing bytes"));
  }
  return rkeys;
}

std::unique_ptr<DataPath> CreateUcxRmaPath(ucx::UcxWorker* worker, std::string agent,
                                           CoreListener* listener) {
  worker->set_rma_listener(listener);
  return std::make_unique<ucx::UcxRmaPath>(worker, std::move(agent));
}

}  // namespace eplbx::internal
