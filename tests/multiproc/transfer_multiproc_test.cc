// Transfers between real processes over real UCX, for every transport: bytes, notifications,
// bounds, malformed metadata, and peers that die (SIGKILL) or stop (SIGSTOP).
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <numeric>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "eplbx/transfer.h"
#include "multiproc/child.h"
#include "multiproc/peer_util.h"
#include "transfer/metadata.h"
#include "transfer/ucx/ucx_path.h"

namespace eplbx {
namespace {

using std::chrono::milliseconds;
using testing::Child;
using testing::Fnv1a;
using testing::PatternByte;

constexpr int kPeerTimeoutMs = 2000;

struct Variant {
  const char* label;
  Transport transport;
  const char* memory;  // the peer's buffer: plain, allocate (AllocateShared) or file
  // Notifications through the peer's inbox (same host); false: over UCX as between hosts
  // (EPLBX_LOCAL_NOTIFY=0 here and in the peer process, which inherits it).
  bool local_notify = true;
};
void PrintTo(const Variant& v, std::ostream* os) { *os << v.label; }  // readable test names

// A peer process with a buffer of `bytes` filled with PatternByte(seed, offset).
struct RemotePeer {
  std::unique_ptr<Child> child;
  std::string blob;
  uint64_t base = 0;
  uint64_t size = 0;

