// The TCP rendezvous store: members join with (rank, world size, token); once all joined it
// serves all-gathers and collects reports like the embedded rendezvous of `eplbx demo`.
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "bootstrap/frames.h"
#include "common/bytes.h"
#include "common/numbers.h"
#include "common/strings.h"
#include "eplbx/bootstrap.h"

namespace eplbx {
namespace {

// Probes an idle member every `within` / 4 (at least 1 s) and gives up after three
// unanswered probes, or after `within` with data unacknowledged: a dead host or link closes
// the socket in about `within` (best effort: errors leave the socket as it was).
void KeepAlive(int fd, std::chrono::milliseconds within) {
  const int on = 1;
  const int probe_s = std::max<int>(1, static_cast<int>(within.count() / 4000));
  const int probes = 3;
  const unsigned user_ms = static_cast<unsigned>(within.count());
  (void)setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof(on));
  (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &probe_s, sizeof(probe_s));
  (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &probe_s, sizeof(probe_s));
  (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof(probes));
  (void)setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_ms, sizeof(user_ms));
}

using internal::StrCat;

// Compares in time that depends only on the lengths, never on where the bytes differ.
bool ConstantTimeEqual(std::string_view a, std::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

Result<sockaddr_in> Resolve(const std::string& addr, uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (int rc = getaddrinfo(addr.c_str(), nullptr, &hints, &res); rc != 0 || res == nullptr) {
    return Status::InvalidArgument(StrCat("cannot resolve '", addr, "': ", gai_strerror(rc)));
  }
  sockaddr_in sa = *reinterpret_cast<sockaddr_in*>(res->ai_addr);
  freeaddrinfo(res);
  sa.sin_port = htons(port);
  return sa;
}

}  // namespace

Result<std::unique_ptr<TcpStore>> TcpStore::Listen(const std::string& addr, uint16_t port,
                                                   std::string token, uint32_t world, Env* env) {
  if (token.empty()) {
    return Status::InvalidArgument(
        "the rendezvous token is empty; set EPLBX_TOKEN to the same secret on every rank");
  }
  if (world == 0) return Status::InvalidArgument("world size 0");
  Result<sockaddr_in> sa = Resolve(addr, port);
  if (!sa.ok()) return sa.status();
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(fd, reinterpret_cast<sockaddr*>(&*sa), sizeof(*sa)) != 0 || listen(fd, 128) != 0) {
    Status s = Status::Unavailable(
        StrCat("rendezvous store cannot listen on ", addr, ":", port, ": ", std::strerror(errno)));
    close(fd);
    return s;
  }
  sockaddr_in bound{};
  socklen_t len = sizeof(bound);
  const bool named = getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) == 0;
  auto store = std::unique_ptr<TcpStore>(new TcpStore());
  store->listen_fd_ = fd;
  store->port_ = named ? ntohs(bound.sin_port) : port;
  store->token_ = std::move(token);
  store->world_ = world;
  store->env_ = EnvOrDefault(env);
  store->started_ = store->env_->Now();
  return store;
}

