// ServingGroup (eplbx/serving.h) with ranks as threads on the real store with membership and
// loopback agents: serving with rebalances in flight through a sequence of membership
// changes (a loss, a later second loss, a lost rank's process coming back, a drain), and
// with the membership an engine feeds (MembersView), every row each rank serves checked
// against the placement in force at every step. The same with
// processes: tests/cli/demo_test.cc (the demo's ranks are ServingGroups).
#include "eplbx/serving.h"

#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <type_traits>

#include "eplbx/backup.h"
#include "eplbx/etcd.h"
#include "etcd_cluster.h"
#include "joined_store.h"
#include "rank_fixture.h"

namespace eplbx {
namespace {

using namespace eplbx::fixture;  // NOLINT: the fixture

constexpr int kWorld = 5;
constexpr int kSlots = kWorld * kRows;  // 20 slots for 9 experts

// Slots 0-8 hold experts 0-8 at the start, the others replicas of 0, 1, 2, 3 and 8: experts
// 4-7 are on rank 1 only (its slots 4-7), so its loss needs the backup.
std::vector<std::vector<int32_t>> StartMaps() {
  constexpr int kReplicated[] = {0, 1, 2, 3, 8};
  std::vector<std::vector<int32_t>> maps(kLayers);
  for (int l = 0; l < kLayers; ++l) {
    for (int s = 0; s < kSlots; ++s) maps[l].push_back(s < kExperts ? s : kReplicated[(s - 9) % 5]);
  }
  return maps;
}

Placement StartPlacement() {
  std::vector<int32_t> flat;
  for (const auto& m : StartMaps()) flat.insert(flat.end(), m.begin(), m.end());
  return *Placement::FromPhy2Log(kLayers, kSlots, kExperts, flat);
}

// Skewed counts, the same on every rank at a step, drifting so that rebalances happen.
std::vector<double> Counts(int step) {
  std::mt19937 rng(static_cast<uint32_t>(step) * 7919u + 1);
  std::vector<double> c;
  for (int l = 0; l < kLayers; ++l) {
    for (int e = 0; e < kExperts; ++e) {
      const int hot = (e + step / 6 + l) % kExperts;
      c.push_back(hot < 2 ? 400.0 + rng() % 50 : 10.0 + rng() % 20);
    }
  }
  return c;
}

ServingOptions Options() {
  ServingOptions o;
  o.balancer.topology = Topology{.ranks = kWorld, .nodes = 1, .slots = kSlots, .groups = 1};
  o.balancer.policy = Policy::kIncremental;
  o.balancer.window = 4;
  o.balancer.trigger.interval = 4;
  o.balancer.mode = BalancerMode::kAsynchronous;
  o.balancer.plan_lag_steps = 1;
  o.balancer.bytes_per_expert = kBytes[0] + kBytes[1];
  o.rearrange.deadline = std::chrono::seconds(5);
  o.round_wait = std::chrono::milliseconds(3000);
  return o;
}

// Every row `rank` serves holds the expert placement() names there ("" when so).
std::string CheckRows(const Rank& rank, const ServingGroup& g) {
  const Placement& p = g.placement();
  const int r = static_cast<int>(rank.layout.rank);
  for (int l = 0; l < kLayers; ++l) {
    const std::vector<uint32_t> table = g.RowTable(static_cast<uint32_t>(l));
    for (int row = 0; row < kRows; ++row) {
      const int32_t e = p.phy2log(l, r * kRows + row);
      if (e < 0) continue;
      for (int t = 0; t < 2; ++t) {
        const uint8_t* got = rank.SlotRow(l, t, row, table);
        for (uint64_t i = 0; i < kBytes[t]; ++i) {
          if (got[i] != Byte(l, e, t, i)) {
            return "rank " + std::to_string(r) + " layer " + std::to_string(l) + " row " +
                   std::to_string(row) + " does not hold expert " + std::to_string(e);
          }
        }
      }
    }
  }
  // Every expert is served by a member.
  for (int l = 0; l < kLayers; ++l) {
    for (int e = 0; e < kExperts; ++e) {
      bool held = false;
      for (int32_t slot : p.replicas(l, e)) held |= g.members()[slot / kRows];
      if (!held) return "expert " + std::to_string(e) + " of layer " + std::to_string(l) + " lost";
    }
  }
  return "";
}

// What one rank's thread saw.
struct Outcome {
  Status status;
  int64_t steps = 0;
  uint64_t epoch = 0;
  std::vector<int32_t> placement;
  std::vector<RecoveryRecord> recoveries;
  std::string bad;
  int64_t rows_checked = 0;
  int64_t rebalances = 0;
  std::string metrics;  // PrometheusText(group) at the end
};

struct World {
  JoinedStore store{kWorld, /*membership=*/true};
  std::vector<std::unique_ptr<Rank>> ranks;
  std::unique_ptr<HostBackup> backup;
  std::mutex mu;
  std::map<std::string, Outcome> out;  // by "rank N" (a rank's second process: "rank N again")

