// Agent core, metadata codec and the loopback backend (in-process). The real transfers
// between processes are in tests/multiproc/.
#include <cstring>
#include <numeric>
#include <vector>

#include <gtest/gtest.h>

#include "common/bytes.h"
#include "eplbx/transfer.h"
#include "transfer/loopback/loopback_backend.h"
#include "transfer/metadata.h"

namespace eplbx {
namespace {

using internal::AgentMetadata;
using internal::DecodeAgentMetadata;
using internal::EncodeAgentMetadata;

AgentMetadata SampleMetadata() {
  AgentMetadata m;
  m.name = "rank7";
  m.host_id = "host/boot/net/pid";
  m.backend = "ucx";
  m.pid = 4242;
  m.probe_addr = 0x1000;
  m.conn_info = std::string("\x01\x02\x00\x03", 4);
  m.regions.push_back({0x7f0000000000, 1 << 20, 0, -1, 0, "rkey-a"});
  m.regions.push_back(
      {0x7f0000200000, 4096, internal::kRegionShared, 12, 0x123456789, std::string(40, 'k')});
  return m;
}

TEST(AgentMetadataTest, RoundTrips) {
  const AgentMetadata m = SampleMetadata();
  Result<AgentMetadata> d = DecodeAgentMetadata(EncodeAgentMetadata(m));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->name, m.name);
  EXPECT_EQ(d->host_id, m.host_id);
  EXPECT_EQ(d->backend, m.backend);
  EXPECT_EQ(d->pid, m.pid);
  EXPECT_EQ(d->probe_addr, m.probe_addr);
  EXPECT_EQ(d->conn_info, m.conn_info);
  ASSERT_EQ(d->regions.size(), 2u);
  EXPECT_EQ(d->regions[1].addr, m.regions[1].addr);
  EXPECT_EQ(d->regions[1].bytes, m.regions[1].bytes);
  EXPECT_EQ(d->regions[1].flags, internal::kRegionShared);
  EXPECT_EQ(d->regions[1].shm_fd, 12);
  EXPECT_EQ(d->regions[1].shm_offset, 0x123456789u);
  EXPECT_EQ(d->regions[1].rkey, m.regions[1].rkey);
  EXPECT_EQ(d->regions[0].shm_fd, -1);
}

TEST(AgentMetadataTest, EveryTruncationIsRejected) {
  const std::string blob = EncodeAgentMetadata(SampleMetadata());
  for (size_t n = 0; n < blob.size(); ++n) {
    Result<AgentMetadata> d = DecodeAgentMetadata(blob.substr(0, n));
    ASSERT_FALSE(d.ok()) << "prefix of " << n << " bytes accepted";
    EXPECT_EQ(d.status().code(), Code::kCorruption) << n;
  }
  // With the length field patched to match, a truncated field is named.
  std::string cut = blob.substr(0, blob.size() - 10);
  internal::ByteWriter w;
  w.U32(static_cast<uint32_t>(cut.size()));
  cut.replace(8, 4, w.Take());
  Result<AgentMetadata> d = DecodeAgentMetadata(cut);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("truncated at field 'regions[1].rkey'"), std::string::npos)
      << d.status().ToString();
}