namespace {
constexpr size_t kMaxTokenBytes = 4096;
constexpr size_t kMaxPending = 64;                           // connections without a hello yet
constexpr auto kHelloDeadline = std::chrono::seconds(2);     // from accept to a whole hello
constexpr auto kFrameWait = std::chrono::milliseconds(500);  // for the rest of a started frame

// A connection that has not said hello yet (`partial`: part of one came).
struct Pending {
  int fd;
  Env::Clock::time_point since;
  bool partial = false;
};

// 1: a whole hello frame is buffered on `fd` (looked at, not read); 0: not yet; -1: closed,
// failed, or a frame that is no hello or too long for one.
int HelloBuffered(int fd) {
  unsigned char head[5];
  const ssize_t n = recv(fd, head, sizeof(head), MSG_PEEK | MSG_DONTWAIT);
  if (n == 0) return -1;
  if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? 0 : -1;
  if (n < static_cast<ssize_t>(sizeof(head))) return 0;
  const uint32_t len = static_cast<uint32_t>(head[1]) | static_cast<uint32_t>(head[2]) << 8 |
                       static_cast<uint32_t>(head[3]) << 16 | static_cast<uint32_t>(head[4]) << 24;
  if (head[0] != internal::kHello || len > 4 + 4 + 2 + kMaxTokenBytes) return -1;
  std::string frame(sizeof(head) + len, '\0');
  const ssize_t m = recv(fd, frame.data(), frame.size(), MSG_PEEK | MSG_DONTWAIT);
  if (m < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? 0 : -1;
  return m == static_cast<ssize_t>(frame.size()) ? 1 : 0;
}

// Waits up to `wait_ms` for connections and hellos. A hello is read only once all of it has
// come (so reading never waits), and at most kMaxPending connections wait for theirs: silent
// or half-said connections cannot hold up a member, at the start or while serving (issue
// 17, item 5). A hello goes to `on_hello` with its socket (which it then owns); a connection
// that says something else, or no whole hello within kHelloDeadline, is closed; one new
// connection is accepted per call.
void TakeHellos(int listen_fd, std::vector<Pending>& pending, int wait_ms, Env* env,
                const std::function<void(int, const std::string&)>& on_hello) {
  std::vector<pollfd> p{{listen_fd, POLLIN, 0}};
  bool partial = false;
  for (const Pending& c : pending) {
    // A half-said hello's bytes stay buffered: polling it for input would return at once.
    p.push_back({c.fd, static_cast<short>(c.partial ? 0 : POLLIN), 0});
    partial = partial || c.partial;
  }
  if (poll(p.data(), p.size(), partial ? std::min(wait_ms, 10) : wait_ms) < 0) return;
  std::vector<Pending> still;
  for (size_t k = 1; k < p.size(); ++k) {
    Pending c = pending[k - 1];
    const bool in_time = env->Now() - c.since < kHelloDeadline;
    if (!c.partial && (p[k].revents & (POLLIN | POLLHUP | POLLERR)) == 0) {
      if (in_time) {
        still.push_back(c);
      } else {
        close(c.fd);  // said nothing in time: not a member
      }
      continue;
    }
    const int whole = HelloBuffered(c.fd);
    if (whole == 0 && in_time) {
      c.partial = true;
      still.push_back(c);
      continue;
    }
    uint8_t type = 0;
    std::string body;
    bool timed_out = false;
    if (whole < 1 ||
        !internal::ReadFrame(c.fd, env->Now() + kFrameWait, &type, &body, &timed_out, env) ||
        type != internal::kHello) {
      close(c.fd);  // not a member (or too slow to say hello)
      continue;
    }
    on_hello(c.fd, body);
  }
  pending.swap(still);
  if ((p[0].revents & POLLIN) != 0) {
    int fd = accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) {
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      if (pending.size() >= kMaxPending) {  // the oldest silent one makes room
        close(pending.front().fd);
        pending.erase(pending.begin());
      }
      pending.push_back({fd, env->Now()});
    }
  }
}

}  // namespace

std::string TcpStore::CheckHello(const std::string& body, uint32_t* rank) const {
  internal::ByteReader r(body, "hello");
  uint32_t world = 0;
  std::string token;
  if (!r.U32("rank", rank) || !r.U32("world", &world) ||
      !r.Str16("token", kMaxTokenBytes, &token)) {
    return r.status().message();
  }
  if (!ConstantTimeEqual(token, token_)) {
    return StrCat("a peer claiming rank ", *rank,
                  " presented a wrong rendezvous token (the rank is its unauthenticated claim; "
                  "EPLBX_TOKEN differs across ranks?)");
  }
  if (world != world_) {
    return StrCat("world size mismatch: rank ", *rank, " says ", world, ", the store expects ",
                  world_, " (EPLBX_WORLD_SIZE differs across ranks)");
  }
  if (*rank >= world_) return StrCat("rank ", *rank, " is out of range for world size ", world_);
  return "";
}

bool TcpStore::Admit(int fd, const std::string& body) {
  uint32_t rank = 0;
  std::string refusal = CheckHello(body, &rank);
  if (refusal.empty() && members_[rank] >= 0) {
    refusal = StrCat("rank ", rank, " joined twice (two processes with the same EPLBX_RANK)");
  }
  if (!refusal.empty()) {
    Refuse(fd, refusal);
    return false;
  }
  if (!internal::WriteFrame(fd, internal::kWelcome, {}, env_->Now() + kFrameWait, env_)) {
    close(fd);  // left right after its hello
    return false;
  }
  members_[rank] = fd;
  return true;
}

