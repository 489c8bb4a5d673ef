// Internal: the backend seam (ARCHITECTURE.md, "Backend seam"). The agent core owns names,
// regions, peers, bounds checks and transfer states; a backend only moves bytes and small
// messages and reports back through BackendListener. Backends are created in one place,
// CreateBackend(); there is no static self-registration.
#ifndef EPLBX_SRC_TRANSFER_BACKEND_H_
#define EPLBX_SRC_TRANSFER_BACKEND_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "eplbx/status.h"
#include "eplbx/transfer.h"
#include "transfer/metadata.h"

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

struct PostRequest {
  TransferId id = 0;
  PeerId peer = 0;
  std::string peer_name;
  XferOp op = XferOp::kRead;
  std::vector<Segment> segments;
  std::optional<std::string> notify;
};

// Implemented by the agent core. Calls may come from any backend thread, never while the
// backend holds a lock the core could wait on.
class BackendListener {
 public:
  virtual ~BackendListener() = default;
  // Exactly once for every PostRequest that Post() accepted.
  virtual void OnTransferDone(TransferId id, Status status) = 0;
  virtual void OnNotification(std::string sender, std::string payload) = 0;
  virtual void OnPeerFailed(PeerId peer, Status reason) = 0;
};

struct BackendOptions {
  std::string agent_name;
  std::chrono::milliseconds peer_timeout{30000};
  int copy_threads = 2;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;
  // Bytes a peer needs to reach us (UCX: the worker address).
  virtual std::string ConnectionInfo() const = 0;
  // Returns the remote-access key peers need for the region.
  virtual Result<std::string> RegisterMemory(uint64_t region_id, void* ptr, size_t bytes) = 0;
  virtual void DeregisterMemory(uint64_t region_id) = 0;
  // Connects to a peer whose metadata the core validated. `wanted` is kShm, kTcp or kAuto;
  // returns the transport in use.
  virtual Result<Transport> Connect(PeerId id, const AgentMetadata& peer, Transport wanted,
                                    bool same_host) = 0;
  // Fails the peer's in-flight transfers with kAborted and forgets it.
  virtual void Disconnect(PeerId id) = 0;
  // Starts a transfer; on error nothing was sent and no OnTransferDone follows.
  virtual Status Post(PostRequest request) = 0;
  virtual Status Notify(PeerId peer, std::string payload) = 0;
  // Asks a transfer to stop; it still ends through OnTransferDone.
  virtual Status Cancel(TransferId) { return Status::NotSupported("cancel"); }
};

// Creates the backend named `name` ("ucx", "loopback").
Result<std::unique_ptr<Backend>> CreateBackend(std::string_view name, const BackendOptions& options,
                                               BackendListener* listener);

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_TRANSFER_BACKEND_H_