  World() {
    const auto maps = StartMaps();
    for (uint32_t r = 0; r < kWorld; ++r) ranks.push_back(MakeRank(r, maps));
    auto b = HostBackup::Create(::testing::TempDir(), ranks[0]->layout, kExperts);
    EXPECT_TRUE(b.ok()) << b.status().ToString();
    if (!b.ok()) return;
    backup = std::move(*b);
    for (uint32_t r = 0; r < kWorld; ++r)
      EXPECT_TRUE(backup->Capture(StartPlacement(), ranks[r]->layout).ok());
  }

  // Serves on `g` from its step to `to`, or, with `await_join`, until 8 steps after a join
  // was settled (every member and the joiner agree on that step; at most kMaxSteps);
  // `die_at(step)` true: this rank's process dies there (before the step's collective).
  static constexpr int kMaxSteps = 400;
  template <typename Boot>
  void Serve(const std::string& name, Rank& rank, ServingGroup& g, int to, bool await_join,
             const std::function<bool(int)>& die_at, const std::function<void(int)>& at_step,
             std::unique_ptr<Boot>& boot) {
    Outcome o;
    auto end = [&] {
      for (const RecoveryRecord& r : g.recoveries()) {
        if (r.kind == "join") return std::max<int64_t>(to, r.step + 8);
      }
      return await_join ? int64_t{kMaxSteps} : int64_t{to};
    };
    for (int step = static_cast<int>(g.step()); step < end() && step < kMaxSteps; ++step) {
      if (at_step) at_step(step);
      const std::vector<double> c = Counts(step);
      Result<BalancerStep> st = g.Step(c);
      if (!st.ok()) {
        o.status = st.status();
        break;
      }
      (void)g.Commit();
      if (o.bad.empty()) o.bad = CheckRows(rank, g);
      o.rows_checked += kLayers * kRows;
      if (die_at && die_at(step)) {
        // The process is gone: its socket closes; on etcd its lease is no longer renewed.
        if constexpr (std::is_same_v<Boot, EtcdBootstrap>) boot->StopRenewing();
        boot.reset();
        o.status = Status::Aborted("died");
        break;
      }
      Result<bool> synced = g.Sync();
      if (!synced.ok()) {
        o.status = synced.status();
        break;
      }
      if (*synced && o.bad.empty()) o.bad = CheckRows(rank, g);
    }
    Finish(name, rank, &g, std::move(o));
  }

