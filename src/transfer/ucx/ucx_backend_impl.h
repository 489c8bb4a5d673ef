// Internal: the UCX backend's state, shared by ucx_backend.cc (set-up, public calls and the
// progress loop), ucx_peers.cc (failure detection and active messages) and ucx_data.cc
// (UCX RMA and same-host copies). See ucx_backend.h for the design. Not installed.
#ifndef EPLBX_SRC_TRANSFER_UCX_UCX_BACKEND_IMPL_H_
#define EPLBX_SRC_TRANSFER_UCX_UCX_BACKEND_IMPL_H_

#include <sys/mman.h>
#include <sys/types.h>
#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/strings.h"
#include "transfer/backend.h"
#include "transfer/shm/copier.h"

namespace eplbx::internal::ucx {

using Clock = std::chrono::steady_clock;
constexpr unsigned kAmId = 0x45;

inline std::string Ucs(ucs_status_t s) { return ucs_status_string(s); }

class UcxBackend;

struct MappedRegion {
  uint8_t* ptr = nullptr;  // the region's first byte
  void* base = nullptr;    // what to munmap (page-aligned, at or before ptr)
  size_t map_bytes = 0;
};

// One connected peer. Immutable after Connect except where noted.
struct PeerState {
  UcxBackend* self = nullptr;
  PeerId id = 0;
  std::string name;
  pid_t pid = 0;
  Transport transport = Transport::kTcp;
  std::vector<RegionInfo> regions;
  std::vector<MappedRegion> mapped;  // per region; null where not mapped
  std::atomic<bool> failed{false};
  bool disconnected = false;  // progress thread
  std::string failure;        // guarded by UcxBackend::mu_ once `failed`
  // Progress thread only:
  ucp_ep_h ep = nullptr;
  std::vector<ucp_rkey_h> rkeys;
  Clock::time_point last_heard;
  Clock::time_point last_ping;

  ~PeerState() {
    for (MappedRegion& m : mapped) {
      if (m.base != nullptr) munmap(m.base, m.map_bytes);
    }
  }
};

// One transfer on UCX RMA (progress thread only).
struct Op {
  UcxBackend* self = nullptr;
  TransferId id = 0;
  std::shared_ptr<PeerState> peer;
  XferOp kind = XferOp::kRead;
  size_t pending = 0;  // UCX requests not completed yet
  bool posted_all = false;
  bool cancelled = false;
  bool notified = false;
  Status error;
  std::optional<std::string> notify;
};

// A connection's first flush (wireup done both ways).
struct ConnectFlush {
  UcxBackend* self = nullptr;
  std::shared_ptr<std::promise<ucs_status_t>> promise;
};

// An active message in flight: its bytes live until UCX is done with them.
struct AmMessage {
  UcxBackend* self = nullptr;
  std::string bytes;
  Op* op = nullptr;  // the transfer waiting for it, if any
};

class UcxBackend final : public Backend {
 public:
  UcxBackend(const BackendOptions& options, BackendListener* listener);
  ~UcxBackend() override;

  Status Start();

  std::string_view name() const override { return "ucx"; }
  std::string ConnectionInfo() const override { return address_; }

  Result<std::string> RegisterMemory(uint64_t region_id, void* ptr, size_t bytes) override;
  void DeregisterMemory(uint64_t region_id) override;
  Result<Transport> Connect(PeerId id, const AgentMetadata& meta, Transport wanted,
                            bool same_host) override;
  void Disconnect(PeerId id) override;
  Status Post(PostRequest req) override;
  Status Notify(PeerId peer, std::string payload) override;
  Status Cancel(TransferId id) override;

 private:
  // ---- threads and commands -----------------------------------------------------------

  void Enqueue(std::function<void()> fn);

  // Runs `fn` on the progress thread and waits for its result (bounded).
  template <typename T>
  Result<T> RunSync(std::function<Result<T>()> fn) {
    if (std::this_thread::get_id() == thread_.get_id()) return fn();
    auto promise = std::make_shared<std::promise<Result<T>>>();
    std::future<Result<T>> future = promise->get_future();
    Enqueue([promise, fn = std::move(fn)] { promise->set_value(fn()); });
    const auto limit = options_.peer_timeout + std::chrono::seconds(5);
    if (future.wait_for(limit) != std::future_status::ready) {
      return Status::Timeout(StrCat(
          "agent '", options_.agent_name, "': the UCX progress thread did not answer within ",
          std::chrono::duration_cast<std::chrono::milliseconds>(limit).count(), " ms"));
    }
    return future.get();
  }

  void Loop();

  // ---- failure ---------------------------------------------------------------------------

  Status Unreachable(const PeerState& p) const;
  void MarkFailed(PeerState& p, const std::string& why);
  void FailPeer(const std::shared_ptr<PeerState>& p, const std::string& why);
  static void OnEpError(void* arg, ucp_ep_h, ucs_status_t status);
  void CloseEp(const std::shared_ptr<PeerState>& p);
  void FinishCloses();
  static void DestroyRkeys(PeerState& p);
  void Heartbeat(Clock::time_point now);

  // ---- messages --------------------------------------------------------------------------

  // Sends header + payload; `op`, if set, counts it as pending and finishes after it.
  void SendAm(PeerState& p, MessageKind kind, std::string payload, Op* op);
  void SendAmOn(ucp_ep_h ep, AmMessage* msg, const ucp_request_param_t* param);
  static void OnAmSent(void* request, ucs_status_t status, void* user_data);
  static ucs_status_t OnAm(void* arg, const void*, size_t, void* data, size_t length,
                           const ucp_am_recv_param_t* param);

  // ---- data: UCX RMA ---------------------------------------------------------------------

  void StartRma(const std::shared_ptr<PeerState>& p, PostRequest req);
  bool Track(Op* op, void* request);
  void RmaError(Op* op, ucs_status_t status);
  static void OnRmaDone(void* request, ucs_status_t status, void* user_data);
  void MaybeFinish(Op* op);

  // ---- data: same host -------------------------------------------------------------------

  void MapSharedRegions(PeerState& p);
  void PostShm(std::shared_ptr<PeerState> p, PostRequest req);

  const BackendOptions options_;
  BackendListener* const listener_;
  Clock::duration ping_interval_;
  Clock::duration tick_;

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string address_;
  int wake_fd_ = -1;
  int epoll_fd_ = -1;
  std::thread thread_;
  std::unique_ptr<ShmCopier> copier_;

  std::mutex mu_;  // commands_, peers_ and by_name_ membership, PeerState::failure
  std::deque<std::function<void()>> commands_;
  std::map<PeerId, std::shared_ptr<PeerState>> peers_;
  std::map<std::string, std::shared_ptr<PeerState>> by_name_;

  // Progress thread only.
  bool stopping_ = false;
  std::map<uint64_t, ucp_mem_h> memh_;
  std::map<TransferId, std::unique_ptr<Op>> ops_;
  std::vector<std::pair<void*, std::shared_ptr<PeerState>>> closing_;
  int64_t inflight_ = 0;
  uint64_t dropped_messages_ = 0;
};

}  // namespace eplbx::internal::ucx

#endif  // EPLBX_SRC_TRANSFER_UCX_UCX_BACKEND_IMPL_H_
