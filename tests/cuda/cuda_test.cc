// The cuda_ipc data path (built with EPLBX_WITH_CUDA). Without a device: its metadata section,
// and what an agent says when a peer offers device memory it cannot open ("no CUDA device").
// With a device: transfers between real processes on one GPU (cudaMalloc and cuMem memory),
// every byte checked, and a peer killed mid-transfer. Device tests skip with the reason.
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/bytes.h"
#include "common/strings.h"
#include "eplbx/transfer.h"
#include "multiproc/child.h"
#include "multiproc/device_buffer.h"
#include "multiproc/peer_util.h"
#include "transfer/backend.h"
#include "transfer/cuda/cuda_driver.h"
#include "transfer/cuda/cuda_section.h"
#include "transfer/cuda/cuda_staged_path.h"
#include "transfer/device_memory.h"
#include "transfer/metadata.h"
#include "transfer/ucx/ucx_path.h"

namespace eplbx {
namespace {

using internal::AgentMetadata;
using internal::RegionInfo;
using internal::cuda::Chunk;
using internal::cuda::DecodeCudaSection;
using internal::cuda::EncodeCudaSection;
using internal::cuda::HandleKind;
using internal::cuda::RegionHandle;
using std::chrono::milliseconds;
using testing::Child;
using testing::DeviceBuffer;
using testing::PatternByte;

// ---- the section, no device needed ------------------------------------------------------

std::vector<RegionInfo> Regions() {
  return {{0x1000, 4096, MemoryKind::kHost},
          {0x7f0000100000, 3 << 20, MemoryKind::kCuda},
          {0x7f0000500000, 1 << 20, MemoryKind::kCuda}};
}

std::vector<RegionHandle> Handles() {
  std::vector<RegionHandle> h(3);
  h[1].kind = HandleKind::kLegacy;
  h[1].device_uuid = std::string(16, '\x11');
  h[1].base = 0x7f0000000000;
  h[1].bytes = 8 << 20;
  h[1].ipc_handle = std::string(64, '\x22');
  h[2].kind = HandleKind::kVmm;
  h[2].device_uuid = std::string(16, '\x33');
  h[2].base = 0x7f0000400000;
  h[2].bytes = 4 << 20;
  h[2].chunks = {Chunk{0, 2 << 20, 17}, Chunk{2 << 20, 2 << 20, 18}};
  return h;
}

TEST(CudaSectionTest, RoundTripsBothHandleKinds) {
  auto decoded = DecodeCudaSection(EncodeCudaSection(Handles()), Regions(), "b");
  ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
  const std::vector<RegionHandle> want = Handles();
  ASSERT_EQ(decoded->size(), 3u);
  EXPECT_EQ((*decoded)[0].kind, HandleKind::kNone);
  EXPECT_EQ((*decoded)[1].kind, HandleKind::kLegacy);
  EXPECT_EQ((*decoded)[1].ipc_handle, want[1].ipc_handle);
  EXPECT_EQ((*decoded)[1].device_uuid, want[1].device_uuid);
  EXPECT_EQ((*decoded)[1].base, want[1].base);
  EXPECT_EQ((*decoded)[2].kind, HandleKind::kVmm);
  ASSERT_EQ((*decoded)[2].chunks.size(), 2u);
  EXPECT_EQ((*decoded)[2].chunks[1].offset, 2u << 20);
  EXPECT_EQ((*decoded)[2].chunks[1].fd, 18u);
}

TEST(CudaSectionTest, RejectsEveryMalformedSectionByName) {
  auto error = [](std::vector<RegionHandle> h, std::vector<RegionInfo> regions,
                  std::string extra = "") {
    auto d = DecodeCudaSection(EncodeCudaSection(h) + extra, regions, "b");
    EXPECT_FALSE(d.ok());
    return d.ok() ? std::string() : d.status().message();
  };
  auto has = [](const std::string& text, const std::string& part) {
    return text.find(part) != std::string::npos;
  };
  std::vector<RegionInfo> regions = Regions();
  regions.pop_back();
  EXPECT_TRUE(has(error(Handles(), regions), "handles for 3 regions, the header lists 2"));
  std::vector<RegionHandle> h = Handles();
  h[1].kind = HandleKind::kNone;
  EXPECT_TRUE(has(error(h, Regions()), "region[1] is cuda memory but its handle kind is 0"));
  regions = Regions();
  regions[0].kind = MemoryKind::kCuda;
  h = Handles();
  EXPECT_TRUE(has(error(h, regions), "region[0] is cuda memory but its handle kind is 0"));
  h = Handles();
  h[1].bytes = 1 << 20;  // the region is 3 MiB at +1 MiB
  EXPECT_TRUE(has(error(h, Regions()),
                  "region[1] [0x7f0000100000, +3145728) is not inside its "
                  "allocation [0x7f0000000000, +1048576)"));
  h = Handles();
  h[2].chunks[1].offset = 3 << 20;
  EXPECT_TRUE(has(error(h, Regions()),
                  "region[2].chunk[1] [+3145728, 2097152 bytes) does not "
                  "continue at +2097152"));
  h = Handles();
  h[2].chunks.pop_back();
  EXPECT_TRUE(has(error(h, Regions()), "region[2] chunks cover 2097152 of its 4194304 bytes"));
  h = Handles();
  h[2].chunks.clear();
  EXPECT_TRUE(has(error(h, Regions()), "region[2] has 0 chunks"));
  EXPECT_TRUE(has(error(Handles(), Regions(), "x"), "1 trailing bytes"));
  std::string s = EncodeCudaSection(Handles());
  s[4 + 1] = 7;  // region 1's handle kind
  auto d = DecodeCudaSection(s, Regions(), "b");
  ASSERT_FALSE(d.ok());
  EXPECT_TRUE(
      has(d.status().message(), "region[1].handle_kind is 7 (known: 0 none, 1 ipc, 2 vmm)"));
  s = EncodeCudaSection(Handles());
  d = DecodeCudaSection(s.substr(0, s.size() - 3), Regions(), "b");
  ASSERT_FALSE(d.ok());
  EXPECT_TRUE(has(d.status().message(), "cuda_ipc section of peer 'b'"));
}

// ---- without a device -------------------------------------------------------------------

// A copy of `b`'s metadata that also lists device memory: a legacy handle nobody can open here.
std::string WithDeviceRegion(const std::string& blob) {
  auto m = internal::DecodeAgentMetadata(blob);
  EXPECT_TRUE(m.ok());
  AgentMetadata out = *m;
  out.regions.push_back(RegionInfo{0x7f0000100000, 1 << 20, MemoryKind::kCuda});
  out.sections.clear();
  auto keys = internal::DecodeUcxSection(m->Section("ucx")->body, m->regions.size(), m->name);
  EXPECT_TRUE(keys.ok());
  internal::ByteWriter w;
  w.U32(static_cast<uint32_t>(out.regions.size()));
  for (const std::string& k : *keys) w.Str32(k);
  w.Str32("");  // UCX without CUDA support publishes no key for device memory
  out.sections.push_back({"ucx", w.Take()});
  std::vector<RegionHandle> h(out.regions.size());
  h.back().kind = HandleKind::kLegacy;
  h.back().device_uuid = std::string(16, '\x11');
  h.back().base = 0x7f0000100000;
  h.back().bytes = 1 << 20;
  h.back().ipc_handle = std::string(64, '\x22');
  out.sections.push_back({"cuda_ipc", EncodeCudaSection(h)});
  return internal::EncodeAgentMetadata(out);
}

TEST(CudaPathTest, WithoutADeviceHostMemoryMovesAsBeforeAndDeviceMemoryIsRefusedWithTheReason) {
  const std::string no_device = internal::cuda::NoDeviceReason();
  if (no_device.empty())
    GTEST_SKIP() << "a CUDA device is present; this test is for machines without one";
  AgentConfig config;
  config.paths = {"shm", "cma", "cuda_ipc", "ucx"};
  auto a = Agent::Create("a", config);
  auto b = Agent::Create("b", config);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status().ToString();
  EXPECT_EQ((*a)->paths(), config.paths);
  std::vector<uint8_t> src(1 << 16, 7), dst(1 << 16, 0);
  auto rs = (*b)->RegisterMemory(src.data(), src.size());
  auto rd = (*a)->RegisterMemory(dst.data(), dst.size());
  ASSERT_TRUE(rs.ok() && rd.ok()) << rs.status().ToString();
  // Host memory: cuda_ipc stays out of the way.
  auto peer = (*a)->Connect((*b)->Metadata());
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();
  const Descriptor l = Descriptor::Of(dst.data(), dst.size());
  const Descriptor r = Descriptor::Of(src.data(), src.size());
  auto x = (*a)->Read(*peer, {&l, 1}, {&r, 1});
  ASSERT_TRUE(x.ok()) << x.status().ToString();
  EXPECT_EQ((*a)->Wait(*x, std::chrono::seconds(10)).state, TransferState::kDone);
  EXPECT_EQ(dst, src);
  // A peer offering device memory: refused at Connect, every path saying why.
  auto c = Agent::Create("c", config);
  ASSERT_TRUE(c.ok());
  auto p = (*c)->Connect(WithDeviceRegion((*b)->Metadata()));
  // b's side of the UCX wireup with c may still be in flight; UCX 1.13 aborts b's process
  // if c's worker vanishes before it ends (docs/reliability.md, "Known issues"), so c lives on
  // a moment after its refused Connect.
  std::this_thread::sleep_for(milliseconds(300));
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), Code::kUnavailable);
  const std::string m = p.status().message();
  EXPECT_NE(m.find("reaches region 1 (cuda) of peer 'b'"), std::string::npos) << m;
  EXPECT_NE(m.find("cuda_ipc: " + no_device), std::string::npos) << m;
  EXPECT_NE(m.find("ucx: moves no cuda memory"), std::string::npos) << m;
  EXPECT_NE(m.find("no CUDA device: libcuda.so.1 not found"), std::string::npos) << m;
  std::cout << "the refusal: " << m << "\n";
}