  static RemotePeer Start(const std::string& name, uint64_t bytes, uint64_t seed,
                          const char* memory) {
    RemotePeer p;
    std::vector<std::string> argv = {EPLBX_XFER_PEER,
                                     "--name",
                                     name,
                                     "--bytes",
                                     std::to_string(bytes),
                                     "--seed",
                                     std::to_string(seed),
                                     "--timeout-ms",
                                     std::to_string(kPeerTimeoutMs)};
    argv.push_back("--memory");
    argv.push_back(memory);
    p.child = std::make_unique<Child>(argv);
    p.blob = testing::FromHex(p.child->Expect("META "));
    p.base = std::stoull(p.child->Expect("BASE "));
    p.size = std::stoull(p.child->Expect("SIZE "));
    return p;
  }
  uint64_t Hash(uint64_t off, uint64_t len) {
    child->Send("HASH " + std::to_string(off) + " " + std::to_string(len));
    return std::stoull(child->Expect("HASH "));
  }
};

class TransferMultiProcTest : public ::testing::TestWithParam<Variant> {
 protected:
  void SetUp() override {
    if (GetParam().local_notify) {
      unsetenv("EPLBX_LOCAL_NOTIFY");
    } else {
      setenv("EPLBX_LOCAL_NOTIFY", "0", 1);
    }
  }
  std::unique_ptr<Agent> MakeAgent(const std::string& name) {
    AgentConfig config;
    config.transport = GetParam().transport;
    config.peer_timeout = milliseconds(kPeerTimeoutMs);
    auto agent = Agent::Create(name, config);
    EXPECT_TRUE(agent.ok()) << agent.status().ToString();
    return agent.ok() ? std::move(*agent) : nullptr;
  }
};

// Random non-overlapping placement of `sizes` in a buffer, in a random order with gaps.
std::vector<uint64_t> Place(const std::vector<uint64_t>& sizes, uint64_t capacity,
                            std::mt19937_64& rng) {
  std::vector<size_t> order(sizes.size());
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<uint64_t> at(sizes.size());
  uint64_t cursor = 0;
  for (size_t i : order) {
    cursor += rng() % 64;
    at[i] = cursor;
    cursor += sizes[i];
  }
  EXPECT_LE(cursor, capacity);
  return at;
}

TEST_P(TransferMultiProcTest, RandomDescriptorListsMoveTheRightBytes) {
  constexpr uint64_t kBytes = 150ull << 20;
  constexpr uint64_t kPeerSeed = 11;
  RemotePeer peer = RemotePeer::Start("peer", kBytes, kPeerSeed, GetParam().memory);
  ASSERT_FALSE(peer.blob.empty());
  auto agent = MakeAgent("tester");
  ASSERT_NE(agent, nullptr);
  std::vector<uint8_t> local(kBytes);
  auto region = agent->RegisterMemory(local.data(), local.size());
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  auto pid = agent->Connect(peer.blob);
  ASSERT_TRUE(pid.ok()) << pid.status().ToString();
  const Transport expected =
      GetParam().transport == Transport::kAuto ? Transport::kShm : GetParam().transport;
  EXPECT_EQ(agent->Peer(*pid)->transport, expected);
  if (std::string(GetParam().memory) == "file" && expected == Transport::kShm) {
    // The peer's file memory is mapped here (the memcpy path), not read through CMA.
    std::ifstream maps("/proc/self/maps");
    std::stringstream text;
    text << maps.rdbuf();
    EXPECT_NE(text.str().find("/dev/shm/eplbx-xfer-peer-"), std::string::npos);
  }

  std::mt19937_64 rng(5);
  // Many tiny, some medium, and 64 MiB descriptors; sizes from 1 byte up.
  std::vector<std::vector<uint64_t>> rounds = {{}, {}, {64ull << 20, 1 + rng() % (60ull << 20)}};
  for (int i = 0; i < 300; ++i) rounds[0].push_back(1 + rng() % 8192);
  for (int i = 0; i < 40; ++i) rounds[1].push_back(1 + rng() % (1 << 20));
  for (bool write : {false, true}) {
    for (const auto& sizes : rounds) {
      std::vector<uint64_t> lo = Place(sizes, kBytes, rng), ro = Place(sizes, kBytes, rng);
      std::vector<Descriptor> l, r;
      for (size_t i = 0; i < sizes.size(); ++i) {
        l.push_back(Descriptor::Of(local.data() + lo[i], sizes[i]));
        r.push_back({peer.base + ro[i], sizes[i]});
        if (write) testing::FillPattern(local.data() + lo[i], sizes[i], 99 + i, ro[i]);
      }
      auto id = write ? agent->Write(*pid, l, r) : agent->Read(*pid, l, r);
      ASSERT_TRUE(id.ok()) << id.status().ToString();
      TransferStatus s = agent->Wait(*id, std::chrono::seconds(60));
      ASSERT_EQ(s.state, TransferState::kDone) << s.error.ToString();
      for (size_t i = 0; i < sizes.size(); ++i) {
        if (write) {
          ASSERT_EQ(peer.Hash(ro[i], sizes[i]), Fnv1a(local.data() + lo[i], sizes[i]))
              << "WRITE descriptor " << i << " of " << sizes.size() << ", " << sizes[i] << " bytes";
        } else {
          for (uint64_t k = 0; k < sizes[i]; ++k) {
            ASSERT_EQ(local[lo[i] + k], PatternByte(kPeerSeed, ro[i] + k))
                << "READ descriptor " << i << " byte " << k;
          }
        }
      }
      EXPECT_TRUE(agent->Release(*id).ok());
    }
  }
  peer.child->Send("QUIT");
}

TEST_P(TransferMultiProcTest, NotificationsArriveAfterTheData) {
  constexpr uint64_t kBytes = 72ull << 20;  // 8 writes of 8 MiB, then a read past them
  RemotePeer peer = RemotePeer::Start("peer", kBytes, 3, GetParam().memory);
  auto agent = MakeAgent("writer");
  ASSERT_NE(agent, nullptr);
  std::vector<uint8_t> local(kBytes);
  auto region = agent->RegisterMemory(local.data(), local.size());
  ASSERT_TRUE(region.ok());
  auto pid = agent->Connect(peer.blob);
  ASSERT_TRUE(pid.ok()) << pid.status().ToString();
  constexpr int kWrites = 8;
  const uint64_t read_hash =
      peer.Hash(64ull << 20, 4096);  // before EXPECT: the peer answers in order
  peer.child->Send("EXPECT " + std::to_string(kWrites + 1) + " 30000");
  std::vector<TransferId> ids;
  for (int k = 0; k < kWrites; ++k) {
    const uint64_t off = k * (8ull << 20), len = 8ull << 20;
    testing::FillPattern(local.data() + off, len, 1000 + k, 0);
    const uint64_t hash = Fnv1a(local.data() + off, len);
    Descriptor l = Descriptor::Of(local.data() + off, len), r{peer.base + off, len};
    auto id = agent->Write(
        *pid, {&l, 1}, {&r, 1},
        "CHECK " + std::to_string(off) + " " + std::to_string(len) + " " + std::to_string(hash));
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    ids.push_back(*id);
  }
  // A READ's notification reaches the peer too (its bytes are unchanged there).
  Descriptor l = Descriptor::Of(local.data() + (64ull << 20), 4096),
             r{peer.base + (64ull << 20), 4096};
  auto rid =
      agent->Read(*pid, {&l, 1}, {&r, 1},
                  "CHECK " + std::to_string(64ull << 20) + " 4096 " + std::to_string(read_hash));
  ASSERT_TRUE(rid.ok());
  ids.push_back(*rid);
  for (TransferId id : ids)
    EXPECT_EQ(agent->Wait(id, std::chrono::seconds(30)).state, TransferState::kDone);
  for (int k = 0; k < kWrites + 1; ++k) {
    EXPECT_EQ(peer.child->Expect("NOTIFY "), "writer OK") << "notification " << k;
  }
}

// NotifyMany: every payload arrives once, in order with Notify's before and after, as a
// notification of its own, though the UCX channel packs them into 64 KiB messages (here
// 4,100 small payloads split over the 4,096-a-message limit, and a 60 KiB one that goes
// alone). ReadMany: each READ lands and its notification follows its bytes; one with a
// bad descriptor among them fails alone.
TEST_P(TransferMultiProcTest, NotifyManyAndReadManyKeepOrderAndEachTransfer) {
  constexpr uint64_t kBytes = 8ull << 20;
  constexpr uint64_t kPeerSeed = 21;
  RemotePeer peer = RemotePeer::Start("peer", kBytes, kPeerSeed, GetParam().memory);
  ASSERT_FALSE(peer.blob.empty());
  auto agent = MakeAgent("batcher");
  ASSERT_NE(agent, nullptr);
  std::vector<uint8_t> local(kBytes, 0);
  auto region = agent->RegisterMemory(local.data(), local.size());
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  auto pid = agent->Connect(peer.blob);
  ASSERT_TRUE(pid.ok()) << pid.status().ToString();

  std::vector<std::string> expected;  // "<size> <first word>"
  auto note = [&](const std::string& p) {
    expected.push_back(std::to_string(p.size()) + " " + p.substr(0, p.find(' ')));
  };
  std::vector<std::string> batch;
  for (int i = 0; i < 4100; ++i) {
    std::string p = "m";
    p += std::to_string(i);
    batch.push_back(std::move(p));
  }
  batch.insert(batch.begin() + 7, "big " + std::string(60 << 10, 'x'));
  ASSERT_TRUE(agent->Notify(*pid, "first").ok());
  note("first");
  for (const std::string& p : batch) note(p);
  std::vector<Status> sent = agent->NotifyMany(*pid, batch);
  ASSERT_EQ(sent.size(), batch.size());
  for (const Status& s : sent) EXPECT_TRUE(s.ok()) << s.ToString();
  // One oversized payload is refused by name; the ones around it go.
  std::vector<std::string> mixed = {"before", std::string(Agent::kMaxNotificationBytes + 1, 'o'),
                                    "after"};
  sent = agent->NotifyMany(*pid, mixed);
  ASSERT_EQ(sent.size(), 3u);
  EXPECT_TRUE(sent[0].ok() && sent[2].ok());
  EXPECT_EQ(sent[1].code(), Code::kInvalidArgument) << sent[1].ToString();
  note("before");
  note("after");
  ASSERT_TRUE(agent->Notify(*pid, "last").ok());
  note("last");
  peer.child->Send("ECHO " + std::to_string(expected.size()) + " 30000");
  for (size_t i = 0; i < expected.size(); ++i) {
    ASSERT_EQ(peer.child->Expect("GOT "), "batcher " + expected[i]) << "notification " << i;
  }

  // ReadMany: 12 READs of 256 KiB at scattered offsets, the 5th out of the peer's bounds.
  std::vector<Agent::ReadRequest> reads;
  constexpr uint64_t kRow = 256u << 10;
  for (uint64_t i = 0; i < 12; ++i) {
    Agent::ReadRequest r;
    r.peer = *pid;
    const uint64_t src = ((i * 7) % 12) * kRow + 64 * i;
    r.local = {Descriptor::Of(local.data() + i * kRow, kRow - 64)};
    r.remote = {{peer.base + (i == 4 ? kBytes : src), kRow - 64}};
    r.notify = "CHECK " + std::to_string(src) + " " + std::to_string(kRow - 64) + " " +
               std::to_string(peer.Hash(src, kRow - 64));
    reads.push_back(std::move(r));
  }
  peer.child->Send("EXPECT 11 30000");
  std::vector<Result<TransferId>> ids = agent->ReadMany(reads);
  ASSERT_EQ(ids.size(), reads.size());
  EXPECT_EQ(ids[4].status().code(), Code::kOutOfRange) << ids[4].status().ToString();
  for (uint64_t i = 0; i < reads.size(); ++i) {
    if (i == 4) continue;
    ASSERT_TRUE(ids[i].ok()) << ids[i].status().ToString();
    TransferStatus st = agent->Wait(*ids[i], std::chrono::seconds(30));
    ASSERT_EQ(st.state, TransferState::kDone) << st.error.ToString();
    const uint64_t src = ((i * 7) % 12) * kRow + 64 * i;
    for (uint64_t k = 0; k < kRow - 64; k += 4093) {
      ASSERT_EQ(local[i * kRow + k], PatternByte(kPeerSeed, src + k)) << "READ " << i;
    }
  }
  for (int k = 0; k < 11; ++k) EXPECT_EQ(peer.child->Expect("NOTIFY "), "batcher OK") << k;
  peer.child->Send("QUIT");
}

// Notifications sent while READs keep the agent busy: a Notify or NotifyMany leaves on the
// calling thread when the UCX progress thread sleeps and is queued to it otherwise
// (docs/transfer.md); either way a peer gets every payload once, in the order sent. One
// thread sends 1,500 payloads, alone and in batches, while another READs 1 MiB at a time
// (over tcp the progress thread drives those READs: it is busy, and sends queue behind it).
TEST_P(TransferMultiProcTest, NotificationsKeepTheirOrderWhileReadsKeepTheAgentBusy) {
  constexpr uint64_t kBytes = 8ull << 20;
  RemotePeer peer = RemotePeer::Start("peer", kBytes, 23, GetParam().memory);
  ASSERT_FALSE(peer.blob.empty());
  auto agent = MakeAgent("sender");
  ASSERT_NE(agent, nullptr);
  std::vector<uint8_t> local(1u << 20, 0);
  auto region = agent->RegisterMemory(local.data(), local.size());
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  auto pid = agent->Connect(peer.blob);
  ASSERT_TRUE(pid.ok()) << pid.status().ToString();
  std::atomic<bool> stop{false};
  std::atomic<int> reads{0};
  std::thread reader([&] {
    const Descriptor l = Descriptor::Of(local.data(), local.size());
    for (uint64_t i = 0; !stop; ++i) {
      const Descriptor r{peer.base + (i % 8) * local.size(), local.size()};
      auto id = agent->Read(*pid, {&l, 1}, {&r, 1});
      if (!id.ok() || agent->Wait(*id, std::chrono::seconds(30)).state != TransferState::kDone) {
        ADD_FAILURE() << "READ " << i << " failed";
        return;
      }
      (void)agent->Release(*id);
      ++reads;
    }
  });
  std::vector<std::string> expected;
  auto payload = [&](char kind, int i) {
    std::string p(1, kind);
    p += std::to_string(i);
    expected.push_back(std::to_string(p.size()));
    expected.back() += ' ';
    expected.back() += p;
    return p;
  };
  // At least 1,500 payloads, and on until a READ completed meanwhile.
  for (int i = 0; (i < 1500 || reads < 1) && i < 400000;) {
    if (i % 7 == 0) {
      std::vector<std::string> batch;
      for (int k = 0; k < 5; ++k, ++i) batch.push_back(payload('b', i));
      for (const Status& st : agent->NotifyMany(*pid, batch)) ASSERT_TRUE(st.ok()) << st.ToString();
    } else {
      ASSERT_TRUE(agent->Notify(*pid, payload('n', i++)).ok());
    }
  }
  stop = true;
  reader.join();
  EXPECT_GE(reads.load(), 1);
  peer.child->Send("ECHO " + std::to_string(expected.size()) + " 30000");
  for (size_t i = 0; i < expected.size(); ++i) {
    ASSERT_EQ(peer.child->Expect("GOT "), "sender " + expected[i]) << "notification " << i;
  }
  peer.child->Send("QUIT");
}

// Resident KiB of our mapping of the peer's shared file (-1: not mapped here).
int64_t MappedPeerRssKib() {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool in_mapping = false;
  while (std::getline(smaps, line)) {
    if (line.find(" /dev/shm/eplbx-xfer-peer-") != std::string::npos) in_mapping = true;
    if (in_mapping && line.rfind("Rss:", 0) == 0) return std::stoll(line.substr(4));
  }
  return -1;
}

// A peer process with --memory file and a same-host agent connected to it (its file
// mapped here), with `local_bytes` of registered memory to read into.
struct ShmReader {
  RemotePeer peer;
  std::unique_ptr<Agent> agent;
  std::vector<uint8_t> local;
  RegisteredRegion region;
  PeerId pid = 0;