  // A rank's end (`g` null: it never served): a rebalance still in flight ends on every
  // member at the same step, its rows checked once more (unless it left), what it saw kept.
  void Finish(const std::string& name, const Rank& rank, ServingGroup* g, Outcome o) {
    if (g != nullptr) {
      const bool serving = o.status.ok() && !g->left();
      while (serving && g->progress().rebalancing) (void)g->Commit();
      if (serving && o.bad.empty()) o.bad = CheckRows(rank, *g);
      o.steps = g->step();
      o.epoch = g->epoch();
      o.placement = g->placement().phy2log();
      o.recoveries = g->recoveries();
      o.rebalances = static_cast<int64_t>(g->report().rebalances.size());
      o.metrics = PrometheusText(*g);
    }
    std::lock_guard<std::mutex> lock(mu);
    out[name] = std::move(o);
  }
};

// Rank 1 is lost at step 6, rank 3 at step 14; at step 20 a new process for rank 1 starts and
// joins where the members are; they all go on to step 34 (or 8 steps past the join). Every member
// ends at one epoch with one placement, the rows it serves checked at every step, experts only a
// lost rank held restored from the backup.
TEST(ServingGroupTest, ServesThroughALossASecondLossAndALostRankComingBack) {
  World w;
  ASSERT_TRUE(w.store.joined() && w.backup != nullptr);
  constexpr int kSteps = 34;
  std::atomic<bool> spawn{false}, members_done{false};
  std::unique_ptr<SocketBootstrap> again_boot;
  std::unique_ptr<Rank> again;
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      std::vector<const BackupSource*> backups{w.backup.get()};
      auto g = ServingGroup::Create(w.ranks[r]->agent.get(), w.store.m[r].get(), w.ranks[r]->layout,
                                    StartPlacement(), Options(), backups);
      if (!g.ok()) {
        std::lock_guard<std::mutex> lock(w.mu);
        w.out["rank " + std::to_string(r)].status = g.status();
        return;
      }
      w.Serve(
          "rank " + std::to_string(r), *w.ranks[r], **g, kSteps, /*await_join=*/true,
          [r](int step) { return (r == 1 && step == 6) || (r == 3 && step == 14); },
          [&, r](int step) {
            if (r == 0 && step == 20) spawn = true;
          },
          w.store.m[r]);
    });
  }
  // Rank 1's process comes back (as systemd would restart it) and joins where they are.
  std::thread joiner([&] {
    while (!spawn && !members_done) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    if (!spawn) return;  // the members never reached the step (their outcomes say why)
    again =
        MakeRank(1, std::vector<std::vector<int32_t>>(kLayers, std::vector<int32_t>(kSlots, 0)));
    auto b = JoinTcpStore("127.0.0.1", w.store.port, "t", 1, kWorld, std::chrono::seconds(5));
    Outcome failed;
    if (!b.ok()) {
      failed.status = b.status();
    } else {
      again_boot = std::move(*b);
      std::vector<const BackupSource*> backups{w.backup.get()};
      auto g = ServingGroup::Join(again->agent.get(), again_boot.get(), again->layout, kExperts,
                                  Options(), backups);
      if (g.ok()) {
        w.Serve("rank 1 again", *again, **g, kSteps, false, nullptr, nullptr, again_boot);
        return;
      }
      failed.status = g.status();
    }
    std::lock_guard<std::mutex> lock(w.mu);
    w.out["rank 1 again"] = failed;
  });
  for (auto& t : threads) t.join();
  members_done = true;
  joiner.join();

  std::string story;  // what every rank saw, for a failure's message
  for (const auto& [name, o] : w.out) {
    story += "\n" + name + ": " + o.status.ToString() + ", " + std::to_string(o.steps) +
             " steps, epoch " + std::to_string(o.epoch);
    for (const RecoveryRecord& r : o.recoveries) {
      story += "; " + r.kind + " at step " + std::to_string(r.step) + " epoch " +
               std::to_string(r.epoch_before) + " -> " + std::to_string(r.epoch) + " (" +
               std::to_string(r.placements) + " placements)";
    }
  }
  SCOPED_TRACE(story);
  const std::vector<std::string> members = {"rank 0", "rank 2", "rank 4", "rank 1 again"};
  const Outcome& first = w.out["rank 0"];
  for (const std::string& m : members) {
    const Outcome& o = w.out[m];
    ASSERT_TRUE(o.status.ok()) << m << ": " << o.status.ToString();
    EXPECT_EQ(o.bad, "") << m;
    EXPECT_EQ(o.steps, first.steps) << m;
    EXPECT_GE(o.steps, kSteps) << m;
    EXPECT_LT(o.steps, World::kMaxSteps) << m << " (the join was never settled)";
    EXPECT_EQ(o.epoch, first.epoch) << m;
    EXPECT_EQ(o.placement, first.placement) << m;
  }
  EXPECT_EQ(first.epoch, 4u);  // two losses and a join
  ASSERT_EQ(first.recoveries.size(), 3u);
  EXPECT_EQ(first.recoveries[0].kind, "loss");
  EXPECT_EQ(first.recoveries[0].members, (std::vector<int>{0, 2, 3, 4}));
  EXPECT_EQ(first.recoveries[0].step, 7);
  EXPECT_EQ(first.recoveries[1].kind, "loss");
  EXPECT_EQ(first.recoveries[1].members, (std::vector<int>{0, 2, 4}));
  EXPECT_EQ(first.recoveries[2].kind, "join");
  EXPECT_EQ(first.recoveries[2].members, (std::vector<int>{0, 1, 2, 4}));
  // The same, as the engines' users read it (Prometheus text).
  for (const char* line :
       {"eplbx_recoveries_total{kind=\"loss\"} 2\n", "eplbx_recoveries_total{kind=\"join\"} 1\n",
        "eplbx_recoveries_total{kind=\"drain\"} 0\n", "eplbx_recovery_seconds_count 3\n",
        "eplbx_membership_epoch 4\n", "eplbx_members 4\n", "# TYPE eplbx_balancedness gauge\n"}) {
    EXPECT_NE(first.metrics.find(line), std::string::npos) << line << " not in\n" << first.metrics;
  }
  int64_t all_recovered = 0;
  for (const RecoveryRecord& r : first.recoveries) all_recovered += r.experts_recovered;
  EXPECT_NE(
      first.metrics.find("eplbx_experts_recovered_total " + std::to_string(all_recovered) + "\n"),
      std::string::npos)
      << first.metrics;
  // Experts only rank 1 held came back from the backup: 4-7 of every layer at the start (a
  // rebalance that committed layers before the loss may have replicated some of them).
  const int64_t recovered = first.recoveries[0].experts_recovered;
  EXPECT_GT(recovered, 0);
  EXPECT_LE(recovered, 4 * kLayers);
  int64_t restored = 0;
  for (const char* m : {"rank 0", "rank 2", "rank 3", "rank 4"})
    restored += w.out[m].recoveries.empty() ? 0 : w.out[m].recoveries[0].rows_recovered;
  EXPECT_GE(restored, recovered * 2);  // two tensors each (a replica or more)
  // The joined process serves its share, and the group rebalanced around the changes.
  const Outcome& joined = w.out["rank 1 again"];
  ASSERT_EQ(joined.recoveries.size(), 1u);
  EXPECT_EQ(joined.recoveries[0].kind, "join");
  EXPECT_GT(first.rebalances, 0);
  int on_joiner = 0;
  for (int s = kRows; s < 2 * kRows; ++s) on_joiner += first.placement[s] >= 0;
  EXPECT_EQ(on_joiner, kRows);
}

