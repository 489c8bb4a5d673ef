// Internal: the transfer seam (ARCHITECTURE.md, "Transfer seam"; docs/transfer.md, "Seam").
// An agent has one ControlChannel (connection info, notifications, heartbeats, liveness) and
// an ordered list of DataPaths (shm, cma, cuda_ipc, ucx, cuda_staged, loopback), each moving some
// memory kinds between some peers. The agent core owns names, regions, peers, bounds
// checks, path choice and transfer states; "a notification leaves only after the data
// landed" is implemented once, in the core. Parts are created in one place (paths.cc);
// there is no static self-registration.
#ifndef EPLBX_SRC_TRANSFER_BACKEND_H_
#define EPLBX_SRC_TRANSFER_BACKEND_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "eplbx/status.h"
#include "eplbx/transfer.h"
#include "transfer/metadata.h"
#include "transfer/shm/shared_file.h"

namespace eplbx::internal {

enum class XferOp { kRead, kWrite };
std::string_view OpName(XferOp op);  // "READ", "WRITE"

// One contiguous piece of a transfer, already bounds-checked by the core.
struct Segment {
  uint64_t local = 0;
  uint64_t remote = 0;
  uint64_t bytes = 0;
  uint32_t remote_region = 0;  // index into the peer's metadata regions
  uint64_t local_region = 0;   // id of our region holding `local`
};

// The part of one transfer that one data path moves.
struct PathRequest {
  TransferId id = 0;
  PeerId peer = 0;
  std::string peer_name;
  XferOp op = XferOp::kRead;
  std::vector<Segment> segments;
  // No other transfer of the agent is outstanding (every earlier one was released): the
  // caller posts one at a time and waits, so a path may finish this one on the caller's
  // thread without holding up others.
  bool alone = false;
  // The caller waits for this transfer with nothing else to do meanwhile (Agent::ReadMany):
  // on a busy host a path may copy it on the caller's thread (ShmCopier).
  bool caller_waits = false;
};

// Implemented by the agent core. Calls may come from any thread of a part, never while
// the part holds a lock the core could wait on.
class CoreListener {
 public:
  virtual ~CoreListener() = default;
  // Data paths: exactly once for every PathRequest that Post() accepted.
  virtual void OnDataDone(TransferId id, Status status) = 0;
  // Control channel: a notification from a peer.
  virtual void OnNotification(std::string sender, std::string payload) = 0;
  // Control channel: several from one peer, in the order sent (one message of
  // ControlChannel::NotifyMany). A listener that forwards overrides it to keep them together.
  virtual void OnNotifications(std::string sender, std::vector<std::string> payloads) {
    for (std::string& p : payloads) OnNotification(sender, std::move(p));
  }
  // Either: the peer is gone (silent past the timeout, broken connection, process exited).
  virtual void OnPeerFailed(PeerId peer, Status reason) = 0;
};

// A listener whose target can change before the agent starts: the fault wrapper puts
// itself between a part and the core.
class ListenerSlot final : public CoreListener {
 public:
  explicit ListenerSlot(CoreListener* target) : target_(target) {}
  CoreListener* target() const { return target_; }
  void set_target(CoreListener* target) { target_ = target; }
  void OnDataDone(TransferId id, Status status) override {
    target_->OnDataDone(id, std::move(status));
  }
  void OnNotification(std::string sender, std::string payload) override {
    target_->OnNotification(std::move(sender), std::move(payload));
  }
  void OnNotifications(std::string sender, std::vector<std::string> payloads) override {
    target_->OnNotifications(std::move(sender), std::move(payloads));
  }
  void OnPeerFailed(PeerId peer, Status reason) override {
    target_->OnPeerFailed(peer, std::move(reason));
  }

