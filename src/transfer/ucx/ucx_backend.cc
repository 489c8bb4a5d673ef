#include "transfer/ucx/ucx_backend.h"

#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <thread>

#include "common/strings.h"
#include "transfer/shm/copier.h"

namespace eplbx::internal {
namespace {

using Clock = std::chrono::steady_clock;
constexpr unsigned kAmId = 0x45;

std::string Ucs(ucs_status_t s) { return ucs_status_string(s); }

class UcxBackend;

struct MappedRegion {
  uint8_t* ptr = nullptr;
  size_t bytes = 0;
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
      if (m.ptr != nullptr) munmap(m.ptr, m.bytes);
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
  UcxBackend(const BackendOptions& options, BackendListener* listener)
      : options_(options), listener_(listener) {
    const auto timeout = options.peer_timeout;
    ping_interval_ = std::clamp<Clock::duration>(timeout / 5, std::chrono::milliseconds(5),
                                                 std::chrono::seconds(2));
    tick_ = std::clamp<Clock::duration>(timeout / 20, std::chrono::milliseconds(2),
                                        std::chrono::milliseconds(200));
  }

  ~UcxBackend() override {
    copier_.reset();  // ends queued same-host copies (they report kAborted)
    if (thread_.joinable()) {
      Enqueue([this] { stopping_ = true; });
      thread_.join();
    }
    for (auto& [id, memh] : memh_) ucp_mem_unmap(context_, memh);
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    if (context_ != nullptr) ucp_cleanup(context_);
    if (wake_fd_ >= 0) close(wake_fd_);
    if (epoll_fd_ >= 0) close(epoll_fd_);
  }

  Status Start() {
    ucp_config_t* config = nullptr;
    ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
    if (st != UCS_OK) return Status::Unavailable("UCX: reading configuration: " + Ucs(st));
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    params.name = "eplbx";
    st = ucp_init(&params, config, &context_);
    ucp_config_release(config);
    if (st != UCS_OK) return Status::Unavailable("UCX: ucp_init: " + Ucs(st));
    ucp_worker_params_t wparams{};
    wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wparams.thread_mode = UCS_THREAD_MODE_SINGLE;
    st = ucp_worker_create(context_, &wparams, &worker_);
    if (st != UCS_OK) return Status::Unavailable("UCX: ucp_worker_create: " + Ucs(st));
    ucp_address_t* address = nullptr;
    size_t length = 0;
    st = ucp_worker_get_address(worker_, &address, &length);
    if (st != UCS_OK) return Status::Unavailable("UCX: ucp_worker_get_address: " + Ucs(st));
    address_.assign(reinterpret_cast<const char*>(address), length);
    ucp_worker_release_address(worker_, address);
    ucp_am_handler_param_t am{};
    am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG;
    am.id = kAmId;
    am.cb = &UcxBackend::OnAm;
    am.arg = this;
    st = ucp_worker_set_am_recv_handler(worker_, &am);
    if (st != UCS_OK) return Status::Unavailable("UCX: setting the message handler: " + Ucs(st));
    int worker_fd = -1;
    st = ucp_worker_get_efd(worker_, &worker_fd);
    if (st != UCS_OK) return Status::Unavailable("UCX: ucp_worker_get_efd: " + Ucs(st));
    wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
    if (wake_fd_ < 0 || epoll_fd_ < 0) {
      return Status::Unavailable(StrCat("eventfd/epoll: ", std::strerror(errno)));
    }
    for (int fd : {worker_fd, wake_fd_}) {
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.fd = fd;
      if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
        return Status::Unavailable(StrCat("epoll_ctl: ", std::strerror(errno)));
      }
    }
    copier_ = std::make_unique<ShmCopier>(options_.copy_threads);
    thread_ = std::thread([this] { Loop(); });
    return Status::OK();
  }

  std::string_view name() const override { return "ucx"; }
  std::string ConnectionInfo() const override { return address_; }

