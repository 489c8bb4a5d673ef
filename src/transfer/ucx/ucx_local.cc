// Notifications between processes of one host (docs/transfer.md, "Notifications on one
// host"). Over UCX a notification is an active message on a TCP connection: on loopback the
// sender's send call runs the kernel's whole TCP path, the receiver's included, 15-20 us of
// CPU a message on this project's 2-core host, which the ranks of a rearrangement pay while
// their copies want the same cores. Here each agent has an inbox, a SOCK_SEQPACKET socket in
// the abstract namespace of its network namespace (the same-host test already includes the
// network namespace), named at random; a peer that reaches it sends its notifications
// there, one message per send call that keeps its bounds, in order. Liveness stays on UCX
// (heartbeats, endpoint errors); a send the inbox refuses because its process is gone fails
// the peer as UCX would. Everything here runs under worker_mu_, on the progress thread or on
// a caller's (SendNow, WaitHere).
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>

#include "common/bytes.h"
#include "transfer/ucx/ucx_path.h"
#include "transfer/ucx/ucx_worker.h"

namespace eplbx::internal {
namespace {

constexpr size_t kMaxLocalName = 64;  // bytes after the leading NUL
// Room for a message's header (its sender's name is at most 256 bytes) and a batch's framing.
constexpr size_t kMaxHeaderBytes = 4096;

// What an event of local_epoll_fd_ is about: [kind << 32 | fd].
enum : uint64_t { kListening = 0, kIncoming = 1, kOutgoing = 2 };
uint64_t Tag(uint64_t kind, int fd) { return kind << 32 | static_cast<uint32_t>(fd); }

sockaddr_un Abstract(std::string_view name, socklen_t* length) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  addr.sun_path[0] = '\0';
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  *length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return addr;
}

}  // namespace

std::string EncodeUcxConnInfo(std::string_view address, std::string_view inbox) {
  ByteWriter w;
  w.U32(static_cast<uint32_t>(address.size()));
  w.Raw(address);
  w.Raw(inbox);
  return w.Take();
}

Result<UcxConnInfo> DecodeUcxConnInfo(std::string_view info, std::string_view agent,
                                      std::string_view peer) {
  ByteReader r(info, "connection info");
  uint32_t bytes = 0;
  if (!r.U32("address bytes", &bytes) || bytes == 0 || bytes > r.remaining()) {
    return Status::InvalidArgument(
        StrCat("agent '", agent, "': the connection info of peer '", peer, "' (", info.size(),
               " bytes) does not hold a UCX address: a peer of another eplbx version?"));
  }
  UcxConnInfo out{info.substr(4, bytes), info.substr(4 + bytes)};
  if (out.inbox.size() > kMaxLocalName) {
    return Status::InvalidArgument(StrCat("agent '", agent, "': the connection info of peer '",
                                          peer, "' names an inbox of ", out.inbox.size(),
                                          " bytes (at most ", kMaxLocalName, ")"));
  }
  return out;
}

namespace ucx {

void UcxWorker::StartLocal() {
  if (!options_.local_notify) return;
  std::random_device rd;
  std::string name = "eplbx-";
  for (int i = 0; i < 4; ++i) {
    char word[9];
    std::snprintf(word, sizeof(word), "%08x", static_cast<unsigned>(rd()));
    name += word;
  }
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  const int ep = epoll_create1(EPOLL_CLOEXEC);
  socklen_t length = 0;
  sockaddr_un addr = Abstract(name, &length);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = Tag(kListening, fd);
  if (fd < 0 || ep < 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), length) != 0 ||
      listen(fd, 256) != 0 || epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev) != 0) {
    if (fd >= 0) close(fd);
    if (ep >= 0) close(ep);
    return;  // every peer over UCX
  }
  local_listen_fd_ = fd;
  local_epoll_fd_ = ep;
  local_name_ = std::move(name);
}

void UcxWorker::ConnectLocal(PeerState& p, std::string_view name) {
  // The cuda_staged path's messages go over UCX and rely on their order with the
  // notifications that follow them: with that path, everything stays on UCX.
  if (name.empty() || name.size() > kMaxLocalName || local_listen_fd_ < 0 || stage_sink_) return;
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return;
  socklen_t length = 0;
  sockaddr_un addr = Abstract(name, &length);
  // A peer of another host has no inbox of that name here (the name is random); one whose
  // backlog is full (EAGAIN) is reached over UCX instead.
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), length) != 0) {
    close(fd);
    return;
  }
  // A message must fit the send buffer whole (else EMSGSIZE): ask for room for several of
  // the largest, and keep UCX where the host's limit (net.core.wmem_max) allows less.
  int want = 1 << 20, got = 0;
  socklen_t got_length = sizeof(got);
  (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &want, sizeof(want));
  if (getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &got, &got_length) != 0 ||
      static_cast<size_t>(got) < 2 * (Agent::kMaxNotificationBytes + kMaxHeaderBytes)) {
    close(fd);
    return;
  }
  p.local_fd = fd;
}

