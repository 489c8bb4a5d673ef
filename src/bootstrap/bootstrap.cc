#include "eplbx/bootstrap.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>

#include "bootstrap/coordinator.h"
#include "bootstrap/frames.h"
#include "common/bytes.h"
#include "common/strings.h"

namespace eplbx {
namespace {

using internal::StrCat;
using Clock = std::chrono::steady_clock;

constexpr uint32_t kMaxFrame = 64u << 20;

// Never raises SIGPIPE: a peer that closed makes the write fail (EPIPE), not the process
// die (issue 17, item 6). Never blocks past `deadline`: a send that would block waits for
// room by poll(). Frames go over sockets; anything else falls back to write() after poll().
bool WriteAll(int fd, const char* p, size_t n, Clock::time_point deadline, Env* env) {
  bool socket = true;
  while (n > 0) {
    ssize_t w = socket ? send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT) : write(fd, p, n);
    if (w < 0 && errno == ENOTSOCK) {
      socket = false;
      w = -1;
      errno = EAGAIN;  // poll before a write that might block
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - env->Now()).count();
      if (left <= 0) return false;
      pollfd pfd{fd, POLLOUT, 0};
      int r = poll(&pfd, 1, static_cast<int>(std::min<long long>(left, 1000)));
      if (r < 0 && errno != EINTR) return false;
      if (r > 0 && (pfd.revents & (POLLERR | POLLHUP | POLLNVAL)) != 0) return false;
      continue;
    }
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

}  // namespace

namespace internal {

bool WriteFrame(int fd, uint8_t type, std::string_view body, Clock::time_point deadline, Env* env) {
  env = EnvOrDefault(env);
  internal::ByteWriter w;
  w.U8(type);
  w.U32(static_cast<uint32_t>(body.size()));
  std::string head = w.Take();
  return WriteAll(fd, head.data(), head.size(), deadline, env) &&
         WriteAll(fd, body.data(), body.size(), deadline, env);
}

// Reads exactly n bytes before `deadline`; false on EOF, error or timeout (*timed_out).
bool ReadAll(int fd, char* p, size_t n, Clock::time_point deadline, bool* timed_out, Env* env) {
  *timed_out = false;
  while (n > 0) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - env->Now()).count();
    if (left <= 0) {
      *timed_out = true;
      return false;
    }
    pollfd pfd{fd, POLLIN, 0};
    int r = poll(&pfd, 1, static_cast<int>(std::min<long long>(left, 1000)));
    if (r < 0 && errno != EINTR) return false;
    if (r <= 0) continue;
    ssize_t got = read(fd, p, n);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    p += got;
    n -= static_cast<size_t>(got);
  }
  return true;
}

bool ReadFrame(int fd, std::chrono::steady_clock::time_point deadline, uint8_t* type,
               std::string* body, bool* timed_out, Env* env) {
  env = EnvOrDefault(env);
  char head[5];
  if (!ReadAll(fd, head, 5, deadline, timed_out, env)) return false;
  *type = static_cast<uint8_t>(head[0]);
  uint32_t n = 0;
  for (int i = 0; i < 4; ++i)
    n |= static_cast<uint32_t>(static_cast<uint8_t>(head[1 + i])) << (8 * i);
  if (n > kMaxFrame) return false;
  body->resize(n);
  return ReadAll(fd, body->data(), n, deadline, timed_out, env);
}

}  // namespace internal

using internal::kContributeAt;
using internal::kFailed;
using internal::kGathered;
using internal::kGatheredAt;
using internal::kMessage;
using internal::kRefused;
using internal::ReadFrame;
using internal::WriteFrame;

MembersView::MembersView(uint32_t rank, uint32_t size, Gather gather, std::vector<bool> members)
    : rank_(rank),
      size_(size),
      gather_(std::move(gather)),
      members_(members.empty() ? std::vector<bool>(size, true) : std::move(members)) {}

Result<std::vector<std::string>> MembersView::AllGather(std::string_view mine,
                                                        std::chrono::milliseconds timeout) {
  EPLBX_ASSIGN_OR_RETURN(std::vector<std::string> all, gather_(epoch_, mine, timeout));
  if (all.size() != size_) {
    return Status::Corruption(StrCat("rank ", rank_, ": the engine's all-gather returned ",
                                     all.size(), " contributions for ", size_, " ranks"));
  }
  return all;
}