  Result<std::string> RegisterMemory(uint64_t region_id, void* ptr, size_t bytes) override {
    return RunSync<std::string>([&]() -> Result<std::string> {
      ucp_mem_map_params_t mp{};
      mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
      mp.address = ptr;
      mp.length = bytes;
      ucp_mem_h memh = nullptr;
      ucs_status_t st = ucp_mem_map(context_, &mp, &memh);
      if (st != UCS_OK) {
        return Status::Unavailable(StrCat("agent '", options_.agent_name, "': UCX cannot register ",
                                          bytes, " bytes: ", Ucs(st)));
      }
      void* rkey = nullptr;
      size_t rkey_size = 0;
      st = ucp_rkey_pack(context_, memh, &rkey, &rkey_size);
      if (st != UCS_OK) {
        ucp_mem_unmap(context_, memh);
        return Status::Unavailable(
            StrCat("agent '", options_.agent_name, "': ucp_rkey_pack: ", Ucs(st)));
      }
      std::string packed(static_cast<const char*>(rkey), rkey_size);
      ucp_rkey_buffer_release(rkey);
      memh_[region_id] = memh;
      return packed;
    });
  }

  void DeregisterMemory(uint64_t region_id) override {
    (void)RunSync<bool>([&]() -> Result<bool> {
      auto it = memh_.find(region_id);
      if (it != memh_.end()) {
        ucp_mem_unmap(context_, it->second);
        memh_.erase(it);
      }
      return true;
    });
  }

  Result<Transport> Connect(PeerId id, const AgentMetadata& meta, Transport wanted,
                            bool same_host) override {
    auto p = std::make_shared<PeerState>();
    p->self = this;
    p->id = id;
    p->name = meta.name;
    p->pid = static_cast<pid_t>(meta.pid);
    p->regions = meta.regions;
    p->transport = Transport::kTcp;
    if (wanted != Transport::kTcp && same_host) {
      Status probe = ShmCopier::Probe(p->pid, meta.probe_addr, kProbeValue);
      if (probe.ok()) {
        p->transport = Transport::kShm;
        MapSharedRegions(*p);
      } else if (wanted == Transport::kShm) {
        return Status::Unavailable(StrCat("agent '", options_.agent_name,
                                          "': transport shm is forced "
                                          "but peer '",
                                          meta.name, "' memory is not reachable: ", probe.message(),
                                          "; use transport tcp"));
      }
    }
    // Create the endpoint and flush it: the flush completes once wireup with the peer is
    // done both ways, so the peer is known reachable and never sees a half-built endpoint.
    auto flushed = std::make_shared<std::promise<ucs_status_t>>();
    std::future<ucs_status_t> flush_done = flushed->get_future();
    Result<Transport> created = RunSync<Transport>([&]() -> Result<Transport> {
      ucp_ep_params_t ep{};
      ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
      ep.address = reinterpret_cast<const ucp_address_t*>(meta.conn_info.data());
      ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
      ep.err_handler.cb = &UcxBackend::OnEpError;
      ep.err_handler.arg = p.get();
      ucs_status_t st = ucp_ep_create(worker_, &ep, &p->ep);
      if (st != UCS_OK) {
        return Status::Unavailable(StrCat("agent '", options_.agent_name, "': cannot reach peer '",
                                          meta.name, "' (UCX ep_create: ", Ucs(st), ")"));
      }
      if (p->transport == Transport::kTcp) {
        for (size_t i = 0; i < meta.regions.size(); ++i) {
          ucp_rkey_h rkey = nullptr;
          st = ucp_ep_rkey_unpack(p->ep, meta.regions[i].rkey.data(), &rkey);
          if (st != UCS_OK) {
            CloseEp(p);
            return Status::Corruption(StrCat("agent '", options_.agent_name, "': peer '", meta.name,
                                             "' region ", i, ": invalid remote key (", Ucs(st),
                                             ")"));
          }
          p->rkeys.push_back(rkey);
        }
      }
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      param.cb.send = [](void* request, ucs_status_t status, void* user_data) {
        auto* flush = static_cast<ConnectFlush*>(user_data);
        --flush->self->inflight_;
        flush->promise->set_value(status);
        delete flush;
        ucp_request_free(request);
      };
      auto* flush = new ConnectFlush{this, flushed};
      param.user_data = flush;
      void* req = ucp_ep_flush_nbx(p->ep, &param);
      if (!UCS_PTR_IS_PTR(req)) {
        delete flush;
        flushed->set_value(UCS_PTR_STATUS(req));
      } else {
        ++inflight_;  // keeps the loop progressing until wireup is done
      }
      return p->transport;
    });
    if (!created.ok()) return created;
    const bool answered = flush_done.wait_for(options_.peer_timeout) == std::future_status::ready;
    const ucs_status_t st = answered ? flush_done.get() : UCS_ERR_TIMED_OUT;
    return RunSync<Transport>([&]() -> Result<Transport> {
      if (st != UCS_OK) {
        CloseEp(p);
        return Status::Unavailable(StrCat("agent '", options_.agent_name, "': peer unreachable: '",
                                          meta.name, "' did not complete the connection within ",
                                          options_.peer_timeout.count(), " ms (", Ucs(st), ")"));
      }
      p->last_heard = Clock::now();
      p->last_ping = Clock::time_point{};
      std::lock_guard<std::mutex> lock(mu_);
      peers_[id] = p;
      by_name_[p->name] = p;
      return p->transport;
    });
  }