TEST(CudaPathTest, DefaultsListCudaIpcOnlyOnceTheProcessUsesCuda) {
  const std::vector<std::string> host = {"shm", "cma", "ucx"};
  const std::vector<std::string> cuda = {"shm", "cma", "cuda_ipc", "ucx", "cuda_staged"};
  auto defaults = [&] { return internal::CudaDriverLoaded() ? cuda : host; };
  EXPECT_EQ((*Agent::Create("a"))->paths(), defaults());
  // Loading the driver (what any CUDA use does) puts cuda_ipc and cuda_staged into the
  // defaults; where
  // libcuda.so.1 is missing nothing is loaded and they stay host-only.
  const bool found =
      internal::cuda::NoDeviceReason().find("libcuda.so.1 not found") == std::string::npos;
  EXPECT_EQ(internal::CudaDriverLoaded(), found);
  EXPECT_EQ((*Agent::Create("b"))->paths(), found ? cuda : host);
}

// ---- with a device: real processes on one GPU -------------------------------------------

constexpr int kPeerTimeoutMs = 2000;

struct DevicePeer {
  std::unique_ptr<Child> child;
  std::string blob;
  uint64_t base = 0;

  // `host`: the peer's EPLBX_HOST_ID (empty: this machine's).
  static DevicePeer Start(const std::string& name, uint64_t bytes, uint64_t seed,
                          const std::string& memory, const std::string& host = "") {
    DevicePeer p;
    std::map<std::string, std::string> env;
    if (!host.empty()) env["EPLBX_HOST_ID"] = host;
    p.child = std::make_unique<Child>(
        std::vector<std::string>{EPLBX_XFER_PEER, "--name", name, "--bytes", std::to_string(bytes),
                                 "--seed", std::to_string(seed), "--timeout-ms",
                                 std::to_string(kPeerTimeoutMs), "--memory", memory},
        env);
    // The peer fills all of its memory before it prints META: 512 MiB took 30 s under TSan
    // on a slow day of this 2-core VM, at the default 30 s wait (a start, not a speed, is
    // what this waits for).
    p.blob = testing::FromHex(p.child->Expect("META ", std::chrono::seconds(180)));
    p.base = std::stoull(p.child->Expect("BASE "));
    return p;
  }
};