void TcpStore::Refuse(int fd, const std::string& refusal) {
  internal::WriteFrame(fd, internal::kFailed, refusal, env_->Now() + kFrameWait,
                       env_);  // may fail: the peer may be gone
  sockaddr_storage sa{};
  socklen_t len = sizeof(sa);
  char host[INET6_ADDRSTRLEN] = "unknown";
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&sa), &len) == 0) {
    if (sa.ss_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&sa)->sin_addr, host, sizeof(host));
    } else if (sa.ss_family == AF_INET6) {
      inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&sa)->sin6_addr, host, sizeof(host));
    }
  }
  close(fd);
  const double now = std::chrono::duration<double>(env_->Now() - started_).count();
  for (RefusedPeer& p : refused_) {
    if (p.address != host) continue;
    ++p.count;
    p.last_s = now;
    p.last_reason = refusal;
    return;
  }
  if (refused_.size() >= kMaxRefusedPeers) {
    ++refused_elsewhere_;
    return;
  }
  refused_.push_back(RefusedPeer{host, 1, now, now, refusal});
}

std::vector<std::string> TcpStore::refusals() const {
  std::vector<std::string> out;
  char span[96];
  for (const RefusedPeer& p : refused_) {
    std::snprintf(span, sizeof(span), "%.1f s to %.1f s", p.first_s, p.last_s);
    out.push_back(p.count == 1
                      ? StrCat("from ", p.address, ": ", p.last_reason)
                      : StrCat("from ", p.address, ": ", p.count, " hellos refused (", span,
                               " after the store started); the last: ", p.last_reason));
  }
  if (refused_elsewhere_ > 0) {
    out.push_back(StrCat(refused_elsewhere_, " more hellos refused from further addresses (past ",
                         kMaxRefusedPeers, " addresses only counted)"));
  }
  return out;
}

TcpStore::~TcpStore() {
  if (listen_fd_ >= 0) close(listen_fd_);
  for (int fd : members_) {
    if (fd >= 0) close(fd);
  }
}

Status TcpStore::Serve(std::chrono::milliseconds join_timeout,
                       std::chrono::milliseconds idle_timeout,
                       const std::function<void(uint32_t, std::string)>& on_message,
                       const std::function<bool()>& stop, std::chrono::milliseconds round_timeout,
                       const std::function<void(uint32_t)>& on_lost) {
  members_.assign(world_, -1);
  uint32_t joined = 0, expected = world_;
  auto late = [&](uint32_t r) { return membership_ && r < late_.size() && late_[r]; };
  for (uint32_t r = 0; r < world_; ++r) expected -= late(r) ? 1 : 0;
  // Processes that joined for a rank that is no member: welcomed, waiting for admit_.
  std::vector<std::pair<uint32_t, int>> waiting;
  auto hold = [&](int fd, const std::string& hello) {
    uint32_t rank = 0;
    if (std::string refusal = CheckHello(hello, &rank); !refusal.empty()) {
      Refuse(fd, refusal);
      return;
    }
    // "join": this process is no member yet; it joins the group where it is.
    if (!internal::WriteFrame(fd, internal::kWelcome, "join", env_->Now() + kFrameWait, env_)) {
      close(fd);
      return;
    }
    if (round_timeout.count() > 0) KeepAlive(fd, round_timeout);
    waiting.push_back({rank, fd});
  };
  const auto deadline = env_->Now() + join_timeout;
  std::vector<Pending> pending;
  while (joined < expected) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - env_->Now()).count();
    if (left <= 0) {
      std::string missing;
      for (uint32_t r = 0; r < world_; ++r) {
        if (members_[r] < 0 && !late(r))
          missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
      for (const Pending& c : pending) close(c.fd);
      for (const auto& w : waiting) close(w.second);
      return Status::Timeout(
          StrCat("rendezvous: ranks ", missing, " did not join within ", join_timeout.count(),
                 " ms (check EPLBX_MASTER_ADDR/PORT and that every rank started)"));
    }
    TakeHellos(listen_fd_, pending, static_cast<int>(std::min<long long>(left, 100)), env_,
               [&](int fd, const std::string& hello) {
                 uint32_t rank = 0;
                 if (CheckHello(hello, &rank).empty() && late(rank)) {
                   hold(fd, hello);  // joins later
                 } else {
                   joined += Admit(fd, hello) ? 1 : 0;
                 }
               });
  }
  for (const Pending& c : pending) close(c.fd);
  pending.clear();
  if (round_timeout.count() > 0) {
    for (int fd : members_) KeepAlive(fd, round_timeout);
  }
  // With membership, the store keeps listening: a process that says hello for a rank that is
  // no member any more (it left or was declared lost) joins as a new member (the coordinator
  // decides; a hello for a member is refused there). Nothing here blocks the rounds: accepts
  // and hellos are read only when ready.
  JoinSource joins = [&]() {
    TakeHellos(listen_fd_, pending, 0, env_, hold);
    std::vector<std::pair<uint32_t, int>> out, still;
    for (const auto& w : waiting) (!admit_ || admit_(w.first) ? out : still).push_back(w);
    waiting.swap(still);
    return out;
  };
  Status served = ServeSocketBootstrap(members_, {.idle_timeout = idle_timeout,
                                                  .on_message = on_message,
                                                  .stop = stop,
                                                  .round_timeout = round_timeout,
                                                  .on_lost = on_lost,
                                                  .env = env_,
                                                  .membership = membership_,
                                                  .joins = membership_ ? joins : JoinSource()});
  for (const Pending& c : pending) close(c.fd);
  for (const auto& w : waiting) close(w.second);
  return served;
}

