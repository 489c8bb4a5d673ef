// Transfer engine: one-sided READ / WRITE between agents (ranks), with registered memory,
// versioned metadata blobs, bounds checks, notifications and failure deadlines.
//
// An Agent is one endpoint (one rank). Typical use:
//
//   auto agent = eplbx::Agent::Create("rank3", {});               // UCX backend
//   auto region = agent->RegisterMemory(weights, weight_bytes);    // once, a large region
//   std::string blob = agent->Metadata();                          // all-gather the blobs
//   auto peer = agent->Connect(blob_of_rank5);
//   auto xfer = agent->Read(*peer, {{dst, n}}, {{src_addr_on_rank5, n}}, "rows landed");
//   agent->Wait(*xfer, std::chrono::seconds(30));
//
// Thread safety: every Agent method may be called from any thread. Completion callbacks
// do not exist; callers poll GetStatus() or block in Wait() with a deadline.
#ifndef EPLBX_TRANSFER_H_
#define EPLBX_TRANSFER_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "eplbx/env.h"
#include "eplbx/status.h"

namespace eplbx {

namespace internal {
class AgentCore;
struct AgentFactory;
}  // namespace internal

// What kind of memory a registered region is; data paths are chosen per peer and kind.
//   kHost: plain host memory of the process.
//   kHostFile: host memory in a writable shared file mapping (memfd, /dev/shm, torch's
//              share_memory_()): same-host peers can map it.
//   kCuda: GPU device memory (not registered by this build yet).
enum class MemoryKind : uint8_t { kHost = 0, kHostFile = 1, kCuda = 2 };
std::string_view MemoryKindName(MemoryKind kind);  // "host", "host_file", "cuda"

// The data paths (docs/transfer.md, "Data paths"), tried in a preference order per peer and
// memory kind; the first that accepts moves the bytes:
//   "shm": same host; the peer's region lies in a shared file, which we map and copy with
//          streaming stores.
//   "cma": same host; process_vm_readv / process_vm_writev on any host memory of the peer
//          (needs ptrace permission over it).
//   "ucx": UCX RMA over whatever UCX picks (tcp here, RDMA where present); any peer.
//   "loopback": agents in one process (unit tests of the layers above).
// Transport is the short form of a preference list:
//   kShm: shm, cma (same host only);  kTcp: ucx;  kAuto: shm, cma, ucx.
enum class Transport { kAuto, kShm, kTcp };
std::string_view TransportName(Transport transport);  // "auto", "shm", "tcp"
Result<Transport> ParseTransport(std::string_view name);

struct AgentConfig {
  // "ucx" (real transfers between processes and hosts) or "loopback" (agents in one
  // process; for unit tests of the layers above).
  std::string backend = "ucx";
  // kAuto defers to the environment variables EPLBX_PATHS (a list, as `paths`) or
  // EPLBX_TRANSPORT (auto|shm|tcp) if set, then uses every path of the backend. A forced
  // transport that cannot reach a peer fails Connect().
  Transport transport = Transport::kAuto;
  // Data paths in order of preference ("shm", "cma", "ucx"; "loopback" with that backend).
  // Non-empty: used as given instead of `transport`. A peer region that no listed path
  // reaches fails Connect() with every path's reason.
  std::vector<std::string> paths;
  // A peer silent for this long (no answer to the agent's heartbeats, or a broken
  // connection) is unreachable: its in-flight transfers fail with kUnavailable naming it,
  // and later calls to it fail at once until it is connected again.
  std::chrono::milliseconds peer_timeout{30000};
  // Threads that copy for same-host peers (SCHED_BATCH: docs/transfer.md). 0:
  // EPLBX_COPY_THREADS from the Env if set (1..64), else min(2, hardware threads).
  int copy_threads = 0;
  // Same-host transfers (shm, cma) of at most this many bytes are copied on the calling
  // thread inside Read()/Write(), which then return with the transfer already done: no
  // hand-off to a copy thread. -1: EPLBX_INLINE_COPY_BYTES from the Env if set, else
  // Agent::kDefaultInlineCopyBytes (256 KiB); 0: never.
  int64_t inline_copy_bytes = -1;
  // A same-host peer's shared regions get their page tables when it is connected, in
  // order, while their bytes add up to at most this (the rest are faulted in when first
  // read): copies from them then take no page faults, at 1/512 of the bytes in page
  // tables. -1: Agent::kDefaultPrefaultBytes (8 GiB, 16 MiB of page tables per peer);
  // 0: never.
  int64_t prefault_bytes = -1;
  // Identity of this host. Empty: boot id + network and pid namespaces, so processes in
  // different network namespaces count as different hosts. EPLBX_HOST_ID overrides.
  std::string host_id;
  // Where EPLBX_PATHS, EPLBX_TRANSPORT and EPLBX_HOST_ID are read (null: Env::Default()).
  Env* env = nullptr;
};

// A contiguous byte range. Local descriptors hold pointers in this process; remote ones hold
// addresses inside regions the peer registered (as listed in its metadata).
struct Descriptor {
  uint64_t addr = 0;
  uint64_t bytes = 0;
  static Descriptor Of(const void* p, uint64_t n) {
    return {static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p)), n};
  }
};