// (memory, hosts): the peer's device memory ("cuda": cudaMalloc, "cuda-vmm": cuMem), and
// whether the two processes say they are on different hosts (EPLBX_HOST_ID), so that the
// rows travel by cuda_staged instead of cuda_ipc.
class CudaIpcMultiProcTest : public ::testing::TestWithParam<std::tuple<std::string, bool>> {
 protected:
  const std::string& memory() const { return std::get<0>(GetParam()); }
  bool other_host() const { return std::get<1>(GetParam()); }
  std::string path() const { return other_host() ? "cuda_staged" : "cuda_ipc"; }
  void SetUp() override {
    const std::string why = internal::cuda::NoDeviceReason();
    if (!why.empty()) GTEST_SKIP() << why;
  }
  // A peer process with `bytes` of device memory filled with PatternByte(seed, offset), and
  // an agent here with as much device memory (cudaMalloc), connected to it.
  struct Rig {
    DevicePeer peer;
    std::unique_ptr<Agent> agent;
    std::unique_ptr<DeviceBuffer> local;
    RegisteredRegion region;
    PeerId pid = 0;
    uint64_t local_addr(uint64_t off) const {
      return reinterpret_cast<uintptr_t>(local->data()) + off;
    }
  };
  // Other hosts: the peer connects back (it sends the rows) unless `connect_back` is false.
  void Connect(Rig& rig, const std::string& peer, const std::string& self, uint64_t bytes,
               uint64_t seed, bool connect_back = true) {
    rig.peer = DevicePeer::Start(peer, bytes, seed, memory(), other_host() ? "gpu-host-b" : "");
    ASSERT_FALSE(rig.peer.blob.empty());
    AgentConfig config;
    config.peer_timeout = milliseconds(kPeerTimeoutMs);
    if (other_host()) config.host_id = "gpu-host-a";
    auto agent = Agent::Create(self, config);  // the driver is loaded: cuda_ipc is a default
    ASSERT_TRUE(agent.ok()) << agent.status().ToString();
    rig.agent = std::move(*agent);
    auto local = DeviceBuffer::Create(bytes, false);
    ASSERT_TRUE(local.ok()) << local.status().ToString();
    rig.local = std::move(*local);
    auto region = rig.agent->RegisterMemory(rig.local->data(), bytes);
    ASSERT_TRUE(region.ok()) << region.status().ToString();
    rig.region = std::move(*region);
    auto pid = rig.agent->Connect(rig.peer.blob);
    ASSERT_TRUE(pid.ok()) << pid.status().ToString();
    rig.pid = *pid;
    if (other_host() && connect_back) {
      ASSERT_NO_FATAL_FAILURE(ConnectBack(rig));
    }
  }
  void ConnectBack(Rig& rig) {
    rig.peer.child->Send("CONNECT " + testing::ToHex(rig.agent->Metadata()));
    const std::string got = rig.peer.child->Expect("PEER ");
    ASSERT_FALSE(got.empty()) << "the peer did not connect back";
  }
};