// A graceful drain: every member moves rank 2's experts to the others at one step; rank 2
// leaves and the others serve on over ranks 0, 1, 3 and 4, rows checked.
TEST(ServingGroupTest, ADrainedRankLeavesAndTheOthersServeOn) {
  World w;
  ASSERT_TRUE(w.store.joined() && w.backup != nullptr);
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      auto g = ServingGroup::Create(w.ranks[r]->agent.get(), w.store.m[r].get(), w.ranks[r]->layout,
                                    StartPlacement(), Options());
      Outcome o;
      if (!g.ok()) {
        o.status = g.status();
      } else {
        for (int step = 0; step < 16 && o.status.ok(); ++step) {
          const std::vector<double> c = Counts(step);
          Result<BalancerStep> st = (*g)->Step(c);
          (void)(*g)->Commit();
          if (o.bad.empty()) o.bad = CheckRows(*w.ranks[r], **g);
          if (!st.ok()) o.status = st.status();
          if (step == 9) {
            o.status = (*g)->Drain(2);
            if ((*g)->left()) {
              w.store.m[r].reset();
              break;
            }
            if (o.bad.empty()) o.bad = CheckRows(*w.ranks[r], **g);
            continue;
          }
          Result<bool> synced = (*g)->Sync();
          if (!synced.ok()) o.status = synced.status();
        }
      }
      w.Finish("rank " + std::to_string(r), *w.ranks[r], g.ok() ? g->get() : nullptr, std::move(o));
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kWorld; ++r) {
    const Outcome& o = w.out["rank " + std::to_string(r)];
    ASSERT_TRUE(o.status.ok()) << r << ": " << o.status.ToString();
    EXPECT_EQ(o.bad, "") << r;
    ASSERT_EQ(o.recoveries.size(), 1u) << r;
    EXPECT_EQ(o.recoveries[0].kind, "drain");
  }
  for (int r : {1, 3, 4}) {
    EXPECT_EQ(w.out["rank " + std::to_string(r)].placement, w.out["rank 0"].placement);
    EXPECT_EQ(w.out["rank " + std::to_string(r)].epoch, 2u);
  }
  EXPECT_EQ(w.out["rank 0"].recoveries[0].members, (std::vector<int>{0, 1, 3, 4}));
  for (int s = 2 * kRows; s < 3 * kRows; ++s) EXPECT_EQ(w.out["rank 0"].placement[s], -1);
}

