// The "cuda_ipc" data path. See cuda_ipc_path.h and docs/transfer.md, "Device memory".
#include "transfer/cuda/cuda_ipc_path.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "common/strings.h"
#include "transfer/cuda/cuda_driver.h"
#include "transfer/cuda/cuda_section.h"

namespace eplbx::internal {
namespace {

using cuda::Chunk;
using cuda::Driver;
using cuda::HandleKind;
using cuda::RegionHandle;

constexpr int kStreams = 2;      // copies of one request alternate between them
constexpr size_t kBatchMin = 4;  // copies per stream from which one batched launch is used

// A registered device region: its handle, and the fds it exports (kVmm), closed on deregister.
struct Export {
  RegionHandle handle;
  std::vector<int> fds;
};

// One allocation of a peer opened in this process; closed when the last user lets go (the
// peer's record and every in-flight copy hold it).
struct Import {
  const Driver* d = nullptr;
  int device = 0;  // whose context opened it (made current again to close it)
  HandleKind kind = HandleKind::kNone;
  uint64_t base = 0;  // the owner's address of the allocation
  uint64_t bytes = 0;
  CUdeviceptr mapped = 0;  // ours
  bool own_process = false;
  ~Import() {
    if (mapped == 0 || own_process || !cuda::UseDevice(*d, device).ok()) return;
    if (kind == HandleKind::kLegacy) {
      d->cuIpcCloseMemHandle(mapped);
    } else {
      d->cuMemUnmap(mapped, bytes);
      d->cuMemAddressFree(mapped, bytes);
    }
  }
};

struct CudaPeer {
  std::string name;
  pid_t pid = 0;
  std::vector<std::shared_ptr<Import>> region;  // per header region; null: not device memory
};

struct Op {
  TransferId id = 0;
  PeerId peer = 0;
  std::vector<CUevent> events;     // one per stream used, recorded after its copies
  std::shared_ptr<CudaPeer> keep;  // the peer's mappings outlive Disconnect until the copies end
  Status error;                    // a copy that failed to start after others did
};

std::string Errno(std::string_view call) { return StrCat(call, ": ", std::strerror(errno)); }

class CudaIpcPath final : public DataPath {
 public:
  CudaIpcPath(std::string agent, CoreListener* listener, bool wait_here)
      : agent_(std::move(agent)), listener_(listener), wait_here_(wait_here) {}

  ~CudaIpcPath() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (poller_.joinable()) poller_.join();
    for (auto& [id, e] : exports_) CloseFds(e);
    if (d_ != nullptr && device_ >= 0 && cuda::UseDevice(*d_, device_).ok()) {
      for (CUstream s : streams_) d_->cuStreamDestroy(s);
    }
  }

  std::string_view name() const override { return "cuda_ipc"; }
  PathCaps caps() const override {
    PathCaps c = DeviceMemoryCaps();
    c.same_host = true;
    return c;
  }

  Status RegisterMemory(const LocalRegionView& region) override {
    if (region.kind != MemoryKind::kCuda) return Status::OK();
    Result<const Driver*> d = cuda::LoadDriver();
    if (!d.ok()) return d.status().WithPrefix(StrCat("agent '", agent_, "'"));
    Result<Export> e = ExportRegion(**d, region);
    if (!e.ok()) return e.status();
    std::lock_guard<std::mutex> lock(mu_);
    exports_[region.id] = std::move(*e);
    return Status::OK();
  }

  void DeregisterMemory(uint64_t region_id) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = exports_.find(region_id);
    if (it == exports_.end()) return;
    CloseFds(it->second);
    exports_.erase(it);
  }

  std::string Section(const std::vector<LocalRegionView>& regions) const override {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<RegionHandle> handles(regions.size());
    for (size_t i = 0; i < regions.size(); ++i) {
      if (auto it = exports_.find(regions[i].id); it != exports_.end()) {
        handles[i] = it->second.handle;
      }
    }
    return cuda::EncodeCudaSection(handles);
  }