Result<std::unique_ptr<SocketBootstrap>> JoinTcpStore(const std::string& addr, uint16_t port,
                                                      const std::string& token, uint32_t rank,
                                                      uint32_t world,
                                                      std::chrono::milliseconds timeout, Env* env) {
  env = EnvOrDefault(env);
  Result<sockaddr_in> sa = Resolve(addr, port);
  if (!sa.ok()) return sa.status();
  const auto deadline = env->Now() + timeout;
  while (true) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (connect(fd, reinterpret_cast<sockaddr*>(&*sa), sizeof(*sa)) == 0) {
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      internal::ByteWriter w;
      w.U32(rank);
      w.U32(world);
      w.Str16(token);
      uint8_t type = 0;
      std::string body;
      bool timed_out = false;
      if (internal::WriteFrame(fd, internal::kHello, w.Take(), deadline, env) &&
          internal::ReadFrame(fd, deadline, &type, &body, &timed_out, env)) {
        if (type == internal::kWelcome) {
          auto boot = std::make_unique<SocketBootstrap>(fd, rank, world, env);
          boot->set_joining(body == "join");
          return boot;
        }
        close(fd);
        return Status::Unavailable(StrCat("rank ", rank, ": the rendezvous store refused: ", body));
      }
      close(fd);
      if (timed_out) break;
    } else {
      close(fd);
    }
    if (env->Now() >= deadline) break;
    usleep(100000);  // the store may not listen yet
  }
  return Status::Timeout(StrCat("rank ", rank, ": no rendezvous store answered at ", addr, ":",
                                port, " within ", timeout.count(), " ms"));
}

Result<RendezvousEnv> RendezvousFromEnv(bool need_rank, Env* env) {
  env = EnvOrDefault(env);
  auto get = [env](const char* name) -> std::string { return env->GetVar(name).value_or(""); };
  RendezvousEnv e;
  e.addr = get("EPLBX_MASTER_ADDR");
  const std::string port = get("EPLBX_MASTER_PORT"), world = get("EPLBX_WORLD_SIZE");
  const std::string rank = need_rank ? get("EPLBX_RANK") : "0";
  e.token = get("EPLBX_TOKEN");
  for (const auto& [name, value] :
       {std::pair<const char*, const std::string*>{"EPLBX_MASTER_ADDR", &e.addr},
        {"EPLBX_MASTER_PORT", &port},
        {"EPLBX_RANK", &rank},
        {"EPLBX_WORLD_SIZE", &world},
        {"EPLBX_TOKEN", &e.token}}) {
    if (value->empty()) {
      return Status::InvalidArgument(
          StrCat("environment variable ", name,
                 env->GetVar(name).has_value() ? " is empty" : " is not set"));
    }
  }
  if (e.token.size() > kMaxTokenBytes) {  // the hello carries it; the store reads at most this
    return Status::InvalidArgument(
        StrCat("EPLBX_TOKEN is ", e.token.size(), " bytes; the limit is ", kMaxTokenBytes));
  }
  EPLBX_ASSIGN_OR_RETURN(const uint16_t p,
                         internal::ParseInteger<uint16_t>(port, "EPLBX_MASTER_PORT", 1, 65535));
  EPLBX_ASSIGN_OR_RETURN(const uint32_t w,
                         internal::ParseInteger<uint32_t>(world, "EPLBX_WORLD_SIZE", 1, 1u << 20));
  EPLBX_ASSIGN_OR_RETURN(const uint32_t r,
                         internal::ParseInteger<uint32_t>(rank, "EPLBX_RANK", 0, w - 1));
  e.port = p;
  e.rank = r;
  e.world = w;
  return e;
}

}  // namespace eplbx
