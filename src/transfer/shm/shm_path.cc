// The "shm" data path: peers' shared files mapped at connect, copies on the copy threads.
#include "transfer/shm/shm_path.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>

#include "common/bytes.h"
#include "common/strings.h"

namespace eplbx::internal {
namespace {

struct MappedRegion {
  uint8_t* ptr = nullptr;  // the region's first byte
  void* base = nullptr;    // what to munmap (page-aligned, at or before ptr)
  size_t map_bytes = 0;
  uint64_t addr = 0;    // the region's address in the peer
  std::string refusal;  // why not mapped, when ptr is null
};

// The mappings of one peer; shared with in-flight copies so they outlive Disconnect.
struct ShmPeer {
  std::string name;
  pid_t pid = 0;
  std::vector<MappedRegion> regions;
  ~ShmPeer() {
    for (MappedRegion& m : regions) {
      if (m.base != nullptr) munmap(m.base, m.map_bytes);
    }
  }
};

class ShmPath final : public DataPath {
 public:
  ShmPath(std::shared_ptr<ShmCopier> copier, std::string agent, CoreListener* listener,
          uint64_t prefault_bytes)
      : copier_(std::move(copier)),
        agent_(std::move(agent)),
        listener_(listener),
        prefault_bytes_(prefault_bytes) {}

  std::string_view name() const override { return "shm"; }
  PathCaps caps() const override {
    PathCaps c;
    c.kinds = 1u << static_cast<unsigned>(MemoryKind::kHostFile);
    c.same_host = true;
    return c;
  }
  Status RegisterMemory(const LocalRegionView&) override { return Status::OK(); }
  void DeregisterMemory(uint64_t) override {}

  std::string Section(const std::vector<LocalRegionView>& regions) const override {
    ByteWriter w;
    w.U32(static_cast<uint32_t>(regions.size()));
    for (const LocalRegionView& r : regions) {
      const bool shared = r.kind == MemoryKind::kHostFile && r.file.fd >= 0;
      w.U32(static_cast<uint32_t>(shared ? r.file.fd : -1));
      w.U64(shared ? r.file.offset : 0);
    }
    return w.Take();
  }

  Status Connect(const PeerView& peer) override {
    if (!peer.same_host) return Status::NotSupported("the peer is on another host");
    if (!peer.has_section) return Status::NotSupported("the peer publishes no shm section");
    Result<std::vector<SharedFile>> files =
        DecodeShmSection(peer.section, peer.regions->size(), peer.name);
    if (!files.ok()) return files.status();
    auto p = std::make_shared<ShmPeer>();
    p->name = peer.name;
    p->pid = static_cast<pid_t>(peer.pid);
    p->regions.resize(files->size());
    uint64_t populated = 0;  // bytes of this peer's regions with page tables built here
    for (size_t i = 0; i < files->size(); ++i) {
      const RegionInfo& r = (*peer.regions)[i];
      MappedRegion& m = p->regions[i];
      m.addr = r.addr;
      const SharedFile f = (*files)[i];
      if (r.kind != MemoryKind::kHostFile || f.fd < 0) {
        m.refusal = StrCat("region ", i, " is not in a shared file");
        continue;
      }
      const std::string path = StrCat("/proc/", p->pid, "/fd/", f.fd);
      int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
      if (fd < 0) {
        m.refusal = StrCat("region ", i, ": cannot open ", path, ": ", std::strerror(errno));
        continue;
      }
      Result<uint8_t*> ptr = MapPeerFile(fd, f.offset, r.bytes, &m.base, &m.map_bytes);
      close(fd);
      if (!ptr.ok()) {  // e.g. a file shorter than the region claims
        m.refusal = StrCat("region ", i, ": ", ptr.status().message());
        continue;
      }
      // Page tables now, not by a fault per page inside the first transfers (first touching
      // a 16 MiB row cost about a fifth of the demo's rearrangement: docs/perf.md), while
      // the peer's regions so far fit the budget: beyond it (a large CPU model's weights)
      // only rows that move ever need them. A file the peer shrank after registering fails
      // here (where a read would raise SIGBUS): not mapped then.
      const bool populate = r.bytes <= prefault_bytes_ - populated;
      if (populate) populated += r.bytes;
      if (populate && !PopulateForRead(*ptr, r.bytes)) {
        munmap(m.base, m.map_bytes);
        m.base = nullptr;
        m.map_bytes = 0;
        m.refusal = StrCat("region ", i, ": the shared file ends before the region does");
        continue;
      }
      m.ptr = *ptr;
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (peers_.count(peer.id) == 0) copier_->PeerJoined(peer.id);
    peers_[peer.id] = std::move(p);
    return Status::OK();
  }

  bool Reaches(PeerId peer, uint32_t region, std::string* why) const override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(peer);
    if (it == peers_.end() || region >= it->second->regions.size()) {
      *why = "not connected";
      return false;
    }
    const MappedRegion& m = it->second->regions[region];
    if (m.ptr == nullptr) *why = m.refusal;
    return m.ptr != nullptr;
  }