bool MatchesPattern(const std::vector<uint8_t>& got, uint64_t seed, uint64_t offset) {
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != PatternByte(seed, offset + i)) {
      ADD_FAILURE() << "byte " << i << " of a row from peer offset " << offset << " is wrong";
      return false;
    }
  }
  return true;
}

// Device memory eplbx cannot share, or cannot copy where asked, is refused by name before
// anything moves (needs a driver: a GPU, or the stand-in in CI).
TEST(CudaRefusalTest, DeviceMemoryItCannotShareOrCopyIsRefusedByName) {
  const std::string why = internal::cuda::NoDeviceReason();
  if (!why.empty()) GTEST_SKIP() << why;
  auto has = [](const Status& s, const std::string& part) {
    return s.message().find(part) != std::string::npos;
  };
  auto agent = Agent::Create("r");  // the driver is loaded: cuda_ipc is a default path
  ASSERT_TRUE(agent.ok()) << agent.status().ToString();
  // A region running past its cudaMalloc allocation.
  auto plain = DeviceBuffer::Create(4 << 20, false);
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  auto past = (*agent)->RegisterMemory((*plain)->data(), 8 << 20);
  ASSERT_FALSE(past.ok());
  EXPECT_TRUE(has(past.status(), "runs past the end of its cudaMalloc allocation"))
      << past.status().ToString();
  EXPECT_TRUE(has(past.status(), "register each allocation (each tensor's storage) on its own"));
  // cuMem memory no other process can open.
  auto sealed = DeviceBuffer::Create(4 << 20, true, /*exportable=*/false);
  ASSERT_TRUE(sealed.ok()) << sealed.status().ToString();
  auto closed = (*agent)->RegisterMemory((*sealed)->data(), (*sealed)->size());
  ASSERT_FALSE(closed.ok());
  EXPECT_TRUE(has(closed.status(),
                  "without a POSIX file descriptor handle type, so no other "
                  "process can open it"))
      << closed.status().ToString();
  // Device memory with no path that moves it.
  AgentConfig host_only;
  host_only.paths = {"shm", "cma", "ucx"};
  auto h = Agent::Create("h", host_only);
  ASSERT_TRUE(h.ok());
  auto none = (*h)->RegisterMemory((*plain)->data(), (*plain)->size());
  ASSERT_FALSE(none.ok());
  EXPECT_TRUE(has(none.status(),
                  "is cuda memory and none of the data paths [shm,cma,ucx] moves "
                  "it; list cuda_ipc (same host) and cuda_staged (other hosts) among the data "
                  "paths (EPLBX_PATHS=shm,cma,cuda_ipc,ucx,cuda_staged)"))
      << none.status().ToString();
  // A READ from a peer's host region into device memory: the path chosen for host memory
  // (cma) cannot copy into device memory; nothing is sent.
  auto dev = (*agent)->RegisterMemory((*plain)->data(), (*plain)->size());
  ASSERT_TRUE(dev.ok()) << dev.status().ToString();
  std::vector<uint8_t> host(4096, 1);
  auto hr = (*h)->RegisterMemory(host.data(), host.size());
  ASSERT_TRUE(hr.ok());
  auto peer = (*agent)->Connect((*h)->Metadata());
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();
  const Descriptor l = Descriptor::Of((*plain)->data(), 4096);
  const Descriptor r = Descriptor::Of(host.data(), 4096);
  auto x = (*agent)->Read(*peer, {&l, 1}, {&r, 1});
  ASSERT_FALSE(x.ok());
  EXPECT_TRUE(has(x.status(),
                  "local descriptor 0 lies in cuda memory, which data path 'cma' "
                  "(chosen for the peer's host region 0) cannot copy; nothing was "
                  "sent"))
      << x.status().ToString();
  std::this_thread::sleep_for(milliseconds(300));  // see WithoutADevice...: UCX wireup
}

