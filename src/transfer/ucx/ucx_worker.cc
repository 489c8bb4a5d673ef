// The UCX worker: set-up, the control channel's calls (each handed to the progress thread)
// and the progress loop.
#include "transfer/ucx/ucx_path.h"

#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "transfer/ucx/ucx_worker.h"

#include <ucs/debug/log_def.h>

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <mutex>

namespace eplbx::internal::ucx {

namespace {

// UCX prints its messages to stdout unless UCX_LOG_FILE says otherwise; stdout belongs to
// the process that embeds eplbx (the CLI's --json report, an engine's own output). Unless
// the user chose a log file, UCX's messages go to stderr, one line each, prefixed.
ucs_log_func_rc_t LogToStderr(const char* file, unsigned line, const char*, ucs_log_level_t level,
                              const ucs_log_component_config_t* comp, const char* format,
                              va_list ap) {
  if (level == UCS_LOG_LEVEL_FATAL) return UCS_LOG_FUNC_RC_CONTINUE;  // UCX's own handling
  if (level != UCS_LOG_LEVEL_PRINT && comp != nullptr && level > comp->log_level)
    return UCS_LOG_FUNC_RC_CONTINUE;  // not enabled: UCX's default handler skips it too
  char message[1024];
  std::vsnprintf(message, sizeof message, format, ap);
  const char* base = std::strrchr(file, '/');
  std::fprintf(stderr, "eplbx: UCX %s %s:%u %s\n",
               level < UCS_LOG_LEVEL_LAST ? ucs_log_level_names[level] : "LOG",
               base != nullptr ? base + 1 : file, line, message);
  return UCS_LOG_FUNC_RC_STOP;
}

void RouteUcxLogToStderr() {
  static std::once_flag once;
  std::call_once(once, [] {
    const char* chosen = std::getenv("UCX_LOG_FILE");
    if (chosen == nullptr || *chosen == '\0') ucs_log_push_handler(&LogToStderr);
  });
}

}  // namespace

UcxWorker::UcxWorker(const PartOptions& options, CoreListener* listener)
    : options_(options), listener_(listener) {
  const auto timeout = options.peer_timeout;
  ping_interval_ = std::clamp<Clock::duration>(timeout / 5, std::chrono::milliseconds(5),
                                               std::chrono::seconds(2));
  tick_ = std::clamp<Clock::duration>(timeout / 20, std::chrono::milliseconds(2),
                                      std::chrono::milliseconds(200));
}

UcxWorker::~UcxWorker() {
  if (thread_.joinable()) {
    Enqueue([this] { stopping_ = true; });
    thread_.join();
  }
  for (auto& [id, memh] : memh_) ucp_mem_unmap(context_, memh);
  if (worker_ != nullptr) {
    // Endpoints UCX made for peers that connected here may still hold a wireup reply;
    // ucp_worker_destroy purges it, and Debian's UCX asserts on a purged reply
    // (docs/reliability.md, "Known issues"). A flush sends what is pending first, bounded.
    ucp_request_param_t param{};
    void* req = ucp_worker_flush_nbx(worker_, &param);
    if (UCS_PTR_IS_PTR(req)) {
      const Clock::time_point until = Clock::now() + std::chrono::milliseconds(100);
      while (ucp_request_check_status(req) == UCS_INPROGRESS && Clock::now() < until)
        ucp_worker_progress(worker_);
      ucp_request_free(req);  // (released by UCX when it ends, if it has not)
    }
    ucp_worker_destroy(worker_);
  }
  if (context_ != nullptr) ucp_cleanup(context_);
  if (wake_fd_ >= 0) close(wake_fd_);
  if (epoll_fd_ >= 0) close(epoll_fd_);
  for (int fd : local_in_) close(fd);
  if (local_listen_fd_ >= 0) close(local_listen_fd_);
  if (local_epoll_fd_ >= 0) close(local_epoll_fd_);
}

Status UcxWorker::Start() {
  RouteUcxLogToStderr();
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
  ucp_context_attr_t cattr{};
  cattr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (ucp_context_query(context_, &cattr) == UCS_OK) {
    cuda_memory_ = (cattr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  }
  ucp_worker_params_t wparams{};
  wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  // Serialized: the progress thread uses it, and a thread sending a notification while the
  // progress thread sleeps uses it in its place (worker_mu_, SendNow).
  wparams.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  st = ucp_worker_create(context_, &wparams, &worker_);
  if (st != UCS_OK) return Status::Unavailable("UCX: ucp_worker_create: " + Ucs(st));
  ucp_address_t* address = nullptr;
  size_t length = 0;
  st = ucp_worker_get_address(worker_, &address, &length);
  if (st != UCS_OK) return Status::Unavailable("UCX: ucp_worker_get_address: " + Ucs(st));
  address_.assign(reinterpret_cast<const char*>(address), length);
  ucp_worker_release_address(worker_, address);
  StartLocal();
  conn_info_ = EncodeUcxConnInfo(address_, local_name_);
  ucp_am_handler_param_t am{};
  am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                  UCP_AM_HANDLER_PARAM_FIELD_ARG;
  am.id = kAmId;
  am.cb = &UcxWorker::OnAm;
  am.arg = this;
  st = ucp_worker_set_am_recv_handler(worker_, &am);
  if (st != UCS_OK) return Status::Unavailable("UCX: setting the message handler: " + Ucs(st));
  st = ucp_worker_get_efd(worker_, &worker_fd_);
  if (st != UCS_OK) return Status::Unavailable("UCX: ucp_worker_get_efd: " + Ucs(st));
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (wake_fd_ < 0 || epoll_fd_ < 0) {
    return Status::Unavailable(StrCat("eventfd/epoll: ", std::strerror(errno)));
  }
  for (int fd : {worker_fd_, wake_fd_, local_epoll_fd_}) {
    if (fd < 0) continue;  // no inbox
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
      return Status::Unavailable(StrCat("epoll_ctl: ", std::strerror(errno)));
    }
  }
  thread_ = std::thread([this] { Loop(); });
  return Status::OK();
}

Result<std::string> UcxWorker::MapMemory(uint64_t region_id, void* ptr, size_t bytes, bool device) {
  return RunSync<std::string>([&]() -> Result<std::string> {
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = ptr;
    mp.length = bytes;
    if (device) {
      mp.field_mask |= UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
      mp.memory_type = UCS_MEMORY_TYPE_CUDA;
    }
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

void UcxWorker::UnmapMemory(uint64_t region_id) {
  (void)RunSync<bool>([&]() -> Result<bool> {
    auto it = memh_.find(region_id);
    if (it != memh_.end()) {
      ucp_mem_unmap(context_, it->second);
      memh_.erase(it);
    }
    return true;
  });
}

Status UcxWorker::Connect(PeerId id, std::string_view peer_name, std::string_view conn_info) {
  auto p = std::make_shared<PeerState>();
  p->self = this;
  p->id = id;
  p->name = std::string(peer_name);
  // Create the endpoint and flush it: the flush completes once wireup with the peer is
  // done both ways, so the peer is known reachable and never sees a half-built endpoint.
  auto flushed = std::make_shared<std::promise<ucs_status_t>>();
  std::future<ucs_status_t> flush_done = flushed->get_future();
  Result<UcxConnInfo> info = DecodeUcxConnInfo(conn_info, options_.agent_name, peer_name);
  if (!info.ok()) return info.status();
  const std::string address(info->address);
  const std::string local(info->inbox);
  Result<bool> created = RunSync<bool>([&]() -> Result<bool> {
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(address.data());
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = &UcxWorker::OnEpError;
    ep.err_handler.arg = p.get();
    ucs_status_t st = ucp_ep_create(worker_, &ep, &p->ep);
    if (st != UCS_OK) {
      return Status::Unavailable(StrCat("agent '", options_.agent_name, "': cannot reach peer '",
                                        p->name, "' (UCX ep_create: ", Ucs(st), ")"));
    }
    ConnectLocal(*p, local);
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
    return true;
  });
  if (!created.ok()) return created.status();
  const bool answered = flush_done.wait_for(options_.peer_timeout) == std::future_status::ready;
  const ucs_status_t st = answered ? flush_done.get() : UCS_ERR_TIMED_OUT;
  Result<bool> done = RunSync<bool>([&]() -> Result<bool> {
    if (st != UCS_OK) {
      CloseEp(p);
      return Status::Unavailable(StrCat("agent '", options_.agent_name, "': peer unreachable: '",
                                        p->name, "' did not complete the connection within ",
                                        options_.peer_timeout.count(), " ms (", Ucs(st), ")"));
    }
    p->last_heard = Clock::now();
    p->last_ping = Clock::time_point{};
    std::lock_guard<std::mutex> lock(mu_);
    peers_[id] = p;
    by_name_[p->name] = p;
    return true;
  });
  return done.status();
}

void UcxWorker::Disconnect(PeerId id) {
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

Result<std::shared_ptr<PeerState>> UcxWorker::LivePeer(PeerId id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = peers_.find(id);
  if (it == peers_.end()) {
    return Status::NotFound(StrCat("agent '", options_.agent_name, "': no peer ", id));
  }
  if (it->second->failed) return Unreachable(*it->second);
  return it->second;
}

Status UcxWorker::Notify(PeerId peer, std::string payload, std::function<void(Status)> sent) {
  Result<std::shared_ptr<PeerState>> p = LivePeer(peer);
  if (!p.ok()) return p.status();
  SendNow(
      [this, p = std::move(*p), payload = std::move(payload), sent = std::move(sent)]() mutable {
        if (p->failed) {
          if (sent) sent(Unreachable(*p));
          return;
        }
        SendAm(*p, MessageKind::kNotify, std::move(payload), std::move(sent));
      });
  return Status::OK();
}

std::vector<Status> UcxWorker::NotifyMany(PeerId peer, std::vector<std::string> payloads) {
  Result<std::shared_ptr<PeerState>> p = LivePeer(peer);
  if (!p.ok()) return std::vector<Status>(payloads.size(), p.status());
  std::vector<Status> out(payloads.size());
  SendNow([this, p = std::move(*p), payloads = std::move(payloads)]() mutable {
    if (p->failed) return;
    // Consecutive payloads share a message while it stays within 64 KiB (one payload: a
    // plain notification, as Notify sends it).
    constexpr size_t kBatchBytes = Agent::kMaxNotificationBytes;
    size_t first = 0;
    while (first < payloads.size()) {
      size_t last = first + 1, bytes = 4 + 4 + payloads[first].size();
      while (last < payloads.size() && last - first < kMaxBatchNotifications &&
             bytes + 4 + payloads[last].size() <= kBatchBytes) {
        bytes += 4 + payloads[last].size();
        ++last;
      }
      if (last - first == 1) {
        SendAm(*p, MessageKind::kNotify, std::move(payloads[first]), nullptr);
      } else {
        std::vector<std::string> group(std::make_move_iterator(payloads.begin() + first),
                                       std::make_move_iterator(payloads.begin() + last));
        SendAm(*p, MessageKind::kNotifyBatch, EncodeNotifyBatch(group), nullptr);
      }
      first = last;
    }
  });
  return out;
}

void UcxWorker::SendNow(std::function<void()> fn) {
  // On the calling thread when the progress thread sleeps (it holds worker_mu_ otherwise) and
  // nothing queued must leave first: the message goes out now instead of after a wake-up of
  // the progress thread, which on a busy host waits for a core (docs/transfer.md). On the
  // progress thread itself (a completion's notification) it queues, as before.
  if (std::this_thread::get_id() == thread_.get_id()) {
    Enqueue(std::move(fn));
    return;
  }
  std::unique_lock<std::mutex> worker(worker_mu_, std::try_to_lock);
  if (worker.owns_lock()) {
    bool queued = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      queued = !commands_.empty();
    }
    if (!queued && !stopping_) {
      fn();
      // A send UCX could not finish at once needs the progress thread.
      const bool pending = inflight_ > 0;
      worker.unlock();
      if (pending) {
        uint64_t one = 1;
        [[maybe_unused]] ssize_t n = write(wake_fd_, &one, sizeof(one));
      }
      return;
    }
  }
  Enqueue(std::move(fn));
}

bool UcxWorker::WaitHere(std::chrono::milliseconds timeout, int wake_fd) {
  if (std::this_thread::get_id() == thread_.get_id()) return false;
  std::unique_lock<std::mutex> worker(worker_mu_, std::try_to_lock);
  // The progress thread runs (it holds worker_mu_ but while it sleeps), or it is needed:
  // RMA in flight and closing endpoints need it to spin; the cuda_staged path's sink is
  // called on it.
  if (!worker.owns_lock() || stopping_ || inflight_ > 0 || !closing_.empty() || stage_sink_) {
    return false;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!commands_.empty()) return false;
  }
  // The progress thread sleeps in epoll_wait (or is about to: it sleeps only after arming
  // the worker, which this thread does too). Muted, the worker's fd no longer wakes it; its
  // tick and its commands still do, and it progresses the worker then as always: whoever
  // holds worker_mu_ progresses, so muting only decides who wakes.
  const auto mute = [&](uint32_t events) {
    for (int fd : {worker_fd_, local_epoll_fd_}) {
      if (fd < 0) continue;
      epoll_event ev{};
      ev.events = events;
      ev.data.fd = fd;
      (void)epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, fd, &ev);
    }
  };
  if (muted_++ == 0) mute(0);
  const Clock::time_point deadline = Clock::now() + timeout;
  // The worker is armed: the progress thread armed it before it went to sleep, and so did
  // every waiter before it let go of worker_mu_ (a send does not disarm it). So UCX is
  // progressed only once its fd says an event came: while notifications come through the
  // inbox, a wait costs no UCX calls.
  bool ucx_events = false;
  while (true) {
    DrainLocal();  // the inbox first, as the progress thread does
    if (ucx_events) {
      while (ucp_worker_progress(worker_) != 0) {
      }
      FinishCloses();
      if (stopping_ || inflight_ > 0 || !closing_.empty()) break;
      if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) continue;
      ucx_events = false;
    }
    const Clock::duration left = deadline - Clock::now();
    if (left <= Clock::duration::zero()) break;
    pollfd fds[3] = {{wake_fd, POLLIN, 0}, {worker_fd_, POLLIN, 0}, {local_epoll_fd_, POLLIN, 0}};
    const auto ms = std::chrono::ceil<std::chrono::milliseconds>(left).count();
    worker.unlock();
    const int n =
        poll(fds, local_epoll_fd_ >= 0 ? 3 : 2, static_cast<int>(std::min<int64_t>(ms, 1000)));
    worker.lock();
    // The listener was handed something (or this thread's caller woken otherwise), the
    // time is up, or poll failed: the caller looks. UCX events not progressed here keep the
    // worker's fd readable: the progress thread takes them once it watches the fd again.
    if (n <= 0 || (fds[0].revents & POLLIN) != 0) break;
    ucx_events = fds[1].revents != 0;
  }
  if (--muted_ == 0) mute(EPOLLIN);
  const bool kick = stopping_ || inflight_ > 0 || !closing_.empty();
  worker.unlock();
  if (kick) {
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = write(wake_fd_, &one, sizeof(one));
  }
  return true;
}

void UcxWorker::Enqueue(std::function<void()> fn) {
  bool was_empty = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    was_empty = commands_.empty();
    commands_.push_back(std::move(fn));
  }
  // The progress thread takes every queued command when it wakes, and looks at the queue
  // again before it sleeps: one wake-up for a queue that was empty is enough.
  if (!was_empty) return;
  uint64_t one = 1;
  [[maybe_unused]] ssize_t n = write(wake_fd_, &one, sizeof(one));
}

void UcxWorker::Loop() {
  std::deque<std::function<void()>> commands;
  Clock::time_point next_tick = Clock::now();
  Clock::time_point stop_deadline{};
  std::unique_lock<std::mutex> worker(worker_mu_);
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
    // The inbox first: what a peer sent before UCX reports it lost arrives before the loss.
    DrainLocal();
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
    worker.unlock();
    epoll_wait(epoll_fd_, events, 4, std::max(ms, 1));
    uint64_t drained = 0;
    [[maybe_unused]] ssize_t n = read(wake_fd_, &drained, sizeof(drained));
    worker.lock();
  }
  for (auto& [id, op] : ops_) {
    rma_listener_->OnDataDone(id, Status::Aborted(StrCat("agent '", options_.agent_name,
                                                         "': shut down during the transfer")));
  }
  ops_.clear();
}

}  // namespace eplbx::internal::ucx

namespace eplbx::internal {

Result<std::unique_ptr<ucx::UcxWorker>> CreateUcxWorker(const PartOptions& options,
                                                        CoreListener* listener) {
  auto worker = std::make_unique<ucx::UcxWorker>(options, listener);
  EPLBX_RETURN_IF_ERROR(worker->Start());
  return worker;
}

}  // namespace eplbx::internal