  void Start(uint64_t peer_bytes, uint64_t seed, size_t local_bytes, int64_t prefault_bytes = -1) {
    peer = RemotePeer::Start("peer", peer_bytes, seed, "file");
    ASSERT_FALSE(peer.blob.empty());
    AgentConfig config;
    config.transport = Transport::kShm;
    config.prefault_bytes = prefault_bytes;
    auto a = Agent::Create("tester", config);
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    agent = std::move(*a);
    local.assign(local_bytes, 0);
    auto r = agent->RegisterMemory(local.data(), local.size());
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    region = std::move(*r);
    auto p = agent->Connect(peer.blob);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    pid = *p;
  }
};

// A peer's shared region beyond the agent's prefault budget is mapped without page tables
// at connect; reads fault them in and still move the right bytes, from the start, middle
// and end. Within the budget (the default's 8 GiB), every page is mapped at connect.
TEST(SharedFileMultiProcTest, LargeRegionIsMappedLazilyAndReadRight) {
  constexpr uint64_t kBytes = 300ull << 20;
  constexpr uint64_t kSeed = 31;
  ShmReader t;
  ASSERT_NO_FATAL_FAILURE(t.Start(kBytes, kSeed, 3 << 20, /*prefault_bytes=*/256 << 20));
  RemotePeer& peer = t.peer;
  Agent* agent = t.agent.get();
  std::vector<uint8_t>& local = t.local;
  const PeerId pid = t.pid;
  const uint64_t at[] = {0, kBytes / 2 + 12345, kBytes - (1 << 20)};
  std::vector<Descriptor> l, r;
  for (int i = 0; i < 3; ++i) {
    l.push_back(Descriptor::Of(local.data() + (static_cast<size_t>(i) << 20), 1 << 20));
    r.push_back({peer.base + at[i], 1 << 20});
  }
  auto id = agent->Read(pid, l, r);
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  TransferStatus s = agent->Wait(*id, std::chrono::seconds(30));
  ASSERT_EQ(s.state, TransferState::kDone) << s.error.ToString();
  for (int i = 0; i < 3; ++i) {
    for (uint64_t k = 0; k < (1 << 20); ++k) {
      ASSERT_EQ(local[(static_cast<size_t>(i) << 20) + k], PatternByte(kSeed, at[i] + k))
          << "piece " << i << " byte " << k;
    }
  }
  // Mapped (not read with CMA), and only about the pages read are resident in our mapping.
  const int64_t rss_kib = MappedPeerRssKib();
  ASSERT_GE(rss_kib, 0) << "the peer's file is not mapped here";
  EXPECT_LT(rss_kib, 64 << 10) << "a 300 MiB peer region was touched at connect";
  EXPECT_GE(rss_kib, 3 << 10);
  peer.child->Send("QUIT");
}

// Within the prefault budget (the default), a peer's 300 MiB region has every page mapped
// here once Connect returns: the first READs take no page faults.
TEST(SharedFileMultiProcTest, RegionWithinThePrefaultBudgetIsMappedAtConnect) {
  constexpr uint64_t kBytes = 300ull << 20;
  ShmReader t;
  ASSERT_NO_FATAL_FAILURE(t.Start(kBytes, 37, 1 << 20));
  const int64_t rss_kib = MappedPeerRssKib();
  ASSERT_GE(rss_kib, 0) << "the peer's file is not mapped here";
  EXPECT_GE(rss_kib, static_cast<int64_t>(kBytes >> 10)) << "pages not mapped at connect";
  t.peer.child->Send("QUIT");
}

// A peer shrinks the shared file it registered after we mapped it (issue 17, item 7).
// Before: the reader died of SIGBUS in its copy thread. Now the READ of the part past the
// new end fails naming the peer, the part before it still reads right, and we live on.
TEST(SharedFileMultiProcTest, APeerThatShrinksItsFileFailsTheReadNotTheReader) {
  constexpr uint64_t kBytes = 8ull << 20;
  constexpr uint64_t kSeed = 41;
  ShmReader t;
  ASSERT_NO_FATAL_FAILURE(t.Start(kBytes, kSeed, 2 << 20));  // maps the peer's file, touches it
  RemotePeer& peer = t.peer;
  Agent* agent = t.agent.get();
  std::vector<uint8_t>& local = t.local;
  const PeerId pid = t.pid;
  peer.child->Send("SHRINK " + std::to_string(1 << 20));
  ASSERT_EQ(peer.child->Expect("SHRU"), "NK") << "the peer could not shrink its file";
  auto read = [&](uint64_t at) {
    Descriptor l = Descriptor::Of(local.data(), 1 << 20), r{peer.base + at, 1 << 20};
    auto id = agent->Read(pid, {&l, 1}, {&r, 1});
    EXPECT_TRUE(id.ok()) << id.status().ToString();
    return id.ok() ? agent->Wait(*id, std::chrono::seconds(30)) : TransferStatus{};
  };
  TransferStatus past = read(4 << 20);
  ASSERT_EQ(past.state, TransferState::kError) << "a READ past the peer's new end succeeded";
  EXPECT_NE(past.error.message().find("the peer's shared file ends before the registered region"),
            std::string::npos)
      << past.error.ToString();
  EXPECT_NE(past.error.message().find("'peer'"), std::string::npos) << past.error.ToString();
  TransferStatus before = read(0);
  ASSERT_EQ(before.state, TransferState::kDone) << before.error.ToString();
  for (uint64_t k = 0; k < (1 << 20); k += 4093) ASSERT_EQ(local[k], PatternByte(kSeed, k));
  peer.child->Send("QUIT");
}

TEST_P(TransferMultiProcTest, OutOfBoundsDescriptorsAreRejectedAndNothingMoves) {
  constexpr uint64_t kBytes = 1 << 20;
  RemotePeer peer = RemotePeer::Start("peer", kBytes, 8, GetParam().memory);
  auto agent = MakeAgent("tester");
  ASSERT_NE(agent, nullptr);
  std::vector<uint8_t> local(kBytes, 0xab);
  auto region = agent->RegisterMemory(local.data(), local.size());
  ASSERT_TRUE(region.ok());
  auto pid = agent->Connect(peer.blob);
  ASSERT_TRUE(pid.ok());
  const uint64_t tail = peer.Hash(kBytes - 4096, 4096);
  // Straddles the end of the peer's region; a good descriptor before it must not move.
  std::vector<Descriptor> l = {Descriptor::Of(local.data(), 4096),
                               Descriptor::Of(local.data() + 4096, 8192)};
  std::vector<Descriptor> r = {{peer.base + kBytes - 4096, 4096},
                               {peer.base + kBytes - 4096, 8192}};
  auto w = agent->Write(*pid, l, r);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), Code::kOutOfRange);
  EXPECT_NE(w.status().message().find("remote descriptor 1"), std::string::npos)
      << w.status().ToString();
  EXPECT_NE(w.status().message().find("'peer'"), std::string::npos);
  EXPECT_EQ(peer.Hash(kBytes - 4096, 4096), tail);
  // Far outside, and an address below the region.
  Descriptor far{peer.base + (1ull << 40), 16}, below{peer.base - 16, 16},
      l16 = Descriptor::Of(local.data(), 16);
  EXPECT_EQ(agent->Read(*pid, {&l16, 1}, {&far, 1}).status().code(), Code::kOutOfRange);
  EXPECT_EQ(agent->Read(*pid, {&l16, 1}, {&below, 1}).status().code(), Code::kOutOfRange);
  // A local descriptor outside our regions.
  std::vector<uint8_t> unregistered(64);
  Descriptor lu = Descriptor::Of(unregistered.data(), 64), ok{peer.base, 64};
  auto lr = agent->Read(*pid, {&lu, 1}, {&ok, 1});
  EXPECT_EQ(lr.status().code(), Code::kOutOfRange);
  EXPECT_NE(lr.status().message().find("local descriptor 0"), std::string::npos);
  EXPECT_TRUE(
      std::all_of(unregistered.begin(), unregistered.end(), [](uint8_t b) { return b == 0; }));
}