// An engine's own collective among threads (what a torch.distributed group rebuilt after a
// failure, or Mooncake's active ranks, give an engine): rounds per epoch among the engine's
// members; when the engine drops a member, rounds of the old epoch fail for everyone.
struct EngineGroup {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t epoch = 1;
  std::vector<bool> members = std::vector<bool>(kWorld, true);
  std::map<std::pair<uint64_t, uint64_t>, std::vector<std::optional<std::string>>> rounds;
  std::map<std::pair<uint64_t, uint32_t>, uint64_t> next;  // (epoch, rank) -> round

  Result<std::vector<std::string>> Gather(uint32_t rank, uint64_t at, std::string_view mine,
                                          std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu);
    if (at != epoch) return Status::Aborted("the engine's group is at another epoch");
    auto& slots = rounds[{at, next[{at, rank}]++}];
    slots.resize(kWorld);
    slots[rank] = std::string(mine);
    cv.notify_all();
    const std::vector<bool> of_epoch = members;  // the members of the round's epoch
    auto complete = [&] {
      for (uint32_t r = 0; r < kWorld; ++r) {
        if (of_epoch[r] && !slots[r]) return false;
      }
      return true;
    };
    // (A round every member of its epoch completed stands, even if a member leaves after.)
    bool done = false;
    if (!cv.wait_for(lock, timeout, [&] { return (done = complete()) || epoch != at; }))
      return Status::Timeout("the engine's all-gather timed out");
    if (!done) return Status::Aborted("the engine's member set changed");
    std::vector<std::string> out(kWorld);
    for (uint32_t r = 0; r < kWorld; ++r) out[r] = slots[r].value_or("");
    return out;
  }
  void Drop(uint32_t rank) {
    std::lock_guard<std::mutex> lock(mu);
    members[rank] = false;
    ++epoch;
    cv.notify_all();
  }
};

