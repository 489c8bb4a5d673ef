// See work_turns.h.
#include "cli/work_turns.h"

#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <new>

#include "common/strings.h"

namespace eplbx::cli {

using internal::StrCat;

int64_t MonotonicNs() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

Result<WorkTurns*> CreateWorkTurns() {
  void* page =
      mmap(nullptr, sizeof(WorkTurns), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (page == MAP_FAILED)
    return Status::Unavailable(StrCat("shared memory: ", std::strerror(errno)));
  auto* t = new (page) WorkTurns;
  if (sem_init(&t->turn, 1, 1) != 0) {
    const int err = errno;
    munmap(page, sizeof(WorkTurns));
    return Status::Unavailable(StrCat("a shared semaphore: ", std::strerror(err)));
  }
  t->moved.store(0);
  for (std::atomic<int64_t>& a : t->at) a.store(WorkTurns::kNotServing);
  return t;
}

bool MeetingWaits(std::span<const int64_t> at, std::span<PeerSeen> seen, int me, int64_t index,
                  int64_t now_ns, int64_t stale_ns) {
  bool waits = false;
  for (size_t r = 0; r < at.size() && r < seen.size(); ++r) {
    if (at[r] != seen[r].at) seen[r] = {at[r], now_ns};
    if (static_cast<int>(r) == me || at[r] == WorkTurns::kNotServing || at[r] == WorkTurns::kDone)
      continue;
    if (at[r] < index && now_ns - seen[r].since_ns < stale_ns) waits = true;
  }
  return waits;
}

Meeting::Meeting(WorkTurns* turns, int rank, int ranks, bool meet)
    : turns_(turns),
      rank_(rank),
      meet_(meet),
      seen_(static_cast<size_t>(std::min(ranks, WorkTurns::kMaxRanks))),
      at_(seen_.size()) {}

void Meeting::Set(int64_t value) {
  if (rank_ >= 0 && rank_ < WorkTurns::kMaxRanks) turns_->at[rank_].store(value);
  turns_->moved.fetch_add(1);
  // Every process that waits on the word (FUTEX_WAKE without _PRIVATE: shared memory).
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&turns_->moved), FUTEX_WAKE, INT32_MAX, nullptr,
          nullptr, 0);
}

void Meeting::Arrive(int64_t index) {
  if (meet_) Set(index);
}

void Meeting::Begin(int64_t index) {
  if (meet_) {
    Set(index);
    for (;;) {
      const uint32_t moved = turns_->moved.load();
      for (size_t r = 0; r < at_.size(); ++r) at_[r] = turns_->at[r].load();
      if (!MeetingWaits(at_, seen_, rank_, index, MonotonicNs(), kStaleNs)) break;
      // Until an `at` moves (or 10 ms, to see a rank go stale).
      const timespec wait{0, 10'000'000};
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&turns_->moved), FUTEX_WAIT, moved, &wait,
              nullptr, 0);
    }
  }
  // The turn, waited for up to kStaleNs: a rank that died inside its turn (the demo's drills
  // strike between steps, but a process can be killed from outside at any time) would hold it
  // for ever; the work is then timed beside another rank's, not waited for.
  timespec until{};
  clock_gettime(CLOCK_REALTIME, &until);  // sem_timedwait's clock
  until.tv_nsec += kStaleNs % 1'000'000'000;
  until.tv_sec += kStaleNs / 1'000'000'000 + until.tv_nsec / 1'000'000'000;
  until.tv_nsec %= 1'000'000'000;
  int rc;
  while ((rc = sem_timedwait(&turns_->turn, &until)) != 0 && errno == EINTR) {
  }
  have_turn_ = rc == 0;
}

void Meeting::End() {
  if (have_turn_) sem_post(&turns_->turn);
  have_turn_ = false;
}

void Meeting::Leave() {
  if (meet_) Set(WorkTurns::kDone);
}

}  // namespace eplbx::cli