  void Disconnect(PeerId id) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (peers_.erase(id) != 0) copier_->PeerLeft(id);
  }

  Status Post(PathRequest req) override {
    std::shared_ptr<ShmPeer> p;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = peers_.find(req.peer);
      if (it == peers_.end()) {
        return Status::NotFound(StrCat("agent '", agent_, "': no shm peer ", req.peer));
      }
      p = it->second;
    }
    CopyJob job;
    job.id = req.id;
    job.pid = p->pid;
    job.read = req.op == XferOp::kRead;
    job.alone = req.alone;
    job.caller_waits = req.caller_waits;
    job.describe = {
        .agent = agent_, .peer = p->name, .op = OpName(req.op), .path = "shm", .pid = p->pid};
    job.pieces.reserve(req.segments.size());
    for (const Segment& s : req.segments) {
      if (s.remote_region >= p->regions.size() || p->regions[s.remote_region].ptr == nullptr) {
        return Status::Internal(StrCat("agent '", agent_, "': '", p->name, "' region ",
                                       s.remote_region, " is not mapped"));
      }
      const MappedRegion& m = p->regions[s.remote_region];
      CopyPiece piece;
      piece.local = reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(s.local));
      piece.remote = s.remote;
      piece.bytes = s.bytes;
      piece.mapped = m.ptr + (s.remote - m.addr);
      job.pieces.push_back(piece);
    }
    job.done = [listener = listener_, p, id = req.id](Status s) {
      listener->OnDataDone(id, std::move(s));
    };
    copier_->Submit(std::move(job));
    return Status::OK();
  }

  Status Cancel(TransferId id) override {
    copier_->Cancel(id);
    return Status::OK();
  }

 private:
  const std::shared_ptr<ShmCopier> copier_;
  const std::string agent_;
  CoreListener* const listener_;
  const uint64_t prefault_bytes_;  // page tables built at connect for this many bytes a peer
  mutable std::mutex mu_;
  std::map<PeerId, std::shared_ptr<ShmPeer>> peers_;
};

}  // namespace

Result<std::vector<SharedFile>> DecodeShmSection(std::string_view section, size_t regions,
                                                 std::string_view peer) {
  const std::string what = StrCat("shm section of peer '", peer, "'");
  ByteReader r(section, what);
  uint32_t count = 0;
  if (!r.U32("region_count", &count)) return r.status();
  if (count != regions) {
    return Status::Corruption(
        StrCat(what, ": files for ", count, " regions, the header lists ", regions));
  }
  std::vector<SharedFile> files(count);
  for (uint32_t i = 0; i < count; ++i) {
    uint32_t fd = 0;
    if (!r.U32(StrCat("fd[", i, "]"), &fd) || !r.U64(StrCat("offset[", i, "]"), &files[i].offset)) {
      return r.status();
    }
    files[i].fd = static_cast<int32_t>(fd);
  }
  if (r.remaining() != 0) {
    return Status::Corruption(StrCat(what, ": ", r.remaining(), " trailing bytes"));
  }
  return files;
}

std::unique_ptr<DataPath> CreateShmPath(std::shared_ptr<ShmCopier> copier, std::string agent,
                                        CoreListener* listener, uint64_t prefault_bytes) {
  return std::make_unique<ShmPath>(std::move(copier), std::move(agent), listener, prefault_bytes);
}

}  // namespace eplbx::internal
