// Agent core, metadata codec and the loopback backend (in-process). The real transfers
// between processes are in tests/multiproc/.
#include <cstring>
#include <numeric>
#include <vector>

#include <gtest/gtest.h>

#include "common/bytes.h"
#include "common/strings.h"
#include "eplbx/transfer.h"
#include "transfer/cma/cma_path.h"
#include "transfer/loopback/loopback_path.h"
#include "transfer/metadata.h"
#include "transfer/shm/shm_path.h"
#include "transfer/ucx/ucx_path.h"

namespace eplbx {
namespace {

using internal::AgentMetadata;
using internal::DecodeAgentMetadata;
using internal::EncodeAgentMetadata;

AgentMetadata SampleMetadata() {
  AgentMetadata m;
  m.name = "rank7";
  m.host_id = "host/boot/net/pid";
  m.pid = 4242;
  m.control = "ucx";
  m.conn_info = std::string("\x01\x02\x00\x03", 4);
  m.regions.push_back({0x7f0000000000, 1 << 20, MemoryKind::kHost});
  m.regions.push_back({0x7f0000200000, 4096, MemoryKind::kHostFile});
  m.sections.push_back({"shm", std::string(24, '\x01')});
  m.sections.push_back({"cma", std::string(8, '\x02')});
  m.sections.push_back({"ucx", std::string(40, 'k')});
  return m;
}

TEST(AgentMetadataTest, RoundTrips) {
  const AgentMetadata m = SampleMetadata();
  Result<AgentMetadata> d = DecodeAgentMetadata(EncodeAgentMetadata(m));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->name, m.name);
  EXPECT_EQ(d->host_id, m.host_id);
  EXPECT_EQ(d->control, m.control);
  EXPECT_EQ(d->pid, m.pid);
  EXPECT_EQ(d->conn_info, m.conn_info);
  ASSERT_EQ(d->regions.size(), 2u);
  EXPECT_EQ(d->regions[1].addr, m.regions[1].addr);
  EXPECT_EQ(d->regions[1].bytes, m.regions[1].bytes);
  EXPECT_EQ(d->regions[0].kind, MemoryKind::kHost);
  EXPECT_EQ(d->regions[1].kind, MemoryKind::kHostFile);
  ASSERT_EQ(d->sections.size(), 3u);
  ASSERT_NE(d->Section("ucx"), nullptr);
  EXPECT_EQ(d->Section("ucx")->body, m.sections[2].body);
  EXPECT_EQ(d->Section("cma")->body, m.sections[1].body);
  EXPECT_EQ(d->Section("cuda_ipc"), nullptr);
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
  EXPECT_NE(d.status().message().find("truncated at field 'sections[2].body'"), std::string::npos)
      << d.status().ToString();
}

TEST(AgentMetadataTest, OlderVersionsAreRefusedNamingThePeer) {
  // Version 2 (eplbx before the data-path sections) and 3 (before the inbox's name in the
  // connection info): magic, version, reserved, length, then the name as in every version.
  for (uint16_t version : {2, 3}) {
    internal::ByteWriter w;
    w.Raw("EPXA");
    w.U16(version);
    w.U16(0);
    w.U32(0);
    w.Str16("rank5");
    w.Str16("host");
    std::string old = w.Take();
    Result<AgentMetadata> d = DecodeAgentMetadata(old);
    EXPECT_EQ(d.status().code(), Code::kNotSupported);
    EXPECT_NE(d.status().message().find(internal::StrCat("of peer 'rank5' is version ", version,
                                                         ", this build reads version 4: "
                                                         "both sides need the same eplbx version")),
              std::string::npos)
        << d.status().ToString();
    // Too short to hold a name: still refused by version, without a name.
    Result<AgentMetadata> bare = DecodeAgentMetadata(old.substr(0, 12));
    EXPECT_NE(bare.status().message().find(internal::StrCat("of the peer is version ", version)),
              std::string::npos)
        << bare.status().ToString();
  }
}

TEST(AgentMetadataTest, EachMalformationHasItsOwnMessage) {
  const std::string blob = EncodeAgentMetadata(SampleMetadata());
  std::string magic = blob;
  magic[1] = 'Q';
  EXPECT_NE(DecodeAgentMetadata(magic).status().message().find("bad magic"), std::string::npos);
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
  big.sections[0].path = std::string(internal::kMaxPartNameBytes + 1, 'p');
  EXPECT_NE(
      DecodeAgentMetadata(EncodeAgentMetadata(big)).status().message().find("sections[0].path"),
      std::string::npos);
  big = SampleMetadata();
  big.sections[1].body = std::string(internal::kMaxSectionBytes + 1, 'b');
  EXPECT_NE(
      DecodeAgentMetadata(EncodeAgentMetadata(big)).status().message().find("sections[1].body"),
      std::string::npos);
  big = SampleMetadata();
  big.sections[2].path = "shm";
  EXPECT_NE(DecodeAgentMetadata(EncodeAgentMetadata(big))
                .status()
                .message()
                .find("two sections for path 'shm'"),
            std::string::npos);
  big = SampleMetadata();
  big.sections[0].path.clear();
  EXPECT_NE(
      DecodeAgentMetadata(EncodeAgentMetadata(big)).status().message().find("has no path name"),
      std::string::npos);
  big = SampleMetadata();
  big.regions[0].kind = static_cast<MemoryKind>(7);
  EXPECT_NE(DecodeAgentMetadata(EncodeAgentMetadata(big))
                .status()
                .message()
                .find("regions[0].kind is 7 (known: 0 host, 1 host_file, 2 cuda)"),
            std::string::npos)
      << DecodeAgentMetadata(EncodeAgentMetadata(big)).status().ToString();
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
  const size_t count_at = 12 + 2 + 5 + 2 + 17 + 4 + 2 + 3 + 4 + 4;
  ASSERT_EQ(static_cast<uint8_t>(many[count_at]), 2u);
  many[count_at + 2] = 0x10;  // 0x100002 regions
  EXPECT_NE(DecodeAgentMetadata(many).status().message().find("regions, the limit is"),
            std::string::npos)
      << DecodeAgentMetadata(many).status().ToString();
  // So is a section count beyond the limit.
  std::string sections = blob;
  const size_t sections_at = count_at + 4 + 2 * 20;
  ASSERT_EQ(static_cast<uint8_t>(sections[sections_at]), 3u);
  sections[sections_at] = 17;
  EXPECT_NE(DecodeAgentMetadata(sections).status().message().find("17 path sections, the limit"),
            std::string::npos)
      << DecodeAgentMetadata(sections).status().ToString();
}

// Each path's section is decoded by the path, with its own checks.
TEST(PathSectionTest, EveryTruncationAndBadCountIsRejected) {
  internal::ByteWriter shm;
  shm.U32(2);
  shm.U32(static_cast<uint32_t>(-1));
  shm.U64(0);
  shm.U32(12);
  shm.U64(4096);
  const std::string s = shm.Take();
  Result<std::vector<internal::SharedFile>> files = internal::DecodeShmSection(s, 2, "p");
  ASSERT_TRUE(files.ok()) << files.status().ToString();
  EXPECT_EQ((*files)[0].fd, -1);
  EXPECT_EQ((*files)[1].fd, 12);
  EXPECT_EQ((*files)[1].offset, 4096u);
  for (size_t n = 0; n < s.size(); ++n) {
    EXPECT_EQ(internal::DecodeShmSection(s.substr(0, n), 2, "p").status().code(), Code::kCorruption)
        << n;
  }
  EXPECT_NE(internal::DecodeShmSection(s, 3, "p").status().message().find(
                "files for 2 regions, the header lists 3"),
            std::string::npos);
  EXPECT_NE(internal::DecodeShmSection(s + "x", 2, "p").status().message().find("trailing"),
            std::string::npos);

  internal::ByteWriter ucx;
  ucx.U32(1);
  ucx.Str32("rkey");
  const std::string u = ucx.Take();
  ASSERT_TRUE(internal::DecodeUcxSection(u, 1, "p").ok());
  for (size_t n = 0; n < u.size(); ++n) {
    EXPECT_FALSE(internal::DecodeUcxSection(u.substr(0, n), 1, "p").ok()) << n;
  }
  EXPECT_NE(internal::DecodeUcxSection(u, 0, "p").status().message().find(
                "ucx section of peer 'p': keys for 1 regions, the header lists 0"),
            std::string::npos);

  internal::ByteWriter cma;
  cma.U64(0x1000);
  const std::string c = cma.Take();
  EXPECT_EQ(*internal::DecodeCmaSection(c, "p"), 0x1000u);
  EXPECT_FALSE(internal::DecodeCmaSection(c.substr(0, 7), "p").ok());
  EXPECT_FALSE(internal::DecodeCmaSection(c + "x", "p").ok());
}

TEST(UcxConnInfoTest, RoundTripsAndRefusesWhatCannotHoldItsParts) {
  const std::string address("\x01\x00\x02ucx-address", 14);
  for (std::string_view inbox : {std::string_view(), std::string_view("eplbx-0123abcd")}) {
    const std::string info = internal::EncodeUcxConnInfo(address, inbox);
    Result<internal::UcxConnInfo> d = internal::DecodeUcxConnInfo(info, "me", "rank1");
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    EXPECT_EQ(d->address, address);
    EXPECT_EQ(d->inbox, inbox);
  }
  // Every prefix shorter than the address, an empty address, a length past the end, a name
  // longer than 64 bytes: each refused by name.
  const std::string info = internal::EncodeUcxConnInfo(address, "eplbx-x");
  for (size_t n = 0; n < 4 + address.size(); ++n) {
    Result<internal::UcxConnInfo> d = internal::DecodeUcxConnInfo(info.substr(0, n), "me", "rank1");
    ASSERT_FALSE(d.ok()) << n;
    EXPECT_EQ(d.status().message(),
              internal::StrCat("agent 'me': the connection info of peer 'rank1' (", n,
                               " bytes) does not hold a UCX address: a peer of another eplbx "
                               "version?"));
  }
  EXPECT_FALSE(internal::DecodeUcxConnInfo(internal::EncodeUcxConnInfo("", "x"), "me", "r").ok());
  Result<internal::UcxConnInfo> long_name = internal::DecodeUcxConnInfo(
      internal::EncodeUcxConnInfo(address, std::string(65, 'n')), "me", "rank1");
  EXPECT_EQ(long_name.status().message(),
            "agent 'me': the connection info of peer 'rank1' names an inbox of 65 bytes (at most "
            "64)");
  EXPECT_TRUE(internal::DecodeUcxConnInfo(
                  internal::EncodeUcxConnInfo(address, std::string(64, 'n')), "me", "rank1")
                  .ok());
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

TEST(MessageHeaderTest, NotificationBatchesRoundTripAndRejectEachMalformation) {
  const std::vector<std::string> payloads = {"a", "", std::string(1000, 'z'), "last"};
  const std::string body = internal::EncodeNotifyBatch(payloads);
  auto d = internal::DecodeNotifyBatch(body);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(*d, payloads);
  for (size_t n = 0; n < body.size(); ++n) {
    EXPECT_FALSE(internal::DecodeNotifyBatch(body.substr(0, n)).ok()) << n;
  }
  auto message = [](std::string_view bytes) {
    return internal::DecodeNotifyBatch(bytes).status().message();
  };
  EXPECT_NE(message(body + "x").find("1 trailing bytes"), std::string::npos) << message(body + "x");
  EXPECT_NE(message(internal::EncodeNotifyBatch({})).find("0 notifications"), std::string::npos);
  std::string many = body;
  many[0] = static_cast<char>(0xff);
  many[1] = static_cast<char>(0xff);  // 65,535 notifications claimed
  EXPECT_NE(message(many).find("65535 notifications (expected 1..4096)"), std::string::npos)
      << message(many);
  const std::string big =
      internal::EncodeNotifyBatch({std::string(Agent::kMaxNotificationBytes + 1, 'b')});
  EXPECT_NE(message(big).find("the limit is 65536"), std::string::npos) << message(big);
  // A bad notification is named by its index (two digits here), and so is a cut one.
  std::vector<std::string> twelve(12, "n");
  twelve[11] = std::string(Agent::kMaxNotificationBytes + 1, 'b');
  const std::string bad_last = internal::EncodeNotifyBatch(twelve);
  EXPECT_NE(message(bad_last).find("notification 11"), std::string::npos) << message(bad_last);
  const std::string cut = body.substr(0, body.size() - 1);
  EXPECT_NE(message(cut).find("notification 3"), std::string::npos) << message(cut);
  // The kind is known to the header decoder.
  const std::string h = internal::EncodeMessageHeader({internal::MessageKind::kNotifyBatch, "r"});
  size_t used = 0;
  auto hd = internal::DecodeMessageHeader(h, &used);
  ASSERT_TRUE(hd.ok()) << hd.status().ToString();
  EXPECT_EQ(hd->kind, internal::MessageKind::kNotifyBatch);
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

TEST_F(LoopbackAgentTest, NotifyManyAndReadManyGoOneByOneInOrder) {
  std::vector<Status> sent =
      b_->NotifyMany(*b_->Connect(a_->Metadata()),
                     {"one", std::string(Agent::kMaxNotificationBytes + 1, 'x'), "three"});
  ASSERT_EQ(sent.size(), 3u);
  EXPECT_TRUE(sent[0].ok() && sent[2].ok());
  EXPECT_EQ(sent[1].code(), Code::kInvalidArgument);
  auto n = a_->PollNotifications();
  ASSERT_EQ(n.size(), 2u);
  EXPECT_EQ(n[0].payload, "one");
  EXPECT_EQ(n[1].payload, "three");
  std::vector<Agent::ReadRequest> reads(3);
  for (size_t i = 0; i < reads.size(); ++i) {
    reads[i].peer = peer_;
    reads[i].local = {Descriptor::Of(abuf_.data() + 100 * i, 10)};
    reads[i].remote = {Descriptor::Of(bbuf_.data() + 7 * i, 10)};
    reads[i].notify = "read " + std::to_string(i);
  }
  reads[1].remote = {Descriptor{~0ull - 2, 10}};  // wraps: refused, the others go
  auto ids = a_->ReadMany(reads);
  ASSERT_EQ(ids.size(), 3u);
  EXPECT_EQ(ids[1].status().code(), Code::kOutOfRange);
  for (size_t i : {size_t{0}, size_t{2}}) {
    ASSERT_TRUE(ids[i].ok()) << ids[i].status().ToString();
    EXPECT_EQ(a_->Wait(*ids[i], std::chrono::seconds(1)).state, TransferState::kDone);
    EXPECT_EQ(abuf_[100 * i + 9], bbuf_[7 * i + 9]);
  }
  auto got = b_->PollNotifications();
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].payload, "read 0");
  EXPECT_EQ(got[1].payload, "read 2");
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
