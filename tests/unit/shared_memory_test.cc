// Same-host shared memory: finding the file behind a registered range, mapping it at any
// offset, and the streaming copy of the mapped path. Transfers over it between real
// processes are in tests/multiproc/ (variant shm_file).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <future>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "eplbx/transfer.h"
#include "transfer/shm/copier.h"
#include "transfer/shm/shared_file.h"

namespace eplbx {
namespace {

using internal::FindInMaps;

constexpr char kMaps[] =
    "55d0a0000000-55d0a0021000 r--p 00000000 fd:01 1234    /usr/bin/python3.11\n"
    "7f0000000000-7f0000400000 rw-s 00000000 00:1b 6449    /dev/shm/torch_1_2_0 (deleted)\n"
    "7f0000400000-7f0000500000 rw-s 00400000 00:1b 6449    /dev/shm/torch_1_2_0 (deleted)\n"
    "7f0000500000-7f0000600000 rw-s 00000000 00:1b 7777    /memfd:eplbx (deleted)\n"
    "7f0000600000-7f0000700000 rw-p 00000000 00:00 0 \n"
    "7f0000700000-7f0000800000 rw-s 00900000 00:1b 7777    /memfd:eplbx (deleted)\n"
    "7f0000800000-7f0000900000 r--s 00000000 fd:01 4242    /models/experts.safetensors\n"
    "7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0       [stack]\n";

TEST(FindInMapsTest, FindsTheFileAndTheOffset) {
  auto m = FindInMaps(kMaps, 0x7f0000001000, 4096);
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->dev_major, 0u);
  EXPECT_EQ(m->dev_minor, 0x1bu);
  EXPECT_EQ(m->inode, 6449u);
  EXPECT_EQ(m->offset, 0x1000u);
  EXPECT_EQ(m->start, 0x7f0000000000u);
  // Across two lines of one file, contiguous in address and offset.
  m = FindInMaps(kMaps, 0x7f00003ff000, 0x2000);
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->offset, 0x3ff000u);
  // Starting in the second line: its own offset counts.
  m = FindInMaps(kMaps, 0x7f0000400010, 16);
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->offset, 0x400010u);
}

TEST(FindInMapsTest, RejectsWhatPeersCannotMap) {
  EXPECT_FALSE(FindInMaps(kMaps, 0x55d0a0000000, 16));  // private file mapping
  EXPECT_FALSE(FindInMaps(kMaps, 0x7f0000600000, 16));  // anonymous
  EXPECT_FALSE(FindInMaps(kMaps, 0x7ffd00000000, 16));  // stack
  EXPECT_FALSE(FindInMaps(kMaps, 0x7f0000800000, 16));  // shared but read-only
  EXPECT_FALSE(FindInMaps(kMaps, 0x7f0000a00000, 16));  // not mapped
  // Runs into another file, into anonymous memory, or past the end of the maps.
  EXPECT_FALSE(FindInMaps(kMaps, 0x7f00004ff000, 0x2000));
  EXPECT_FALSE(FindInMaps(kMaps, 0x7f00005ff000, 0x2000));
  EXPECT_FALSE(FindInMaps(kMaps, 0x7ffd00020000, 0x2000));
  // Same file, adjacent addresses, but not contiguous in the file.
  const char gap[] =
      "7f0000000000-7f0000001000 rw-s 00000000 00:1b 5 /dev/shm/x\n"
      "7f0000001000-7f0000002000 rw-s 00005000 00:1b 5 /dev/shm/x\n";
  EXPECT_FALSE(FindInMaps(gap, 0x7f0000000800, 0x1000));
  EXPECT_FALSE(FindInMaps("garbage\n\n", 0x1000, 1));
}

// A MAP_SHARED mapping of an unlinked /dev/shm file, like torch's share_memory_().
struct ShmFile {
  int fd = -1;
  uint8_t* map = nullptr;
  size_t bytes = 0;
  explicit ShmFile(size_t n, off_t map_offset = 0) : bytes(n) {
    const std::string path = "/eplbx-unit-" + std::to_string(getpid());
    fd = shm_open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    EXPECT_GE(fd, 0);
    shm_unlink(path.c_str());
    EXPECT_EQ(ftruncate(fd, map_offset + static_cast<off_t>(n)), 0);
    void* m = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, map_offset);
    EXPECT_NE(m, MAP_FAILED);
    map = static_cast<uint8_t*>(m);
  }
  ~ShmFile() {
    munmap(map, bytes);
    close(fd);
  }
};