Status MembersView::Update(uint64_t epoch, std::vector<bool> members) {
  if (epoch <= epoch_ || members.size() != size_) {
    return Status::InvalidArgument(StrCat("rank ", rank_, ": members of epoch ", epoch, " (",
                                          members.size(), " flags) after epoch ", epoch_, " (",
                                          size_,
                                          " ranks): the epoch must go forward, one flag "
                                          "per rank"));
  }
  epoch_ = epoch;
  members_ = std::move(members);
  return Status::OK();
}

SocketBootstrap::SocketBootstrap(int fd, uint32_t rank, uint32_t size, Env* env)
    : fd_(fd), rank_(rank), size_(size), env_(EnvOrDefault(env)), members_(size, true) {}

namespace {

Status ReadMembership(internal::ByteReader& r, uint32_t size, uint64_t* epoch,
                      std::vector<bool>* members) {
  uint32_t n = 0;
  if (!r.U64("epoch", epoch) || !r.U32("members", &n)) return r.status();
  if (n != size) {
    return Status::Corruption(StrCat("membership of ", n, " ranks for a group of ", size));
  }
  members->assign(n, false);
  for (uint32_t i = 0; i < n; ++i) {
    uint8_t m = 0;
    if (!r.U8(StrCat("member[", i, "]"), &m)) return r.status();
    (*members)[i] = m != 0;
  }
  return Status::OK();
}

}  // namespace
SocketBootstrap::~SocketBootstrap() {
  if (fd_ >= 0) close(fd_);
}

Status SocketBootstrap::SendMessage(std::string_view bytes) {
  if (!WriteFrame(fd_, kMessage, bytes, env_->Now() + internal::kWriteWait, env_)) {
    return Status::Unavailable(StrCat("rank ", rank_, ": the coordinator is gone or took no ",
                                      "report for ", internal::kWriteWait.count(), " ms"));
  }
  return Status::OK();
}

Result<std::vector<std::string>> SocketBootstrap::AllGather(std::string_view mine,
                                                            std::chrono::milliseconds timeout) {
  internal::ByteWriter contribution;
  contribution.U64(epoch_);
  std::string frame = contribution.Take();
  frame.append(mine);
  if (!WriteFrame(fd_, kContributeAt, frame, env_->Now() + timeout, env_)) {
    // The coordinator may have said why before it closed (a refused joiner).
    uint8_t type = 0;
    std::string why;
    bool timed_out = false;
    if (ReadFrame(fd_, env_->Now() + std::chrono::milliseconds(100), &type, &why, &timed_out,
                  env_) &&
        type == kFailed) {
      return Status::Unavailable(why);
    }
    return Status::Unavailable(StrCat("rank ", rank_,
                                      ": the coordinator is gone or took no frame for ",
                                      timeout.count(), " ms (all-gather)"));
  }
  uint8_t type = 0;
  std::string body;
  bool timed_out = false;
  if (!ReadFrame(fd_, env_->Now() + timeout, &type, &body, &timed_out, env_)) {
    if (timed_out) {
      return Status::Timeout(StrCat("rank ", rank_, ": all-gather did not complete within ",
                                    timeout.count(), " ms (a rank did not join)"));
    }
    return Status::Unavailable(StrCat("rank ", rank_, ": the coordinator is gone (all-gather)"));
  }
  if (type == kFailed) return Status::Unavailable(body);
  if (type != kGathered && type != kGatheredAt && type != kRefused)
    return Status::Corruption(StrCat("rank ", rank_, ": unexpected frame type ", +type));
  internal::ByteReader r(body, "all-gather result");
  if (type == kGatheredAt || type == kRefused) {
    EPLBX_RETURN_IF_ERROR(ReadMembership(r, size_, &epoch_, &members_));
    if (type == kRefused) {
      std::string why;
      if (!r.Str32("why", kMaxFrame, &why)) return r.status();
      return Status::Aborted(why);
    }
  }
  uint32_t count = 0;
  if (!r.U32("count", &count)) return r.status();
  if (count != size_) {
    return Status::Corruption(
        StrCat("all-gather returned ", count, " contributions for ", size_, " ranks"));
  }
  std::vector<std::string> out(count);
  for (uint32_t i = 0; i < count; ++i) {
    if (!r.Str32(StrCat("contribution[", i, "]"), kMaxFrame, &out[i])) return r.status();
  }
  return out;
}

