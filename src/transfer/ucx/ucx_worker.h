// Internal: one UCX context and worker, owned by a progress thread. It is the agent's
// control channel (endpoints, active-message notifications, heartbeats and liveness:
// ucx_worker.cc, ucx_peers.cc) and carries the "ucx" data path's RMA (ucx_path.cc), which
// uses the same endpoints. The progress thread makes every UCX call but two: a notification
// is sent by its calling thread when the progress thread sleeps (SendNow), and a thread
// waiting for the agent's events receives messages itself (WaitHere); so the worker runs in
// serialized mode behind worker_mu_. Not installed.
#ifndef EPLBX_SRC_TRANSFER_UCX_UCX_WORKER_H_
#define EPLBX_SRC_TRANSFER_UCX_UCX_WORKER_H_

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

namespace eplbx::internal::ucx {

using Clock = std::chrono::steady_clock;
constexpr unsigned kAmId = 0x45;

inline std::string Ucs(ucs_status_t s) { return ucs_status_string(s); }

class UcxWorker;

// Where the cuda_staged data path (cuda/cuda_staged_path.cc) hears its messages: a small
// head and optional data that UCX lands straight in memory the sink names (eagerly or by
// rendezvous). Called on the progress thread, with no lock of the worker held.
class StageSink {
 public:
  virtual ~StageSink() = default;
  // A message from `peer` with `head` and `bytes` of data (0: none). Returns where the data
  // goes (host memory of `bytes`), or null to drop it; ignored when `bytes` is 0.
  virtual void* OnStage(PeerId peer, std::string_view head, size_t bytes) = 0;
  // The data of a message OnStage gave memory for landed there (OK) or will not.
  virtual void OnStageLanded(PeerId peer, const std::string& head, Status status) = 0;
  // A message from an agent this one has no connection to: the head of the answer to send
  // back on the message's own endpoint at once (empty: none).
  virtual std::string OnStageFromStranger(std::string_view sender, std::string_view head) = 0;
  // The peer failed (silent, connection lost); not called for Disconnect.
  virtual void OnStagePeerFailed(PeerId peer, Status reason) = 0;
};

// A stage message's data being received by rendezvous.
struct StageReceive {
  UcxWorker* self = nullptr;
  std::shared_ptr<StageSink> sink;  // outlives its path until UCX is done with the memory
  PeerId peer = 0;
  std::string head;
};

struct AmMessage;

// One connected peer. Immutable after Connect except where noted.
struct PeerState {
  UcxWorker* self = nullptr;
  PeerId id = 0;
  std::string name;
  std::atomic<bool> failed{false};
  bool disconnected = false;  // progress thread
  std::string failure;        // guarded by UcxWorker::mu_ once `failed`
  // Whoever holds UcxWorker::worker_mu_ (the progress thread, or SendNow's caller):
  ucp_ep_h ep = nullptr;
  std::vector<ucp_rkey_h> rkeys;
  Clock::time_point last_heard;
  Clock::time_point last_ping;
  // A peer of this host: its notifications go over this connected socket to the peer's
  // inbox (ucx_local.cc) instead of UCX; -1: over UCX. Messages the socket could not take
  // yet wait in `local_queued`, in order, and leave before any later one.
  int local_fd = -1;
  std::deque<AmMessage*> local_queued;
};

// One transfer on UCX RMA (progress thread only).
struct Op {
  UcxWorker* self = nullptr;
  TransferId id = 0;
  std::shared_ptr<PeerState> peer;
  XferOp kind = XferOp::kRead;
  size_t pending = 0;  // UCX requests not completed yet
  bool posted_all = false;
  bool cancelled = false;
  Status error;
};

// A connection's first flush (wireup done both ways).
struct ConnectFlush {
  UcxWorker* self = nullptr;
  std::shared_ptr<std::promise<ucs_status_t>> promise;
};

// An active message in flight: its bytes live until UCX is done with them.
struct AmMessage {
  UcxWorker* self = nullptr;
  std::string bytes;                 // the payload; of a stage message: its header
  std::string peer;                  // for messages
  std::function<void(Status)> sent;  // runs once when UCX is done with it, if set
  bool stage = false;                // a cuda_staged message: `bytes` go as the header,
  const void* data = nullptr;        // and these as its data (kept valid by the sender)
  size_t data_bytes = 0;
};

class UcxWorker final : public ControlChannel {
 public:
  UcxWorker(const PartOptions& options, CoreListener* listener);
  ~UcxWorker() override;