TEST(SharedFileTest, RegisteredFileMemoryIsSharedAndMapsAtItsOffset) {
  ShmFile file(1 << 20, 8192);
  for (size_t i = 0; i < file.bytes; ++i) file.map[i] = static_cast<uint8_t>(i * 7);
  auto found = internal::FindSharedFile(file.map + 100, 5000);
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->offset, 8192u + 100);
  EXPECT_NE(found->fd, file.fd);  // our own fd, closed with the region
  void* base = nullptr;
  size_t map_bytes = 0;
  Result<uint8_t*> p = internal::MapPeerFile(found->fd, found->offset, 5000, &base, &map_bytes);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(std::memcmp(*p, file.map + 100, 5000), 0);
  (*p)[0] ^= 0xff;  // the same pages, not a copy
  EXPECT_EQ(file.map[100], static_cast<uint8_t>((100 * 7) ^ 0xff));
  munmap(base, map_bytes);
  // A region that claims more than the file holds is not mapped (it would fault).
  EXPECT_FALSE(internal::MapPeerFile(found->fd, found->offset, 2 << 20, &base, &map_bytes).ok());
  close(found->fd);

  std::vector<uint8_t> heap(1 << 16);
  EXPECT_FALSE(internal::FindSharedFile(heap.data(), heap.size()).has_value());
}

TEST(SharedFileTest, AgentPublishesFileMemoryAsShared) {
  AgentConfig config;
  config.backend = "loopback";
  auto agent = Agent::Create("a", config);
  ASSERT_TRUE(agent.ok()) << agent.status().ToString();
  ShmFile file(1 << 20);
  auto shared = (*agent)->RegisterMemory(file.map + 64, 4096);
  ASSERT_TRUE(shared.ok()) << shared.status().ToString();
  EXPECT_TRUE(shared->shared());
  std::vector<uint8_t> heap(4096);
  auto plain = (*agent)->RegisterMemory(heap.data(), heap.size());
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE(plain->shared());
  // Deregistering leaves the user's mapping alone.
  *shared = RegisteredRegion();
  file.map[64] = 1;
  EXPECT_EQ(file.map[64], 1);
}

TEST(CopyBytesTest, EverySizeAndAlignmentCopiesExactly) {
  std::mt19937_64 rng(3);
  std::vector<uint8_t> src((2 << 20) + 512), dst(src.size());
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  const size_t sizes[] = {0,
                          1,
                          31,
                          4096,
                          internal::kStreamMinBytes - 1,
                          internal::kStreamMinBytes,
                          internal::kStreamMinBytes + 1,
                          internal::kStreamMinBytes + 127,
                          (1 << 20) + 333,
                          2 << 20};
  for (size_t n : sizes) {
    for (size_t d_off : {0, 1, 17, 32, 63}) {
      for (size_t s_off : {0, 5, 32}) {
        std::fill(dst.begin(), dst.end(), 0xee);
        internal::CopyBytes(dst.data() + d_off, src.data() + s_off, n);
        ASSERT_EQ(std::memcmp(dst.data() + d_off, src.data() + s_off, n), 0)
            << n << " bytes, dst +" << d_off << ", src +" << s_off;
        for (size_t i = 0; i < d_off; ++i) ASSERT_EQ(dst[i], 0xee) << "wrote before the range";
        for (size_t i = d_off + n; i < dst.size(); ++i)
          ASSERT_EQ(dst[i], 0xee) << "wrote past the range";
      }
    }
  }
}

