#include "transfer/shm/copier.h"

#include <sched.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>

#include "common/strings.h"

namespace eplbx::internal {
namespace {

constexpr uint64_t kChunkBytes = 4u << 20;  // a large piece is copied in 4 MiB chunks
// A job the caller helps with is cut in chunks of at least this (one per thread).
constexpr uint64_t kHelpedChunkMinBytes = 256u << 10;
constexpr size_t kMaxIov = 512;  // small pieces batched into one syscall

#if defined(__x86_64__)
// 128 bytes per step: unaligned loads, aligned streaming stores (dst is 32-byte aligned).
__attribute__((target("avx2"))) void StreamAvx2(uint8_t* d, const uint8_t* s, size_t n) {
  for (size_t i = 0; i < n; i += 128) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 64));
    const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 96), e);
  }
}
#endif

}  // namespace

std::ostream& operator<<(std::ostream& out, const JobName& name) {
  return out << "agent '" << name.agent << "': " << name.op << " with '" << name.peer << "' (pid "
             << name.pid << ", " << name.path << ")";
}

void CopyBytes(void* dst, const void* src, size_t n) {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (n >= kStreamMinBytes && avx2) {
    auto* d = static_cast<uint8_t*>(dst);
    const auto* s = static_cast<const uint8_t*>(src);
    const size_t head = (32 - reinterpret_cast<uintptr_t>(d) % 32) % 32;
    std::memcpy(d, s, head);
    const size_t body = (n - head) / 128 * 128;
    StreamAvx2(d + head, s + head, body);
    _mm_sfence();  // the stores are weakly ordered: visible before the copy is reported done
    std::memcpy(d + head + body, s + head + body, n - head - body);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

namespace {

// SIGBUS inside a guarded copy (a peer shrank the file behind a mapping) jumps back to the
// guard; any other SIGBUS goes to the handler that was there before (UCX's, the default).
// volatile, and signal fences around the guarded work: the stores to the guard must not be
// moved across the accesses that may fault, nor merged away.
thread_local sigjmp_buf* volatile t_guard = nullptr;
struct sigaction g_previous_bus {};

void OnSigbus(int sig, siginfo_t* info, void* context) {
  if (t_guard != nullptr) siglongjmp(*t_guard, 1);
  if ((g_previous_bus.sa_flags & SA_SIGINFO) != 0 && g_previous_bus.sa_sigaction != nullptr) {
    g_previous_bus.sa_sigaction(sig, info, context);
    return;
  }
  if (g_previous_bus.sa_handler == SIG_IGN) return;
  if (g_previous_bus.sa_handler == SIG_DFL || g_previous_bus.sa_handler == nullptr) {
    signal(SIGBUS, SIG_DFL);
    raise(SIGBUS);
    return;
  }
  g_previous_bus.sa_handler(sig);
}

void InstallSigbusGuard() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa {};
    sa.sa_sigaction = OnSigbus;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, &g_previous_bus);
  });
}

template <class F>
bool Guarded(F&& f) {
  InstallSigbusGuard();
  sigjmp_buf here;
  if (sigsetjmp(here, 1) != 0) {
    t_guard = nullptr;
    return false;
  }
  t_guard = &here;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  f();
  std::atomic_signal_fence(std::memory_order_seq_cst);
  t_guard = nullptr;
  return true;
}

}  // namespace

bool GuardedCopyBytes(void* dst, const void* src, size_t n) {
  return Guarded([&] { CopyBytes(dst, src, n); });
}

bool GuardedTouchPagesForRead(const void* p, size_t n) {
  return Guarded([&] { TouchPagesForRead(p, n); });
}

bool PopulateForRead(const void* p, size_t n) {
#if defined(MADV_POPULATE_READ)
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t first = reinterpret_cast<uintptr_t>(p) / page * page;
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + n;
  if (madvise(reinterpret_cast<void*>(first), end - first, MADV_POPULATE_READ) == 0) return true;
  // EFAULT: a read there would raise SIGBUS. Otherwise (EINVAL: a kernel without it) the
  // touch below finds out what a read meets.
  if (errno == EFAULT) return false;
#endif
  return GuardedTouchPagesForRead(p, n);
}

void TouchPagesForWrite(void* p, size_t n) { std::memset(p, 0, n); }

void TouchPagesForRead(const void* p, size_t n) {
  const volatile uint8_t* b = static_cast<const volatile uint8_t*>(p);
  uint8_t sink = 0;
  for (size_t i = 0; i < n; i += 4096) sink ^= b[i];
  (void)sink;
}