// Membership the engine feeds (MembersView): no eplbx coordinator; the engine's collective
// carries the all-gathers, and when the engine drops rank 1 every survivor updates its view
// and calls OnMembershipChanged() at the same step. They settle (rank 1's only experts from
// the backup) and serve on, every row checked.
TEST(ServingGroupTest, AnEngineFeedsTheMembershipThroughAMembersView) {
  World w;
  ASSERT_TRUE(w.backup != nullptr);
  EngineGroup engine;
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      Outcome o;
      MembersView view(r, kWorld, [&engine, r](uint64_t at, std::string_view mine, auto timeout) {
        return engine.Gather(r, at, mine, timeout);
      });
      auto g = ServingGroup::Create(w.ranks[r]->agent.get(), &view, w.ranks[r]->layout,
                                    StartPlacement(), Options(), {w.backup.get()});
      if (!g.ok()) o.status = g.status();
      for (int step = 0; step < 24 && o.status.ok(); ++step) {
        Result<BalancerStep> st = (*g)->Step(Counts(step));
        (void)(*g)->Commit();
        if (o.bad.empty()) o.bad = CheckRows(*w.ranks[r], **g);
        if (!st.ok()) o.status = st.status();
        if (r == 1 && step == 8) {
          engine.Drop(1);  // its process is gone; the engine knows
          o.status = Status::Aborted("dropped");
          break;
        }
        // The engine's own collective for the step; it fails when the engine's group moved.
        if (engine.Gather(r, view.epoch(), "", std::chrono::seconds(3)).ok()) continue;
        std::vector<bool> members;
        uint64_t epoch = 0;
        {
          std::lock_guard<std::mutex> lock(engine.mu);
          members = engine.members;
          epoch = engine.epoch;
        }
        o.status = view.Update(epoch, members);
        if (o.status.ok()) o.status = (*g)->OnMembershipChanged();
        if (o.bad.empty()) o.bad = CheckRows(*w.ranks[r], **g);
      }
      w.Finish("rank " + std::to_string(r), *w.ranks[r], g.ok() ? g->get() : nullptr, std::move(o));
    });
  }
  for (auto& t : threads) t.join();
  for (int r : {0, 2, 3, 4}) {
    const Outcome& o = w.out["rank " + std::to_string(r)];
    ASSERT_TRUE(o.status.ok()) << r << ": " << o.status.ToString();
    EXPECT_EQ(o.bad, "") << r;
    EXPECT_EQ(o.epoch, 2u);
    EXPECT_EQ(o.placement, w.out["rank 0"].placement);
    ASSERT_EQ(o.recoveries.size(), 1u);
    EXPECT_EQ(o.recoveries[0].kind, "loss");
    EXPECT_EQ(o.recoveries[0].members, (std::vector<int>{0, 2, 3, 4}));
  }
  // Rank 1's only experts (4-7 of every layer at the start, fewer if a rebalance replicated
  // some before the drop) came from the backup.
  EXPECT_GT(w.out["rank 0"].recoveries[0].experts_recovered, 0);
  EXPECT_LE(w.out["rank 0"].recoveries[0].experts_recovered, 4 * kLayers);
  // The view refuses an epoch that does not go forward.
  MembersView view(0, kWorld, nullptr);
  EXPECT_FALSE(view.Update(1, std::vector<bool>(kWorld, true)).ok());
  EXPECT_FALSE(view.Update(2, std::vector<bool>(kWorld - 1, true)).ok());
}

TEST(ServingGroupTest, OptionsThatDoNotFitTheBootstrapAreNamed) {
  InMemoryGroup group(2);
  auto boot = group.Member(0);
  auto rank = MakeRank(0, StartMaps());
  ServingOptions o = Options();  // 5 ranks
  auto g = ServingGroup::Create(rank->agent.get(), boot.get(), rank->layout, StartPlacement(), o);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().message(), "the topology has 5 ranks; the bootstrap's group 2");
  o.round_wait = std::chrono::milliseconds(0);
  o.balancer.topology.ranks = 2;
  o.balancer.topology.slots = 2 * kRows;
  g = ServingGroup::Create(rank->agent.get(), boot.get(), rank->layout, StartPlacement(), o);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().message(), "round_wait (0 ms) and max_placements (4) must be >= 1");
}

