// Coordination on etcd against a real 3-member etcd cluster on loopback (Debian's
// etcd-server; the tests start and stop it, and skip saying why where etcd is missing): the
// client (puts, ranges, transactions, leases, a member killed), EtcdBootstrap's rounds,
// a rank that stops renewing (its lease runs out), rank 0 lost, an etcd member and the
// leader killed while rounds go on, a rank's new process joining, hostile keys.
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <mutex>
#include <thread>

#include "common/strings.h"
#include "coord/etcd_client.h"
#include "eplbx/etcd.h"
#include "etcd_cluster.h"

namespace eplbx {
namespace {

using coord::EtcdClient;
using internal::StrCat;
using testing::EtcdCluster;

#define SKIP_WITHOUT_ETCD(cluster)                      \
  if (!(cluster).ready()) {                             \
    GTEST_SKIP() << "SKIPPED: " << (cluster).why_not(); \
  }

TEST(EtcdClientTest, KeysTransactionsLeasesAndAKilledMember) {
  EtcdCluster cluster(3);
  SKIP_WITHOUT_ETCD(cluster);
  auto c = EtcdClient::Create(cluster.endpoints(), std::chrono::seconds(5));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EtcdClient& e = **c;
  const std::string binary("a\0b\xff", 4);
  ASSERT_TRUE(e.Put("/t/x", binary).ok());
  ASSERT_TRUE(e.Put("/t/y", "2").ok());
  auto r = e.Prefix("/t/");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->kvs.size(), 2u);
  EXPECT_EQ(r->kvs[0].value, binary);
  // Compare-and-swap: create if absent, then fails with the current value read.
  auto t = e.Txn({coord::VersionIs("/t/z", 0)}, {coord::PutOp("/t/z", "first")});
  ASSERT_TRUE(t.ok() && t->succeeded);
  t = e.Txn({coord::VersionIs("/t/z", 0)}, {coord::PutOp("/t/z", "second")},
            {coord::RangeOp("/t/z")});
  ASSERT_TRUE(t.ok());
  EXPECT_FALSE(t->succeeded);
  ASSERT_EQ(t->ranges.size(), 1u);
  EXPECT_EQ(t->ranges[0].kvs[0].value, "first");
  // A lease: keys go with it.
  auto lease = e.LeaseGrant(2);
  ASSERT_TRUE(lease.ok());
  ASSERT_TRUE(e.Put("/t/leased", "v", *lease).ok());
  EXPECT_TRUE(e.LeaseKeepAlive(*lease).ok());
  ASSERT_TRUE(e.LeaseRevoke(*lease).ok());
  EXPECT_EQ(e.LeaseKeepAlive(*lease).status().code(), Code::kNotFound);
  EXPECT_TRUE(e.Range("/t/leased")->kvs.empty());
  // A killed member (whichever the client uses first): the next one answers.
  cluster.Kill(0);
  auto after = e.Prefix("/t/");
  ASSERT_TRUE(after.ok()) << after.status().ToString();
  EXPECT_EQ(after->kvs.size(), 3u);
  EXPECT_TRUE(e.Put("/t/after", "ok").ok());
  // Refused by name: a bad endpoint, no member reachable.
  EXPECT_EQ(EtcdClient::Create({"no-port"}, std::chrono::seconds(1)).status().code(),
            Code::kInvalidArgument);
  auto none = EtcdClient::Create({"127.0.0.1:1"}, std::chrono::milliseconds(300));
  ASSERT_TRUE(none.ok());
  Status s = (*none)->Put("k", "v").status();
  EXPECT_EQ(s.code(), Code::kUnavailable) << s.ToString();
  EXPECT_NE(s.message().find("127.0.0.1:1"), std::string::npos) << s.ToString();
}

// The watch the rounds wait on: its creation, then every change under the prefix (and none
// outside it) with its revision; StopWatch ends it at once; a member gone is kUnavailable and
// the next watch is on another member.
TEST(EtcdClientTest, AWatchSeesChangesUnderItsPrefixAndEndsWhenAsked) {
  EtcdCluster cluster(3);
  SKIP_WITHOUT_ETCD(cluster);
  auto c = EtcdClient::Create(cluster.endpoints(), std::chrono::seconds(5));
  auto w = EtcdClient::Create(cluster.endpoints(), std::chrono::seconds(5));
  ASSERT_TRUE(c.ok() && w.ok());
  std::mutex mu;
  std::vector<coord::EtcdWatchMessage> seen;
  std::atomic<bool> created{false};
  Status ended;
  std::thread watcher([&] {
    ended = (*w)->Watch(
        "/w/", coord::PrefixEnd("/w/"),
        [&](const coord::EtcdWatchMessage& m) {
          std::lock_guard<std::mutex> lock(mu);
          seen.push_back(m);
          if (m.created) created = true;
          return true;
        },
        std::chrono::seconds(60));
  });
  while (!created) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_TRUE((*c)->Put("/other", "x").ok());  // outside the prefix: not seen
  auto put = (*c)->Put("/w/a", "1");
  ASSERT_TRUE(put.ok());
  auto del = (*c)->Delete("/w/a");
  ASSERT_TRUE(del.ok());
  const int64_t last = (*c)->Range("/w/a")->revision;  // the delete's revision
  for (int i = 0; i < 500; ++i) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!seen.empty() && seen.back().revision >= last) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const auto t0 = std::chrono::steady_clock::now();
  (*w)->StopWatch();
  watcher.join();
  EXPECT_TRUE(ended.ok()) << ended.ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));  // not the 60 s
  ASSERT_GE(seen.size(), 2u);
  EXPECT_TRUE(seen[0].created);
  EXPECT_FALSE(seen[0].changed);
  int64_t changes = 0, top = 0;
  for (const auto& m : seen) {
    changes += m.changed;
    top = std::max(top, m.revision);
  }
  EXPECT_GE(changes, 1);
  EXPECT_EQ(top, last);  // the put and the delete, nothing past them (the other key came first)
  EXPECT_TRUE((*w)->Watch(
                      "/w/", {}, [](const auto&) { return true; }, std::chrono::seconds(9))
                  .ok());  // stopped: at once
  // Every member gone: a watch says so by name.
  auto lone = EtcdClient::Create({"127.0.0.1:1"}, std::chrono::milliseconds(300));
  ASSERT_TRUE(lone.ok());
  Status s = (*lone)->Watch(
      "/w/", {}, [](const auto&) { return true; }, std::chrono::seconds(5));
  EXPECT_EQ(s.code(), Code::kUnavailable) << s.ToString();
  EXPECT_NE(s.message().find("127.0.0.1:1"), std::string::npos) << s.ToString();
}