// A peer whose inbox cannot be reached (another host's name, a full backlog) gets its
// notifications over UCX, in order (docs/transfer.md, "Notifications on one host").
TEST_P(TransferMultiProcTest, NotificationsGoOverUcxWhenTheInboxIsOutOfReach) {
  RemotePeer peer = RemotePeer::Start("peer", 4096, 1, GetParam().memory);
  auto agent = MakeAgent("sender");
  ASSERT_NE(agent, nullptr);
  Result<internal::AgentMetadata> meta = internal::DecodeAgentMetadata(peer.blob);
  ASSERT_TRUE(meta.ok()) << meta.status().ToString();
  Result<internal::UcxConnInfo> info = internal::DecodeUcxConnInfo(meta->conn_info, "t", "peer");
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  meta->conn_info = internal::EncodeUcxConnInfo(info->address, "eplbx-no-such-inbox");
  auto pid = agent->Connect(internal::EncodeAgentMetadata(*meta));
  ASSERT_TRUE(pid.ok()) << pid.status().ToString();
  std::vector<std::string> batch = {"b1", "b2", "b3"};
  ASSERT_TRUE(agent->Notify(*pid, "n0").ok());
  for (const Status& st : agent->NotifyMany(*pid, batch)) ASSERT_TRUE(st.ok()) << st.ToString();
  ASSERT_TRUE(agent->Notify(*pid, "n4").ok());
  peer.child->Send("ECHO 5 30000");
  for (const char* want : {"n0", "b1", "b2", "b3", "n4"})
    EXPECT_EQ(peer.child->Expect("GOT "), std::string("sender 2 ") + want);
  peer.child->Send("QUIT");
}

