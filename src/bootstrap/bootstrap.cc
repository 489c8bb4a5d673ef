#include "eplbx/bootstrap.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>

#include "bootstrap/frames.h"
#include "common/bytes.h"
#include "common/strings.h"

namespace eplbx {
namespace {

using internal::StrCat;
using Clock = std::chrono::steady_clock;

constexpr uint32_t kMaxFrame = 64u << 20;

// Never raises SIGPIPE: a peer that closed makes the write fail (EPIPE), not the process
// die (issue 17, item 6). Frames go over sockets; anything else falls back to write().
bool WriteAll(int fd, const char* p, size_t n) {
  bool socket = true;
  while (n > 0) {
    ssize_t w = socket ? send(fd, p, n, MSG_NOSIGNAL) : write(fd, p, n);
    if (w < 0 && errno == ENOTSOCK) {
      socket = false;
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

}  // namespace

namespace internal {

bool WriteFrame(int fd, uint8_t type, std::string_view body) {
  internal::ByteWriter w;
  w.U8(type);
  w.U32(static_cast<uint32_t>(body.size()));
  std::string head = w.Take();
  return WriteAll(fd, head.data(), head.size()) && WriteAll(fd, body.data(), body.size());
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

using internal::kContribute;
using internal::kFailed;
using internal::kGathered;
using internal::kMessage;
using internal::ReadFrame;
using internal::WriteFrame;

SocketBootstrap::SocketBootstrap(int fd, uint32_t rank, uint32_t size, Env* env)
    : fd_(fd), rank_(rank), size_(size), env_(EnvOrDefault(env)) {}
SocketBootstrap::~SocketBootstrap() {
  if (fd_ >= 0) close(fd_);
}

Status SocketBootstrap::SendMessage(std::string_view bytes) {
  if (!WriteFrame(fd_, kMessage, bytes)) {
    return Status::Unavailable(StrCat("rank ", rank_, ": the coordinator is gone"));
  }
  return Status::OK();
}

Result<std::vector<std::string>> SocketBootstrap::AllGather(std::string_view mine,
                                                            std::chrono::milliseconds timeout) {
  if (!WriteFrame(fd_, kContribute, mine)) {
    return Status::Unavailable(StrCat("rank ", rank_, ": the coordinator is gone (all-gather)"));
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
  if (type != kGathered)
    return Status::Corruption(StrCat("rank ", rank_, ": unexpected frame type ", +type));
  internal::ByteReader r(body, "all-gather result");
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

Status ServeSocketBootstrap(const std::vector<int>& fds, std::chrono::milliseconds idle_timeout,
                            const std::function<void(uint32_t, std::string)>& on_message,
                            const std::function<bool()>& stop,
                            std::chrono::milliseconds round_timeout,
                            const std::function<void(uint32_t)>& on_lost, Env* env) {
  env = EnvOrDefault(env);
  const size_t n = fds.size();
  auto lost = [&](size_t i) {
    if (on_lost) on_lost(static_cast<uint32_t>(i));
  };
  std::vector<bool> open(n, true);
  std::vector<std::optional<std::string>> round(n);
  size_t open_count = n;
  auto fail_round = [&](const std::string& why) {
    for (size_t i = 0; i < n; ++i) {
      if (open[i] && round[i]) WriteFrame(fds[i], kFailed, why);
      round[i].reset();
    }
  };
  auto last_frame = env->Now();
  Clock::time_point round_started{};
  auto check_round = [&] {
    const bool pending =
        std::any_of(round.begin(), round.end(), [](const auto& c) { return c.has_value(); });
    if (!pending) {
      round_started = {};
      return;
    }
    if (round_started == Clock::time_point{}) round_started = env->Now();
    if (round_timeout.count() <= 0 || env->Now() - round_started < round_timeout) return;
    std::string missing;
    for (size_t i = 0; i < n; ++i) {
      if (round[i]) continue;
      missing += StrCat(missing.empty() ? "" : ", ", "rank ", i);
      lost(i);
    }
    fail_round(
        StrCat(missing, " did not join the all-gather within ", round_timeout.count(), " ms"));
    round_started = {};
  };
  while (open_count > 0) {
    if (stop && stop()) return Status::OK();
    check_round();
    std::vector<pollfd> p;
    std::vector<size_t> who;
    for (size_t i = 0; i < n; ++i) {
      if (open[i]) {
        p.push_back({fds[i], POLLIN, 0});
        who.push_back(i);
      }
    }
    int r = poll(p.data(), p.size(), 200);
    if (r < 0 && errno != EINTR) return Status::IoError(StrCat("poll: ", std::strerror(errno)));
    if (r <= 0) {
      if (env->Now() - last_frame > idle_timeout) {
        return Status::Timeout(StrCat("no rank reported for ", idle_timeout.count(), " ms"));
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
      if (!ReadFrame(fds[i], env->Now() + std::chrono::seconds(5), &type, &body, &timed_out, env)) {
        open[i] = false;
        --open_count;
        lost(i);
        if (std::any_of(round.begin(), round.end(), [](const auto& c) { return c.has_value(); })) {
          fail_round(StrCat("rank ", i, " left before the all-gather completed"));
        }
        continue;
      }
      if (type == kMessage) {
        on_message(static_cast<uint32_t>(i), std::move(body));
        continue;
      }
      if (type != kContribute) continue;
      round[i] = std::move(body);
      bool complete = true;
      for (size_t j = 0; j < n; ++j) complete = complete && round[j].has_value();
      if (!complete) {
        // A member that already left can never contribute.
        for (size_t j = 0; j < n; ++j) {
          if (!open[j] && !round[j]) {
            fail_round(StrCat("rank ", j, " left before the all-gather completed"));
            break;
          }
        }
        continue;
      }
      internal::ByteWriter w;
      w.U32(static_cast<uint32_t>(n));
      for (auto& c : round) w.Str32(*c);
      const std::string all = w.Take();
      for (size_t j = 0; j < n; ++j) {
        if (open[j]) WriteFrame(fds[j], kGathered, all);
        round[j].reset();
      }
    }
  }
  return Status::OK();
}

}  // namespace eplbx