TEST(EtcdClientTest, WatchMessagesAreParsedStrictly) {
  auto m =
      coord::ParseWatchMessage(R"({"result":{"header":{"revision":"12"},"created":true}})", "w");
  ASSERT_TRUE(m.ok());
  EXPECT_TRUE(m->created && !m->changed && m->revision == 12);
  m = coord::ParseWatchMessage(
      R"({"result":{"header":{"revision":"40"},"events":[{"kv":{"key":"YQ==","mod_revision":"31"}},)"
      R"({"type":"DELETE","kv":{"key":"Yg==","mod_revision":"33"}}]}})",
      "w");
  ASSERT_TRUE(m.ok());
  EXPECT_TRUE(m->changed);
  EXPECT_EQ(m->revision, 40);  // the header's: at least the last event's
  m = coord::ParseWatchMessage(R"({"result":{"canceled":true,"compact_revision":"5"}})", "w");
  ASSERT_TRUE(m.ok());
  EXPECT_TRUE(m->canceled);
  EXPECT_EQ(coord::ParseWatchMessage(R"({"error":{"message":"etcdserver: no leader"}})", "w")
                .status()
                .code(),
            Code::kUnavailable);
  for (const char* bad :
       {"", "[]", R"({"result":{"events":{}}})", R"({"result":{"events":[1]}})",
        R"({"result":{"events":[{"kv":{"mod_revision":"x"}}]}})", R"({"result":{"header":[]}})",
        R"({"result":{"header":{"revision":"-3"}}})"}) {
    auto r = coord::ParseWatchMessage(bad, "etcd 1.2.3.4:2379 watch");
    EXPECT_EQ(r.status().code(), Code::kCorruption) << bad;
    EXPECT_NE(r.status().message().find("1.2.3.4:2379"), std::string::npos) << bad;
  }
}