  void Disconnect(PeerId id) override {
    (void)RunSync<bool>([&]() -> Result<bool> {
      std::shared_ptr<PeerState> p;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = peers_.find(id);
        if (it == peers_.end()) return true;
        p = it->second;
        peers_.erase(it);
        if (by_name_[p->name] == p) by_name_.erase(p->name);
      }
      p->disconnected = true;
      MarkFailed(*p, "disconnected");
      CloseEp(p);
      return true;
    });
  }

  Status Post(PostRequest req) override {
    std::shared_ptr<PeerState> p;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = peers_.find(req.peer);
      if (it == peers_.end()) {
        return Status::NotFound(StrCat("agent '", options_.agent_name, "': no peer ", req.peer));
      }
      p = it->second;
      if (p->failed) return Unreachable(*p);
    }
    if (p->transport == Transport::kShm) {
      PostShm(std::move(p), std::move(req));
    } else {
      Enqueue([this, p = std::move(p), req = std::move(req)]() mutable {
        StartRma(p, std::move(req));
      });
    }
    return Status::OK();
  }

  Status Notify(PeerId peer, std::string payload) override {
    std::shared_ptr<PeerState> p;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = peers_.find(peer);
      if (it == peers_.end()) {
        return Status::NotFound(StrCat("agent '", options_.agent_name, "': no peer ", peer));
      }
      p = it->second;
      if (p->failed) return Unreachable(*p);
    }
    Enqueue([this, p = std::move(p), payload = std::move(payload)]() mutable {
      if (!p->failed) SendAm(*p, MessageKind::kNotify, std::move(payload), nullptr);
    });
    return Status::OK();
  }

  Status Cancel(TransferId id) override {
    if (copier_->Cancel(id)) return Status::OK();
    Enqueue([this, id] {
      auto it = ops_.find(id);
      if (it == ops_.end()) return;
      it->second->cancelled = true;
      MaybeFinish(it->second.get());
    });
    return Status::OK();
  }

 private:
  // ---- threads and commands -----------------------------------------------------------

  void Enqueue(std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      commands_.push_back(std::move(fn));
    }
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = write(wake_fd_, &one, sizeof(one));
  }

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

  void Loop() {
    std::deque<std::function<void()>> commands;
    Clock::time_point next_tick = Clock::now();
    Clock::time_point stop_deadline{};
    while (true) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        commands.swap(commands_);
      }
      for (auto& fn : commands) fn();
      commands.clear();
      if (stopping_ && stop_deadline == Clock::time_point{}) {
        stop_deadline = Clock::now() + std::chrono::seconds(2);
        std::vector<std::shared_ptr<PeerState>> all;
        {
          std::lock_guard<std::mutex> lock(mu_);
          for (auto& [id, p] : peers_) all.push_back(p);
          peers_.clear();
          by_name_.clear();
        }
        for (auto& p : all) {
          p->disconnected = true;
          MarkFailed(*p, "agent shutting down");
          CloseEp(p);
        }
      }
      while (ucp_worker_progress(worker_) != 0) {
      }
      FinishCloses();
      const Clock::time_point now = Clock::now();
      if (stopping_ && (closing_.empty() || now > stop_deadline)) break;
      if (now >= next_tick) {
        Heartbeat(now);
        next_tick = now + tick_;
      }
      if (inflight_ > 0 || !closing_.empty()) continue;  // RMA needs progress: spin
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!commands_.empty()) continue;
      }
      if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) continue;
      epoll_event events[4];
      const int ms =
          static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(tick_).count());
      epoll_wait(epoll_fd_, events, 4, std::max(ms, 1));
      uint64_t drained = 0;
      [[maybe_unused]] ssize_t n = read(wake_fd_, &drained, sizeof(drained));
    }
    for (auto& [id, op] : ops_) {
      listener_->OnTransferDone(id, Status::Aborted(StrCat("agent '", options_.agent_name,
                                                           "': shut down during the transfer")));
    }
    ops_.clear();
  }

  // ---- failure ---------------------------------------------------------------------------

  Status Unreachable(const PeerState& p) const {
    if (p.disconnected) {
      return Status::Aborted(
          StrCat("agent '", options_.agent_name, "': peer '", p.name, "' ", p.failure));
    }
    return Status::Unavailable(StrCat("agent '", options_.agent_name, "': peer unreachable: '",
                                      p.name, "' (", p.failure, ")"));
  }

  void MarkFailed(PeerState& p, const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (p.failed) return;
      p.failure = why;
      p.failed = true;
    }
    if (!p.disconnected) listener_->OnPeerFailed(p.id, Unreachable(p));
  }

  void FailPeer(const std::shared_ptr<PeerState>& p, const std::string& why) {
    MarkFailed(*p, why);
    CloseEp(p);
  }

  static void OnEpError(void* arg, ucp_ep_h, ucs_status_t status) {
    auto* p = static_cast<PeerState*>(arg);
    UcxBackend* self = p->self;
    self->MarkFailed(*p, StrCat("connection lost: ", Ucs(status)));
    // UCX forbids closing the endpoint inside this callback; the loop closes it next.
    std::lock_guard<std::mutex> lock(self->mu_);
    auto it = self->peers_.find(p->id);
    if (it != self->peers_.end() && it->second.get() == p) {
      self->commands_.push_back([self, sp = it->second] { self->CloseEp(sp); });
    }
  }

  void CloseEp(const std::shared_ptr<PeerState>& p) {
    if (p->ep == nullptr) return;
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void* req = ucp_ep_close_nbx(p->ep, &param);
    p->ep = nullptr;
    if (UCS_PTR_IS_PTR(req)) {
      closing_.push_back({req, p});
    } else {
      DestroyRkeys(*p);
    }
  }

  void FinishCloses() {
    for (size_t i = 0; i < closing_.size();) {
      if (ucp_request_check_status(closing_[i].first) == UCS_INPROGRESS) {
        ++i;
        continue;
      }
      ucp_request_free(closing_[i].first);
      DestroyRkeys(*closing_[i].second);
      closing_.erase(closing_.begin() + static_cast<long>(i));
    }
  }

  static void DestroyRkeys(PeerState& p) {
    for (ucp_rkey_h k : p.rkeys) ucp_rkey_destroy(k);
    p.rkeys.clear();
  }

  void Heartbeat(Clock::time_point now) {
    std::vector<std::shared_ptr<PeerState>> all;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [id, p] : peers_) all.push_back(p);
    }
    for (auto& p : all) {
      if (p->failed) continue;
      if (now - p->last_heard > options_.peer_timeout) {
        FailPeer(p, StrCat("no answer for ", options_.peer_timeout.count(),
                           " ms: process stopped, hung or unreachable over the network"));
      } else if (now - p->last_ping >= ping_interval_) {
        p->last_ping = now;
        SendAm(*p, MessageKind::kPing, {}, nullptr);
      }
    }
  }

  // ---- messages --------------------------------------------------------------------------

  // Sends header + payload; `op`, if set, counts it as pending and finishes after it.
  void SendAm(PeerState& p, MessageKind kind, std::string payload, Op* op) {
    if (p.ep == nullptr) {
      if (op != nullptr && op->error.ok()) op->error = Unreachable(p);
      return;
    }
    auto* msg = new AmMessage{this, EncodeMessageHeader({kind, options_.agent_name}), op};
    msg->bytes += payload;
    ucp_request_param_t param{};
    param.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    param.cb.send = &UcxBackend::OnAmSent;
    param.user_data = msg;
    param.flags =
        UCP_AM_SEND_FLAG_EAGER | (kind == MessageKind::kPing ? UCP_AM_SEND_FLAG_REPLY : 0);
    SendAmOn(p.ep, msg, &param);
  }

  void SendAmOn(ucp_ep_h ep, AmMessage* msg, const ucp_request_param_t* param) {
    void* req = ucp_am_send_nbx(ep, kAmId, nullptr, 0, msg->bytes.data(), msg->bytes.size(), param);
    if (req == nullptr) {
      delete msg;
    } else if (UCS_PTR_IS_ERR(req)) {
      if (msg->op != nullptr && msg->op->error.ok()) {
        msg->op->error = Status::Unavailable(StrCat("agent '", options_.agent_name,
                                                    "': notification to '", msg->op->peer->name,
                                                    "' failed: ", Ucs(UCS_PTR_STATUS(req))));
      }
      delete msg;
    } else {
      ++inflight_;
      if (msg->op != nullptr) ++msg->op->pending;
    }
  }

  static void OnAmSent(void* request, ucs_status_t status, void* user_data) {
    auto* msg = static_cast<AmMessage*>(user_data);
    UcxBackend* self = msg->self;
    --self->inflight_;
    if (Op* op = msg->op; op != nullptr) {
      --op->pending;
      if (status != UCS_OK && op->error.ok()) {
        op->error = op->peer->failed
                        ? self->Unreachable(*op->peer)
                        : Status::Unavailable(StrCat("agent '", self->options_.agent_name,
                                                     "': notification to '", op->peer->name,
                                                     "' failed: ", Ucs(status)));
      }
      self->MaybeFinish(op);
    }
    delete msg;
    ucp_request_free(request);
  }

  static ucs_status_t OnAm(void* arg, const void*, size_t, void* data, size_t length,
                           const ucp_am_recv_param_t* param) {
    auto* self = static_cast<UcxBackend*>(arg);
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) return UCS_OK;  // never sent
    std::string_view bytes(static_cast<const char*>(data), length);
    size_t consumed = 0;
    Result<MessageHeader> h = DecodeMessageHeader(bytes, &consumed);
    if (!h.ok()) {
      ++self->dropped_messages_;
      return UCS_OK;
    }
    if (auto it = self->by_name_.find(h->sender); it != self->by_name_.end()) {
      it->second->last_heard = Clock::now();
    }
    switch (h->kind) {
      case MessageKind::kNotify:
        self->listener_->OnNotification(std::move(h->sender), std::string(bytes.substr(consumed)));
        break;
      case MessageKind::kPing:
        if ((param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 &&
            param->reply_ep != nullptr) {
          auto* msg = new AmMessage{
              self, EncodeMessageHeader({MessageKind::kPong, self->options_.agent_name}), nullptr};
          ucp_request_param_t p{};
          p.op_attr_mask =
              UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
          p.cb.send = &UcxBackend::OnAmSent;
          p.user_data = msg;
          p.flags = UCP_AM_SEND_FLAG_EAGER;
          self->SendAmOn(param->reply_ep, msg, &p);
        }
        break;
      case MessageKind::kPong:
        break;
    }
    return UCS_OK;
  }

  // ---- data: UCX RMA ---------------------------------------------------------------------

  void StartRma(const std::shared_ptr<PeerState>& p, PostRequest req) {
    auto owned = std::make_unique<Op>();
    Op* op = owned.get();
    op->self = this;
    op->id = req.id;
    op->peer = p;
    op->kind = req.op;
    op->notify = std::move(req.notify);
    ops_[req.id] = std::move(owned);
    if (p->failed || p->ep == nullptr) {
      op->error = Unreachable(*p);
    } else {
      for (const Segment& s : req.segments) {
        ucp_request_param_t param{};
        param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
        param.cb.send = &UcxBackend::OnRmaDone;
        param.user_data = op;
        if (auto m = memh_.find(s.local_region); m != memh_.end()) {
          param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
          param.memh = m->second;
        }
        void* buffer = reinterpret_cast<void*>(static_cast<uintptr_t>(s.local));
        ucp_rkey_h rkey = p->rkeys.at(s.remote_region);
        void* r = req.op == XferOp::kRead
                      ? ucp_get_nbx(p->ep, buffer, s.bytes, s.remote, rkey, &param)
                      : ucp_put_nbx(p->ep, buffer, s.bytes, s.remote, rkey, &param);
        if (!Track(op, r)) break;
      }
      if (req.op == XferOp::kWrite && op->error.ok()) {
        ucp_request_param_t param{};
        param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
        param.cb.send = &UcxBackend::OnRmaDone;
        param.user_data = op;
        Track(op, ucp_ep_flush_nbx(p->ep, &param));  // remote completion of every put
      }
    }
    op->posted_all = true;
    MaybeFinish(op);
  }

  bool Track(Op* op, void* request) {
    if (request == nullptr) return true;
    if (UCS_PTR_IS_ERR(request)) {
      RmaError(op, UCS_PTR_STATUS(request));
      return false;
    }
    ++op->pending;
    ++inflight_;
    return true;
  }

  void RmaError(Op* op, ucs_status_t status) {
    if (!op->error.ok()) return;
    op->error =
        op->peer->failed
            ? Unreachable(*op->peer)
            : Status::IoError(StrCat("agent '", options_.agent_name, "': ", OpName(op->kind),
                                     " with '", op->peer->name, "' failed in UCX: ", Ucs(status)));
  }

  static void OnRmaDone(void* request, ucs_status_t status, void* user_data) {
    auto* op = static_cast<Op*>(user_data);
    UcxBackend* self = op->self;
    --op->pending;
    --self->inflight_;
    if (status != UCS_OK) self->RmaError(op, status);
    ucp_request_free(request);
    self->MaybeFinish(op);
  }

  void MaybeFinish(Op* op) {
    if (!op->posted_all || op->pending > 0) return;
    if (op->error.ok() && op->peer->failed) op->error = Unreachable(*op->peer);
    if (op->error.ok() && op->cancelled) {
      op->error = Status::Aborted(StrCat("agent '", options_.agent_name, "': ", OpName(op->kind),
                                         " with '", op->peer->name, "' cancelled"));
    }
    if (op->error.ok() && op->notify && !op->notified) {
      op->notified = true;  // data landed: now the notification may go
      SendAm(*op->peer, MessageKind::kNotify, std::move(*op->notify), op);
      if (op->pending > 0) return;
    }
    const TransferId id = op->id;
    Status s = op->error;
    ops_.erase(id);
    listener_->OnTransferDone(id, std::move(s));
  }

  // ---- data: same host -------------------------------------------------------------------

  void MapSharedRegions(PeerState& p) {
    p.mapped.resize(p.regions.size());
    for (size_t i = 0; i < p.regions.size(); ++i) {
      const RegionInfo& r = p.regions[i];
      if ((r.flags & kRegionShared) == 0 || r.shm_fd < 0) continue;
      int fd = open(StrCat("/proc/", p.pid, "/fd/", r.shm_fd).c_str(), O_RDWR | O_CLOEXEC);
      if (fd < 0) continue;  // CMA still works
      void* m = mmap(nullptr, r.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      close(fd);
      if (m == MAP_FAILED) continue;
      TouchPagesForRead(m, r.bytes);  // first-access cost now, not inside the first transfers
      p.mapped[i] = MappedRegion{static_cast<uint8_t*>(m), r.bytes};
    }
  }

  void PostShm(std::shared_ptr<PeerState> p, PostRequest req) {
    CopyJob job;
    job.id = req.id;
    job.pid = p->pid;
    job.read = req.op == XferOp::kRead;
    job.describe = StrCat("agent '", options_.agent_name, "': ", OpName(req.op), " with '", p->name,
                          "' (pid ", p->pid, ")");
    job.pieces.reserve(req.segments.size());
    for (const Segment& s : req.segments) {
      CopyPiece piece;
      piece.local = reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(s.local));
      piece.remote = s.remote;
      piece.bytes = s.bytes;
      const MappedRegion& m =
          p->mapped.size() > s.remote_region ? p->mapped[s.remote_region] : MappedRegion{};
      if (m.ptr != nullptr) piece.mapped = m.ptr + (s.remote - p->regions[s.remote_region].addr);
      job.pieces.push_back(piece);
    }
    job.done = [this, p, id = req.id, kind = req.op,
                notify = std::move(req.notify)](Status s) mutable {
      if (s.ok() && p->failed) s = Unreachable(*p);
      if (s.code() == Code::kUnavailable && !p->failed) {
        // The process is gone (or its memory unreachable): every later call fails at once.
        MarkFailed(*p, s.message());
        Enqueue([this, p] { CloseEp(p); });
      }
      if (s.ok() && notify) {
        Enqueue([this, p, id, kind, notify = std::move(notify)]() mutable {
          auto owned = std::make_unique<Op>();
          Op* op = owned.get();
          op->self = this;
          op->id = id;
          op->peer = p;
          op->kind = kind;
          op->notify = std::move(notify);
          op->posted_all = true;
          ops_[id] = std::move(owned);
          MaybeFinish(op);
        });
        return;
      }
      listener_->OnTransferDone(id, std::move(s));
    };
    copier_->Submit(std::move(job));
  }

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

}  // namespace

Result<std::unique_ptr<Backend>> CreateUcxBackend(const BackendOptions& options,
                                                  BackendListener* listener) {
  auto backend = std::make_unique<UcxBackend>(options, listener);
  EPLBX_RETURN_IF_ERROR(backend->Start());
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace eplbx::internal