TEST_P(CudaIpcMultiProcTest, ReadsAndWritesDeviceRowsEveryByteChecked) {
  constexpr uint64_t kBytes = 64ull << 20, kRow = 1 << 20, kSeed = 5;
  Rig rig;
  ASSERT_NO_FATAL_FAILURE(Connect(rig, "gpu-peer", "tester", kBytes, kSeed, false));
  auto& [peer, agent, local, region, pid] = rig;
  PeerInfo info = *agent->Peer(pid);
  ASSERT_EQ(info.paths.size(), 1u);
  EXPECT_EQ(info.paths[0].kind, MemoryKind::kCuda);
  EXPECT_EQ(info.paths[0].path, path());
  if (other_host()) {
    // The peer sends the staged rows, so it must be connected to us too: until it is, a
    // READ fails at once naming both (nothing waits).
    const Descriptor l{rig.local_addr(0), kRow};
    const Descriptor r{peer.base, kRow};
    auto x = agent->Read(pid, {&l, 1}, {&r, 1});
    ASSERT_TRUE(x.ok()) << x.status().ToString();
    TransferStatus st = agent->Wait(*x, std::chrono::seconds(30));
    ASSERT_EQ(st.state, TransferState::kError);
    EXPECT_NE(st.error.message().find("agent 'gpu-peer' (cuda_staged) is not connected to "
                                      "'tester': staged transfers need the two agents connected "
                                      "both ways"),
              std::string::npos)
        << st.error.ToString();
    ASSERT_NO_FATAL_FAILURE(ConnectBack(rig));
  }

  // 16 rows from random places (the cuda-vmm peer's second allocation starts half way).
  std::mt19937_64 rng(3);
  std::vector<Descriptor> l, r;
  std::vector<uint64_t> from;
  for (int i = 0; i < 16; ++i) {
    const uint64_t off = (rng() % (kBytes / kRow - 1)) * kRow + rng() % 4096;
    from.push_back(off);
    l.push_back({rig.local_addr(i * kRow), kRow});
    r.push_back({peer.base + off, kRow});
  }
  // One row across the middle of the peer's buffer.
  from.push_back(kBytes / 2 - kRow / 2);
  l.push_back({rig.local_addr(16 * kRow), kRow});
  r.push_back({peer.base + from.back(), kRow});
  auto x = agent->Read(pid, l, r);
  ASSERT_TRUE(x.ok()) << x.status().ToString();
  TransferStatus st = agent->Wait(*x, std::chrono::seconds(30));
  ASSERT_EQ(st.state, TransferState::kDone) << st.error.ToString();
  for (size_t i = 0; i < from.size(); ++i) {
    auto got = local->Download(i * kRow, kRow);
    ASSERT_TRUE(got.ok());
    ASSERT_TRUE(MatchesPattern(*got, kSeed, from[i])) << "row " << i;
  }

  // One row larger than a staged piece (kStageChunk), not aligned: three pieces.
  const uint64_t big = 2 * internal::kStageChunk + 4097, big_from = 20 * kRow + 77;
  const Descriptor bl{rig.local_addr(30 * kRow), big};
  const Descriptor br{peer.base + big_from, big};
  auto b = agent->Read(pid, {&bl, 1}, {&br, 1});
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  st = agent->Wait(*b, std::chrono::seconds(30));
  ASSERT_EQ(st.state, TransferState::kDone) << st.error.ToString();
  auto got_big = local->Download(30 * kRow, big);
  ASSERT_TRUE(got_big.ok());
  ASSERT_TRUE(MatchesPattern(*got_big, kSeed, big_from));

  // WRITE 4 rows and a bit back (two staged pieces) with a notification; the peer checks
  // the bytes when it arrives.
  peer.child->Send("EXPECT 1 10000");
  const uint64_t dst = 8 * kRow + 123, wbytes = 4 * kRow + 4097;
  const Descriptor wl{rig.local_addr(0), wbytes};
  const Descriptor wr{peer.base + dst, wbytes};
  auto want = local->Download(0, wbytes);
  ASSERT_TRUE(want.ok());
  const std::string check = "CHECK " + std::to_string(dst) + " " + std::to_string(wbytes) + " " +
                            std::to_string(testing::Fnv1a(want->data(), want->size()));
  auto w = agent->Write(pid, {&wl, 1}, {&wr, 1}, check);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  st = agent->Wait(*w, std::chrono::seconds(30));
  ASSERT_EQ(st.state, TransferState::kDone) << st.error.ToString();
  EXPECT_EQ(peer.child->Expect("NOTIFY "), "tester OK");

  if (other_host()) {
    // The owner serves only memory it registered: a reader whose copy of its metadata claims
    // a region twice as large is refused by the owner for rows past the real end, naming
    // them; nothing of ours is written and the owner goes on serving.
    auto lie = internal::DecodeAgentMetadata(peer.blob);
    ASSERT_TRUE(lie.ok());
    uint64_t end = 0;
    for (RegionInfo& r : lie->regions) {
      if (r.kind != MemoryKind::kCuda) continue;
      end = std::max(end, r.addr + r.bytes);
      r.bytes *= 2;
    }
    AgentConfig config;
    config.host_id = "gpu-host-c";
    auto liar = Agent::Create("liar", config);
    ASSERT_TRUE(liar.ok()) << liar.status().ToString();
    std::vector<uint8_t> mine(kRow, 0x5a);
    auto mr = (*liar)->RegisterMemory(mine.data(), mine.size());
    ASSERT_TRUE(mr.ok()) << mr.status().ToString();
    auto lp = (*liar)->Connect(internal::EncodeAgentMetadata(*lie));
    ASSERT_TRUE(lp.ok()) << lp.status().ToString();
    peer.child->Send("CONNECT " + testing::ToHex((*liar)->Metadata()));
    ASSERT_FALSE(peer.child->Expect("PEER ").empty());
    const Descriptor ml = Descriptor::Of(mine.data(), kRow);
    const Descriptor past{end + 4096, kRow};
    auto bad = (*liar)->Read(*lp, {&ml, 1}, {&past, 1});
    ASSERT_TRUE(bad.ok()) << bad.status().ToString();
    TransferStatus bs = (*liar)->Wait(*bad, std::chrono::seconds(30));
    ASSERT_EQ(bs.state, TransferState::kError);
    EXPECT_NE(bs.error.message().find("agent 'gpu-peer' (cuda_staged): rows [" +
                                      internal::Hex(end + 4096) +
                                      ", +1048576) are not in a registered device region of "
                                      "this agent"),
              std::string::npos)
        << bs.error.ToString();
    EXPECT_EQ(mine, std::vector<uint8_t>(kRow, 0x5a));
  }

  // Host memory on our side reads the peer's device rows too.
  std::vector<uint8_t> host(kRow);
  auto hr = agent->RegisterMemory(host.data(), host.size());
  ASSERT_TRUE(hr.ok()) << hr.status().ToString();
  const Descriptor hl = Descriptor::Of(host.data(), kRow);
  const Descriptor hrem{peer.base + 5 * kRow, kRow};
  auto h = agent->Read(pid, {&hl, 1}, {&hrem, 1});
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  ASSERT_EQ(agent->Wait(*h, std::chrono::seconds(30)).state, TransferState::kDone);
  EXPECT_TRUE(MatchesPattern(host, kSeed, 5 * kRow));
  EXPECT_GT(agent->PathBytes().size(), 0u);
}