namespace {

int CoresOfThisProcess() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace

ShmCopier::ShmCopier(int threads, uint64_t inline_max_bytes, bool when_busy, int cores)
    : inline_max_bytes_(inline_max_bytes),
      when_busy_(when_busy && inline_max_bytes > 0),
      cores_(cores > 0 ? cores : CoresOfThisProcess()) {
  for (int i = 0; i < std::max(threads, 1); ++i) {
    threads_.emplace_back([this] {
      // Bulk work: a copy thread that wakes does not preempt the thread that woke it (the
      // one posting the next READs, or a protocol thread that has a message to pass on), and
      // is treated as the CPU-bound work it is; its share of the CPU is unchanged (same
      // weight as nice 0). Where the policy cannot be set, the thread copies as it is.
      sched_param none{};
      (void)sched_setscheduler(0, SCHED_BATCH, &none);
      Worker();
    });
  }
}

ShmCopier::~ShmCopier() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    for (auto& r : queue_) r->cancelled = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

std::vector<ShmCopier::Chunk> ShmCopier::Split(const std::vector<CopyPiece>& pieces,
                                               uint64_t chunk_bytes) {
  std::vector<Chunk> chunks;
  size_t i = 0;
  while (i < pieces.size()) {
    if (pieces[i].bytes >= chunk_bytes) {
      for (uint64_t off = 0; off < pieces[i].bytes; off += chunk_bytes) {
        chunks.push_back({i, i + 1, off, std::min(chunk_bytes, pieces[i].bytes - off)});
      }
      ++i;
      continue;
    }
    // Batch consecutive small pieces of the same kind (mapped or CMA).
    Chunk c{i, i, 0, 0};
    const bool mapped = pieces[i].mapped != nullptr;
    while (c.last < pieces.size() && c.last - c.first < kMaxIov &&
           pieces[c.last].bytes < chunk_bytes && (pieces[c.last].mapped != nullptr) == mapped &&
           c.bytes + pieces[c.last].bytes <= chunk_bytes) {
      c.bytes += pieces[c.last].bytes;
      ++c.last;
    }
    i = c.last;
    chunks.push_back(c);
  }
  return chunks;
}

void ShmCopier::PeerJoined(uint64_t peer) {
  std::lock_guard<std::mutex> lock(mu_);
  ++peers_[peer];
  busy_.store(static_cast<int>(peers_.size()) + 1 >= cores_, std::memory_order_relaxed);
}

void ShmCopier::PeerLeft(uint64_t peer) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = peers_.find(peer);
  if (it != peers_.end() && --it->second == 0) peers_.erase(it);
  busy_.store(static_cast<int>(peers_.size()) + 1 >= cores_, std::memory_order_relaxed);
}

void ShmCopier::Submit(CopyJob job) {
  uint64_t total = 0;
  for (const CopyPiece& p : job.pieces) total += p.bytes;
  // On a busy host a job posted among others is copied here (see the constructor's comment).
  const bool busy_inline =
      when_busy_ && job.caller_waits && !job.alone && total <= kBusyInlineBytes && busy();
  // A job alone (its agent waits for nothing else) is copied by the submitting thread and
  // the copy threads together, in chunks small enough for each to take one: the caller
  // waits for it anyway, and starts copying at once instead of after a hand-off.
  const bool helped = inline_max_bytes_ > 0 && job.alone && total > inline_max_bytes_;
  const uint64_t chunk = helped ? std::clamp<uint64_t>(total / (threads_.size() + 1),
                                                       kHelpedChunkMinBytes, kChunkBytes)
                                : kChunkBytes;
  auto r = std::make_shared<Running>();
  r->chunks = Split(job.pieces, chunk);
  r->job = std::move(job);
  if (r->chunks.empty()) {
    r->job.done(Status::OK());
    return;
  }
  if (total <= inline_max_bytes_ || busy_inline || (helped && r->chunks.size() == 1)) {
    for (const Chunk& c : r->chunks) {
      RunChunk(*r, c);
      if (!r->error.ok()) break;
    }
    Status s = r->error;  // only this thread ran the chunks
    r->job.done(std::move(s));
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(r);
    active_.push_back(r);
  }
  cv_.notify_all();
  if (!helped) return;
  // The caller takes chunks too, until none is left to take; whoever ends the last chunk
  // ends the job (here, or on a copy thread).
  for (;;) {
    const size_t index = r->next.fetch_add(1);
    if (index >= r->chunks.size()) break;
    RunClaimed(r, index);
  }
}