TEST(AgentMetadataTest, EachMalformationHasItsOwnMessage) {
  const std::string blob = EncodeAgentMetadata(SampleMetadata());
  std::string magic = blob;
  magic[1] = 'Q';
  EXPECT_NE(DecodeAgentMetadata(magic).status().message().find("bad magic"), std::string::npos);
  std::string version = blob;
  version[4] = 1;  // the format before regions carried a file offset
  Result<AgentMetadata> v = DecodeAgentMetadata(version);
  EXPECT_EQ(v.status().code(), Code::kNotSupported);
  EXPECT_NE(v.status().message().find("version 1 is not supported (this build reads version 2)"),
            std::string::npos)
      << v.status().ToString();
  // Found by fuzz_agent_metadata: a non-zero reserved field decoded, then re-encoded differently.
  std::string reserved = blob;
  reserved[6] = 1;
  EXPECT_NE(DecodeAgentMetadata(reserved).status().message().find("reserved field is 1"),
            std::string::npos);
  Result<AgentMetadata> trailing = DecodeAgentMetadata(blob + "x");
  EXPECT_NE(trailing.status().message().find("length field says"), std::string::npos)
      << trailing.status().ToString();

  // Fields over their limits, with the length field kept consistent.
  AgentMetadata big = SampleMetadata();
  big.name = std::string(Agent::kMaxNameBytes + 1, 'n');
  Result<AgentMetadata> name = DecodeAgentMetadata(EncodeAgentMetadata(big));
  EXPECT_NE(name.status().message().find("field 'name' is 257 bytes, the limit is 256"),
            std::string::npos)
      << name.status().ToString();
  big = SampleMetadata();
  big.regions[0].rkey = std::string(internal::kMaxRkeyBytes + 1, 'r');
  EXPECT_NE(
      DecodeAgentMetadata(EncodeAgentMetadata(big)).status().message().find("regions[0].rkey"),
      std::string::npos);
  big = SampleMetadata();
  big.regions[0].bytes = 0;
  EXPECT_NE(DecodeAgentMetadata(EncodeAgentMetadata(big)).status().message().find("empty or wraps"),
            std::string::npos);
  big = SampleMetadata();
  big.regions[0].addr = ~0ull - 10;
  EXPECT_NE(DecodeAgentMetadata(EncodeAgentMetadata(big)).status().message().find("empty or wraps"),
            std::string::npos);
  big = SampleMetadata();
  big.name.clear();
  EXPECT_NE(
      DecodeAgentMetadata(EncodeAgentMetadata(big)).status().message().find("empty agent name"),
      std::string::npos);
  // A region count beyond the limit is refused before anything is allocated.
  std::string many = blob;
  const size_t count_at = 12 + 2 + 5 + 2 + 17 + 2 + 3 + 4 + 8 + 4 + 4;
  ASSERT_EQ(static_cast<uint8_t>(many[count_at]), 2u);
  many[count_at + 2] = 0x10;  // 0x100002 regions
  EXPECT_NE(DecodeAgentMetadata(many).status().message().find("regions, the limit is"),
            std::string::npos)
      << DecodeAgentMetadata(many).status().ToString();
}

TEST(MessageHeaderTest, RoundTripsAndRejectsMalformed) {
  const std::string h = internal::EncodeMessageHeader({internal::MessageKind::kPing, "r1"});
  size_t used = 0;
  auto d = internal::DecodeMessageHeader(h + "payload", &used);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->kind, internal::MessageKind::kPing);
  EXPECT_EQ(d->sender, "r1");
  EXPECT_EQ(used, h.size());
  for (size_t n = 0; n < h.size(); ++n) {
    EXPECT_FALSE(internal::DecodeMessageHeader(h.substr(0, n), &used).ok()) << n;
  }
  std::string kind = h;
  kind[6] = 9;
  EXPECT_NE(internal::DecodeMessageHeader(kind, &used).status().message().find("unknown kind 9"),
            std::string::npos);
  std::string magic = h;
  magic[0] = 0;
  EXPECT_FALSE(internal::DecodeMessageHeader(magic, &used).ok());
}

TEST(TransportTest, ParsesNames) {
  EXPECT_EQ(*ParseTransport("shm"), Transport::kShm);
  EXPECT_EQ(*ParseTransport("tcp"), Transport::kTcp);
  EXPECT_EQ(*ParseTransport("auto"), Transport::kAuto);
  EXPECT_EQ(ParseTransport("rdma").status().code(), Code::kInvalidArgument);
  EXPECT_EQ(TransportName(Transport::kShm), "shm");
}