TEST(EtcdClientTest, Base64AndPrefixEnds) {
  for (const std::string& s :
       {std::string(), std::string("f"), std::string("fo"), std::string("foo"), std::string("foob"),
        std::string("\xff\x00\x01", 3)}) {
    auto back = coord::Base64Decode(coord::Base64Encode(s));
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, s);
  }
  EXPECT_EQ(coord::Base64Encode("foob"), "Zm9vYg==");
  for (const char* bad : {"Zm9", "Zm9v!A==", "Z===", "=Zm9"}) {
    EXPECT_EQ(coord::Base64Decode(bad).status().code(), Code::kCorruption) << bad;
  }
  EXPECT_EQ(coord::PrefixEnd("/a/"), "/a0");
  EXPECT_EQ(coord::PrefixEnd(std::string("a\xff", 2)), "b");
}

TEST(EtcdUrlTest, EndpointsAreParsedAndBadOnesNamed) {
  auto ok = ParseEtcdUrl("etcd://10.0.0.1:2379,host-b:32379");
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok, (std::vector<std::string>{"10.0.0.1:2379", "host-b:32379"}));
  for (const char* bad : {"http://a:1", "etcd://", "etcd://a", "etcd://a:0", "etcd://a:99999",
                          "etcd://a:1,", "etcd://a:1/x", "etcd://u@a:1"}) {
    Result<std::vector<std::string>> got = ParseEtcdUrl(bad);
    EXPECT_EQ(got.status().code(), Code::kInvalidArgument) << bad;
  }
}

EtcdOptions Options(const EtcdCluster& cluster, const std::string& group) {
  EtcdOptions o;
  o.endpoints = cluster.endpoints();
  o.group = group;
  o.token = "secret";
  o.lease = std::chrono::seconds(2);
  o.start_timeout = std::chrono::seconds(30);
  return o;
}

// Rounds among threads; `stop(rank, round)` true: that rank stops renewing there (as a
// killed process) and stops taking part. Returns per rank what each round returned.
struct Rounds {
  std::mutex mu;
  std::map<uint32_t, std::vector<std::string>> log;  // rank -> "ok:<blobs>" / "aborted:<why>"
  std::map<uint32_t, uint64_t> epoch;
  std::map<uint32_t, std::vector<bool>> members;
};