  Status Start();

  // ControlChannel
  std::string_view name() const override { return "ucx"; }
  // The UCX address and the inbox's name: [u32 address bytes][address][name].
  std::string ConnectionInfo() const override { return conn_info_; }
  Status Connect(PeerId id, std::string_view peer_name, std::string_view conn_info) override;
  void Disconnect(PeerId id) override;
  Status Notify(PeerId peer, std::string payload, std::function<void(Status)> sent) override;
  // One active message (or inbox message) per 64 KiB of payloads, sent as Notify's are.
  std::vector<Status> NotifyMany(PeerId peer, std::vector<std::string> payloads) override;
  // While the progress thread sleeps: mutes its wait on the worker's and the inbox's fds,
  // polls them on the calling thread and receives what comes (the inbox drained, UCX
  // progressed and armed again when its fd fired) until a message was handed to the
  // listener (the listener writes `wake_fd`), `timeout` passed, or the progress thread is
  // needed (RMA, closing endpoints); then unmutes.
  bool WaitHere(std::chrono::milliseconds timeout, int wake_fd) override;

  // For the "ucx" data path (ucx_path.cc), which reports to `rma_listener`.
  void set_rma_listener(CoreListener* listener) { rma_listener_ = listener; }
  // -> rkey. `device`: CUDA device memory (only where cuda_memory()).
  Result<std::string> MapMemory(uint64_t region_id, void* ptr, size_t bytes, bool device = false);
  // Whether this UCX was built with CUDA support (ucp_context_query at Start): then the ucx
  // path registers device memory with UCX directly.
  bool cuda_memory() const { return cuda_memory_; }
  void UnmapMemory(uint64_t region_id);
  // For the cuda_staged path: where its messages go (null: nowhere; a receive in flight
  // keeps its sink alive), and a message to `peer`: `head` plus `bytes` of data at `data`
  // (kept valid until `sent` runs once: UCX is done with it, OK or the reason). Thread-safe.
  void SetStageSink(std::shared_ptr<StageSink> sink);
  Status SendStage(PeerId peer, std::string head, const void* data, size_t bytes,
                   std::function<void(Status)> sent);
  Status UnpackRkeys(PeerId id, const std::vector<std::string>& rkeys);
  Status PostRma(PathRequest req);
  void CancelRma(TransferId id);

 private:
  // ---- threads and commands -----------------------------------------------------------

  void Enqueue(std::function<void()> fn);
  // Runs a send at once on the calling thread when the progress thread sleeps and nothing is
  // queued before it (worker_mu_), else queues it.
  void SendNow(std::function<void()> fn);

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

  // The connected peer `id`, or why not (not found; unreachable).
  Result<std::shared_ptr<PeerState>> LivePeer(PeerId id);

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

  // Sends header + payload; `sent`, if set, runs once UCX is done with it.
  void SendAm(PeerState& p, MessageKind kind, std::string payload,
              std::function<void(Status)> sent);
  // Sends `msg` (deleted once UCX is done with it) with UCP_AM_SEND_FLAG_* `flags`.
  void SendAmOn(ucp_ep_h ep, AmMessage* msg, uint32_t flags);
  static void OnAmSent(void* request, ucs_status_t status, void* user_data);
  static ucs_status_t OnAm(void* arg, const void* header, size_t header_length, void* data,
                           size_t length, const ucp_am_recv_param_t* param);
  // A message with a header: the cuda_staged path's.
  ucs_status_t OnStageAm(std::string_view header, void* data, size_t length,
                         const ucp_am_recv_param_t* param);
  static void OnStageReceived(void* request, ucs_status_t status, size_t length, void* user_data);

