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

using internal::kContributeAt;
using internal::kFailed;
using internal::kGathered;
using internal::kGatheredAt;
using internal::kMessage;
using internal::kRefused;
using internal::ReadFrame;
using internal::WriteFrame;

SocketBootstrap::SocketBootstrap(int fd, uint32_t rank, uint32_t size, Env* env)
    : fd_(fd), rank_(rank), size_(size), env_(EnvOrDefault(env)), members_(size, true) {}

namespace {

// [u64 epoch][u32 n][u8 member] x n: the membership head of kGatheredAt and kRefused.
void WriteMembership(internal::ByteWriter& w, uint64_t epoch, const std::vector<bool>& members) {
  w.U64(epoch);
  w.U32(static_cast<uint32_t>(members.size()));
  for (bool m : members) w.U8(m ? 1 : 0);
}

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

// "0, 1, 3"
std::string MemberList(const std::vector<bool>& members) {
  std::string out;
  for (size_t i = 0; i < members.size(); ++i) {
    if (members[i]) out += StrCat(out.empty() ? "" : ", ", i);
  }
  return out.empty() ? "none" : out;
}

}  // namespace
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
  internal::ByteWriter contribution;
  contribution.U64(epoch_);
  std::string frame = contribution.Take();
  frame.append(mine);
  if (!WriteFrame(fd_, kContributeAt, frame)) {
    // The coordinator may have said why before it closed (a refused joiner).
    uint8_t type = 0;
    std::string why;
    bool timed_out = false;
    if (ReadFrame(fd_, env_->Now() + std::chrono::milliseconds(100), &type, &why, &timed_out,
                  env_) &&
        type == kFailed) {
      return Status::Unavailable(why);
    }
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

Status ServeSocketBootstrap(const std::vector<int>& fds, std::chrono::milliseconds idle_timeout,
                            const std::function<void(uint32_t, std::string)>& on_message,
                            const std::function<bool()>& stop,
                            std::chrono::milliseconds round_timeout,
                            const std::function<void(uint32_t)>& on_lost, Env* env, bool membership,
                            const JoinSource& joins) {
  env = EnvOrDefault(env);
  const size_t n = fds.size();
  auto lost = [&](size_t i) {
    if (on_lost) on_lost(static_cast<uint32_t>(i));
  };
  std::vector<int> fd = fds;
  // Joiners' connections are the coordinator's own: closed when it returns.
  struct Owned {
    std::vector<int> fds;
    ~Owned() {
      for (int f : fds) close(f);
    }
  } owned;
  std::vector<bool> open(n);
  size_t open_count = 0;
  for (size_t i = 0; i < n; ++i) {
    open[i] = fd[i] >= 0;
    open_count += open[i] ? 1 : 0;
  }
  if (!membership && open_count < n) {
    return Status::InvalidArgument(
        "a coordinator without membership needs a connection for every rank");
  }
  std::vector<std::optional<std::string>> round(n);
  // Membership (when on): who is a member, since which epoch each non-member is out, which
  // non-members have a new process that will ask to join.
  uint64_t epoch = 1;
  std::vector<bool> member = open;
  std::vector<bool> joining(n, false);
  std::vector<uint64_t> lost_at(n, 0);
  auto take_joiners = [&] {
    if (!joins) return;
    for (const auto& [rank, f] : joins()) {
      std::string refusal;
      if (!membership) {
        refusal = "this coordinator does not track membership: no rank can join";
      } else if (rank >= n) {
        refusal = StrCat("rank ", rank, " cannot join a group of ", n, " ranks");
      } else if (member[rank] || joining[rank]) {
        refusal =
            StrCat("rank ", rank, " cannot join: it is ", member[rank] ? "a member" : "joining",
                   " already (two processes for one rank?)");
      }
      if (!refusal.empty()) {
        WriteFrame(f, kFailed, refusal);
        close(f);
        continue;
      }
      if (open[rank]) {  // the connection of a rank declared lost: not heard any more
        open[rank] = false;
        --open_count;
      }
      owned.fds.push_back(f);
      fd[rank] = f;
      open[rank] = true;
      ++open_count;
      joining[rank] = true;
    }
  };
  auto refuse = [&](size_t i, const std::string& why) {
    internal::ByteWriter w;
    WriteMembership(w, epoch, member);
    w.Str32(why);
    WriteFrame(fd[i], kRefused, w.Take());
  };
  auto fail_round = [&](const std::string& why) {
    for (size_t i = 0; i < n; ++i) {
      if (open[i] && round[i]) {
        if (membership)
          refuse(i, why);
        else
          WriteFrame(fd[i], kFailed, why);
      }
      round[i].reset();
    }
  };
  // Membership: rank i is out from the next epoch on; a round in progress fails for the
  // members in it, with the new epoch and member set.
  auto declare_lost = [&](size_t i, const std::string& why) {
    lost(i);
    if (!member[i]) return;
    member[i] = false;
    lost_at[i] = ++epoch;
    round[i].reset();
    fail_round(StrCat(why, ": epoch ", epoch, ", members ", MemberList(member)));
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
    std::vector<size_t> late;
    for (size_t i = 0; i < n; ++i) {
      if (round[i] || (membership && !member[i])) continue;
      missing += StrCat(missing.empty() ? "" : ", ", "rank ", i);
      late.push_back(i);
    }
    const std::string why =
        StrCat(missing, " did not join the all-gather within ", round_timeout.count(), " ms");
    if (membership) {
      // Every late rank is out; the survivors hear of it once, at the last epoch.
      for (size_t i : late) {
        lost(i);
        member[i] = false;
        lost_at[i] = epoch + 1;
      }
      ++epoch;
      fail_round(StrCat(why, ": epoch ", epoch, ", members ", MemberList(member)));
    } else {
      for (size_t i : late) lost(i);
      fail_round(why);
    }
    round_started = {};
  };
  auto complete_round = [&] {
    for (size_t j = 0; j < n; ++j) {
      if ((!membership || member[j]) && !round[j]) return;
    }
    internal::ByteWriter w;
    if (membership) WriteMembership(w, epoch, member);
    w.U32(static_cast<uint32_t>(n));
    for (auto& c : round) w.Str32(c ? *c : std::string());
    const std::string all = w.Take();
    for (size_t j = 0; j < n; ++j) {
      if (open[j] && round[j]) WriteFrame(fd[j], membership ? kGatheredAt : kGathered, all);
      round[j].reset();
    }
    round_started = {};
  };
  while (open_count > 0) {
    if (stop && stop()) return Status::OK();
    take_joiners();
    check_round();
    std::vector<pollfd> p;
    std::vector<size_t> who;
    for (size_t i = 0; i < n; ++i) {
      if (open[i]) {
        p.push_back({fd[i], POLLIN, 0});
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
      if (!ReadFrame(fd[i], env->Now() + std::chrono::seconds(5), &type, &body, &timed_out, env)) {
        open[i] = false;
        --open_count;
        if (joining[i]) {  // went before it asked to join: it never was a member
          joining[i] = false;
          continue;
        }
        if (membership) {
          declare_lost(i, StrCat("rank ", i, " left"));
          complete_round();
          continue;
        }
        lost(i);
        if (std::any_of(round.begin(), round.end(), [](const auto& c) { return c.has_value(); })) {
          fail_round(StrCat("rank ", i, " left before the all-gather completed"));
        }
        continue;
      }
      if (joining[i] && type == kContributeAt) {
        // Asks to join: a member from a new epoch; everyone contributes again at it.
        joining[i] = false;
        member[i] = true;
        ++epoch;
        const std::string members = MemberList(member);
        fail_round(StrCat("rank ", i, " joined: epoch ", epoch, ", members ", members));
        refuse(i, StrCat("rank ", i, " joined at epoch ", epoch, " (members ", members,
                         "): contribute again at this epoch"));
        continue;
      }
      if (membership && !member[i] && !joining[i]) {
        // Declared lost (it missed a round, stopped): it is not heard any more.
        WriteFrame(fd[i], kFailed,
                   StrCat("rank ", i, " was declared lost at epoch ", lost_at[i],
                          " (the group is at epoch ", epoch, ", members ", MemberList(member),
                          "): rejoin as a new member"));
        open[i] = false;
        --open_count;
        continue;
      }
      if (type == kMessage) {
        on_message(static_cast<uint32_t>(i), std::move(body));
        continue;
      }
      if (type != kContributeAt) continue;
      internal::ByteReader at(body, "contribution");
      uint64_t their = 0;
      if (!at.U64("epoch", &their)) continue;
      if (membership && their != epoch) {
        refuse(i, StrCat("rank ", i, " contributed at epoch ", their, "; the group is at epoch ",
                         epoch, " (members ", MemberList(member),
                         "): learn the member set and contribute again"));
        continue;
      }
      body.erase(0, 8);
      round[i] = std::move(body);
      if (!membership) {
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
      }
      complete_round();
    }
  }
  return Status::OK();
}

}  // namespace eplbx