// What a peer sent just before it died is delivered before its loss is reported: once the
// agent says the peer is unreachable, every notification it sent is already there to poll
// (the rearrangement's CheckPeers relies on it: a peer whose DONE left does not fail the
// layer by dying). Through the inbox or over UCX alike.
TEST_P(TransferMultiProcTest, WhatAPeerSentBeforeItDiedArrivesBeforeItsLoss) {
  RemotePeer peer = RemotePeer::Start("peer", 4096, 1, GetParam().memory);
  auto agent = MakeAgent("receiver");
  ASSERT_NE(agent, nullptr);
  std::vector<uint8_t> mine(4096, 7);
  auto region = agent->RegisterMemory(mine.data(), mine.size());
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  auto pid = agent->Connect(peer.blob);
  ASSERT_TRUE(pid.ok()) << pid.status().ToString();
  peer.child->Send("CONNECT " + testing::ToHex(agent->Metadata()));
  const std::string back = peer.child->Expect("PEER ");
  // The peer's last notification rides on a READ it waits for: once it says SENT, every
  // notification left its process (a message still queued in a process that dies is lost
  // whatever the channel).
  constexpr int kCount = 300;
  peer.child->Send("NOTIFY " + back + " " + std::to_string(kCount) + " " +
                   std::to_string(region->addr()));
  ASSERT_EQ(peer.child->Expect("SENT "), "ok");
  peer.child->Signal(SIGKILL);
  const auto limit = std::chrono::steady_clock::now() + milliseconds(kPeerTimeoutMs + 5000);
  while (agent->Peer(*pid)->reachable && std::chrono::steady_clock::now() < limit)
    std::this_thread::sleep_for(milliseconds(1));
  ASSERT_FALSE(agent->Peer(*pid)->reachable) << "the killed peer is never reported lost";
  std::vector<Notification> got = agent->PollNotifications();
  ASSERT_EQ(got.size(), static_cast<size_t>(kCount + 1));
  for (int i = 0; i <= kCount; ++i) {
    EXPECT_EQ(got[i].peer, "peer");
    EXPECT_EQ(got[i].payload, "last" + std::to_string(i));
  }
}

