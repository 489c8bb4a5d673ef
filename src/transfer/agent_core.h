// Internal: what an Agent is. Owns the region table, the peer table with every peer's
// regions, bounds checks, the choice of data path per peer region, transfer states and
// received notifications; delegates byte movement to its data paths and small messages to
// its control channel (transfer/backend.h). A notification leaves only after every data
// path finished its part of the transfer: that rule lives here, once.
#ifndef EPLBX_SRC_TRANSFER_AGENT_CORE_H_
#define EPLBX_SRC_TRANSFER_AGENT_CORE_H_

#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "eplbx/transfer.h"
#include "transfer/backend.h"
#include "transfer/metadata.h"
#include "transfer/shm/shared_file.h"

namespace eplbx::internal {

// Lets tests wrap an agent's parts before it starts (fault/fault_path.h): a wrapper takes a
// part's place in `parts` and puts itself into the part's slot, between it and the core.
using PartsDecorator = std::function<Status(AgentParts& parts, ListenerSlot* control,
                                            const std::vector<ListenerSlot*>& paths)>;

class AgentCore : public CoreListener {
 public:
  static constexpr size_t kMaxPaths = 8;

  static Result<std::shared_ptr<AgentCore>> Create(std::string name, AgentConfig config,
                                                   PartsDecorator decorate = nullptr);
  ~AgentCore() override;

  const std::string& name() const { return name_; }
  const std::string& host_id() const { return host_id_; }
  const std::string& backend_name() const { return backend_name_; }
  std::vector<std::string> path_names() const;
  std::vector<PathTotals> PathBytes() const;

  // Returns the new region's id.
  // `kind`: kHost, kHostFile (with `file`) or kCuda (device memory, found by the caller).
  Result<uint64_t> Register(void* ptr, size_t bytes, SharedFile file, MemoryKind kind);
  void Deregister(uint64_t id);
  std::string Metadata() const;

  Result<PeerId> Connect(std::string_view blob);
  Status Disconnect(PeerId peer);
  Result<PeerInfo> Peer(PeerId peer) const;

  // `may_help`: a transfer posted while nothing else is in flight may be copied by the
  // calling thread too (PathRequest::alone). `caller_waits`: PathRequest::caller_waits.
  Result<TransferId> Post(XferOp op, PeerId peer, std::span<const Descriptor> local,
                          std::span<const Descriptor> remote, std::optional<std::string> notify,
                          bool may_help = true, bool caller_waits = false);
  TransferStatus GetStatus(TransferId id) const;
  TransferStatus Wait(TransferId id, std::chrono::milliseconds timeout) const;
  Status Cancel(TransferId id);
  Status Release(TransferId id);

  Status Notify(PeerId peer, std::string_view payload);
  std::vector<Status> NotifyMany(PeerId peer, std::vector<std::string> payloads);
  // Waits up to `timeout` for a notification; with or_completion, also returns once a
  // transfer became terminal or a peer was lost since the last such call.
  std::vector<Notification> PollNotifications(std::chrono::milliseconds timeout,
                                              bool or_completion = false);

  // CoreListener (the control channel's; data paths report through PathSink)
  void OnDataDone(TransferId id, Status status) override;
  void OnNotification(std::string sender, std::string payload) override;
  void OnNotifications(std::string sender, std::vector<std::string> payloads) override;
  void OnPeerFailed(PeerId peer, Status reason) override;

 private:
  // Tells the core which path finished a part, so a duplicate completion is ignored.
  class PathSink final : public CoreListener {
   public:
    PathSink(AgentCore* core, size_t index) : core_(core), index_(index) {}
    void OnDataDone(TransferId id, Status status) override {
      core_->OnPartDone(index_, id, std::move(status));
    }
    void OnNotification(std::string sender, std::string payload) override {
      core_->OnNotification(std::move(sender), std::move(payload));
    }
    void OnNotifications(std::string sender, std::vector<std::string> payloads) override {
      core_->OnNotifications(std::move(sender), std::move(payloads));
    }
    void OnPeerFailed(PeerId peer, Status reason) override {
      core_->OnPeerFailed(peer, std::move(reason));
    }

