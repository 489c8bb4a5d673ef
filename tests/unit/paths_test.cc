// Data paths behind the seam (transfer/backend.h): which path an agent picks per peer and
// memory kind, why the others were refused, bytes per path, a transfer split over two
// paths, and the fault-injecting wrappers. Real UCX agents in one process: same host, so
// shm and cma work on our own pid.
#include <chrono>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "eplbx/transfer.h"
#include "test_env.h"
#include "transfer/backend.h"
#include "transfer/fault/fault_path.h"

namespace eplbx {
namespace {

using std::chrono::milliseconds;

bool Has(const std::vector<std::string>& v, const std::string& needle) {
  for (const std::string& s : v) {
    if (s.find(needle) != std::string::npos) return true;
  }
  return false;
}

std::string PathOf(const PeerInfo& info, MemoryKind kind) {
  for (const PathChoice& c : info.paths) {
    if (c.kind == kind) return c.path;
  }
  return "(none)";
}

// Agent b with one plain region and one in a shared file; agent a connects to it.
struct TwoAgents {
  std::unique_ptr<Agent> a, b;
  std::vector<uint8_t> plain = std::vector<uint8_t>(64 << 10);
  RegisteredRegion plain_region, shared_region, local_region;
  std::vector<uint8_t> local = std::vector<uint8_t>(128 << 10);
  Result<PeerId> peer = Status::Internal("unset");