void ShmCopier::RunClaimed(const std::shared_ptr<Running>& r, size_t index) {
  if (!r->cancelled) RunChunk(*r, r->chunks[index]);
  if (r->finished.fetch_add(1) + 1 != r->chunks.size()) return;
  Status s;
  {
    std::lock_guard<std::mutex> lock(r->mu);
    s = r->error;
  }
  if (s.ok() && r->cancelled) s = Status::Aborted(StrCat(r->job.describe, ": cancelled"));
  {
    std::lock_guard<std::mutex> lock(mu_);
    active_.erase(std::find(active_.begin(), active_.end(), r));
  }
  r->job.done(std::move(s));
}

bool ShmCopier::Cancel(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& r : active_) {
    if (r->job.id == id) {
      r->cancelled = true;
      return true;
    }
  }
  return false;
}

void ShmCopier::Worker() {
  while (true) {
    std::shared_ptr<Running> r;
    size_t index = 0;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      r = queue_.front();
      index = r->next.fetch_add(1);
      if (index + 1 >= r->chunks.size()) queue_.pop_front();  // all chunks claimed
    }
    if (index >= r->chunks.size()) continue;  // (the caller took the rest)
    RunClaimed(r, index);
  }
}

void ShmCopier::RunChunk(Running& r, const Chunk& c) {
  const CopyJob& job = r.job;
  std::vector<iovec> local, remote;
  for (size_t i = c.first; i < c.last; ++i) {
    const CopyPiece& p = job.pieces[i];
    const uint64_t off = (c.first + 1 == c.last) ? c.offset : 0;
    const uint64_t n = (c.first + 1 == c.last) ? c.bytes : p.bytes;
    if (p.mapped != nullptr) {
      const bool copied = job.read ? GuardedCopyBytes(p.local + off, p.mapped + off, n)
                                   : GuardedCopyBytes(p.mapped + off, p.local + off, n);
      if (!copied) {
        std::lock_guard<std::mutex> lock(r.mu);
        if (r.error.ok()) {
          r.error = Status::IoError(
              StrCat(job.describe,
                     ": the peer's shared file ends before the registered region does "
                     "(SIGBUS at byte ",
                     off, " of a ", p.bytes,
                     "-byte row: the peer shrank or truncated memory it registered)"));
        }
        return;
      }
      continue;
    }
    local.push_back({p.local + off, n});
    remote.push_back({reinterpret_cast<void*>(static_cast<uintptr_t>(p.remote + off)), n});
  }
  if (local.empty()) return;
  uint64_t want = 0;
  for (const iovec& v : local) want += v.iov_len;
  ssize_t got =
      job.read
          ? process_vm_readv(job.pid, local.data(), local.size(), remote.data(), remote.size(), 0)
          : process_vm_writev(job.pid, local.data(), local.size(), remote.data(), remote.size(), 0);
  if (got == static_cast<ssize_t>(want)) return;
  const int err = errno;
  std::lock_guard<std::mutex> lock(r.mu);
  if (!r.error.ok()) return;
  if (got < 0 && err == ESRCH) {
    r.error = Status::Unavailable(StrCat(job.describe, ": peer unreachable: the process is gone"));
  } else if (got < 0 && err == EPERM) {
    r.error = Status::Unavailable(StrCat(job.describe,
                                         ": the kernel denies cross-process memory "
                                         "access (ptrace permission); use transport tcp "
                                         "(EPLBX_TRANSPORT=tcp) or AllocateShared memory"));
  } else {
    r.error = Status::IoError(StrCat(job.describe, ": cross-process copy moved ", got < 0 ? 0 : got,
                                     " of ", want,
                                     " bytes: ", got < 0 ? std::strerror(err) : "short copy",
                                     " (did the peer free a registered region?)"));
  }
}

Status ShmCopier::Probe(pid_t pid, uint64_t addr, uint64_t expected) {
  uint64_t value = 0;
  iovec local{&value, sizeof(value)};
  iovec remote{reinterpret_cast<void*>(static_cast<uintptr_t>(addr)), sizeof(value)};
  ssize_t got = process_vm_readv(pid, &local, 1, &remote, 1, 0);
  if (got != static_cast<ssize_t>(sizeof(value))) {
    return Status::Unavailable(StrCat("process_vm_readv of pid ", pid, ": ",
                                      got < 0 ? std::strerror(errno) : "short read"));
  }
  if (value != expected) {
    return Status::Unavailable(StrCat("pid ", pid,
                                      " is not the peer agent (probe mismatch; "
                                      "same host id but another pid namespace?)"));
  }
  return Status::OK();
}

}  // namespace eplbx::internal
