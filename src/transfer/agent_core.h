// Internal: what an Agent is. Owns the region table, the peer table with every peer's
// regions, bounds checks, transfer states and received notifications; delegates byte
// movement to a Backend.
#ifndef EPLBX_SRC_TRANSFER_AGENT_CORE_H_
#define EPLBX_SRC_TRANSFER_AGENT_CORE_H_

#include <condition_variable>
#include <deque>
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

class AgentCore : public BackendListener {
 public:
  static Result<std::shared_ptr<AgentCore>> Create(std::string name, AgentConfig config);
  ~AgentCore() override;

  const std::string& name() const { return name_; }
  const std::string& host_id() const { return host_id_; }
  const std::string& backend_name() const { return backend_name_; }

  // Returns the new region's id.
  Result<uint64_t> Register(void* ptr, size_t bytes, SharedFile file);
  void Deregister(uint64_t id);
  std::string Metadata() const;

  Result<PeerId> Connect(std::string_view blob);
  Status Disconnect(PeerId peer);
  Result<PeerInfo> Peer(PeerId peer) const;

  Result<TransferId> Post(XferOp op, PeerId peer, std::span<const Descriptor> local,
                          std::span<const Descriptor> remote, std::optional<std::string> notify);
  TransferStatus GetStatus(TransferId id) const;
  TransferStatus Wait(TransferId id, std::chrono::milliseconds timeout) const;
  Status Cancel(TransferId id);
  Status Release(TransferId id);

  Status Notify(PeerId peer, std::string_view payload);
  // Waits up to `timeout` for a notification; with or_completion, also returns once a
  // transfer became terminal or a peer was lost since the last such call.
  std::vector<Notification> PollNotifications(std::chrono::milliseconds timeout,
                                              bool or_completion = false);

  // BackendListener
  void OnTransferDone(TransferId id, Status status) override;
  void OnNotification(std::string sender, std::string payload) override;
  void OnPeerFailed(PeerId peer, Status reason) override;

 private:
  struct LocalRegion {
    uint64_t id = 0;
    uint64_t addr = 0;
    uint64_t bytes = 0;
    SharedFile file;  // fd -1: not mappable by peers
    std::string rkey;
  };
  struct PeerRecord {
    AgentMetadata meta;
    std::vector<uint32_t> by_addr;  // region indices sorted by address
    Transport transport = Transport::kAuto;
    bool reachable = true;
    std::string failure;
  };

  AgentCore(std::string name, AgentConfig config, std::string host_id);
  Status CheckLocal(XferOp op, const PeerRecord& p, size_t i, const Descriptor& d,
                    uint64_t* region) const;
  Status CheckRemote(XferOp op, const PeerRecord& p, size_t i, const Descriptor& d,
                     uint32_t* region) const;

  const std::string name_;
  const AgentConfig config_;
  const std::string host_id_;
  std::string backend_name_;
  std::unique_ptr<Backend> backend_;  // set once in Create

  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  uint64_t events_ = 0;       // transfers that became terminal, peers lost (guarded by mu_)
  uint64_t events_seen_ = 0;  // as of the last PollNotifications(or_completion)
  std::map<uint64_t, LocalRegion> regions_;  // by address
  uint64_t next_region_id_ = 1;
  std::map<PeerId, PeerRecord> peers_;
  PeerId next_peer_ = 0;
  std::unordered_map<TransferId, TransferStatus> transfers_;
  TransferId next_transfer_ = 1;
  std::deque<Notification> notifications_;
};

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_TRANSFER_AGENT_CORE_H_
