// Internal: the same-host data path. The initiator copies with its own threads: from or to
// a peer region it has mapped (memfd shared memory, plain memcpy), or with
// process_vm_readv / process_vm_writev (CMA) for any other region of the peer process.
// Large pieces are split into chunks so every copy thread works on one transfer.
#ifndef EPLBX_SRC_TRANSFER_SHM_COPIER_H_
#define EPLBX_SRC_TRANSFER_SHM_COPIER_H_

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <ostream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "eplbx/status.h"

namespace eplbx::internal {

// Touches every page of a new mapping so the first transfers do not pay for it. On these
// VMs the first access to each 4 KiB page of a shared mapping costs 5-10 us even after
// MAP_POPULATE or MADV_POPULATE_WRITE (about 2-4 ms per MiB; measured, docs/transfer.md);
// a plain access pass is what removes it.
// Zero-fills: only for memory nobody uses yet.
void TouchPagesForWrite(void* p, size_t n);
// Reads one byte per page: for mappings of memory another process owns.
void TouchPagesForRead(const void* p, size_t n);

// memcpy for the mapped path. Copies of at least kStreamMinBytes use non-temporal stores
// on x86-64 CPUs with AVX2 (others: memcpy) and end with a store fence: the
// destination is not read back soon, and skipping the read-for-ownership of every
// destination line cuts memory traffic by a third. With a large L3 glibc's memcpy keeps
// regular stores up to ~3/4 of it, so it never does this for expert rows (measured 1.3-1.5x
// memcpy with two threads on these VMs; docs/perf.md).
inline constexpr size_t kStreamMinBytes = 256u << 10;
void CopyBytes(void* dst, const void* src, size_t n);
// CopyBytes / TouchPagesForRead that survive SIGBUS (a mapping whose file the peer shrank):
// false, and the bytes before the fault copied, instead of the process dying. A SIGBUS
// outside these calls goes to the handler installed before the first call.
bool GuardedCopyBytes(void* dst, const void* src, size_t n);
bool GuardedTouchPagesForRead(const void* p, size_t n);
// Builds the page tables of [p, p + n) of a mapping of memory another process owns, so that
// copies from it take no page faults: one MADV_POPULATE_READ where the kernel has it (5.14
// and later), else GuardedTouchPagesForRead. False when the mapped file ends before p + n
// (the peer shrank it): where a read would raise SIGBUS.
bool PopulateForRead(const void* p, size_t n);

struct CopyPiece {
  uint8_t* local = nullptr;
  uint64_t remote = 0;        // address in the peer process
  uint8_t* mapped = nullptr;  // the same bytes mapped here, or null: use CMA
  uint64_t bytes = 0;
};

// A job's name in messages ("agent 'a': READ with 'b' (pid 123, shm)"), put together only
// when a message needs it: a job is posted for every transfer, and formatting its name each
// time (an ostringstream) was work on every READ of a rearrangement.
struct JobName {
  std::string agent, peer;
  std::string_view op, path;  // OpName(), the data path's name (static strings)
  pid_t pid = 0;
};
std::ostream& operator<<(std::ostream& out, const JobName& name);

struct CopyJob {
  uint64_t id = 0;
  pid_t pid = 0;
  bool read = true;  // peer -> local
  JobName describe;
  std::vector<CopyPiece> pieces;
  bool alone = false;         // PathRequest::alone
  bool caller_waits = false;  // PathRequest::caller_waits
  // Called once when every chunk is done or the job failed/was cancelled: on a copy thread,
  // or on the submitting thread before Submit returns (inline, or a helped job it ended).
  std::function<void(Status)> done;
};

class ShmCopier {
 public:
  // Jobs of at most `inline_max_bytes` are copied on the thread that submits them (no
  // hand-off to a copy thread: lower latency for small transfers); larger ones are split
  // over the `threads` copy threads. A job `alone` (its agent has nothing else outstanding)
  // is copied by the submitting thread and the copy threads together (the caller waits for
  // it anyway), unless `inline_max_bytes` is 0.
  //
  // On a busy host — at least as many agents as the cores this process may run on: this
  // one and its same-host peers (shm and cma connect to no other), counted by PeerJoined /
  // PeerLeft — every core already has an agent copying, so a copy thread adds a hand-off
  // (and a wake-up of the waiting thread per job), not parallelism: there, with
  // `when_busy`, a job whose caller waits for it with nothing else to do (caller_waits: a
  // synchronous rearrangement; not an engine thread that posts and goes on serving), not
  // alone, of at most kBusyInlineBytes, is copied on the submitting thread too
  // (docs/transfer.md, "On a busy host the caller that waits copies"). Off while
  // `inline_max_bytes` is 0 (copy threads only). `cores` 0: the CPUs of this process's
  // affinity mask.
  static constexpr uint64_t kBusyInlineBytes = 1u << 20;
  explicit ShmCopier(int threads, uint64_t inline_max_bytes = 0, bool when_busy = true,
                     int cores = 0);
  ~ShmCopier();  // finishes queued jobs as aborted
  ShmCopier(const ShmCopier&) = delete;
  ShmCopier& operator=(const ShmCopier&) = delete;

  // Runs the job (inline, queued, or queued and helped by the caller); `done` may run before
  // Submit returns.
  void Submit(CopyJob job);
  // The job ends with kAborted after the chunks already running; false if unknown.
  bool Cancel(uint64_t id);

  // A same-host peer connected through a path of this copier (each path once a peer), or
  // gone: the count that says whether the host is busy.
  void PeerJoined(uint64_t peer);
  void PeerLeft(uint64_t peer);
  bool busy() const { return busy_.load(std::memory_order_relaxed); }

  // Reads 8 bytes at `addr` of process `pid` with CMA (same-host reachability probe).
  static Status Probe(pid_t pid, uint64_t addr, uint64_t expected);

 private:
  struct Chunk {
    size_t first = 0;  // piece range [first, last)
    size_t last = 0;
    uint64_t offset = 0;  // within `first` when the chunk splits one large piece
    uint64_t bytes = 0;
  };
  struct Running {
    CopyJob job;
    std::vector<Chunk> chunks;
    std::atomic<size_t> next{0};
    std::atomic<size_t> finished{0};
    std::atomic<bool> cancelled{false};
    std::mutex mu;
    Status error;
  };

  void Worker();
  void RunChunk(Running& r, const Chunk& c);
  // Runs chunk `index` (claimed through r->next); ends the job after its last chunk.
  void RunClaimed(const std::shared_ptr<Running>& r, size_t index);
  static std::vector<Chunk> Split(const std::vector<CopyPiece>& pieces, uint64_t chunk_bytes);

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Running>> queue_;
  std::vector<std::shared_ptr<Running>> active_;  // for Cancel
  bool stop_ = false;
  const uint64_t inline_max_bytes_;
  const bool when_busy_;
  const int cores_;
  std::map<uint64_t, int> peers_;  // under mu_: same-host peer -> paths connected to it
  std::atomic<bool> busy_{false};
  std::vector<std::thread> threads_;
};

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_TRANSFER_SHM_COPIER_H_