  // A message's bytes (header, then body) as they arrived over UCX or the inbox: handed to
  // the listener. `reply_ep`: where a PING's PONG goes (UCX only).
  void Deliver(std::string_view bytes, ucp_ep_h reply_ep);

  // ---- notifications between processes of one host (ucx_local.cc) -----------------------

  // The inbox: a SOCK_SEQPACKET socket in the abstract namespace, named at random. Without
  // it (an error), every peer's notifications go over UCX.
  void StartLocal();
  // Connects to the inbox `name` of the peer (one of this host: reachable by that name in
  // this network namespace); on failure the peer's notifications go over UCX.
  void ConnectLocal(PeerState& p, std::string_view name);
  // Sends `msg` over the peer's socket (true) or returns false: the peer is not local.
  bool SendLocal(PeerState& p, AmMessage* msg);
  void FlushLocal(PeerState& p);
  // Closes the peer's socket; fails the peer with `failure` unless empty; what waited for
  // the socket fails with the peer's reason.
  void CloseLocal(PeerState& p, const std::string& failure);
  // Accepts connections and hands every message waiting in the inbox to the listener.
  void DrainLocal();
  void DrainLocalOnce();
  void Accept();
  void ReceiveLocal(int fd);

  // ---- data: UCX RMA ---------------------------------------------------------------------

  void StartRma(const std::shared_ptr<PeerState>& p, PathRequest req);
  bool Track(Op* op, void* request);
  void RmaError(Op* op, ucs_status_t status);
  static void OnRmaDone(void* request, ucs_status_t status, void* user_data);
  void MaybeFinish(Op* op);

  const PartOptions options_;
  CoreListener* const listener_;
  CoreListener* rma_listener_ = nullptr;
  std::shared_ptr<StageSink> stage_sink_;  // progress thread
  Clock::duration ping_interval_;
  Clock::duration tick_;

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string address_;
  bool cuda_memory_ = false;
  int wake_fd_ = -1;
  int epoll_fd_ = -1;
  int worker_fd_ = -1;     // ucp_worker_get_efd's; in epoll_fd_
  std::string conn_info_;  // ConnectionInfo(): the UCX address and the inbox's name
  // The inbox (ucx_local.cc): its listening socket and the connections it accepted, all in
  // local_epoll_fd_, which is in epoll_fd_. Whoever holds worker_mu_.
  int local_listen_fd_ = -1;
  int local_epoll_fd_ = -1;
  std::string local_name_;
  std::vector<int> local_in_;
  std::string local_buffer_;
  bool draining_ = false;
  // Peers whose inbox could not take a message yet, by socket (watched for EPOLLOUT).
  std::map<int, std::shared_ptr<PeerState>> local_blocked_;
  int muted_ = 0;  // callers in WaitHere (worker_fd_, local_epoll_fd_ muted in epoll_fd_)
  std::thread thread_;

  // Held by whoever uses worker_: the progress thread but while it sleeps, SendNow, WaitHere.
  std::mutex worker_mu_;
  std::mutex mu_;  // commands_, peers_ and by_name_ membership, PeerState::failure
  std::deque<std::function<void()>> commands_;
  std::map<PeerId, std::shared_ptr<PeerState>> peers_;
  std::map<std::string, std::shared_ptr<PeerState>> by_name_;

  // Whoever holds worker_mu_ (the progress thread, SendNow's or WaitHere's caller).
  bool stopping_ = false;
  std::map<uint64_t, ucp_mem_h> memh_;
  std::map<TransferId, std::unique_ptr<Op>> ops_;
  std::vector<std::pair<void*, std::shared_ptr<PeerState>>> closing_;
  int64_t inflight_ = 0;
  uint64_t dropped_messages_ = 0;
};

}  // namespace eplbx::internal::ucx

#endif  // EPLBX_SRC_TRANSFER_UCX_UCX_WORKER_H_