TEST(EtcdBootstrapTest, RoundsAgreeAndALostRankIsNamedOnEveryMember) {
  EtcdCluster cluster(3);
  SKIP_WITHOUT_ETCD(cluster);
  constexpr uint32_t kWorld = 4;
  Rounds out;
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      auto b = EtcdBootstrap::Join(r, kWorld, Options(cluster, "rounds"));
      if (!b.ok()) {
        std::lock_guard<std::mutex> lock(out.mu);
        out.log[r].push_back("join failed: " + b.status().ToString());
        return;
      }
      EXPECT_FALSE((*b)->joining());
      EXPECT_EQ((*b)->epoch(), 1u);
      for (int round = 0; round < 12; ++round) {
        if (r == 0 && round == 5) {
          (*b)->StopRenewing();  // rank 0 (as if killed): its lease runs out
          return;
        }
        auto got = (*b)->AllGather(StrCat("r", r, "n", round), std::chrono::seconds(20));
        std::string line;
        if (got.ok()) {
          line = "ok:";
          for (const std::string& x : *got) line += x + ",";
        } else {
          line = StrCat(static_cast<int>(got.status().code()), ":", got.status().message());
        }
        std::lock_guard<std::mutex> lock(out.mu);
        out.log[r].push_back(line);
        out.epoch[r] = (*b)->epoch();
        out.members[r] = (*b)->members();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (uint32_t r = 1; r < kWorld; ++r) {
    SCOPED_TRACE(StrCat("rank ", r));
    const std::vector<std::string>& log = out.log[r];
    ASSERT_EQ(log.size(), 12u);
    // Rounds 0-4 with everyone; then one refusal naming rank 0's loss; then rounds among 1-3.
    for (int i = 0; i < 5; ++i) {
      EXPECT_EQ(log[i], StrCat("ok:r0n", i, ",r1n", i, ",r2n", i, ",r3n", i, ",")) << log[i];
    }
    EXPECT_EQ(log[5],
              StrCat(static_cast<int>(Code::kAborted), ":rank 0 left: epoch 2, members 1, 2, 3"));
    EXPECT_EQ(log[6], "ok:,r1n6,r2n6,r3n6,");  // the next round, at epoch 2
    EXPECT_EQ(out.epoch[r], 2u);
    EXPECT_EQ(out.members[r], (std::vector<bool>{false, true, true, true}));
    EXPECT_EQ(log, out.log[1]);  // the same on every member
  }
}

TEST(EtcdBootstrapTest, AnEtcdMemberAndTheLeaderKilledWhileRoundsGoOn) {
  EtcdCluster cluster(3);
  SKIP_WITHOUT_ETCD(cluster);
  constexpr uint32_t kWorld = 3;
  std::atomic<int> finished{0};
  std::vector<std::vector<std::string>> logs(kWorld);
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      auto b = EtcdBootstrap::Join(r, kWorld, Options(cluster, "chaos"));
      ASSERT_TRUE(b.ok()) << b.status().ToString();
      for (int round = 0; round < 60; ++round) {
        auto got = (*b)->AllGather(StrCat(r, ":", round), std::chrono::seconds(30));
        logs[r].push_back(got.ok() ? StrCat(got->size(), "/", (*got)[0], (*got)[1], (*got)[2])
                                   : got.status().ToString());
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      ++finished;
    });
  }
  // While they run: kill a follower, then the leader (two of three: the cluster keeps a
  // quorum only after the follower comes back, so it is restarted first).
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  int leader = cluster.Leader();
  const int follower = leader == 0 ? 1 : 0;
  cluster.Kill(follower);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  cluster.Restart(follower);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  leader = cluster.Leader();
  if (leader >= 0) cluster.Kill(leader);
  for (auto& t : threads) t.join();
  EXPECT_EQ(finished.load(), 3);
  for (uint32_t r = 0; r < kWorld; ++r) {
    ASSERT_EQ(logs[r].size(), 60u);
    for (int i = 0; i < 60; ++i)
      EXPECT_EQ(logs[r][i], StrCat("3/0:", i, "1:", i, "2:", i)) << "rank " << r << " round " << i;
  }
}