  TwoAgents(AgentConfig ca, AgentConfig cb) {
    a = std::move(*Agent::Create("a", ca));
    b = std::move(*Agent::Create("b", cb));
    for (size_t i = 0; i < plain.size(); ++i) plain[i] = static_cast<uint8_t>(i * 7 + 1);
    plain_region = std::move(*b->RegisterMemory(plain.data(), plain.size()));
    shared_region = std::move(*b->AllocateShared(64 << 10));
    auto* s = static_cast<uint8_t*>(shared_region.data());
    for (size_t i = 0; i < shared_region.size(); ++i) s[i] = static_cast<uint8_t>(i * 5 + 3);
    local_region = std::move(*a->RegisterMemory(local.data(), local.size()));
    peer = a->Connect(b->Metadata());
  }
};

TEST(PathChoiceTest, DefaultOrderTakesTheFirstPathThatReachesEachKind) {
  TwoAgents t({}, {});
  ASSERT_TRUE(t.peer.ok()) << t.peer.status().ToString();
  EXPECT_EQ(t.a->paths(), (std::vector<std::string>{"shm", "cma", "ucx"}));
  PeerInfo info = *t.a->Peer(*t.peer);
  EXPECT_EQ(PathOf(info, MemoryKind::kHost), "cma");
  EXPECT_EQ(PathOf(info, MemoryKind::kHostFile), "shm");
  EXPECT_EQ(info.transport, Transport::kShm);
  // shm was refused for the plain region, with the reason, once.
  ASSERT_EQ(info.refused.size(), 1u) << info.refused.size();
  EXPECT_EQ(info.refused[0], "shm: region 0 is not in a shared file");
}

TEST(PathChoiceTest, ForcedTransportsAndExplicitLists) {
  AgentConfig tcp;
  tcp.transport = Transport::kTcp;
  TwoAgents t({tcp}, {});
  ASSERT_TRUE(t.peer.ok()) << t.peer.status().ToString();
  PeerInfo info = *t.a->Peer(*t.peer);
  EXPECT_EQ(PathOf(info, MemoryKind::kHost), "ucx");
  EXPECT_EQ(PathOf(info, MemoryKind::kHostFile), "ucx");
  EXPECT_EQ(info.transport, Transport::kTcp);
  EXPECT_TRUE(info.refused.empty());

  // Only shm listed: the plain region has no path, and Connect says why, per path.
  AgentConfig shm_only;
  shm_only.paths = {"shm"};
  TwoAgents s(shm_only, {});
  ASSERT_FALSE(s.peer.ok());
  EXPECT_EQ(s.peer.status().code(), Code::kUnavailable);
  EXPECT_NE(s.peer.status().message().find(
                "no data path of [shm] reaches region 0 (host) of peer 'b': shm: region 0 is "
                "not in a shared file"),
            std::string::npos)
      << s.peer.status().ToString();

  // cma before shm: cma takes both kinds, nothing is refused.
  AgentConfig cma_first;
  cma_first.paths = {"cma", "shm"};
  TwoAgents c(cma_first, {});
  ASSERT_TRUE(c.peer.ok()) << c.peer.status().ToString();
  info = *c.a->Peer(*c.peer);
  EXPECT_EQ(PathOf(info, MemoryKind::kHostFile), "cma");
  EXPECT_TRUE(info.refused.empty());
}

TEST(PathChoiceTest, AnotherHostGoesOverUcxAndSaysWhySameHostPathsWereRefused) {
  AgentConfig here, there;
  here.host_id = "host-a";
  there.host_id = "host-b";
  TwoAgents t(here, there);
  ASSERT_TRUE(t.peer.ok()) << t.peer.status().ToString();
  PeerInfo info = *t.a->Peer(*t.peer);
  EXPECT_EQ(PathOf(info, MemoryKind::kHost), "ucx");
  EXPECT_EQ(PathOf(info, MemoryKind::kHostFile), "ucx");
  EXPECT_EQ(info.transport, Transport::kTcp);
  EXPECT_TRUE(Has(info.refused,
                  "shm: the peer is on another host ('host-b'; this agent is on "
                  "'host-a')"));
  EXPECT_TRUE(Has(info.refused, "cma: the peer is on another host"));

  here.transport = Transport::kShm;  // same-host paths only
  TwoAgents f(here, there);
  ASSERT_FALSE(f.peer.ok());
  EXPECT_NE(f.peer.status().message().find("no data path of [shm,cma] reaches region 0 (host) of "
                                           "peer 'b': shm: the peer is on another host"),
            std::string::npos)
      << f.peer.status().ToString();
}

TEST(PathChoiceTest, BadPathListsAreRefusedByName) {
  AgentConfig c;
  c.paths = {"shm", "rdma"};
  EXPECT_NE(Agent::Create("x", c).status().message().find("unknown data path 'rdma'"),
            std::string::npos);
  c.paths = {"ucx", "ucx"};
  EXPECT_NE(Agent::Create("x", c).status().message().find("data path 'ucx' listed twice"),
            std::string::npos);
  c.paths = {"loopback"};
  EXPECT_NE(Agent::Create("x", c).status().message().find(
                "data path 'loopback' does not work with backend 'ucx'"),
            std::string::npos);
  c.backend = "loopback";
  c.paths = {"shm"};
  EXPECT_FALSE(Agent::Create("x", c).ok());
  // cuda_ipc and cuda_staged exist only in a build with CUDA; elsewhere the error says how
  // to get them.
  AgentConfig cuda;
  cuda.paths = {"cuda_ipc", "ucx", "cuda_staged"};
  auto a = Agent::Create("x", cuda);
  if (internal::CudaPathBuilt()) {
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    EXPECT_EQ((*a)->paths(), cuda.paths);
  } else {
    ASSERT_FALSE(a.ok());
    EXPECT_NE(a.status().message().find("data path 'cuda_ipc' is not in this build; this eplbx "
                                        "was built without CUDA"),
              std::string::npos)
        << a.status().ToString();
  }
}

// One READ with descriptors in both regions: split over shm and cma, one notification,
// sent after both parts landed; bytes are counted per path.
TEST(PathChoiceTest, ATransferSplitOverTwoPathsNotifiesOnceAfterBoth) {
  TwoAgents t({}, {});
  ASSERT_TRUE(t.peer.ok()) << t.peer.status().ToString();
  std::vector<Descriptor> local, remote;
  local.push_back(Descriptor::Of(t.local.data(), 40000));
  remote.push_back({t.plain_region.addr() + 100, 40000});
  local.push_back(Descriptor::Of(t.local.data() + 65536, 50000));
  remote.push_back({t.shared_region.addr() + 7, 50000});
  auto x = t.a->Read(*t.peer, local, remote, "both");
  ASSERT_TRUE(x.ok()) << x.status().ToString();
  TransferStatus s = t.a->Wait(*x, std::chrono::seconds(10));
  ASSERT_EQ(s.state, TransferState::kDone) << s.error.ToString();
  EXPECT_EQ(std::memcmp(t.local.data(), t.plain.data() + 100, 40000), 0);
  EXPECT_EQ(
      std::memcmp(t.local.data() + 65536, static_cast<uint8_t*>(t.shared_region.data()) + 7, 50000),
      0);
  std::vector<Notification> got = t.b->WaitNotifications(std::chrono::seconds(5));
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].payload, "both");
  std::this_thread::sleep_for(milliseconds(50));
  EXPECT_TRUE(t.b->PollNotifications().empty());
  for (const PathTotals& p : t.a->PathBytes()) {
    const uint64_t want = p.path == "shm" ? 50000 : p.path == "cma" ? 40000 : 0;
    EXPECT_EQ(p.bytes, want) << p.path;
    EXPECT_EQ(p.transfers, p.bytes > 0 ? 1u : 0u) << p.path;
  }
}