// Two loopback agents with one registered buffer each.
class LoopbackAgentTest : public ::testing::Test {
 protected:
  void SetUp() override {
    AgentConfig config;
    config.backend = "loopback";
    a_ = std::move(*Agent::Create("a", config));
    b_ = std::move(*Agent::Create("b", config));
    abuf_.assign(1 << 16, 0);
    bbuf_.resize(1 << 16);
    std::iota(bbuf_.begin(), bbuf_.end(), 0);
    ra_ = std::move(*a_->RegisterMemory(abuf_.data(), abuf_.size()));
    rb_ = std::move(*b_->RegisterMemory(bbuf_.data(), bbuf_.size()));
    peer_ = *a_->Connect(b_->Metadata());
  }
  void TearDown() override { internal::SetLoopbackReachable("b", true); }

  std::unique_ptr<Agent> a_, b_;
  std::vector<uint8_t> abuf_, bbuf_;
  RegisteredRegion ra_, rb_;
  PeerId peer_ = 0;
};

TEST_F(LoopbackAgentTest, ReadWriteAndNotifyAfterData) {
  std::vector<Descriptor> l = {Descriptor::Of(abuf_.data(), 10),
                               Descriptor::Of(abuf_.data() + 100, 5)};
  std::vector<Descriptor> r = {Descriptor::Of(bbuf_.data() + 20, 10),
                               Descriptor::Of(bbuf_.data(), 5)};
  auto id = a_->Read(peer_, l, r, std::string("done"));
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  EXPECT_EQ(a_->Wait(*id, std::chrono::seconds(1)).state, TransferState::kDone);
  EXPECT_EQ(abuf_[0], 20);
  EXPECT_EQ(abuf_[9], 29);
  EXPECT_EQ(abuf_[104], 4);
  auto n = b_->PollNotifications();
  ASSERT_EQ(n.size(), 1u);
  EXPECT_EQ(n[0].peer, "a");
  EXPECT_EQ(n[0].payload, "done");
  EXPECT_TRUE(b_->PollNotifications().empty());
  abuf_[0] = 200;
  auto w = a_->Write(peer_, {l.data(), 1}, {r.data(), 1});
  ASSERT_TRUE(w.ok());
  EXPECT_EQ(bbuf_[20], 200);
  // Terminal states stick; released ids are unknown.
  EXPECT_EQ(a_->GetStatus(*w).state, TransferState::kDone);
  EXPECT_TRUE(a_->Release(*w).ok());
  EXPECT_EQ(a_->GetStatus(*w).error.code(), Code::kNotFound);
  EXPECT_EQ(a_->Release(*w).code(), Code::kNotFound);
  EXPECT_TRUE(a_->Notify(peer_, "hello").ok());
  EXPECT_EQ(b_->WaitNotifications(std::chrono::milliseconds(10)).at(0).payload, "hello");
}

TEST_F(LoopbackAgentTest, BadDescriptorsAreRejectedBeforeAnythingMoves) {
  const std::vector<uint8_t> before = bbuf_;
  Descriptor good_l = Descriptor::Of(abuf_.data(), 8), good_r = Descriptor::Of(bbuf_.data(), 8);
  Descriptor past_end = Descriptor::Of(bbuf_.data() + bbuf_.size() - 4, 8);
  std::vector<Descriptor> l = {good_l, good_l}, r = {good_r, past_end};
  auto w = a_->Write(peer_, l, r);
  EXPECT_EQ(w.status().code(), Code::kOutOfRange);
  EXPECT_NE(w.status().message().find("remote descriptor 1"), std::string::npos)
      << w.status().ToString();
  EXPECT_EQ(bbuf_, before);
  // Count and length mismatches.
  EXPECT_EQ(a_->Read(peer_, l, {r.data(), 1}).status().code(), Code::kInvalidArgument);
  Descriptor longer = Descriptor::Of(bbuf_.data(), 9);
  auto len = a_->Read(peer_, {&good_l, 1}, {&longer, 1});
  EXPECT_NE(len.status().message().find("8 local bytes but 9 remote"), std::string::npos);
  // A local range running past our region, and an address wrap-around.
  Descriptor local_past = Descriptor::Of(abuf_.data() + abuf_.size() - 1, 2);
  Descriptor r2 = Descriptor::Of(bbuf_.data(), 2);
  auto lp = a_->Read(peer_, {&local_past, 1}, {&r2, 1});
  EXPECT_NE(lp.status().message().find("local descriptor 0"), std::string::npos)
      << lp.status().ToString();
  Descriptor wrap{~0ull - 2, 8};
  Descriptor l8 = Descriptor::Of(abuf_.data(), 8);
  EXPECT_EQ(a_->Read(peer_, {&l8, 1}, {&wrap, 1}).status().code(), Code::kOutOfRange);
  // Unknown peer; oversized notification.
  EXPECT_EQ(a_->Read(99, {&l8, 1}, {&good_r, 1}).status().code(), Code::kNotFound);
  EXPECT_EQ(a_->Notify(peer_, std::string(Agent::kMaxNotificationBytes + 1, 'x')).code(),
            Code::kInvalidArgument);
}