// A transfer posted alone (nothing else of the agent outstanding) is finished by the calling
// thread (cuda_ipc): it is done when Read() returns, every byte there; one posted while
// another is outstanding goes to the poller as before. (cuda_staged: the same transfers,
// waited for: its rows come from the peer.)
TEST_P(CudaIpcMultiProcTest, ATransferPostedAloneIsDoneWhenReadReturns) {
  constexpr uint64_t kBytes = 16ull << 20, kRow = 1 << 20, kSeed = 7;
  Rig rig;
  ASSERT_NO_FATAL_FAILURE(Connect(rig, "gpu-peer", "tester", kBytes, kSeed, true));
  auto& [peer, agent, local, region, pid] = rig;
  for (uint64_t i = 0; i < 3; ++i) {
    const uint64_t from = (i + 2) * kRow + 5;
    const Descriptor l{rig.local_addr(i * kRow), kRow};
    const Descriptor r{peer.base + from, kRow};
    auto x = agent->Read(pid, {&l, 1}, {&r, 1});
    ASSERT_TRUE(x.ok()) << x.status().ToString();
    const TransferStatus st = other_host() ? agent->Wait(*x, std::chrono::seconds(30))
                                           : agent->GetStatus(*x);  // cuda_ipc: no Wait
    EXPECT_EQ(st.state, TransferState::kDone) << "READ " << i << ": " << st.error.ToString();
    ASSERT_TRUE(agent->Release(*x).ok());
    auto got = local->Download(i * kRow, kRow);
    ASSERT_TRUE(got.ok());
    ASSERT_TRUE(MatchesPattern(*got, kSeed, from)) << "row " << i;
  }
  // Two outstanding: the second is not alone.
  const Descriptor l1{rig.local_addr(4 * kRow), kRow}, r1{peer.base + 9 * kRow, kRow};
  const Descriptor l2{rig.local_addr(5 * kRow), kRow}, r2{peer.base + 11 * kRow + 3, kRow};
  auto a = agent->Read(pid, {&l1, 1}, {&r1, 1});
  auto b = agent->Read(pid, {&l2, 1}, {&r2, 1});
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(agent->Wait(*a, std::chrono::seconds(30)).state, TransferState::kDone);
  EXPECT_EQ(agent->Wait(*b, std::chrono::seconds(30)).state, TransferState::kDone);
  auto g1 = local->Download(4 * kRow, kRow), g2 = local->Download(5 * kRow, kRow);
  ASSERT_TRUE(g1.ok() && g2.ok());
  EXPECT_TRUE(MatchesPattern(*g1, kSeed, 9 * kRow));
  EXPECT_TRUE(MatchesPattern(*g2, kSeed, 11 * kRow + 3));
}