// The variables an agent reads come through its Env, never from the process directly.
TEST(PathChoiceTest, VariablesComeFromTheEnv) {
  MapEnv vars;
  AgentConfig c;
  c.env = &vars;
  vars.Set("EPLBX_PATHS", "ucx");
  vars.Set("EPLBX_HOST_ID", "rack7");
  auto a = Agent::Create("env-a", c);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ((*a)->paths(), (std::vector<std::string>{"ucx"}));
  EXPECT_EQ((*a)->host_id(), "rack7");
  vars.Unset("EPLBX_PATHS");
  vars.Set("EPLBX_TRANSPORT", "shm");
  EXPECT_EQ((*Agent::Create("env-b", c))->paths(), (std::vector<std::string>{"shm", "cma"}));
  vars.Set("EPLBX_TRANSPORT", "rdma");
  EXPECT_NE(Agent::Create("env-c", c)
                .status()
                .message()
                .find("environment variable EPLBX_TRANSPORT: unknown transport 'rdma'"),
            std::string::npos)
      << Agent::Create("env-c", c).status().ToString();
  vars.Set("EPLBX_PATHS", "shm,bogus");
  EXPECT_NE(Agent::Create("env-d", c).status().message().find("unknown data path 'bogus'"),
            std::string::npos);
  vars.Unset("EPLBX_PATHS");
  vars.Unset("EPLBX_TRANSPORT");
  // Copy threads: 1..64; anything else is refused by name, naming the agent.
  vars.Set("EPLBX_COPY_THREADS", "3");
  EXPECT_TRUE(Agent::Create("env-e", c).ok());
  for (const char* bad : {"0", "65", "two", "-1"}) {
    vars.Set("EPLBX_COPY_THREADS", bad);
    const Status s = Agent::Create("env-f", c).status();
    EXPECT_NE(s.message().find("EPLBX_COPY_THREADS"), std::string::npos)
        << bad << ": " << s.ToString();
    EXPECT_NE(s.message().find("agent 'env-f'"), std::string::npos) << bad << ": " << s.ToString();
  }
  vars.Unset("EPLBX_COPY_THREADS");
  // The prefault budget: -1 (default), 0 (never) or a byte count; below -1 refused by name.
  for (int64_t ok : {int64_t{-1}, int64_t{0}, int64_t{1} << 40}) {
    AgentConfig p = c;
    p.prefault_bytes = ok;
    EXPECT_TRUE(Agent::Create("env-g", p).ok()) << ok;
  }
  AgentConfig p = c;
  p.prefault_bytes = -2;
  const Status s = Agent::Create("env-h", p).status();
  EXPECT_NE(s.message().find("agent 'env-h': prefault_bytes is -2; expected -1 (default) or a byte "
                             "count"),
            std::string::npos)
      << s.ToString();
}

// ---- the fault-injecting wrappers, on loopback agents ---------------------------------

class FaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    AgentConfig c;
    c.backend = "loopback";
    c.peer_timeout = milliseconds(2000);
    plan_ = std::make_shared<internal::FaultPlan>();
    a_ = std::move(*internal::CreateFaultyAgent("fa", c, plan_));
    b_ = std::move(*Agent::Create("fb", c));
    src_.assign(4096, 0);
    std::iota(src_.begin(), src_.end(), 0);
    dst_.assign(4096, 0);
    rs_ = std::move(*b_->RegisterMemory(src_.data(), src_.size()));
    rd_ = std::move(*a_->RegisterMemory(dst_.data(), dst_.size()));
    peer_ = *a_->Connect(b_->Metadata());
    ASSERT_TRUE(b_->Connect(a_->Metadata()).ok());
  }
  Result<TransferId> Read(uint64_t bytes, std::optional<std::string> notify = std::nullopt) {
    Descriptor l = Descriptor::Of(dst_.data(), bytes), r = Descriptor::Of(src_.data(), bytes);
    return a_->Read(peer_, {&l, 1}, {&r, 1}, std::move(notify));
  }
  std::shared_ptr<internal::FaultPlan> plan_;
  std::unique_ptr<Agent> a_, b_;
  std::vector<uint8_t> src_, dst_;
  RegisteredRegion rs_, rd_;
  PeerId peer_ = 0;
};

TEST_F(FaultTest, AFailedTransferSendsNoNotification) {
  plan_->OnTransfers(internal::Fault::Of(internal::Fault::Action::kFail, "fb", 0, 1));
  auto x = Read(100, "note");
  ASSERT_TRUE(x.ok());
  TransferStatus s = a_->Wait(*x, milliseconds(1000));
  EXPECT_EQ(s.state, TransferState::kError);
  EXPECT_EQ(s.error.code(), Code::kIoError);
  EXPECT_NE(s.error.message().find("injected failure"), std::string::npos);
  EXPECT_TRUE(b_->WaitNotifications(milliseconds(50)).empty());
  // The rule applied once: the next transfer goes through.
  auto y = Read(100, "note");
  EXPECT_EQ(a_->Wait(*y, milliseconds(1000)).state, TransferState::kDone);
  EXPECT_EQ(b_->WaitNotifications(milliseconds(1000)).size(), 1u);
  EXPECT_EQ(plan_->injected(), 1u);
}