bool UcxWorker::SendLocal(PeerState& p, AmMessage* msg) {
  if (p.local_fd < 0) return false;
  p.local_queued.push_back(msg);
  FlushLocal(p);
  return true;
}

void UcxWorker::FlushLocal(PeerState& p) {
  while (!p.local_queued.empty() && p.local_fd >= 0) {
    AmMessage* msg = p.local_queued.front();
    const ssize_t n =
        send(p.local_fd, msg->bytes.data(), msg->bytes.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      // The inbox is full: whoever drains next (DrainLocal) sends the rest, first, once the
      // socket takes more.
      if (local_blocked_.count(p.local_fd) != 0) return;
      std::shared_ptr<PeerState> sp;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (auto it = peers_.find(p.id); it != peers_.end() && it->second.get() == &p)
          sp = it->second;
      }
      epoll_event ev{};
      ev.events = EPOLLOUT;
      ev.data.u64 = Tag(kOutgoing, p.local_fd);
      if (sp && epoll_ctl(local_epoll_fd_, EPOLL_CTL_ADD, p.local_fd, &ev) == 0)
        local_blocked_[p.local_fd] = std::move(sp);
      return;
    }
    if (n < 0) {
      // The inbox is closed: its agent or its process is gone.
      CloseLocal(
          p, StrCat("connection lost: its inbox refused a message (", std::strerror(errno), ")"));
      return;
    }
    p.local_queued.pop_front();
    if (msg->sent) msg->sent(Status::OK());
    delete msg;
  }
}

void UcxWorker::CloseLocal(PeerState& p, const std::string& failure) {
  if (p.local_fd < 0) return;
  if (local_blocked_.erase(p.local_fd) != 0)
    (void)epoll_ctl(local_epoll_fd_, EPOLL_CTL_DEL, p.local_fd, nullptr);
  close(p.local_fd);
  p.local_fd = -1;
  if (!failure.empty()) MarkFailed(p, failure);
  // Never sent: the peer failed or was disconnected (its reason).
  for (AmMessage* msg : p.local_queued) {
    if (msg->sent) msg->sent(Unreachable(p));
    delete msg;
  }
  p.local_queued.clear();
}

void UcxWorker::DrainLocal() {
  // Not again from inside itself (a send that fails marks its peer failed, which drains).
  if (local_epoll_fd_ < 0 || draining_) return;
  draining_ = true;
  DrainLocalOnce();
  draining_ = false;
}

void UcxWorker::DrainLocalOnce() {
  epoll_event events[16];
  while (true) {
    const int n = epoll_wait(local_epoll_fd_, events, 16, 0);
    if (n <= 0) return;
    for (int i = 0; i < n; ++i) {
      const int fd = static_cast<int>(events[i].data.u64 & 0xffffffffu);
      switch (events[i].data.u64 >> 32) {
        case kIncoming:
          ReceiveLocal(fd);
          break;
        case kOutgoing:  // a peer's inbox takes more of what waits for it
          if (auto it = local_blocked_.find(fd); it != local_blocked_.end()) {
            std::shared_ptr<PeerState> p = it->second;
            FlushLocal(*p);
            if (p->local_fd == fd && p->local_queued.empty()) {
              local_blocked_.erase(fd);
              (void)epoll_ctl(local_epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
            }
          }
          break;
        default:
          Accept();
      }
    }
    if (n < 16) return;
  }
}

void UcxWorker::Accept() {
  while (true) {
    const int in = accept4(local_listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (in < 0) return;
    // Only processes of this user (or root) write to the inbox.
    ucred cred{};
    socklen_t len = sizeof(cred);
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = Tag(kIncoming, in);
    if (getsockopt(in, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 ||
        (cred.uid != geteuid() && cred.uid != 0) ||
        epoll_ctl(local_epoll_fd_, EPOLL_CTL_ADD, in, &ev) != 0) {
      ++dropped_messages_;
      close(in);
      continue;
    }
    local_in_.push_back(in);
  }
}

void UcxWorker::ReceiveLocal(int fd) {
  // A header and a batch of notifications of at most kMaxNotificationBytes; anything longer
  // is not ours (MSG_TRUNC gives its length) and is dropped whole.
  const size_t capacity = Agent::kMaxNotificationBytes + kMaxHeaderBytes;
  if (local_buffer_.size() < capacity) local_buffer_.resize(capacity);
  while (true) {
    const ssize_t n = recv(fd, local_buffer_.data(), capacity, MSG_DONTWAIT | MSG_TRUNC);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n <= 0) {  // the sender closed its end (or an error): forget the connection
      (void)epoll_ctl(local_epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
      close(fd);
      std::erase(local_in_, fd);
      return;
    }
    if (static_cast<size_t>(n) > capacity) {
      ++dropped_messages_;
      continue;
    }
    Deliver(std::string_view(local_buffer_.data(), static_cast<size_t>(n)), nullptr);
  }
}

}  // namespace ucx
}  // namespace eplbx::internal