   private:
    AgentCore* const core_;
    const size_t index_;
  };

  // Whether a notification of `bytes` may go to `peer` now (size, known, reachable).
  Status CheckNotify(PeerId peer, size_t bytes) const;

  struct LocalRegion {
    uint64_t id = 0;
    uint64_t addr = 0;
    uint64_t bytes = 0;
    MemoryKind kind = MemoryKind::kHost;
    SharedFile file;  // fd -1: not mappable by peers
  };
  struct PeerRecord {
    AgentMetadata meta;
    std::vector<uint32_t> by_addr;     // region indices sorted by address
    std::vector<uint8_t> region_path;  // per region: index into paths_
    std::vector<PathChoice> choices;
    std::vector<std::string> refused;
    uint32_t connected_paths = 0;  // bit i: paths_[i] connected
    Transport transport = Transport::kTcp;
    bool reachable = true;
    std::string failure;
  };
  struct Xfer {
    TransferStatus status;
    PeerId peer = 0;
    uint32_t parts = 0;  // bit i: paths_[i] still moving its part
    std::array<uint64_t, kMaxPaths> part_bytes{};
    Status error;  // the first part's failure
    std::optional<std::string> notify;
  };

  AgentCore(std::string name, AgentConfig config, std::string host_id);
  Status CheckLocal(XferOp op, const PeerRecord& p, size_t i, const Descriptor& d, uint64_t* region,
                    MemoryKind* kind) const;
  Status CheckRemote(XferOp op, const PeerRecord& p, size_t i, const Descriptor& d,
                     uint32_t* region) const;
  std::vector<LocalRegionView> RegionViews() const;  // REQUIRES: mu_ held
  // Chooses a path for each of the peer's regions; on error every reason is in it.
  Status ChoosePaths(PeerId id, bool same_host, PeerRecord* rec);
  void OnPartDone(size_t path, TransferId id, Status status);
  // All parts done: sends the notification if any, then completes.
  void FinishParts(TransferId id);
  void Complete(TransferId id, Status status);

  const std::string name_;
  const AgentConfig config_;
  const std::string host_id_;
  std::string backend_name_;
  std::vector<std::string> path_names_;
  bool paths_explicit_ = false;  // listed by the user: refusals are reported on stderr
  std::vector<std::unique_ptr<PathSink>> sinks_;
  std::unique_ptr<ListenerSlot> control_slot_;
  std::vector<std::unique_ptr<ListenerSlot>> path_slots_;
  AgentParts parts_;  // set once in Create
  std::vector<DataPath*> paths_;

  // Wakes waiters after a change under mu_: the condition variable's, and the one waiting
  // in the control channel (WaitHere) through wake_fd_.
  void Wake();

  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  int wake_fd_ = -1;  // an eventfd: the waiter in the control channel's WaitHere
  std::atomic<bool> waiting_here_{false};  // a PollNotifications waits there (one at a time)
  bool receive_here_ = true;               // EPLBX_RECEIVE_HERE=0: waits stay on cv_
  uint64_t events_ = 0;       // transfers that became terminal, peers lost (guarded by mu_)
  uint64_t events_seen_ = 0;  // as of the last PollNotifications(or_completion)
  std::map<uint64_t, LocalRegion> regions_;  // by address
  uint64_t next_region_id_ = 1;
  std::map<PeerId, PeerRecord> peers_;
  PeerId next_peer_ = 0;
  std::unordered_map<TransferId, Xfer> transfers_;
  TransferId next_transfer_ = 1;
  std::deque<Notification> notifications_;
  std::vector<PathTotals> totals_;  // per path
};

// Builds Agents around cores made with a decorator (tests; the public Agent::Create has none).
struct AgentFactory {
  static Result<std::unique_ptr<Agent>> Create(std::string name, AgentConfig config,
                                               PartsDecorator decorate);
};

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_TRANSFER_AGENT_CORE_H_