TEST_P(TransferMultiProcTest, MalformedAndDuplicateMetadataIsRejected) {
  RemotePeer peer = RemotePeer::Start("peer", 4096, 1, GetParam().memory);
  auto agent = MakeAgent("tester");
  ASSERT_NE(agent, nullptr);
  std::string blob = peer.blob;
  std::string bad_magic = blob;
  bad_magic[0] = 'X';
  EXPECT_NE(agent->Connect(bad_magic).status().message().find("bad magic"), std::string::npos);
  std::string bad_version = blob;
  bad_version[4] = 9;
  EXPECT_EQ(agent->Connect(bad_version).status().code(), Code::kNotSupported);
  EXPECT_NE(agent->Connect(blob.substr(0, blob.size() - 3)).status().message().find("length"),
            std::string::npos);
  EXPECT_NE(agent->Connect(agent->Metadata()).status().message().find("own metadata"),
            std::string::npos);
  // Connection info that cannot hold the UCX address it announces: refused by name.
  Result<internal::AgentMetadata> meta = internal::DecodeAgentMetadata(blob);
  ASSERT_TRUE(meta.ok()) << meta.status().ToString();
  const std::string info = meta->conn_info;
  ASSERT_GT(info.size(), 4u);
  for (const std::string& bad : {info.substr(0, 3), std::string("\xff\xff\x00\x00", 4) + "abc",
                                 std::string(4, '\0') + info.substr(4)}) {
    internal::AgentMetadata m = *meta;
    m.conn_info = bad;
    Result<PeerId> refused = agent->Connect(internal::EncodeAgentMetadata(m));
    EXPECT_EQ(refused.status().code(), Code::kInvalidArgument) << refused.status().ToString();
    EXPECT_NE(refused.status().message().find("connection info of peer 'peer'"), std::string::npos)
        << refused.status().ToString();
  }
  auto first = agent->Connect(blob);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  auto again = agent->Connect(blob);
  EXPECT_EQ(again.status().code(), Code::kInvalidArgument);
  EXPECT_NE(again.status().message().find("already connected"), std::string::npos);
}