// A registered memory region; deregisters (and frees memory the agent allocated) when
// destroyed. Move-only. REQUIRES: no transfer that uses the region is in flight when it is
// destroyed. May outlive its Agent (then destruction only frees).
class RegisteredRegion {
 public:
  RegisteredRegion() = default;
  RegisteredRegion(RegisteredRegion&& other) noexcept;
  RegisteredRegion& operator=(RegisteredRegion&& other) noexcept;
  RegisteredRegion(const RegisteredRegion&) = delete;
  RegisteredRegion& operator=(const RegisteredRegion&) = delete;
  ~RegisteredRegion();

  void* data() const { return data_; }
  size_t size() const { return size_; }
  // True when same-host peers can map the region and memcpy: memory from AllocateShared,
  // or registered memory that lies in a writable shared file mapping (memfd, /dev/shm).
  bool shared() const { return fd_ >= 0; }
  uint64_t addr() const { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(data_)); }

 private:
  friend class Agent;
  void Reset();

  std::weak_ptr<internal::AgentCore> core_;
  uint64_t id_ = 0;
  void* data_ = nullptr;
  size_t size_ = 0;
  bool owns_mapping_ = false;  // AllocateShared: unmapped on destruction
  int fd_ = -1;                // our fd of the backing file, when peers can map the region
};

using PeerId = uint32_t;
using TransferId = uint64_t;

enum class TransferState { kInProgress, kDone, kError };

struct TransferStatus {
  TransferState state = TransferState::kInProgress;
  Status error;  // set when state == kError
};

struct Notification {
  std::string peer;     // the sending agent's name
  std::string payload;  // opaque bytes
};

// The data path chosen for one memory kind of a peer's regions.
struct PathChoice {
  MemoryKind kind = MemoryKind::kHost;
  std::string path;  // "shm", "cma", "ucx", "loopback"
};

struct PeerInfo {
  std::string name;
  std::string host_id;
  // kShm when every region of the peer moves over a same-host path, else kTcp (never kAuto).
  Transport transport = Transport::kAuto;
  bool reachable = true;
  std::string failure;  // why not, when !reachable
  // Per memory kind the peer registered, the path in use (several when regions of one kind
  // differ, e.g. a shared file shorter than its region: that region moves over cma).
  std::vector<PathChoice> paths;
  // Each preferred path that was refused for this peer, once: "shm: <reason>".
  std::vector<std::string> refused;
};

// Bytes that completed transfers moved, per data path (PathBytes()).
struct PathTotals {
  std::string path;
  uint64_t bytes = 0;
  uint64_t transfers = 0;  // transfers with at least one byte on this path
};

class Agent {
 public:
  // Limits on what crosses a process boundary.
  static constexpr size_t kMaxNameBytes = 256;
  static constexpr size_t kMaxNotificationBytes = 64 * 1024;
  static constexpr uint64_t kDefaultInlineCopyBytes = 256 << 10;  // measured: docs/perf.md
  static constexpr uint64_t kDefaultPrefaultBytes = 8ull << 30;   // AgentConfig::prefault_bytes

  // Starts the backend (for UCX: context, worker and a progress thread).
  // Fails with kInvalidArgument for an empty or too long name, an unknown backend or bad
  // config, kUnavailable when the backend cannot start.
  static Result<std::unique_ptr<Agent>> Create(std::string name, AgentConfig config = {});
  ~Agent();
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  const std::string& name() const;
  // Backend (control channel) name and host identity, as peers see them.
  const std::string& backend() const;
  // The data paths this agent uses, in preference order.
  std::vector<std::string> paths() const;
  // Bytes moved per data path by transfers that completed, since the agent was created.
  std::vector<PathTotals> PathBytes() const;
  const std::string& host_id() const;

  // Registers [ptr, ptr + bytes) for local and remote access. Regions may not overlap.
  // Register a few large regions once and describe tensors as offsets inside them.
  // Memory inside one writable MAP_SHARED file mapping (memfd, /dev/shm, e.g. a torch tensor
  // after share_memory_()) is published as mappable: same-host peers then copy it with memcpy
  // instead of process_vm_readv (shared() is true).
  Result<RegisteredRegion> RegisterMemory(void* ptr, size_t bytes);
  // Allocates `bytes` of zeroed shared memory and registers it. Same-host peers map it and
  // copy at memory speed; use it for buffers the agent's user owns anyway.
  Result<RegisteredRegion> AllocateShared(size_t bytes);