// A peer that shrinks a shared file it registered: reading (or writing) the mapping past the
// new end raises SIGBUS. Before, that killed the reading rank in the copy thread (issue 17,
// item 7); now the copy fails with a named error and the process goes on.
TEST(CopyBytesTest, AShrunkSharedFileFailsTheCopyInsteadOfKillingTheProcess) {
  const int fd = memfd_create("eplbx_shrink_test", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  const size_t bytes = 1 << 20;
  ASSERT_EQ(ftruncate(fd, bytes), 0);
  auto* m = static_cast<uint8_t*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  ASSERT_NE(m, MAP_FAILED);
  std::memset(m, 7, bytes);
  std::vector<uint8_t> local(bytes, 0);
  EXPECT_TRUE(internal::PopulateForRead(m + 1, bytes - 1));
  EXPECT_TRUE(internal::GuardedCopyBytes(local.data(), m, bytes));
  ASSERT_EQ(ftruncate(fd, 4096), 0);  // the "peer" shrinks it
  EXPECT_FALSE(internal::GuardedCopyBytes(local.data(), m + 8192, 65536));
  EXPECT_FALSE(internal::GuardedCopyBytes(m + 8192, local.data(), 65536));  // a WRITE
  EXPECT_FALSE(internal::GuardedTouchPagesForRead(m, bytes));
  EXPECT_FALSE(internal::PopulateForRead(m, bytes));  // what a peer's connect does
  EXPECT_FALSE(internal::PopulateForRead(m + 100, bytes - 200));
  EXPECT_TRUE(internal::PopulateForRead(m, 4096));
  EXPECT_TRUE(internal::PopulateForRead(m + 100, 3000));
  EXPECT_TRUE(internal::GuardedCopyBytes(local.data(), m, 4096));  // what is left still reads
  // Through the copier, as a READ of a mapped peer region runs: the job fails by name.
  internal::ShmCopier copier(2);
  std::promise<Status> result;
  internal::CopyJob job;
  job.id = 1;
  job.pid = getpid();
  job.describe = {.agent = "a", .peer = "peer", .op = "READ", .path = "shm", .pid = getpid()};
  job.pieces.push_back({local.data(), 0, m + (512 << 10), 256 << 10});
  job.done = [&](Status s) { result.set_value(std::move(s)); };
  copier.Submit(std::move(job));
  const Status s = result.get_future().get();
  EXPECT_EQ(s.code(), Code::kIoError) << s.ToString();
  EXPECT_NE(s.message().find("agent 'a': READ with 'peer' (pid " + std::to_string(getpid()) +
                             ", shm): the peer's shared file ends before the registered "
                             "region does (SIGBUS"),
            std::string::npos)
      << s.ToString();
  munmap(m, bytes);
  close(fd);
}

// Submits `job` and waits for its end; *calls counts its `done` calls (one expected).
Status SubmitAndWait(internal::ShmCopier& copier, internal::CopyJob job, std::atomic<int>* calls) {
  auto result = std::make_shared<std::promise<Status>>();
  job.done = [calls, result](Status s) {
    if (calls->fetch_add(1) == 0) result->set_value(std::move(s));
  };
  copier.Submit(std::move(job));
  return result->get_future().get();
}

// Jobs alone (their agent waits for nothing else) are copied by the submitting thread and
// the copy threads together; queued jobs by the copy threads; small ones inline (and, on a
// busy host, jobs among others of at most kBusyInlineBytes). Whatever
// the route: every byte lands, `done` runs exactly once, a failure is named once. Random
// jobs (CMA from this process itself), alone or not, one to five pieces of 1 KiB to 9 MiB.
TEST(ShmCopierTest, JobsAloneAreHelpedByTheCallerAndEveryByteLandsOnce) {
  std::mt19937_64 rng(5);
  const size_t kBytes = 24u << 20;
  std::vector<uint8_t> src(kBytes), dst(kBytes);
  for (size_t i = 0; i < kBytes; ++i) src[i] = static_cast<uint8_t>(rng());
  for (int config = 0; config < 3; ++config) {
    const uint64_t inline_max = config == 0 ? 0 : uint64_t{256} << 10;
    internal::ShmCopier copier(2, inline_max, /*when_busy=*/true, /*cores=*/2);
    if (config == 2) copier.PeerJoined(1);  // a busy host: jobs among others inline too
    ASSERT_EQ(copier.busy(), config == 2);
    for (int job_index = 0; job_index < 120; ++job_index) {
      std::fill(dst.begin(), dst.end(), 0);
      internal::CopyJob job;
      job.id = static_cast<uint64_t>(job_index) + 1;
      job.pid = getpid();
      job.read = true;
      job.alone = rng() % 3 != 0;
      job.caller_waits = rng() % 2 == 0;
      std::vector<std::pair<size_t, size_t>> ranges;  // (offset, bytes), disjoint
      size_t at = 0;
      for (int k = 1 + static_cast<int>(rng() % 5); k > 0; --k) {
        const size_t n = size_t{1024} << (rng() % 14);  // 1 KiB .. 8 MiB
        const size_t bytes = std::min(n + rng() % 4096, kBytes - at);
        if (bytes == 0) break;
        ranges.push_back({at, bytes});
        job.pieces.push_back(
            {dst.data() + at, reinterpret_cast<uint64_t>(src.data() + at), nullptr, bytes});
        at += bytes + 64;
        if (at >= kBytes) break;
      }
      std::atomic<int> calls{0};
      const Status s = SubmitAndWait(copier, std::move(job), &calls);
      ASSERT_TRUE(s.ok()) << s.ToString();
      for (const auto& [off, bytes] : ranges) {
        ASSERT_EQ(std::memcmp(dst.data() + off, src.data() + off, bytes), 0)
            << "job " << job_index << ", bytes " << off << " + " << bytes;
      }
      EXPECT_EQ(calls.load(), 1);
    }
    // A job alone whose source is not mapped in the peer: one named failure, the job named
    // from its parts as a data path names it (put together only for the message).
    internal::CopyJob bad;
    bad.id = 999;
    bad.pid = getpid();
    bad.alone = true;
    bad.describe = {.agent = "a", .peer = "self", .op = "READ", .path = "shm", .pid = getpid()};
    bad.pieces.push_back({dst.data(), 8, nullptr, 2u << 20});  // address 8: never mapped
    std::atomic<int> calls{0};
    const Status s = SubmitAndWait(copier, std::move(bad), &calls);
    EXPECT_EQ(s.code(), Code::kIoError) << s.ToString();
    EXPECT_NE(s.message().find("agent 'a': READ with 'self' (pid " + std::to_string(getpid()) +
                               ", shm): cross-process copy moved"),
              std::string::npos)
        << s.ToString();
    EXPECT_EQ(calls.load(), 1);
  }
}

// On a busy host (as many agents, this one and its same-host peers, as cores) a job whose
// caller waits for it with nothing else to do, posted among others and of at most
// kBusyInlineBytes, is copied by the thread that posts it, before Submit returns; elsewhere,
// or larger, or when the caller goes on with other work, or with the rule off, by a copy
// thread. A peer connected through two paths counts once and leaves with its last path.
TEST(ShmCopierTest, OnABusyHostAJobItsCallerWaitsForIsCopiedByTheCaller) {
  std::vector<uint8_t> src((2u << 20) + 1, 7), dst(src.size(), 0);
  // Whether `done` ran on this thread (before Submit returned) rather than a copy thread.
  auto copied_here = [&](internal::ShmCopier& copier, uint64_t bytes, bool waits = true) {
    internal::CopyJob job;
    job.id = 1;
    job.pid = getpid();
    job.caller_waits = waits;
    job.pieces.push_back({dst.data(), reinterpret_cast<uint64_t>(src.data()), nullptr, bytes});
    auto ran_on = std::make_shared<std::promise<std::thread::id>>();
    job.done = [ran_on](Status s) {
      EXPECT_TRUE(s.ok()) << s.ToString();
      ran_on->set_value(std::this_thread::get_id());
    };
    std::fill(dst.begin(), dst.end(), 0);
    copier.Submit(std::move(job));
    const bool here = ran_on->get_future().get() == std::this_thread::get_id();
    EXPECT_EQ(std::memcmp(dst.data(), src.data(), bytes), 0);
    return here;
  };
  const uint64_t kMax = internal::ShmCopier::kBusyInlineBytes;
  {
    internal::ShmCopier copier(2, 256u << 10, /*when_busy=*/true, /*cores=*/3);
    EXPECT_FALSE(copied_here(copier, 512u << 10));  // one agent on 3 cores
    copier.PeerJoined(11);
    EXPECT_FALSE(copier.busy());  // two agents on 3 cores
    EXPECT_FALSE(copied_here(copier, 512u << 10));
    copier.PeerJoined(12);
    copier.PeerJoined(12);  // the same peer through a second path
    EXPECT_TRUE(copier.busy());
    EXPECT_TRUE(copied_here(copier, 512u << 10));
    EXPECT_TRUE(copied_here(copier, kMax));
    EXPECT_FALSE(copied_here(copier, kMax + 1));
    EXPECT_FALSE(copied_here(copier, 512u << 10, /*waits=*/false));  // an engine's thread
    EXPECT_TRUE(copied_here(copier, 100u << 10, false));             // small: inline anyway
    copier.PeerLeft(12);
    EXPECT_TRUE(copier.busy());  // still connected through the other path
    copier.PeerLeft(12);
    EXPECT_FALSE(copier.busy());
    EXPECT_FALSE(copied_here(copier, 512u << 10));
    copier.PeerLeft(99);  // never joined: nothing changes
    EXPECT_FALSE(copier.busy());
  }
  for (const bool rule_on : {false, true}) {  // the rule off, or inline copies off altogether
    internal::ShmCopier copier(2, rule_on ? 0 : 256u << 10, rule_on, 2);
    copier.PeerJoined(11);
    EXPECT_FALSE(copied_here(copier, 512u << 10)) << rule_on;
  }
}

}  // namespace
}  // namespace eplbx