  Status Connect(const PeerView& peer) override {
    bool any_device = false;
    for (const RegionInfo& r : *peer.regions) any_device |= r.kind == MemoryKind::kCuda;
    auto rec = std::make_shared<CudaPeer>();
    rec->name = peer.name;
    rec->pid = static_cast<pid_t>(peer.pid);
    rec->region.resize(peer.regions->size());
    if (any_device) {
      if (!peer.has_section) {
        return Status::NotSupported(
            "the peer publishes no cuda_ipc section (an eplbx built without CUDA)");
      }
      Result<std::vector<RegionHandle>> handles =
          cuda::DecodeCudaSection(peer.section, *peer.regions, peer.name);
      if (!handles.ok()) return handles.status();
      Result<const Driver*> d = cuda::LoadDriver();
      if (!d.ok()) return d.status();
      std::map<uint64_t, std::shared_ptr<Import>> by_base;  // one open per allocation
      for (size_t i = 0; i < handles->size(); ++i) {
        const RegionHandle& h = (*handles)[i];
        if (h.kind == HandleKind::kNone) continue;
        auto [it, fresh] = by_base.try_emplace(h.base);
        if (fresh) {
          Result<std::shared_ptr<Import>> imp = Open(**d, peer, i, h);
          if (!imp.ok()) return imp.status();
          it->second = std::move(*imp);
        }
        rec->region[i] = it->second;
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    peers_[peer.id] = std::move(rec);
    return Status::OK();
  }

  bool Reaches(PeerId peer, uint32_t region, std::string* why) const override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(peer);
    if (it == peers_.end()) {
      *why = "not connected";
      return false;
    }
    if (region >= it->second->region.size() || it->second->region[region] == nullptr) {
      why->clear();  // not device memory: the core says "moves no host memory"
      return false;
    }
    return true;
  }

  void Disconnect(PeerId id) override {
    std::vector<std::unique_ptr<Op>> ended;
    int device = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      device = device_;
      peers_.erase(id);
      for (auto it = ops_.begin(); it != ops_.end();) {
        if ((*it)->peer == id) {
          ended.push_back(std::move(*it));
          it = ops_.erase(it);
        } else {
          ++it;
        }
      }
    }
    // Copies cannot be recalled: wait until no byte of them can change, then report.
    if (!ended.empty()) static_cast<void>(cuda::UseDevice(*d_, device));
    for (std::unique_ptr<Op>& op : ended) {
      for (CUevent e : op->events) d_->cuEventSynchronize(e);
      const TransferId tid = op->id;
      Finish(std::move(op));
      listener_->OnDataDone(
          tid, Status::Aborted(StrCat("agent '", agent_, "': peer disconnected (cuda_ipc)")));
    }
  }

