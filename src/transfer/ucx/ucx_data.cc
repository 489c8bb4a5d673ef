// The UCX backend's data paths: get/put on the peer's rkeys (tcp; a put completes with a
// flush) and, for same-host peers, ShmCopier on the peer's mapped shared-file regions or CMA.
#include "transfer/ucx/ucx_backend_impl.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include "transfer/shm/shared_file.h"

namespace eplbx::internal::ucx {

constexpr uint64_t kTouchAtConnectBytes = 256ull << 20;  // larger mapped regions fault lazily

void UcxBackend::StartRma(const std::shared_ptr<PeerState>& p, PostRequest req) {
  auto owned = std::make_unique<Op>();
  Op* op = owned.get();
  op->self = this;
  op->id = req.id;
  op->peer = p;
  op->kind = req.op;
  op->notify = std::move(req.notify);
  ops_[req.id] = std::move(owned);
  if (p->failed || p->ep == nullptr) {
    op->error = Unreachable(*p);
  } else {
    for (const Segment& s : req.segments) {
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      param.cb.send = &UcxBackend::OnRmaDone;
      param.user_data = op;
      if (auto m = memh_.find(s.local_region); m != memh_.end()) {
        param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
        param.memh = m->second;
      }
      void* buffer = reinterpret_cast<void*>(static_cast<uintptr_t>(s.local));
      ucp_rkey_h rkey = p->rkeys.at(s.remote_region);
      void* r = req.op == XferOp::kRead
                    ? ucp_get_nbx(p->ep, buffer, s.bytes, s.remote, rkey, &param)
                    : ucp_put_nbx(p->ep, buffer, s.bytes, s.remote, rkey, &param);
      if (!Track(op, r)) break;
    }
    if (req.op == XferOp::kWrite && op->error.ok()) {
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      param.cb.send = &UcxBackend::OnRmaDone;
      param.user_data = op;
      Track(op, ucp_ep_flush_nbx(p->ep, &param));  // remote completion of every put
    }
  }
  op->posted_all = true;
  MaybeFinish(op);
}

bool UcxBackend::Track(Op* op, void* request) {
  if (request == nullptr) return true;
  if (UCS_PTR_IS_ERR(request)) {
    RmaError(op, UCS_PTR_STATUS(request));
    return false;
  }
  ++op->pending;
  ++inflight_;
  return true;
}

void UcxBackend::RmaError(Op* op, ucs_status_t status) {
  if (!op->error.ok()) return;
  op->error =
      op->peer->failed
          ? Unreachable(*op->peer)
          : Status::IoError(StrCat("agent '", options_.agent_name, "': ", OpName(op->kind),
                                   " with '", op->peer->name, "' failed in UCX: ", Ucs(status)));
}

void UcxBackend::OnRmaDone(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<Op*>(user_data);
  UcxBackend* self = op->self;
  --op->pending;
  --self->inflight_;
  if (status != UCS_OK) self->RmaError(op, status);
  ucp_request_free(request);
  self->MaybeFinish(op);
}

void UcxBackend::MaybeFinish(Op* op) {
  if (!op->posted_all || op->pending > 0) return;
  if (op->error.ok() && op->peer->failed) op->error = Unreachable(*op->peer);
  if (op->error.ok() && op->cancelled) {
    op->error = Status::Aborted(StrCat("agent '", options_.agent_name, "': ", OpName(op->kind),
                                       " with '", op->peer->name, "' cancelled"));
  }
  if (op->error.ok() && op->notify && !op->notified) {
    op->notified = true;  // data landed: now the notification may go
    SendAm(*op->peer, MessageKind::kNotify, std::move(*op->notify), op);
    if (op->pending > 0) return;
  }
  const TransferId id = op->id;
  Status s = op->error;
  ops_.erase(id);
  listener_->OnTransferDone(id, std::move(s));
}

void UcxBackend::MapSharedRegions(PeerState& p) {
  p.mapped.resize(p.regions.size());
  for (size_t i = 0; i < p.regions.size(); ++i) {
    const RegionInfo& r = p.regions[i];
    if ((r.flags & kRegionShared) == 0 || r.shm_fd < 0) continue;
    int fd = open(StrCat("/proc/", p.pid, "/fd/", r.shm_fd).c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) continue;  // CMA still works
    MappedRegion m;
    Result<uint8_t*> ptr = MapPeerFile(fd, r.shm_offset, r.bytes, &m.base, &m.map_bytes);
    close(fd);
    if (!ptr.ok()) continue;  // e.g. a file shorter than the region claims: CMA
    m.ptr = *ptr;
    // First-access cost now, not inside the first transfers. Not for large regions (a CPU
    // model's weights): every peer would build page tables for all of them, while only the
    // rows actually read ever need them.
    // A file the peer shrank after registering faults here (SIGBUS): not mapped then, so its
    // rows go through CMA, which reports the short region as an error.
    if (r.bytes <= kTouchAtConnectBytes && !GuardedTouchPagesForRead(m.ptr, r.bytes)) {
      munmap(m.base, m.map_bytes);
      continue;
    }
    p.mapped[i] = m;
  }
}

void UcxBackend::PostShm(std::shared_ptr<PeerState> p, PostRequest req) {
  CopyJob job;
  job.id = req.id;
  job.pid = p->pid;
  job.read = req.op == XferOp::kRead;
  job.describe = StrCat("agent '", options_.agent_name, "': ", OpName(req.op), " with '", p->name,
                        "' (pid ", p->pid, ")");
  job.pieces.reserve(req.segments.size());
  for (const Segment& s : req.segments) {
    CopyPiece piece;
    piece.local = reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(s.local));
    piece.remote = s.remote;
    piece.bytes = s.bytes;
    const MappedRegion& m =
        p->mapped.size() > s.remote_region ? p->mapped[s.remote_region] : MappedRegion{};
    if (m.ptr != nullptr) piece.mapped = m.ptr + (s.remote - p->regions[s.remote_region].addr);
    job.pieces.push_back(piece);
  }
  job.done = [this, p, id = req.id, kind = req.op,
              notify = std::move(req.notify)](Status s) mutable {
    if (s.ok() && p->failed) s = Unreachable(*p);
    if (s.code() == Code::kUnavailable && !p->failed) {
      // The process is gone (or its memory unreachable): every later call fails at once.
      MarkFailed(*p, s.message());
      Enqueue([this, p] { CloseEp(p); });
    }
    if (s.ok() && notify) {
      Enqueue([this, p, id, kind, notify = std::move(notify)]() mutable {
        auto owned = std::make_unique<Op>();
        Op* op = owned.get();
        op->self = this;
        op->id = id;
        op->peer = p;
        op->kind = kind;
        op->notify = std::move(notify);
        op->posted_all = true;
        ops_[id] = std::move(owned);
        MaybeFinish(op);
      });
      return;
    }
    listener_->OnTransferDone(id, std::move(s));
  };
  copier_->Submit(std::move(job));
}

}  // namespace eplbx::internal::ucx