TEST(EtcdBootstrapTest, ANewProcessForALostRankJoinsAndHostileKeysAreRefusedByName) {
  EtcdCluster cluster(3);
  SKIP_WITHOUT_ETCD(cluster);
  constexpr uint32_t kWorld = 3;
  std::vector<std::unique_ptr<EtcdBootstrap>> b(kWorld);
  {
    std::vector<std::thread> threads;
    for (uint32_t r = 0; r < kWorld; ++r) {
      threads.emplace_back([&, r] {
        auto x = EtcdBootstrap::Join(r, kWorld, Options(cluster, "join"));
        ASSERT_TRUE(x.ok()) << x.status().ToString();
        b[r] = std::move(*x);
      });
    }
    for (auto& t : threads) t.join();
  }
  ASSERT_TRUE(b[0] && b[1] && b[2]);
  // Rank 2 leaves gracefully (its lease revoked): the others learn it at their next round.
  b[2].reset();
  for (uint32_t r : {0u, 1u}) {
    auto got = b[r]->AllGather("x", std::chrono::seconds(10));
    EXPECT_EQ(got.status().ToString(), "aborted: rank 2 left: epoch 2, members 0, 1");
  }
  // A new process for rank 2 joins where they are; their round in progress is refused.
  std::unique_ptr<EtcdBootstrap> again;
  std::thread joiner([&] {
    auto x = EtcdBootstrap::Join(2, kWorld, Options(cluster, "join"));
    ASSERT_TRUE(x.ok()) << x.status().ToString();
    again = std::move(*x);
  });
  std::vector<std::string> seen(2);
  std::vector<std::thread> members;
  for (uint32_t r : {0u, 1u}) {
    members.emplace_back([&, r] {
      for (int i = 0; i < 50; ++i) {
        auto got = b[r]->AllGather("m", std::chrono::seconds(10));
        if (!got.ok()) {
          seen[r] = got.status().ToString();
          return;
        }
      }
      seen[r] = "no join seen";
    });
  }
  joiner.join();
  for (auto& t : members) t.join();
  ASSERT_TRUE(again != nullptr);
  EXPECT_TRUE(again->joining());
  EXPECT_EQ(again->epoch(), 3u);
  for (uint32_t r : {0u, 1u})
    EXPECT_EQ(seen[r], "aborted: rank 2 joined: epoch 3, members 0, 1, 2");
  // All three go on together.
  std::vector<std::string> last(3);
  std::vector<std::thread> all;
  for (uint32_t r = 0; r < 3; ++r) {
    all.emplace_back([&, r] {
      EtcdBootstrap& me = r == 2 ? *again : *b[r];
      auto got = me.AllGather(StrCat("z", r), std::chrono::seconds(10));
      last[r] = got.ok() ? (*got)[0] + (*got)[1] + (*got)[2] : got.status().ToString();
    });
  }
  for (auto& t : all) t.join();
  for (uint32_t r = 0; r < 3; ++r) EXPECT_EQ(last[r], "z0z1z2");
  // Hostile input: a key under the group's prefix that eplbx did not write, a foreign view.
  auto c = EtcdClient::Create(cluster.endpoints(), std::chrono::seconds(3));
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE((*c)->Put("/eplbx/join/members/garbage", "x").ok());
  auto got = b[0]->AllGather("h", std::chrono::seconds(5));
  EXPECT_EQ(got.status().code(), Code::kCorruption);
  EXPECT_NE(got.status().message().find("'/eplbx/join/members/garbage'"), std::string::npos)
      << got.status().ToString();
  ASSERT_TRUE((*c)->Delete("/eplbx/join/members/garbage").ok());
  // A closing round that is no number (or past int64) for the epoch in force.
  ASSERT_TRUE((*c)->Put("/eplbx/join/closed/0000000003", "99999999999999999999").ok());
  got = b[1]->AllGather("h", std::chrono::seconds(5));
  EXPECT_EQ(got.status().code(), Code::kInvalidArgument) << got.status().ToString();
  EXPECT_NE(got.status().message().find("the closing round of epoch 3"), std::string::npos)
      << got.status().ToString();
  ASSERT_TRUE((*c)->Delete("/eplbx/join/closed/0000000003").ok());
  ASSERT_TRUE((*c)->Put("/eplbx/join/epoch", "eplbx-view 1 1 0 0 0").ok());  // no member: refused
  got = again->AllGather("h", std::chrono::seconds(5));
  EXPECT_EQ(got.status().code(), Code::kCorruption);
  EXPECT_NE(got.status().message().find("has no member"), std::string::npos)
      << got.status().ToString();
  // Another token or world size for the same group is refused by name.
  EtcdOptions wrong = Options(cluster, "join");
  wrong.token = "other";
  auto w = EtcdBootstrap::Join(0, kWorld, wrong);
  EXPECT_EQ(w.status().code(), Code::kInvalidArgument);
  EXPECT_NE(w.status().message().find("another token"), std::string::npos) << w.status().ToString();
  w = EtcdBootstrap::Join(0, 5, Options(cluster, "join"));
  EXPECT_NE(w.status().message().find("the group has 3 ranks, this process says 5"),
            std::string::npos)
      << w.status().ToString();
}

}  // namespace
}  // namespace eplbx