  Status Post(PathRequest req) override {
    Result<const Driver*> dr = cuda::LoadDriver();
    if (!dr.ok()) return dr.status();
    const Driver& d = **dr;
    std::shared_ptr<CudaPeer> peer;
    int device = -1;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = peers_.find(req.peer);
      if (it == peers_.end()) {
        return Status::NotFound(StrCat("agent '", agent_, "': no cuda_ipc peer ", req.peer));
      }
      peer = it->second;
      device = device_;
    }
    EPLBX_RETURN_IF_ERROR(cuda::UseDevice(d, device));
    EPLBX_RETURN_IF_ERROR(StartOnce(d, device));
    auto op = std::make_unique<Op>();
    op->id = req.id;
    op->peer = req.peer;
    op->keep = peer;
    for (const Segment& s : req.segments) {
      if (s.remote_region >= peer->region.size() || peer->region[s.remote_region] == nullptr) {
        return Status::Internal(StrCat("agent '", agent_, "': region ", s.remote_region, " of '",
                                       req.peer_name, "' is not device memory (cuda_ipc)"));
      }
    }
    // The descriptors alternate between the streams; per stream one batched launch where
    // the driver has cuMemcpyBatchAsync and there are several, else one copy each.
    struct Copies {
      std::vector<CUdeviceptr> dst, src;
      std::vector<size_t> bytes;
    };
    Copies per[kStreams];
    size_t n = 0;
    for (const Segment& s : req.segments) {
      const Import& imp = *peer->region[s.remote_region];
      const CUdeviceptr remote = imp.mapped + (s.remote - imp.base);
      const bool read = req.op == XferOp::kRead;
      Copies& c = per[n++ % kStreams];
      c.dst.push_back(read ? s.local : remote);
      c.src.push_back(read ? remote : s.local);
      c.bytes.push_back(s.bytes);
    }
    bool used[kStreams] = {};
    bool started = false;
    for (int k = 0; k < kStreams && op->error.ok(); ++k) {
      Copies& c = per[k];
      if (c.dst.empty()) continue;
      bool batched = false;
      if (d.cuMemcpyBatchAsync != nullptr && c.dst.size() >= kBatchMin) {
        CUmemcpyAttributes attr{};
        attr.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
        size_t first = 0;
        // On an error nothing of the batch is assumed done: the copies below redo it.
        batched = d.cuMemcpyBatchAsync(c.dst.data(), c.src.data(), c.bytes.data(), c.dst.size(),
                                       &attr, &first, 1, streams_[k]) == CUDA_SUCCESS;
      }
      for (size_t i = 0; !batched && i < c.dst.size(); ++i) {
        CUresult r = d.cuMemcpyAsync(c.dst[i], c.src[i], c.bytes[i], streams_[k]);
        if (r != CUDA_SUCCESS) {
          Status error =
              Status::Internal(StrCat("agent '", agent_, "': ", OpName(req.op), " with '",
                                      req.peer_name, "': ", d.Error("cuMemcpyAsync", r)));
          if (!started && i == 0) return error;  // nothing started
          op->error = std::move(error);
          break;
        }
        started = used[k] = true;
      }
      if (batched) started = used[k] = true;
    }
    for (int k = 0; k < kStreams; ++k) {
      if (!used[k]) continue;
      CUevent e = nullptr;
      CUresult r = d.cuEventCreate(&e, CU_EVENT_DISABLE_TIMING);
      if (r == CUDA_SUCCESS) r = d.cuEventRecord(e, streams_[k]);
      if (r != CUDA_SUCCESS) {
        // Without an event the copies' end cannot be seen: wait for them here.
        if (e != nullptr) d.cuEventDestroy(e);
        d.cuStreamSynchronize(streams_[k]);
        if (op->error.ok()) op->error = Status::Internal(d.Error("cuEventRecord", r));
        continue;
      }
      op->events.push_back(e);
    }
    if (wait_here_ && req.alone) {
      // The caller posted this transfer alone and waits for it: wait here for its copies
      // and report it now, instead of handing it to the poller (a condition variable, a
      // paced event query, another wake-up: tens of microseconds on a copy of a few). The
      // peer's mapping stays open meanwhile (`op->keep`); a disconnect does not see this op
      // and needs not: its copies end here either way.
      Status status = op->error;
      for (CUevent e : op->events) {
        const CUresult r = d.cuEventSynchronize(e);
        if (r != CUDA_SUCCESS && status.ok()) {
          status = Status::Internal(StrCat("agent '", agent_, "': ", d.Error("copy", r)));
        }
      }
      const TransferId id = op->id;
      Finish(std::move(op));
      listener_->OnDataDone(id, std::move(status));
      return Status::OK();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      ops_.push_back(std::move(op));
      posted_ = true;
    }
    cv_.notify_one();
    return Status::OK();
  }

  // Device copies cannot be recalled; they end through OnDataDone within microseconds.
  Status Cancel(TransferId) override { return Status::OK(); }

 private:
  static void CloseFds(Export& e) {
    for (int fd : e.fds) close(fd);
    e.fds.clear();
  }

  // The device every copy of this agent runs on: the first one its memory lives on (or, for
  // an agent with host memory only, the first peer's).
  Status ClaimDevice(int ordinal, std::string_view what) {
    std::lock_guard<std::mutex> lock(mu_);
    if (device_ < 0) {
      device_ = ordinal;
      return Status::OK();
    }
    if (device_ == ordinal) return Status::OK();
    return Status::InvalidArgument(
        StrCat("agent '", agent_, "': ", what, " is on CUDA device ", ordinal,
               " but this agent already uses device ", device_,
               "; one device per agent (create one agent per GPU rank)"));
  }

  Result<Export> ExportRegion(const Driver& d, const LocalRegionView& region) {
    const std::string where =
        StrCat("agent '", agent_, "': device region [", Hex(region.addr), ", +", region.bytes, ")");
    auto fail = [&](std::string_view call, CUresult r) {
      return Status::Unavailable(StrCat(where, ": ", d.Error(call, r)));
    };
    int ordinal = -1;
    if (CUresult r =
            d.cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, region.addr);
        r != CUDA_SUCCESS) {
      return fail("cuPointerGetAttribute(DEVICE_ORDINAL)", r);
    }
    EPLBX_RETURN_IF_ERROR(ClaimDevice(ordinal, StrCat("device region [", Hex(region.addr), "]")));
    Export out;
    RegionHandle& h = out.handle;
    Result<std::string> uuid = cuda::DeviceUuid(d, ordinal);
    if (!uuid.ok()) return uuid.status().WithPrefix(where);
    h.device_uuid = *uuid;
    CUdeviceptr base = 0;
    size_t size = 0;
    if (CUresult r = d.cuMemGetAddressRange(&base, &size, region.addr); r != CUDA_SUCCESS) {
      return fail("cuMemGetAddressRange", r);
    }
    int legacy = 0;
    if (d.cuPointerGetAttribute(&legacy, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                                region.addr) != CUDA_SUCCESS) {
      legacy = 0;
    }
    if (legacy != 0) {
      if (region.addr + region.bytes > base + size) {
        return Status::InvalidArgument(
            StrCat(where, " runs past the end of its cudaMalloc allocation [", Hex(base), ", +",
                   size, "); register each allocation (each tensor's storage) on its own"));
      }
      CUipcMemHandle ipc{};
      if (CUresult r = d.cuIpcGetMemHandle(&ipc, base); r != CUDA_SUCCESS) {
        return fail("cuIpcGetMemHandle", r);
      }
      h.kind = HandleKind::kLegacy;
      h.base = base;
      h.bytes = size;
      h.ipc_handle.assign(ipc.reserved, sizeof(ipc.reserved));
      return out;
    }
    // cuMem* memory: one exported fd per mapping, from the region's first mapping on.
    h.kind = HandleKind::kVmm;
    h.base = base;
    uint64_t cursor = base;
    const uint64_t end = region.addr + region.bytes;
    while (cursor < end) {
      CUdeviceptr s = 0;
      size_t n = 0;
      CUresult r = d.cuMemGetAddressRange(&s, &n, cursor);
      if (r != CUDA_SUCCESS || s != cursor || n == 0) {
        CloseFds(out);
        return Status::InvalidArgument(StrCat(where, " is not mapped contiguously at ", Hex(cursor),
                                              "; register memory of one allocation at a time"));
      }
      CUmemGenericAllocationHandle mem = 0;
      if (r = d.cuMemRetainAllocationHandle(&mem, reinterpret_cast<void*>(cursor));
          r != CUDA_SUCCESS) {
        CloseFds(out);
        return Status::InvalidArgument(
            StrCat(where,
                   " cannot be shared between processes: not cudaMalloc memory (no legacy IPC) "
                   "and no cuMem allocation handle (",
                   d.Error("cuMemRetainAllocationHandle", r),
                   "); stream-ordered pools (cudaMallocAsync, PyTorch's backend:cudaMallocAsync) "
                   "cannot be registered: use PyTorch's default allocator"));
      }
      CUmemAllocationProp prop{};
      r = d.cuMemGetAllocationPropertiesFromHandle(&prop, mem);
      if (r != CUDA_SUCCESS ||
          (prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) == 0) {
        d.cuMemRelease(mem);
        CloseFds(out);
        return Status::InvalidArgument(
            StrCat(where,
                   " was allocated with cuMemCreate without a POSIX file descriptor handle "
                   "type, so no other process can open it; allocate with requestedHandleTypes = "
                   "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (PyTorch's expandable segments do)"));
      }
      int fd = -1;
      r = d.cuMemExportToShareableHandle(&fd, mem, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
      d.cuMemRelease(mem);
      if (r != CUDA_SUCCESS) {
        CloseFds(out);
        return fail("cuMemExportToShareableHandle", r);
      }
      out.fds.push_back(fd);
      h.chunks.push_back(Chunk{cursor - base, n, static_cast<uint32_t>(fd)});
      cursor += n;
    }
    h.bytes = cursor - base;
    return out;
  }

  Result<std::shared_ptr<Import>> Open(const Driver& d, const PeerView& peer, size_t index,
                                       const RegionHandle& h) {
    const std::string where = StrCat("region ", index, " of peer '", peer.name, "' (",
                                     cuda::UuidText(h.device_uuid), ")");
    const int owner = cuda::OrdinalOfUuid(d, h.device_uuid);
    if (owner < 0) {
      return Status::Unavailable(
          StrCat(where,
                 ": that device is not visible in this process; cuda_ipc needs every rank's "
                 "GPU visible to each rank of the host (CUDA_VISIBLE_DEVICES hides it: select the "
                 "rank's device with torch.cuda.set_device instead)"));
    }
    int device = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (device_ < 0) device_ = owner;  // an agent with host memory only copies on the peer's
      device = device_;
    }
    if (device != owner) {
      CUdevice a = 0, b = 0;
      int can = 0;
      d.cuDeviceGet(&a, device);
      d.cuDeviceGet(&b, owner);
      if (d.cuDeviceCanAccessPeer(&can, a, b) != CUDA_SUCCESS || can == 0) {
        return Status::Unavailable(StrCat(where, ": device ", device,
                                          " of this process cannot access device ", owner,
                                          " peer to peer (no NVLink or PCIe P2P between them)"));
      }
    }
    EPLBX_RETURN_IF_ERROR(cuda::UseDevice(d, device));
    auto imp = std::make_shared<Import>();
    imp->d = &d;
    imp->device = device;
    imp->kind = h.kind;
    imp->base = h.base;
    imp->bytes = h.bytes;
    if (static_cast<pid_t>(peer.pid) == getpid()) {  // two agents of one process
      imp->own_process = true;
      imp->mapped = h.base;
      return imp;
    }
    if (h.kind == HandleKind::kLegacy) {
      CUipcMemHandle ipc{};
      std::memcpy(ipc.reserved, h.ipc_handle.data(), sizeof(ipc.reserved));
      if (CUresult r = d.cuIpcOpenMemHandle(&imp->mapped, ipc, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
          r != CUDA_SUCCESS) {
        imp->mapped = 0;
        return Status::Unavailable(StrCat(where, ": ", d.Error("cuIpcOpenMemHandle", r)));
      }
      return imp;
    }
    const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, peer.pid, 0));
    if (pidfd < 0) return Status::Unavailable(StrCat(where, ": ", Errno("pidfd_open")));
    std::vector<CUmemGenericAllocationHandle> mems;
    auto release = [&] {
      for (CUmemGenericAllocationHandle m : mems) d.cuMemRelease(m);
      close(pidfd);
    };
    for (const Chunk& c : h.chunks) {
      const int fd = static_cast<int>(syscall(SYS_pidfd_getfd, pidfd, c.fd, 0));
      if (fd < 0) {
        const std::string e = Errno("pidfd_getfd");
        release();
        return Status::Unavailable(StrCat(
            where, ": ", e,
            " (taking the peer's handle needs ptrace permission over it, as "
            "cma does: run the ranks as one user, or allow it with kernel.yama.ptrace_scope)"));
      }
      CUmemGenericAllocationHandle m = 0;
      CUresult r =
          d.cuMemImportFromShareableHandle(&m, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
      close(fd);
      if (r != CUDA_SUCCESS) {
        release();
        return Status::Unavailable(
            StrCat(where, ": ", d.Error("cuMemImportFromShareableHandle", r)));
      }
      mems.push_back(m);
    }
    CUdeviceptr va = 0;
    if (CUresult r = d.cuMemAddressReserve(&va, h.bytes, 0, 0, 0); r != CUDA_SUCCESS) {
      release();
      return Status::Unavailable(StrCat(where, ": ", d.Error("cuMemAddressReserve", r)));
    }
    size_t mapped = 0;
    CUresult r = CUDA_SUCCESS;
    for (; mapped < h.chunks.size(); ++mapped) {
      const Chunk& c = h.chunks[mapped];
      if ((r = d.cuMemMap(va + c.offset, c.bytes, 0, mems[mapped], 0)) != CUDA_SUCCESS) break;
    }
    if (r == CUDA_SUCCESS) {
      CUmemAccessDesc access{};
      access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      access.location.id = device;
      access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      r = d.cuMemSetAccess(va, h.bytes, &access, 1);
    }
    release();  // the mappings hold the allocations now
    if (r != CUDA_SUCCESS) {
      for (size_t i = 0; i < mapped; ++i) d.cuMemUnmap(va + h.chunks[i].offset, h.chunks[i].bytes);
      d.cuMemAddressFree(va, h.bytes);
      return Status::Unavailable(StrCat(where, ": ", d.Error("cuMemMap / cuMemSetAccess", r)));
    }
    imp->mapped = va;
    return imp;
  }

  // The streams and the poller thread, at the first Post.
  Status StartOnce(const Driver& d, int device) {
    std::lock_guard<std::mutex> lock(mu_);
    if (poller_.joinable()) return Status::OK();
    d_ = &d;
    for (int k = 0; k < kStreams; ++k) {
      CUstream s = nullptr;
      if (CUresult r = d.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING); r != CUDA_SUCCESS) {
        for (CUstream t : streams_) d.cuStreamDestroy(t);
        streams_.clear();
        return Status::Unavailable(StrCat("agent '", agent_, "': ", d.Error("cuStreamCreate", r)));
      }
      streams_.push_back(s);
    }
    poller_ = std::thread([this, device] { Poll(device); });
    return Status::OK();
  }

  void Finish(std::unique_ptr<Op> op) {
    for (CUevent e : op->events) d_->cuEventDestroy(e);
  }

  // Watches the events of copies in flight; reports each transfer once all of its are done.
  void Poll(int device) {
    // Post made the context current for the copies; the events are queried from here.
    static_cast<void>(cuda::UseDevice(*d_, device));
    cuda::UsePreciseSleeps();
    cuda::PollPacer pacer;
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return stop_ || !ops_.empty(); });
      if (stop_) return;
      std::vector<std::pair<std::unique_ptr<Op>, Status>> done;
      for (auto it = ops_.begin(); it != ops_.end();) {
        Op& op = **it;
        Status status = op.error;
        bool pending = false;
        for (CUevent e : op.events) {
          CUresult r = d_->cuEventQuery(e);
          if (r == CUDA_ERROR_NOT_READY) {
            pending = true;
            break;
          }
          if (r != CUDA_SUCCESS && status.ok()) {
            status = Status::Internal(StrCat("agent '", agent_, "': ", d_->Error("copy", r)));
          }
        }
        if (pending) {
          ++it;
          continue;
        }
        done.emplace_back(std::move(*it), std::move(status));
        it = ops_.erase(it);
      }
      const bool more = !ops_.empty();
      lock.unlock();
      for (auto& [op, status] : done) {
        const TransferId id = op->id;
        Finish(std::move(op));
        listener_->OnDataDone(id, std::move(status));
      }
      lock.lock();
      if (!done.empty()) {
        pacer.Progress();
      } else if (more) {  // wait a while before querying again, unless a new copy comes
        posted_ = false;
        if (cv_.wait_for(lock, pacer.Next(), [&] { return stop_ || posted_; })) pacer.Progress();
      }
    }
  }

  const std::string agent_;
  CoreListener* const listener_;
  const bool wait_here_;  // a transfer posted alone ends on the caller's thread
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  bool posted_ = false;        // a copy was posted since the poller last looked
  const Driver* d_ = nullptr;  // set at the first Post
  int device_ = -1;
  std::map<uint64_t, Export> exports_;
  std::map<PeerId, std::shared_ptr<CudaPeer>> peers_;
  std::vector<CUstream> streams_;
  std::vector<std::unique_ptr<Op>> ops_;
  std::thread poller_;
};

}  // namespace

std::unique_ptr<DataPath> CreateCudaIpcPath(std::string agent, CoreListener* listener,
                                            bool wait_here) {
  return std::make_unique<CudaIpcPath>(std::move(agent), listener, wait_here);
}

}  // namespace eplbx::internal
