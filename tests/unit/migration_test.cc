#include "eplbx/migration.h"

#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <random>
#include <set>

#include "plan/round_coloring.h"
#include "plan/source_choice.h"

namespace eplbx {
namespace {

Placement P(std::vector<int32_t> phy2log, int experts = 0) {
  int e = experts;
  for (int32_t x : phy2log) e = std::max(e, x + 1);
  const int slots = static_cast<int>(phy2log.size());
  return *Placement::FromPhy2Log(1, slots, e, std::move(phy2log));
}

MigrationPlan Migrate(const std::vector<int32_t>& from, const std::vector<int32_t>& to, int ranks,
                      int nodes = 1) {
  const int experts = std::max(*std::max_element(from.begin(), from.end()),
                               *std::max_element(to.begin(), to.end())) +
                      1;
  Result<MigrationPlan> plan = PlanMigration(
      P(from, experts), P(to, experts), {.ranks = ranks, .nodes = nodes, .bytes_per_expert = 10});
  EXPECT_TRUE(plan.ok()) << plan.status().ToString();
  return plan.ok() ? *plan : MigrationPlan{};
}

// vLLM's published example: 2 slots per rank, [0,1 | 1,2] -> [0,1 | 0,2].
TEST(MigrationTest, VllmExampleOneRead) {
  MigrationPlan plan = Migrate({0, 1, 1, 2}, {0, 1, 0, 2}, 2);
  const LayerMigration& m = plan.layers.at(0);
  ASSERT_EQ(m.transfers.size(), 1u);
  EXPECT_EQ(m.transfers[0].expert, 0);
  EXPECT_EQ(m.transfers[0].src, 0);
  EXPECT_EQ(m.transfers[0].src_row, 0);
  EXPECT_EQ(m.transfers[0].dst, 1);
  EXPECT_EQ(m.transfers[0].dst_row, 0);
  EXPECT_TRUE(m.local_copies.empty());
  EXPECT_EQ(m.rounds, 1);
}

// vLLM's published example: 1 slot per rank, [0,0,1,1,1] -> [0,0,0,0,0].
TEST(MigrationTest, VllmExampleSpreadOverSources) {
  MigrationPlan plan = Migrate({0, 0, 1, 1, 1}, {0, 0, 0, 0, 0}, 5);
  const LayerMigration& m = plan.layers.at(0);
  ASSERT_EQ(m.transfers.size(), 3u);
  std::map<int, int> served;
  std::set<int> readers;
  for (const RemoteRead& t : m.transfers) {
    EXPECT_EQ(t.expert, 0);
    ++served[t.src];
    readers.insert(t.dst);
  }
  EXPECT_EQ(readers, (std::set<int>{2, 3, 4}));
  EXPECT_EQ(served.size(), 2u);  // both holders serve
  EXPECT_EQ(served[0] + served[1], 3);
  EXPECT_EQ(std::max(served[0], served[1]), 2);
  EXPECT_EQ(m.max_bytes_out, 20u);
  EXPECT_EQ(m.rounds, 2);  // a source serves one reader per round
  EXPECT_EQ(m.rounds_lower_bound, 2);
}

TEST(MigrationTest, LocalCopiesFromOldAndFreeRiders) {
  // rank 0: [3, 1, 2] -> [1, 4, 4]: row 0 gets 1 from its own row 1 (old); rows 1 and 2 get
  // expert 4 once over the network, row 2 from row 1 (new).
  MigrationPlan plan = Migrate({3, 1, 2, 4, 0, 0}, {1, 4, 4, 4, 0, 0}, 2);
  const LayerMigration& m = plan.layers.at(0);
  ASSERT_EQ(m.transfers.size(), 1u);
  EXPECT_EQ(m.transfers[0].expert, 4);
  EXPECT_EQ(m.transfers[0].dst_row, 1);
  ASSERT_EQ(m.local_copies.size(), 2u);
  EXPECT_EQ(m.local_copies[0].dst_row, 0);
  EXPECT_EQ(m.local_copies[0].src_row, 1);
  EXPECT_EQ(m.local_copies[0].source, CopySource::kOld);
  EXPECT_EQ(m.local_copies[1].dst_row, 2);
  EXPECT_EQ(m.local_copies[1].src_row, 1);
  EXPECT_EQ(m.local_copies[1].source, CopySource::kNew);
}

TEST(MigrationTest, EmptySlotsReceiveNothingAndServeNothing) {
  // Slot 1 becomes empty (nothing to receive); an empty old slot is never a source.
  MigrationPlan plan = Migrate({0, 1, -1, 2}, {0, -1, 1, 2}, 2);
  const LayerMigration& m = plan.layers.at(0);
  ASSERT_EQ(m.transfers.size(), 1u);
  EXPECT_EQ(m.transfers[0].expert, 1);
  EXPECT_EQ(m.transfers[0].src, 0);
  EXPECT_EQ(m.transfers[0].src_row, 1);
  EXPECT_TRUE(m.local_copies.empty());
}

TEST(MigrationTest, PrefersSourcesOnTheReadersNode) {
  // 4 ranks, 2 nodes, 1 slot each. Expert 0 is on rank 0 (node 0) and rank 2 (node 1).
  // Rank 3 (node 1) must read it from rank 2 although rank 0 is lower.
  MigrationPlan plan = Migrate({0, 1, 0, 2}, {0, 1, 0, 0}, 4, 2);
  const LayerMigration& m = plan.layers.at(0);
  ASSERT_EQ(m.transfers.size(), 1u);
  EXPECT_EQ(m.transfers[0].src, 2);
  EXPECT_EQ(m.bytes_cross_node, 0u);
  // Only a remote holder: the read crosses nodes and is counted.
  MigrationPlan cross = Migrate({0, 1, 2, 3}, {0, 1, 2, 0}, 4, 2);
  EXPECT_EQ(cross.layers.at(0).bytes_cross_node, 10u);
  EXPECT_EQ(cross.summary.cross_node_bytes, 10u);
}

TEST(MigrationTest, UnchangedPlacementMovesNothing) {
  MigrationPlan plan = Migrate({0, 1, 2, 3}, {0, 1, 2, 3}, 2);
  EXPECT_TRUE(plan.layers.at(0).transfers.empty());
  EXPECT_TRUE(plan.layers.at(0).local_copies.empty());
  EXPECT_EQ(plan.summary.rounds, 0);
  EXPECT_EQ(plan.summary.time_lower_bound_s, 0.0);
}

TEST(MigrationTest, Errors) {
  auto err = [](const Placement& a, const Placement& b, MigrationOptions o) {
    Result<MigrationPlan> p = PlanMigration(a, b, o);
    EXPECT_FALSE(p.ok());
    return p.status().message();
  };
  EXPECT_NE(err(P({0, 1}), P({0, 1, 1, 0}), {.ranks = 2})
                .find("old placement is 1 layers x 2 "
                      "slots but new placement is 1 "
                      "layers x 4 slots"),
            std::string::npos);
  EXPECT_NE(err(P({0, 1, 2}), P({0, 1, 2}), {.ranks = 2})
                .find("slots (3) is not a multiple of "
                      "ranks (2)"),
            std::string::npos);
  EXPECT_NE(err(P({0, 1, 2, 3}), P({0, 1, 2, 3}), {.ranks = 2, .nodes = 3})
                .find("ranks (2) is not a multiple of nodes (3)"),
            std::string::npos);
  EXPECT_NE(err(P({0, 1, 1, 0}, 3), P({0, 1, 2, 0}, 3), {.ranks = 2})
                .find("layer 0: expert 2 is placed on rank 1 (row 0) in the new placement but no "
                      "rank holds it in the old placement"),
            std::string::npos);
  EXPECT_NE(err(P({0, 1}), P({1, 0}), {.ranks = 2, .bytes_per_expert = 0})
                .find("bytes per "
                      "expert is 0"),
            std::string::npos);
  EXPECT_NE(err(P({0, 1}), P({1, 0}), {.ranks = 2, .link_gbps = -1}).find("link bandwidth"),
            std::string::npos);
}

TEST(MigrationTest, SummaryAndTimeBound) {
  // 2 layers; each moves 2 experts into rank 1 from rank 0.
  Placement from = *Placement::FromPhy2Log(2, 4, 4, {0, 1, 2, 3, 0, 1, 2, 3});
  Placement to = *Placement::FromPhy2Log(2, 4, 4, {0, 1, 0, 1, 0, 1, 0, 1});
  Result<MigrationPlan> plan =
      PlanMigration(from, to, {.ranks = 2, .bytes_per_expert = 1000, .link_gbps = 8});
  ASSERT_TRUE(plan.ok());
  const MigrationSummary& s = plan->summary;
  EXPECT_EQ(s.remote_transfers, 4);
  EXPECT_EQ(s.bytes_moved, 4000u);
  EXPECT_EQ(s.rounds, 2);  // one pair per layer: one round each (several experts per round)
  EXPECT_EQ(s.rounds_lower_bound, 2);
  EXPECT_EQ(s.max_bytes_in, 2000u);
  EXPECT_EQ(s.max_bytes_out, 2000u);
  EXPECT_DOUBLE_EQ(s.time_lower_bound_s, 2 * 2000.0 / 1e9);  // 8 Gb/s = 1e9 B/s
}

// ---- independent checks for the property test ----------------------------------------

// Minimum possible max load of any source, by brute force: smallest T for which a simple
// max-flow (augmenting paths, depth first) places every read.
int OptimalMaxServed(const std::vector<std::vector<int32_t>>& candidates, int sources) {
  if (candidates.empty()) return 0;
  for (int cap = 1;; ++cap) {
    std::vector<std::vector<int>> at(static_cast<size_t>(sources));
    std::vector<int> choice(candidates.size(), -1);
    std::function<bool(int, std::vector<bool>&)> place = [&](int r, std::vector<bool>& seen) {
      for (int s : candidates[r]) {
        if (seen[s]) continue;
        seen[s] = true;
        if (static_cast<int>(at[s].size()) < cap) {
          at[s].push_back(r);
          choice[r] = s;
          return true;
        }
        for (size_t k = 0; k < at[s].size(); ++k) {
          const int other = at[s][k];
          if (place(other, seen)) {
            // `other` moved elsewhere; take its place
            at[s].erase(at[s].begin() + static_cast<long>(k));
            at[s].push_back(r);
            choice[r] = s;
            return true;
          }
        }
      }
      return false;
    };
    bool all = true;
    for (size_t r = 0; r < candidates.size() && all; ++r) {
      std::vector<bool> seen(static_cast<size_t>(sources), false);
      all = place(static_cast<int>(r), seen);
    }
    if (all) return cap;
  }
}

TEST(SourceChoiceTest, MatchesBruteForceOptimum) {
  std::mt19937_64 rng(5);
  for (int iter = 0; iter < 2000; ++iter) {
    const int sources = 2 + static_cast<int>(rng() % 6);
    const int reads = static_cast<int>(rng() % 14);
    std::vector<std::vector<int32_t>> candidates(static_cast<size_t>(reads));
    for (auto& c : candidates) {
      for (int s = 0; s < sources; ++s) {
        if (rng() % 3 == 0) c.push_back(s);
      }
      if (c.empty()) c.push_back(static_cast<int32_t>(rng() % sources));
    }
    const std::vector<int32_t> choice = internal::ChooseSources(candidates, sources);
    std::vector<int> load(static_cast<size_t>(sources), 0);
    for (size_t r = 0; r < choice.size(); ++r) {
      ASSERT_NE(std::find(candidates[r].begin(), candidates[r].end(), choice[r]),
                candidates[r].end());
      ++load[choice[r]];
    }
    const int got = reads ? *std::max_element(load.begin(), load.end()) : 0;
    ASSERT_EQ(got, OptimalMaxServed(candidates, sources)) << "iter " << iter;
  }
}

// vLLM-style first-fit batching: each pair goes into the first round where neither side
// is busy.
int FirstFitRounds(const std::vector<std::pair<int32_t, int32_t>>& pairs, int ranks) {
  std::vector<std::set<int>> reads(static_cast<size_t>(ranks)), serves(reads);
  int rounds = 0;
  for (const auto& [r, s] : pairs) {
    int k = 0;
    while (reads[r].count(k) || serves[s].count(k)) ++k;
    reads[r].insert(k);
    serves[s].insert(k);
    rounds = std::max(rounds, k + 1);
  }
  return rounds;
}

TEST(RoundColoringTest, AlwaysReachesTheLowerBoundWhereFirstFitDoesNot) {
  std::mt19937_64 rng(11);
  int first_fit_worse = 0;
  for (int iter = 0; iter < 2000; ++iter) {
    const int ranks = 2 + static_cast<int>(rng() % 9);
    std::set<std::pair<int32_t, int32_t>> set;
    const int n = static_cast<int>(rng() % (ranks * 3));
    for (int k = 0; k < n; ++k) {
      const int32_t r = static_cast<int32_t>(rng() % ranks),
                    s = static_cast<int32_t>(rng() % ranks);
      if (r != s) set.insert({r, s});
    }
    std::vector<std::pair<int32_t, int32_t>> pairs(set.begin(), set.end());
    int used = -1;
    const std::vector<int32_t> round = internal::ColorRounds(pairs, ranks, &used);
    const int bound = internal::RoundsLowerBound(pairs, ranks);
    ASSERT_EQ(used, bound);
    std::set<std::pair<int, int>> reader_round, server_round;
    for (size_t i = 0; i < pairs.size(); ++i) {
      ASSERT_GE(round[i], 0);
      ASSERT_LT(round[i], bound);
      ASSERT_TRUE(reader_round.insert({pairs[i].first, round[i]}).second);
      ASSERT_TRUE(server_round.insert({pairs[i].second, round[i]}).second);
    }
    first_fit_worse += FirstFitRounds(pairs, ranks) > bound;
  }
  EXPECT_GT(first_fit_worse, 0);  // the claim in docs/migration.md
}

// Thousands of random placement pairs; every invariant of a migration plan.
TEST(MigrationPropertyTest, RandomPlacementPairs) {
  std::mt19937_64 rng(2026);
  for (int iter = 0; iter < 3000; ++iter) {
    const int nodes = 1 + static_cast<int>(rng() % 3);
    const int ranks = nodes * (1 + static_cast<int>(rng() % 4));
    const int rows = 1 + static_cast<int>(rng() % 4);
    const int slots = ranks * rows;
    const int experts = 1 + static_cast<int>(rng() % slots);
    const int layers = 1 + static_cast<int>(rng() % 2);
    std::vector<int32_t> a(static_cast<size_t>(layers * slots)), b(a.size());
    for (int l = 0; l < layers; ++l) {
      // old: every expert somewhere, the rest random or empty; new: random over old experts
      for (int s = 0; s < slots; ++s) {
        a[l * slots + s] =
            s < experts ? s : (rng() % 5 == 0 ? -1 : static_cast<int32_t>(rng() % experts));
      }
      std::shuffle(a.begin() + l * slots, a.begin() + (l + 1) * slots, rng);
      for (int s = 0; s < slots; ++s) {
        b[l * slots + s] = rng() % 6 == 0 ? -1 : static_cast<int32_t>(rng() % experts);
      }
    }
    Placement from = *Placement::FromPhy2Log(layers, slots, experts, a);
    Placement to = *Placement::FromPhy2Log(layers, slots, experts, b);
    const MigrationOptions options{.ranks = ranks, .nodes = nodes, .bytes_per_expert = 3};
    Result<MigrationPlan> plan = PlanMigration(from, to, options);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    Result<MigrationPlan> again = PlanMigration(from, to, options);
    SCOPED_TRACE(testing::Message() << "iter " << iter << " ranks " << ranks << " nodes " << nodes
                                    << " rows " << rows);
    for (int l = 0; l < layers; ++l) {
      const LayerMigration& m = plan->layers[l];
      const std::vector<int32_t> old_rows(a.begin() + l * slots, a.begin() + (l + 1) * slots);
      const std::vector<int32_t> new_rows(b.begin() + l * slots, b.begin() + (l + 1) * slots);
      // Applying the plan to the old contents gives the new placement.
      Result<std::vector<int32_t>> after = ApplyMigration(old_rows, m, ranks);
      ASSERT_TRUE(after.ok()) << after.status().ToString();
      for (int s = 0; s < slots; ++s) {
        if (new_rows[s] >= 0) {
          ASSERT_EQ((*after)[s], new_rows[s]) << "slot " << s;
        }
      }
      // Every changed row is written exactly once; unchanged and empty rows never.
      std::map<std::pair<int, int>, int> writes;
      for (const RemoteRead& t : m.transfers) ++writes[{t.dst, t.dst_row}];
      for (const LocalCopy& c : m.local_copies) ++writes[{c.rank, c.dst_row}];
      for (int s = 0; s < slots; ++s) {
        const bool changed = new_rows[s] >= 0 && new_rows[s] != old_rows[s];
        const std::pair<int, int> row{s / rows, s % rows};
        ASSERT_EQ(writes[row], changed ? 1 : 0) << "slot " << s;
      }
      // At most one remote read per (rank, expert), none for an expert the rank holds.
      std::set<std::pair<int, int>> read_pairs;
      std::vector<int> served(static_cast<size_t>(ranks), 0);
      std::vector<std::vector<int32_t>> candidates;
      for (const RemoteRead& t : m.transfers) {
        ASSERT_TRUE(read_pairs.insert({t.dst, t.expert}).second);
        for (int i = 0; i < rows; ++i) ASSERT_NE(old_rows[t.dst * rows + i], t.expert);
        ASSERT_NE(t.src, t.dst);
        ++served[t.src];
        // Source on the reader's node whenever some holder is.
        std::vector<int32_t> local, all;
        for (int r = 0; r < ranks; ++r) {
          bool holds = false;
          for (int i = 0; i < rows; ++i) holds |= old_rows[r * rows + i] == t.expert;
          if (!holds) continue;
          all.push_back(r);
          if (r / (ranks / nodes) == t.dst / (ranks / nodes)) local.push_back(r);
        }
        candidates.push_back(local.empty() ? all : local);
        if (!local.empty()) {
          ASSERT_EQ(t.src / (ranks / nodes), t.dst / (ranks / nodes));
        }
      }
      // The busiest source serves as few reads as possible.
      const int busiest = m.transfers.empty() ? 0 : *std::max_element(served.begin(), served.end());
      ASSERT_EQ(busiest, OptimalMaxServed(candidates, ranks));
      ASSERT_EQ(m.max_bytes_out, static_cast<uint64_t>(busiest) * 3);
      // Rounds: contention-free and minimal.
      ASSERT_EQ(m.rounds, m.rounds_lower_bound);
      std::map<std::pair<int, int>, int> reader_peer, server_peer;  // (rank, round) -> peer
      for (const RemoteRead& t : m.transfers) {
        auto [it, fresh] = reader_peer.insert({{t.dst, t.round}, t.src});
        ASSERT_TRUE(fresh || it->second == t.src);
        auto [it2, fresh2] = server_peer.insert({{t.src, t.round}, t.dst});
        ASSERT_TRUE(fresh2 || it2->second == t.dst);
      }
      // Deterministic.
      ASSERT_EQ(again->layers[l].transfers.size(), m.transfers.size());
      for (size_t k = 0; k < m.transfers.size(); ++k) {
        ASSERT_EQ(again->layers[l].transfers[k].src, m.transfers[k].src);
        ASSERT_EQ(again->layers[l].transfers[k].round, m.transfers[k].round);
      }
    }
  }
}

TEST(ApplyMigrationTest, RejectsALyingPlan) {
  LayerMigration m;
  m.transfers.push_back({.src = 0, .src_row = 0, .dst = 1, .dst_row = 0, .expert = 5});
  Result<std::vector<int32_t>> r = ApplyMigration({1, 2}, m, 2);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("the source does not hold that expert"), std::string::npos);
}

}  // namespace
}  // namespace eplbx