  // This agent's metadata blob (format: docs/transfer.md): name, host identity, backend
  // connection info, and every region registered so far with its remote-access key.
  // Peers connect with it; re-send it after registering more memory.
  std::string Metadata() const;

  // Connects to the agent that produced `blob`. Rejects (each with its own message) bad
  // magic, unsupported version, a length that disagrees with the blob, truncated fields,
  // oversized fields, our own name, a name already connected, and another backend.
  Result<PeerId> Connect(std::string_view blob);
  // Forgets a peer; its in-flight transfers fail with kAborted.
  Status Disconnect(PeerId peer);
  Result<PeerInfo> Peer(PeerId peer) const;

  // One-sided transfer of local[i] <-> remote[i] (equal lengths, same count). Every local
  // descriptor must lie inside one of our regions and every remote one inside one region
  // of the peer's, else nothing is posted and kOutOfRange names the descriptor.
  // `notify`, if set, is delivered to the peer after all the data has landed (READ: in our
  // memory; WRITE: in the peer's memory), and the transfer is done only once it was sent.
  // Local completion == remote visibility for both operations: when GetStatus() says kDone
  // a READ's bytes are in our memory and a WRITE's bytes are in the peer's.
  Result<TransferId> Read(PeerId peer, std::span<const Descriptor> local,
                          std::span<const Descriptor> remote,
                          std::optional<std::string> notify = std::nullopt);
  Result<TransferId> Write(PeerId peer, std::span<const Descriptor> local,
                           std::span<const Descriptor> remote,
                           std::optional<std::string> notify = std::nullopt);
  // One READ of a ReadMany(): what Read() takes.
  struct ReadRequest {
    PeerId peer = 0;
    std::vector<Descriptor> local, remote;
    std::optional<std::string> notify;
  };
  // Posts each request as Read() would, in order, and returns each one's id or error. For
  // an event loop that posts many READs at once: a Read() that finds nothing else in flight
  // copies on the calling thread beside the copy threads (it expects the caller to wait for
  // it), so the next READs would be posted only after it; these are all handed over (same-
  // host copies of at most inline_copy_bytes are still copied here) and run in this order.
  // `caller_waits`: the caller will wait for these READs with nothing else to do meanwhile
  // (a synchronous rearrangement). Then, on a busy host (at least as many agents on it as
  // cores), same-host copies of up to 1 MiB each are made here too, in order: every core
  // already has an agent copying, and a hand-off to a copy thread would add a wake-up per
  // READ, not parallelism (docs/transfer.md, "On a busy host the caller that waits copies").
  std::vector<Result<TransferId>> ReadMany(std::span<const ReadRequest> requests,
                                           bool caller_waits = false);

  // kInProgress, kDone, or kError with the reason. Terminal states never change.
  // An unknown (or released) id gives kError with kNotFound.
  TransferStatus GetStatus(TransferId id) const;
  // Blocks until the transfer is terminal or `timeout` passed (then kInProgress).
  TransferStatus Wait(TransferId id, std::chrono::milliseconds timeout) const;
  // Stops a transfer. Returns once no byte of it can change any more (bounded by the peer
  // timeout); the transfer ends kError/kAborted unless it had already finished.
  Status Cancel(TransferId id);
  // Forgets a terminal transfer. REQUIRES: GetStatus(id).state != kInProgress.
  Status Release(TransferId id);

  // Sends `payload` (at most kMaxNotificationBytes) to the peer. Ordered per peer.
  Status Notify(PeerId peer, std::string_view payload);
  // Sends each payload as Notify would, in order, and returns one status a payload; over
  // UCX they travel together, up to 64 KiB a message (one wake-up of each side's progress
  // thread and of the receiver instead of one each), and arrive as separate notifications.
  std::vector<Status> NotifyMany(PeerId peer, std::vector<std::string> payloads);
  // Notifications received so far, oldest first (removes them).
  std::vector<Notification> PollNotifications();
  // Like PollNotifications, but waits up to `timeout` for at least one.
  std::vector<Notification> WaitNotifications(std::chrono::milliseconds timeout);
  // Like WaitNotifications, but also returns (possibly with none) as soon as any transfer
  // of this agent became terminal, or a peer was found unreachable, since the previous
  // call: one wait for an event loop that drives notifications, transfers and peer
  // failures. Meant for one consumer thread.
  std::vector<Notification> WaitEvents(std::chrono::milliseconds timeout);

 private:
  friend struct internal::AgentFactory;
  explicit Agent(std::shared_ptr<internal::AgentCore> core);
  std::shared_ptr<internal::AgentCore> core_;
};

}  // namespace eplbx

#endif  // EPLBX_TRANSFER_H_