Status ServeSocketBootstrap(const std::vector<int>& fds, const CoordinatorOptions& options) {
  Env* env = EnvOrDefault(options.env);
  const size_t n = fds.size();
  std::vector<int> fd = fds;
  // Joiners' connections are the coordinator's own: closed when it returns.
  struct Owned {
    std::vector<int> fds;
    ~Owned() {
      for (int f : fds) close(f);
    }
  } owned;
  std::vector<bool> open(n);
  for (size_t i = 0; i < n; ++i) open[i] = fd[i] >= 0;
  if (!options.membership && std::count(open.begin(), open.end(), true) < static_cast<long>(n)) {
    return Status::InvalidArgument(
        "a coordinator without membership needs a connection for every rank");
  }
  internal::CoordinatorCore core(open, options.membership, options.round_timeout);
  // A frame a member does not take within this long (its link is down: the send buffer stays
  // full) closes its connection like a hang-up, so one dead link never stalls the others
  // for longer than a round may take.
  const auto write_wait =
      options.round_timeout.count() > 0 ? options.round_timeout : internal::kWriteWait;
  // Carries out what the core decided: the lost ranks first (whoever hears of a loss from a
  // round's answer finds on_lost already called), then the frames in order, then messages;
  // again while a member whose frame did not leave is closed.
  auto act = [&] {
    while (true) {
      for (uint32_t r : core.TakeLost()) {
        if (options.on_lost) options.on_lost(r);
      }
      std::vector<size_t> broken;
      for (const internal::CoordinatorSend& s : core.TakeSends()) {
        if (std::find(broken.begin(), broken.end(), s.rank) != broken.end()) continue;
        if (!WriteFrame(fd[s.rank], s.type, s.body, env->Now() + write_wait, env))
          broken.push_back(s.rank);
      }
      for (auto& [r, body] : core.TakeMessages()) {
        if (options.on_message) options.on_message(r, std::move(body));
      }
      bool closed = false;
      for (size_t r : broken) {
        if (!core.open(r)) continue;
        core.Closed(r);
        closed = true;
      }
      if (!closed) return;
    }
  };
  auto last_frame = env->Now();
  while (core.open_count() > 0) {
    if (options.stop && options.stop()) return Status::OK();
    for (const auto& [rank, f] : options.joins ? options.joins() : JoinSource::result_type{}) {
      if (std::string refusal = core.Join(rank); !refusal.empty()) {
        WriteFrame(f, kFailed, refusal, env->Now() + internal::kWriteWait, env);
        close(f);
        continue;
      }
      owned.fds.push_back(f);
      fd[rank] = f;
    }
    core.Tick(env->Now());
    act();
    std::vector<pollfd> p;
    std::vector<size_t> who;
    for (size_t i = 0; i < n; ++i) {
      if (core.open(i)) {
        p.push_back({fd[i], POLLIN, 0});
        who.push_back(i);
      }
    }
    int r = poll(p.data(), p.size(), 200);
    if (r < 0 && errno != EINTR) return Status::IoError(StrCat("poll: ", std::strerror(errno)));
    if (r <= 0) {
      if (env->Now() - last_frame > options.idle_timeout) {
        return Status::Timeout(
            StrCat("no rank reported for ", options.idle_timeout.count(), " ms"));
      }
      continue;
    }
    last_frame = env->Now();
    for (size_t k = 0; k < p.size(); ++k) {
      if ((p[k].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      const size_t i = who[k];
      uint8_t type = 0;
      std::string body;
      bool timed_out = false;
      if (!ReadFrame(fd[i], env->Now() + std::chrono::seconds(5), &type, &body, &timed_out, env)) {
        core.Closed(i);
      } else {
        core.Frame(i, type, std::move(body));
      }
      act();
    }
  }
  return Status::OK();
}

}  // namespace eplbx