TEST_P(TransferMultiProcTest, CancelEndsTheTransferForGood) {
  constexpr uint64_t kBytes = 64ull << 20;
  RemotePeer peer = RemotePeer::Start("peer", kBytes, 4, GetParam().memory);
  auto agent = MakeAgent("tester");
  ASSERT_NE(agent, nullptr);
  std::vector<uint8_t> local(kBytes);
  auto region = agent->RegisterMemory(local.data(), local.size());
  ASSERT_TRUE(region.ok());
  auto pid = agent->Connect(peer.blob);
  ASSERT_TRUE(pid.ok());
  std::vector<Descriptor> l, r;
  for (uint64_t off = 0; off < kBytes; off += 1 << 20) {
    l.push_back(Descriptor::Of(local.data() + off, 1 << 20));
    r.push_back({peer.base + off, 1 << 20});
  }
  auto id = agent->Read(*pid, l, r);
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(agent->Cancel(*id).ok());
  // Terminal at once, and it stays so: done if it won the race, aborted otherwise.
  TransferStatus s = agent->GetStatus(*id);
  ASSERT_NE(s.state, TransferState::kInProgress);
  if (s.state == TransferState::kError) {
    EXPECT_EQ(s.error.code(), Code::kAborted) << s.error.ToString();
  }
  EXPECT_EQ(agent->Wait(*id, milliseconds(100)).state, s.state);
  EXPECT_TRUE(agent->Release(*id).ok());
  // The peer stays usable.
  auto again = agent->Read(*pid, {l.data(), 1}, {r.data(), 1});
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(agent->Wait(*again, std::chrono::seconds(10)).state, TransferState::kDone);
  EXPECT_EQ(local[100], PatternByte(4, 100));
}

// Posts 16 MiB reads from `victim` until one fails; returns that failure and its delay
// after `signal` was sent (mid-transfer: right after a read was posted).
struct Failure {
  Status status;
  milliseconds after{0};
};

