// The "cma" data path: process_vm_readv / process_vm_writev on the copy threads.
#include "transfer/cma/cma_path.h"

#include <map>
#include <mutex>

#include "common/bytes.h"
#include "common/strings.h"

namespace eplbx::internal {
namespace {

// The probe peers read to prove they can reach our memory (same-host check).
const volatile uint64_t g_probe = kProbeValue;

struct CmaPeer {
  std::string name;
  pid_t pid = 0;
};

class CmaPath final : public DataPath {
 public:
  CmaPath(std::shared_ptr<ShmCopier> copier, std::string agent, CoreListener* listener)
      : copier_(std::move(copier)), agent_(std::move(agent)), listener_(listener) {}

  std::string_view name() const override { return "cma"; }
  PathCaps caps() const override {
    PathCaps c;
    c.kinds = (1u << static_cast<unsigned>(MemoryKind::kHost)) |
              (1u << static_cast<unsigned>(MemoryKind::kHostFile));
    c.same_host = true;
    return c;
  }
  Status RegisterMemory(const LocalRegionView&) override { return Status::OK(); }
  void DeregisterMemory(uint64_t) override {}

  std::string Section(const std::vector<LocalRegionView>&) const override {
    ByteWriter w;
    w.U64(reinterpret_cast<uintptr_t>(&g_probe));
    return w.Take();
  }

  Status Connect(const PeerView& peer) override {
    if (!peer.same_host) return Status::NotSupported("the peer is on another host");
    if (!peer.has_section) return Status::NotSupported("the peer publishes no cma section");
    Result<uint64_t> probe = DecodeCmaSection(peer.section, peer.name);
    if (!probe.ok()) return probe.status();
    // Fails where ptrace is forbidden (EPERM) or the pid is another process.
    EPLBX_RETURN_IF_ERROR(ShmCopier::Probe(static_cast<pid_t>(peer.pid), *probe, kProbeValue));
    std::lock_guard<std::mutex> lock(mu_);
    if (peers_.count(peer.id) == 0) copier_->PeerJoined(peer.id);
    peers_[peer.id] = CmaPeer{peer.name, static_cast<pid_t>(peer.pid)};
    return Status::OK();
  }

  bool Reaches(PeerId peer, uint32_t, std::string* why) const override {
    std::lock_guard<std::mutex> lock(mu_);
    if (peers_.count(peer) == 0) *why = "not connected";
    return peers_.count(peer) != 0;
  }

  void Disconnect(PeerId id) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (peers_.erase(id) != 0) copier_->PeerLeft(id);
  }

  Status Post(PathRequest req) override {
    CmaPeer p;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = peers_.find(req.peer);
      if (it == peers_.end()) {
        return Status::NotFound(StrCat("agent '", agent_, "': no cma peer ", req.peer));
      }
      p = it->second;
    }
    CopyJob job;
    job.id = req.id;
    job.pid = p.pid;
    job.read = req.op == XferOp::kRead;
    job.alone = req.alone;
    job.caller_waits = req.caller_waits;
    job.describe = {
        .agent = agent_, .peer = p.name, .op = OpName(req.op), .path = "cma", .pid = p.pid};
    job.pieces.reserve(req.segments.size());
    for (const Segment& s : req.segments) {
      CopyPiece piece;
      piece.local = reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(s.local));
      piece.remote = s.remote;
      piece.bytes = s.bytes;
      job.pieces.push_back(piece);
    }
    job.done = [listener = listener_, id = req.id, peer = req.peer](Status s) {
      // The process is gone (or its memory unreachable): every later call fails at once.
      if (s.code() == Code::kUnavailable) listener->OnPeerFailed(peer, s);
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
  mutable std::mutex mu_;
  std::map<PeerId, CmaPeer> peers_;
};

}  // namespace

Result<uint64_t> DecodeCmaSection(std::string_view section, std::string_view peer) {
  const std::string what = StrCat("cma section of peer '", peer, "'");
  ByteReader r(section, what);
  uint64_t probe = 0;
  if (!r.U64("probe_addr", &probe)) return r.status();
  if (r.remaining() != 0) {
    return Status::Corruption(StrCat(what, ": ", r.remaining(), " trailing bytes"));
  }
  return probe;
}

std::unique_ptr<DataPath> CreateCmaPath(std::shared_ptr<ShmCopier> copier, std::string agent,
                                        CoreListener* listener) {
  return std::make_unique<CmaPath>(std::move(copier), std::move(agent), listener);
}

}  // namespace eplbx::internal