 private:
  CoreListener* target_;
};

struct PartOptions {
  std::string agent_name;
  std::chrono::milliseconds peer_timeout{30000};
  int copy_threads = 2;
  uint64_t inline_copy_bytes = 0;  // same-host transfers up to this size: on the caller
  uint64_t prefault_bytes = 0;     // AgentConfig::prefault_bytes, resolved
  // Notifications to a peer of this host through its inbox, not the network (UCX:
  // ucx_local.cc); EPLBX_LOCAL_NOTIFY=0 turns it off.
  bool local_notify = true;
  // shm / cma: on a busy host, copy a transfer whose caller waits for it (caller_waits) on
  // the caller's thread (ShmCopier; EPLBX_INLINE_WHEN_BUSY=0 turns it off, for measuring).
  bool inline_when_busy = true;
};

// A registered region as a data path sees it.
struct LocalRegionView {
  uint64_t id = 0;
  uint64_t addr = 0;
  uint64_t bytes = 0;
  MemoryKind kind = MemoryKind::kHost;
  SharedFile file;  // fd -1 unless kind == kHostFile
};

// A peer as a data path sees it at connect: the neutral header and this path's section.
struct PeerView {
  PeerId id = 0;
  std::string name;
  uint32_t pid = 0;
  bool same_host = false;
  const std::vector<RegionInfo>* regions = nullptr;
  std::string_view section;  // empty when the peer published none for this path
  bool has_section = false;
};

class ControlChannel {
 public:
  virtual ~ControlChannel() = default;
  virtual std::string_view name() const = 0;  // "ucx", "loopback"
  // Bytes a peer needs to reach us (UCX: the worker address).
  virtual std::string ConnectionInfo() const = 0;
  // Connects and starts liveness checks; on error nothing is left behind.
  virtual Status Connect(PeerId id, std::string_view peer_name, std::string_view conn_info) = 0;
  // Forgets the peer (no OnPeerFailed follows).
  virtual void Disconnect(PeerId id) = 0;
  // Sends `payload`, ordered per peer. `sent`, if set, runs exactly once when the payload
  // left (OK) or cannot leave (the reason) — unless this returns an error, then never.
  virtual Status Notify(PeerId peer, std::string payload,
                        std::function<void(Status)> sent = nullptr) = 0;
  // Sends `payloads` in order, as Notify would one after another, and returns one status a
  // payload (an error: that one cannot leave). A channel may pack them into fewer messages
  // (UCX: one message of up to 64 KiB); this one sends them one by one.
  virtual std::vector<Status> NotifyMany(PeerId peer, std::vector<std::string> payloads) {
    std::vector<Status> out;
    out.reserve(payloads.size());
    for (std::string& p : payloads) out.push_back(Notify(peer, std::move(p)));
    return out;
  }
  // Optional: the calling thread waits up to `timeout` for a message and receives it itself
  // (delivered through the listener on this thread), or until the eventfd `wake_fd` is
  // readable. Saves the channel's own thread a wake-up per message, which on a host with
  // fewer cores than busy threads is a wait for a core (docs/transfer.md). Returns false
  // at once, having done nothing, where it cannot (not supported; the channel's thread
  // busy): the caller then waits as it would have.
  virtual bool WaitHere(std::chrono::milliseconds /*timeout*/, int /*wake_fd*/) { return false; }
};

// Which memory a path moves, and between which peers.
struct PathCaps {
  uint32_t kinds = 0;  // bit (1 << MemoryKind): the peer's regions it reaches
  // Kinds of our own memory it can copy to and from; 0: host and host_file.
  uint32_t local_kinds = 0;
  bool same_host = false;
  bool other_hosts = false;
  bool read = true;
  bool write = true;
  bool Moves(MemoryKind k) const { return (kinds & (1u << static_cast<unsigned>(k))) != 0; }
  bool CopiesLocal(MemoryKind k) const {
    const uint32_t host = (1u << static_cast<unsigned>(MemoryKind::kHost)) |
                          (1u << static_cast<unsigned>(MemoryKind::kHostFile));
    return ((local_kinds != 0 ? local_kinds : host) & (1u << static_cast<unsigned>(k))) != 0;
  }
};

// Caps of a path that reaches peers' device memory and copies to and from any memory of
// ours (the driver copies host <-> device); the caller says which peers.
inline PathCaps DeviceMemoryCaps() {
  PathCaps c;
  c.kinds = 1u << static_cast<unsigned>(MemoryKind::kCuda);
  c.local_kinds = c.kinds | (1u << static_cast<unsigned>(MemoryKind::kHost)) |
                  (1u << static_cast<unsigned>(MemoryKind::kHostFile));
  return c;
}

class DataPath {
 public:
  virtual ~DataPath() = default;
  virtual std::string_view name() const = 0;
  virtual PathCaps caps() const = 0;
  virtual Status RegisterMemory(const LocalRegionView& region) = 0;
  virtual void DeregisterMemory(uint64_t region_id) = 0;
  // This path's public bytes for the metadata, about `regions` in the order listed there.
  virtual std::string Section(const std::vector<LocalRegionView>& regions) const = 0;
  // OK: usable for the peer (Reaches says for which regions); else why not.
  virtual Status Connect(const PeerView& peer) = 0;
  // After a successful Connect: whether this path can move bytes of the peer's region
  // `region`; if not, *why says so.
  virtual bool Reaches(PeerId peer, uint32_t region, std::string* why) const = 0;
  // Ends the peer's transfers on this path with kAborted and forgets it.
  virtual void Disconnect(PeerId id) = 0;
  // Starts moving; on error nothing was moved and no OnDataDone follows.
  virtual Status Post(PathRequest request) = 0;
  // Asks a transfer to stop; it still ends through OnDataDone.
  virtual Status Cancel(TransferId) { return Status::NotSupported("cancel"); }
};

// What an agent is made of. Created by CreateParts; tests may wrap the parts (fault/).
struct AgentParts {
  std::unique_ptr<ControlChannel> control;
  std::vector<std::unique_ptr<DataPath>> paths;  // preference order
};

// The control channel `control` ("ucx", "loopback") and the data paths `paths`
// ("shm", "cma", "cuda_ipc", "ucx", "cuda_staged", "loopback"), in that order. The control channel
// reports to `listener`, the data path at index i to `path_listeners[i]`.
Result<AgentParts> CreateParts(std::string_view control, const std::vector<std::string>& paths,
                               const PartOptions& options, CoreListener* listener,
                               const std::vector<CoreListener*>& path_listeners);

// The default preference order for a control channel (auto): shm, cma, ucx for "ucx"
// (shm, cma, cuda_ipc, ucx, cuda_staged when CudaPathByDefault()); loopback for "loopback".
std::vector<std::string> DefaultPaths(std::string_view control);

// Whether this build has the cuda_ipc path (EPLBX_WITH_CUDA); whether the defaults list it
// (built, and the process has loaded the CUDA driver: it uses a GPU); what to tell a user
// who registered device memory that no listed path moves ("; ..." or "").
bool CudaPathBuilt();
bool CudaPathByDefault();
std::string NoCudaPathHint();

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_TRANSFER_BACKEND_H_
