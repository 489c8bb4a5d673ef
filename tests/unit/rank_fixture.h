// Test fixture: expert-parallel ranks as threads in one process, each with a loopback (or
// fault-injecting) agent and small weight tensors whose every byte says which expert,
// layer and tensor it belongs to.
#ifndef EPLBX_TESTS_UNIT_RANK_FIXTURE_H_
#define EPLBX_TESTS_UNIT_RANK_FIXTURE_H_

#include <algorithm>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <functional>
#include <thread>

#include "eplbx/bootstrap.h"
#include "eplbx/layout.h"
#include "eplbx/placement.h"
#include "eplbx/transfer.h"
#include "transfer/fault/fault_path.h"

namespace eplbx::fixture {

// A rank as a thread: loopback agent, weights, layout.
struct Rank {
  std::unique_ptr<Agent> agent;
  std::vector<std::vector<std::vector<uint8_t>>> weights;  // [layer][tensor] rows * bytes
  RegisteredRegion region_store[8];
  RankLayout layout;
  // The row of local slot `slot` in layer `l`, tensor `t`, under `table` (slot -> row; empty:
  // the layout's).
  const uint8_t* SlotRow(int l, int t, int slot, const std::vector<uint32_t>& table = {}) const;
};

constexpr int kRanks = 3, kLayers = 3, kRows = 4, kExperts = 9;
inline const uint64_t kBytes[2] = {96, 40};

inline uint8_t Byte(int layer, int expert, int tensor, uint64_t i) {
  return static_cast<uint8_t>((layer * 131 + expert * 17 + tensor * 7 + i * 3) & 0xff);
}

inline std::vector<int32_t> RandomMap(std::mt19937& rng) {
  std::vector<int32_t> map(kRanks * kRows);
  for (int s = 0; s < kRanks * kRows; ++s)
    map[s] = s < kExperts ? s : static_cast<int32_t>(rng() % kExperts);
  std::shuffle(map.begin(), map.end(), rng);
  return map;
}

inline const uint8_t* Rank::SlotRow(int l, int t, int slot,
                                    const std::vector<uint32_t>& table) const {
  const uint32_t row = table.empty() ? layout.RowOf(l, slot) : table[slot];
  return weights[l][t].data() + row * layout.layers[l][t].bytes_per_expert;
}

// With `faults`, the rank's agent follows it (transfer/fault/fault_path.h). `spare` rows per
// layer beyond the kRows slots (swap commit mode) start as 0xee bytes.
inline std::unique_ptr<Rank> MakeRank(uint32_t r, const std::vector<std::vector<int32_t>>& map,
                                      std::shared_ptr<internal::FaultPlan> faults = nullptr,
                                      uint32_t spare = 0) {
  auto rank = std::make_unique<Rank>();
  AgentConfig config;
  config.backend = "loopback";
  std::string name =
      "r" + std::to_string(r) + "_" + std::to_string(reinterpret_cast<uintptr_t>(rank.get()));
  rank->agent = std::move(faults ? *internal::CreateFaultyAgent(name, config, faults)
                                 : *Agent::Create(name, config));
  rank->layout.rank = r;
  rank->layout.spare_rows = spare;
  const uint32_t rows = kRows + spare;
  rank->weights.resize(kLayers);
  int region = 0;
  for (int l = 0; l < kLayers; ++l) {
    std::vector<TensorSpec> tensors;
    for (int t = 0; t < 2; ++t) {
      auto& w = rank->weights[l].emplace_back(rows * kBytes[t], 0xee);
      for (int row = 0; row < kRows; ++row) {
        for (uint64_t i = 0; i < kBytes[t]; ++i)
          w[row * kBytes[t] + i] = Byte(l, map[l][r * kRows + row], t, i);
      }
      rank->region_store[region++] = std::move(*rank->agent->RegisterMemory(w.data(), w.size()));
      tensors.push_back({t ? "w2" : "w13",
                         "bf16",
                         {static_cast<int64_t>(kBytes[t] / 2)},
                         reinterpret_cast<uintptr_t>(w.data()),
                         kBytes[t],
                         rows});
    }
    rank->layout.layers.push_back(tensors);
  }
  return rank;
}

// Random old and new maps of every layer, and their placements.
struct RandomMoves {
  std::vector<std::vector<int32_t>> before, after;
  Result<Placement> from = Status::Internal("unset"), to = Status::Internal("unset");
  explicit RandomMoves(std::mt19937& rng) {
    std::vector<int32_t> flat_before, flat_after;
    for (int l = 0; l < kLayers; ++l) {
      before.push_back(RandomMap(rng));
      after.push_back(RandomMap(rng));
      flat_before.insert(flat_before.end(), before[l].begin(), before[l].end());
      flat_after.insert(flat_after.end(), after[l].begin(), after[l].end());
    }
    from = Placement::FromPhy2Log(kLayers, kRanks * kRows, kExperts, flat_before);
    to = Placement::FromPhy2Log(kLayers, kRanks * kRows, kExperts, flat_after);
  }
};

// kRanks ranks under `maps`; rank `faulty` (if any) follows `faults`.
inline std::vector<std::unique_ptr<Rank>> MakeRanks(
    const std::vector<std::vector<int32_t>>& maps, int faulty = -1,
    std::shared_ptr<internal::FaultPlan> faults = nullptr, uint32_t spare = 0) {
  std::vector<std::unique_ptr<Rank>> ranks;
  for (uint32_t r = 0; r < kRanks; ++r)
    ranks.push_back(MakeRank(r, maps, static_cast<int>(r) == faulty ? faults : nullptr, spare));
  return ranks;
}

// Runs body(rank, its bootstrap) on a thread per rank of one in-memory group; waits for all.
inline void OnThreads(const std::function<void(uint32_t, Bootstrap&)>& body) {
  InMemoryGroup group(kRanks);
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      auto boot = group.Member(r);
      body(r, *boot);
    });
  }
  for (auto& t : threads) t.join();
}

}  // namespace eplbx::fixture

#endif  // EPLBX_TESTS_UNIT_RANK_FIXTURE_H_