// Coordination on etcd (3 etcd members on loopback; no eplbx coordinator anywhere): rank 0
// is lost at step 6 (its lease runs out as after a SIGKILL), the others settle over ranks 1-4
// and serve on; at step 20 a new process for rank 0 joins where they are. Every row checked
// at every step.
TEST(ServingGroupTest, OnEtcdRankZeroIsLostAndANewProcessForItJoins) {
  testing::EtcdCluster cluster(3);
  if (!cluster.ready()) GTEST_SKIP() << "SKIPPED: " << cluster.why_not();
  World w;
  ASSERT_TRUE(w.backup != nullptr);
  EtcdOptions eo;
  eo.endpoints = cluster.endpoints();
  eo.group = "serving";
  eo.token = "t";
  eo.lease = std::chrono::seconds(2);
  ServingOptions o = Options();
  o.round_wait = std::chrono::seconds(10);  // a lost rank is seen when its lease runs out
  constexpr int kSteps = 34;
  std::atomic<bool> spawn{false}, members_done{false};
  std::vector<std::unique_ptr<EtcdBootstrap>> boots(kWorld);
  std::unique_ptr<EtcdBootstrap> again_boot;
  std::unique_ptr<Rank> again;
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      auto b = EtcdBootstrap::Join(r, kWorld, eo);
      if (!b.ok()) {
        std::lock_guard<std::mutex> lock(w.mu);
        w.out["rank " + std::to_string(r)].status = b.status();
        return;
      }
      boots[r] = std::move(*b);
      std::vector<const BackupSource*> backups{w.backup.get()};
      auto g = ServingGroup::Create(w.ranks[r]->agent.get(), boots[r].get(), w.ranks[r]->layout,
                                    StartPlacement(), o, backups);
      if (!g.ok()) {
        std::lock_guard<std::mutex> lock(w.mu);
        w.out["rank " + std::to_string(r)].status = g.status();
        return;
      }
      w.Serve(
          "rank " + std::to_string(r), *w.ranks[r], **g, kSteps, /*await_join=*/true,
          [r](int step) { return r == 0 && step == 6; },
          [&, r](int step) {
            if (r == 1 && step == 20) spawn = true;
          },
          boots[r]);
    });
  }
  std::thread joiner([&] {
    while (!spawn && !members_done) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    if (!spawn) return;
    again =
        MakeRank(0, std::vector<std::vector<int32_t>>(kLayers, std::vector<int32_t>(kSlots, 0)));
    auto b = EtcdBootstrap::Join(0, kWorld, eo);
    Outcome failed;
    if (!b.ok()) {
      failed.status = b.status();
    } else {
      again_boot = std::move(*b);
      EXPECT_TRUE(again_boot->joining());
      std::vector<const BackupSource*> backups{w.backup.get()};
      auto g = ServingGroup::Join(again->agent.get(), again_boot.get(), again->layout, kExperts, o,
                                  backups);
      if (g.ok()) {
        w.Serve("rank 0 again", *again, **g, kSteps, false, nullptr, nullptr, again_boot);
        return;
      }
      failed.status = g.status();
    }
    std::lock_guard<std::mutex> lock(w.mu);
    w.out["rank 0 again"] = failed;
  });
  for (auto& t : threads) t.join();
  members_done = true;
  joiner.join();
  std::string story;
  for (const auto& [name, x] : w.out) {
    story += "\n" + name + ": " + x.status.ToString() + ", " + std::to_string(x.steps) +
             " steps, epoch " + std::to_string(x.epoch);
    for (const RecoveryRecord& r : x.recoveries)
      story += "; " + r.kind + " at step " + std::to_string(r.step) + " in " +
               std::to_string(r.recovery_s) + " s";
  }
  SCOPED_TRACE(story);
  const Outcome& first = w.out["rank 1"];
  for (const std::string m : {"rank 1", "rank 2", "rank 3", "rank 4", "rank 0 again"}) {
    const Outcome& x = w.out[m];
    ASSERT_TRUE(x.status.ok()) << m << ": " << x.status.ToString();
    EXPECT_EQ(x.bad, "") << m;
    EXPECT_EQ(x.steps, first.steps) << m;
    EXPECT_EQ(x.epoch, first.epoch) << m;
    EXPECT_EQ(x.placement, first.placement) << m;
  }
  EXPECT_EQ(first.epoch, 3u);  // the loss, then the join
  ASSERT_EQ(first.recoveries.size(), 2u);
  EXPECT_EQ(first.recoveries[0].kind, "loss");
  EXPECT_EQ(first.recoveries[0].members, (std::vector<int>{1, 2, 3, 4}));
  EXPECT_EQ(first.recoveries[1].kind, "join");
  EXPECT_EQ(first.recoveries[1].members, (std::vector<int>{0, 1, 2, 3, 4}));
}

}  // namespace
}  // namespace eplbx