TEST_P(CudaIpcMultiProcTest, APeerKilledMidTransferEndsItAndIsReportedWithoutAHang) {
  constexpr uint64_t kBytes = 512ull << 20, kRow = 16ull << 20;
  Rig rig;
  ASSERT_NO_FATAL_FAILURE(Connect(rig, "doomed", "survivor", kBytes, 9));
  auto& [peer, agent, local, region, pid] = rig;
  std::vector<TransferId> ids;
  for (uint64_t off = 0; off < kBytes; off += kRow) {
    const Descriptor l{rig.local_addr(off), kRow};
    const Descriptor r{peer.base + off, kRow};
    auto x = agent->Read(pid, {&l, 1}, {&r, 1});
    ASSERT_TRUE(x.ok()) << x.status().ToString();
    ids.push_back(*x);
  }
  kill(peer.child->pid(), SIGKILL);
  const auto start = std::chrono::steady_clock::now();
  for (TransferId id : ids) {
    // Copies already queued finish (the mapping keeps the memory alive) or fail; none hangs.
    EXPECT_NE(agent->Wait(id, std::chrono::seconds(10)).state, TransferState::kInProgress);
  }
  // The control channel finds the peer gone; later transfers fail at once, naming it.
  Status later = Status::OK();
  while (std::chrono::steady_clock::now() - start < milliseconds(kPeerTimeoutMs * 3)) {
    const Descriptor l{rig.local_addr(0), kRow};
    const Descriptor r{peer.base, kRow};
    auto x = agent->Read(pid, {&l, 1}, {&r, 1});
    if (!x.ok()) {
      later = x.status();
      break;
    }
    agent->Wait(*x, std::chrono::seconds(10));
    std::this_thread::sleep_for(milliseconds(50));
  }
  EXPECT_EQ(later.code(), Code::kUnavailable) << later.ToString();
  EXPECT_NE(later.message().find("doomed"), std::string::npos) << later.ToString();
}

INSTANTIATE_TEST_SUITE_P(Memory, CudaIpcMultiProcTest,
                         ::testing::Combine(::testing::Values("cuda", "cuda-vmm"),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) == "cuda" ? "CudaMalloc"
                                                                                : "CuMemVmm") +
                                  (std::get<1>(info.param) ? "OtherHostStaged" : "SameHostIpc");
                         });

}  // namespace
}  // namespace eplbx