Failure ReadUntilFailure(Agent& agent, PeerId victim, RemotePeer& peer, std::vector<uint8_t>& local,
                         int signal) {
  const uint64_t n = std::min<uint64_t>(16ull << 20, peer.size);
  Descriptor l = Descriptor::Of(local.data(), n), r{peer.base, n};
  auto first = agent.Read(victim, {&l, 1}, {&r, 1});
  EXPECT_TRUE(first.ok());
  EXPECT_EQ(agent.Wait(*first, std::chrono::seconds(10)).state, TransferState::kDone);
  auto pending = agent.Read(victim, {&l, 1}, {&r, 1});
  peer.child->Signal(signal);
  const auto t0 = std::chrono::steady_clock::now();
  const auto give_up = t0 + milliseconds(kPeerTimeoutMs) + std::chrono::seconds(8);
  Result<TransferId> id = std::move(pending);
  while (std::chrono::steady_clock::now() < give_up) {
    if (!id.ok())
      return {id.status(),
              std::chrono::duration_cast<milliseconds>(std::chrono::steady_clock::now() - t0)};
    TransferStatus s = agent.Wait(*id, milliseconds(200));
    if (s.state == TransferState::kError) {
      return {s.error,
              std::chrono::duration_cast<milliseconds>(std::chrono::steady_clock::now() - t0)};
    }
    if (s.state == TransferState::kDone) id = agent.Read(victim, {&l, 1}, {&r, 1});
  }
  return {Status::OK(),
          std::chrono::duration_cast<milliseconds>(std::chrono::steady_clock::now() - t0)};
}

void CheckDeathOf(TransferMultiProcTest* test, int signal) {
  constexpr uint64_t kBytes = 32ull << 20;
  RemotePeer healthy = RemotePeer::Start("healthy", kBytes, 21, test->GetParam().memory);
  RemotePeer victim = RemotePeer::Start("victim", kBytes, 22, test->GetParam().memory);
  AgentConfig config;
  config.transport = test->GetParam().transport;
  config.peer_timeout = milliseconds(kPeerTimeoutMs);
  auto agent = Agent::Create("survivor", config);
  ASSERT_TRUE(agent.ok());
  std::vector<uint8_t> local(kBytes);
  auto region = (*agent)->RegisterMemory(local.data(), local.size());
  ASSERT_TRUE(region.ok());
  auto h = (*agent)->Connect(healthy.blob);
  auto v = (*agent)->Connect(victim.blob);
  ASSERT_TRUE(h.ok() && v.ok());

  Failure f = ReadUntilFailure(**agent, *v, victim, local, signal);
  ASSERT_FALSE(f.status.ok()) << "no error within the deadline after signal " << signal;
  EXPECT_EQ(f.status.code(), Code::kUnavailable) << f.status.ToString();
  EXPECT_NE(f.status.message().find("peer unreachable"), std::string::npos) << f.status.ToString();
  EXPECT_NE(f.status.message().find("'victim'"), std::string::npos) << f.status.ToString();
  EXPECT_LE(f.after.count(), kPeerTimeoutMs + 3000) << f.status.ToString();
  auto info = (*agent)->Peer(*v);
  ASSERT_TRUE(info.ok());
  // The victim is reported unreachable, with the reason; the healthy peer is not.
  EXPECT_FALSE(info->reachable) << "signal " << signal;
  EXPECT_FALSE(info->failure.empty()) << "signal " << signal;
  EXPECT_TRUE((*agent)->Peer(*h)->reachable);
  // The healthy peer keeps working, bytes and all.
  Descriptor l = Descriptor::Of(local.data(), kBytes), r{healthy.base, kBytes};
  auto id = (*agent)->Read(*h, {&l, 1}, {&r, 1});
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  TransferStatus s = (*agent)->Wait(*id, std::chrono::seconds(30));
  ASSERT_EQ(s.state, TransferState::kDone) << s.error.ToString();
  for (uint64_t k = 0; k < kBytes; k += 4093) ASSERT_EQ(local[k], PatternByte(21, k));
  // Later calls to the dead peer fail at once, naming it.
  Descriptor l1 = Descriptor::Of(local.data(), 64), r1{victim.base, 64};
  auto later = (*agent)->Read(*v, {&l1, 1}, {&r1, 1});
  if (later.ok()) {
    EXPECT_EQ((*agent)->Wait(*later, std::chrono::seconds(10)).state, TransferState::kError);
  } else {
    EXPECT_EQ(later.status().code(), Code::kUnavailable);
  }
  EXPECT_EQ((*agent)->Notify(*v, "x").code(), Code::kUnavailable);
}

TEST_P(TransferMultiProcTest, KilledPeerFailsWithNamedErrorWithinDeadline) {
  CheckDeathOf(this, SIGKILL);
}

TEST_P(TransferMultiProcTest, StoppedPeerFailsWithNamedErrorWithinDeadline) {
  CheckDeathOf(this, SIGSTOP);
}

INSTANTIATE_TEST_SUITE_P(
    Transports, TransferMultiProcTest,
    ::testing::Values(Variant{"shm_cma", Transport::kShm, "plain"},
                      Variant{"shm_mapped", Transport::kShm, "allocate"},
                      Variant{"shm_file", Transport::kShm, "file"},
                      Variant{"tcp", Transport::kTcp, "plain"},
                      Variant{"tcp_file", Transport::kTcp, "file"},
                      Variant{"tcp_ucx_notify", Transport::kTcp, "plain", false},
                      Variant{"auto", Transport::kAuto, "plain"}),
    [](const ::testing::TestParamInfo<Variant>& info) { return info.param.label; });

}  // namespace
}  // namespace eplbx