TEST_F(FaultTest, ADuplicatedCompletionCompletesOnceAndNotifiesOnce) {
  plan_->OnTransfers(internal::Fault::Of(internal::Fault::Action::kDuplicate));
  auto x = Read(256, "once");
  ASSERT_TRUE(x.ok());
  EXPECT_EQ(a_->Wait(*x, milliseconds(1000)).state, TransferState::kDone);
  std::this_thread::sleep_for(milliseconds(20));
  EXPECT_EQ(b_->PollNotifications().size(), 1u);
  uint64_t total = 0;
  for (const PathTotals& p : a_->PathBytes()) total += p.bytes;
  EXPECT_EQ(total, 256u);  // counted once
}

TEST_F(FaultTest, ADroppedCompletionWaitsUntilCancelled) {
  plan_->OnTransfers(internal::Fault::Of(internal::Fault::Action::kDrop));
  auto x = Read(64);
  ASSERT_TRUE(x.ok());
  EXPECT_EQ(a_->Wait(*x, milliseconds(100)).state, TransferState::kInProgress);
  ASSERT_TRUE(a_->Cancel(*x).ok());
  TransferStatus s = a_->GetStatus(*x);
  EXPECT_EQ(s.state, TransferState::kError);
  EXPECT_EQ(s.error.code(), Code::kAborted);
}

TEST_F(FaultTest, ADelayedCompletionArrivesLate) {
  internal::Fault f = internal::Fault::Of(internal::Fault::Action::kDelay);
  f.delay = milliseconds(150);
  plan_->OnTransfers(f);
  const auto start = std::chrono::steady_clock::now();
  auto x = Read(64, "late");
  ASSERT_TRUE(x.ok());
  EXPECT_EQ(a_->Wait(*x, milliseconds(5000)).state, TransferState::kDone);
  EXPECT_GE(std::chrono::steady_clock::now() - start, milliseconds(150));
  EXPECT_EQ(b_->WaitNotifications(milliseconds(1000)).size(), 1u);
}

TEST_F(FaultTest, APeerLostAfterSomeBytesFailsByName) {
  plan_->OnTransfers(internal::Fault::Of(internal::Fault::Action::kLosePeer, "fb", 1000));
  auto ok = Read(600);
  EXPECT_EQ(a_->Wait(*ok, milliseconds(1000)).state, TransferState::kDone);
  auto lost = Read(600);  // crosses 1000 bytes
  ASSERT_TRUE(lost.ok());
  TransferStatus s = a_->Wait(*lost, milliseconds(1000));
  EXPECT_EQ(s.error.code(), Code::kUnavailable);
  EXPECT_NE(s.error.message().find("peer unreachable: 'fb'"), std::string::npos);
  PeerInfo info = *a_->Peer(peer_);
  EXPECT_FALSE(info.reachable);
  EXPECT_EQ(Read(10).status().code(), Code::kUnavailable);  // sticky
}

TEST_F(FaultTest, NotificationsCanBeDroppedDuplicatedOrFailed) {
  internal::Fault drop = internal::Fault::Of(internal::Fault::Action::kDrop);
  drop.match = [](std::string_view p) { return p == "drop-me"; };
  plan_->OnNotifications(drop);
  internal::Fault dup = internal::Fault::Of(internal::Fault::Action::kDuplicate);
  dup.match = [](std::string_view p) { return p == "twice"; };
  plan_->OnNotifications(dup);
  internal::Fault fail = internal::Fault::Of(internal::Fault::Action::kFail);
  fail.match = [](std::string_view p) { return p == "fail"; };
  plan_->OnNotifications(fail);
  ASSERT_TRUE(a_->Notify(peer_, "drop-me").ok());
  ASSERT_TRUE(a_->Notify(peer_, "twice").ok());
  EXPECT_EQ(a_->Notify(peer_, "fail").code(), Code::kIoError);
  ASSERT_TRUE(a_->Notify(peer_, "plain").ok());
  std::vector<std::string> got;
  for (const Notification& n : b_->WaitNotifications(milliseconds(500))) got.push_back(n.payload);
  EXPECT_EQ(got, (std::vector<std::string>{"twice", "twice", "plain"}));
  // A notification after data fails the transfer when it cannot leave.
  auto x = Read(32, "fail");
  ASSERT_TRUE(x.ok());
  EXPECT_EQ(a_->Wait(*x, milliseconds(1000)).error.code(), Code::kIoError);
}

}  // namespace
}  // namespace eplbx