TEST_F(LoopbackAgentTest, RegistrationAndConnectionErrors) {
  EXPECT_NE(a_->RegisterMemory(abuf_.data() + 10, 10).status().message().find("overlaps"),
            std::string::npos);
  EXPECT_EQ(a_->RegisterMemory(nullptr, 10).status().code(), Code::kInvalidArgument);
  EXPECT_NE(a_->Connect(b_->Metadata()).status().message().find("already connected"),
            std::string::npos);
  EXPECT_NE(a_->Connect(a_->Metadata()).status().message().find("own metadata"), std::string::npos);
  auto ucx = Agent::Create("u", {});
  ASSERT_TRUE(ucx.ok()) << ucx.status().ToString();
  auto mixed = a_->Connect((*ucx)->Metadata());
  EXPECT_EQ(mixed.status().code(), Code::kMismatch);
  EXPECT_NE(mixed.status().message().find("uses backend 'ucx'"), std::string::npos);
  EXPECT_EQ(Agent::Create("", {}).status().code(), Code::kInvalidArgument);
  AgentConfig bad;
  bad.backend = "verbs";
  EXPECT_NE(Agent::Create("x", bad).status().message().find("unknown backend 'verbs'"),
            std::string::npos);
  // A disconnected peer is unknown; reconnecting works.
  EXPECT_TRUE(a_->Disconnect(peer_).ok());
  EXPECT_EQ(a_->Peer(peer_).status().code(), Code::kNotFound);
  EXPECT_TRUE(a_->Connect(b_->Metadata()).ok());
}

TEST_F(LoopbackAgentTest, UnreachablePeerIsNamedAndSticky) {
  internal::SetLoopbackReachable("b", false);
  Descriptor l = Descriptor::Of(abuf_.data(), 8), r = Descriptor::Of(bbuf_.data(), 8);
  auto id = a_->Read(peer_, {&l, 1}, {&r, 1});
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(id.status().code(), Code::kUnavailable);
  EXPECT_NE(id.status().message().find("peer unreachable: 'b'"), std::string::npos)
      << id.status().ToString();
  EXPECT_FALSE(a_->Peer(peer_)->reachable);
  internal::SetLoopbackReachable("b", true);
  EXPECT_EQ(a_->Notify(peer_, "x").code(), Code::kUnavailable);  // until reconnected
}

TEST_F(LoopbackAgentTest, RegionsMayOutliveTheirAgent) {
  auto shared = a_->AllocateShared(4096);
  ASSERT_TRUE(shared.ok()) << shared.status().ToString();
  EXPECT_TRUE(shared->shared());
  static_cast<uint8_t*>(shared->data())[4095] = 1;  // mapped and writable
  a_.reset();
  RegisteredRegion moved = std::move(*shared);
  EXPECT_EQ(moved.size(), 4096u);
}

}  // namespace
}  // namespace eplbx
