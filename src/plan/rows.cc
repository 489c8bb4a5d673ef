#include "plan/rows.h"

#include <algorithm>
#include <numeric>
#include <set>

namespace eplbx::internal {

std::vector<double> RankLoads(std::span<const double> weight, std::span<const int32_t> slots,
                              int ranks) {
  std::vector<int32_t> count(weight.size(), 0);
  for (int32_t e : slots) {
    if (e >= 0) ++count[e];
  }
  const size_t per_rank = slots.size() / static_cast<size_t>(ranks);
  std::vector<double> load(static_cast<size_t>(ranks), 0.0);
  for (size_t s = 0; s < slots.size(); ++s) {
    if (slots[s] >= 0) load[s / per_rank] += weight[slots[s]] / count[slots[s]];
  }
  return load;
}

double SlotsBalancedness(std::span<const double> weight, std::span<const int32_t> slots,
                         int ranks) {
  return LoadsBalancedness(RankLoads(weight, slots, ranks));
}

double LoadsBalancedness(std::span<const double> load) {
  const double max = *std::max_element(load.begin(), load.end());
  return max > 0 ? std::accumulate(load.begin(), load.end(), 0.0) /
                       static_cast<double>(load.size()) / max
                 : 1.0;
}

std::vector<int32_t> CompleteSlots(std::span<const double> weight,
                                   std::span<const int32_t> previous, int ranks) {
  std::vector<int32_t> slots(previous.begin(), previous.end());
  const int n = static_cast<int>(weight.size());
  const size_t per_rank = slots.size() / static_cast<size_t>(ranks);
  std::vector<int32_t> count(static_cast<size_t>(n), 0);
  for (int32_t e : slots) {
    if (e >= 0) ++count[e];
  }
  auto share = [&](int32_t e) { return weight[e] / count[e]; };
  for (int32_t missing = 0; missing < n; ++missing) {
    if (count[missing] > 0) continue;
    size_t pick = slots.size();
    for (size_t s = 0; s < slots.size() && pick == slots.size(); ++s) {
      if (slots[s] < 0) pick = s;
    }
    if (pick == slots.size()) {  // no empty slot: the redundant replica of smallest share
      for (size_t t = 0; t < slots.size(); ++t) {
        const int32_t e = slots[t];
        if (count[e] > 1 && (pick == slots.size() || share(e) < share(slots[pick]))) pick = t;
      }
    }
    if (pick == slots.size()) break;  // cannot happen when slots >= experts
    if (slots[pick] >= 0) --count[slots[pick]];
    slots[pick] = missing;
    ++count[missing];
  }
  for (size_t s = 0; s < slots.size(); ++s) {
    if (slots[s] >= 0) continue;
    const size_t rank = s / per_rank;
    int32_t best = -1;
    for (int32_t e = 0; e < n; ++e) {
      const auto first = slots.begin() + static_cast<std::ptrdiff_t>(rank * per_rank);
      if (std::find(first, first + static_cast<std::ptrdiff_t>(per_rank), e) !=
          first + static_cast<std::ptrdiff_t>(per_rank)) {
        continue;
      }
      if (best < 0 || weight[e] / (count[e] + 1) > weight[best] / (count[best] + 1)) best = e;
    }
    if (best < 0) best = 0;
    slots[s] = best;
    ++count[best];
  }
  return slots;
}

void RelabelRanks(std::span<const int32_t> previous, std::vector<int32_t>& next, int ranks,
                  int ranks_per_node) {
  const size_t per_rank = next.size() / static_cast<size_t>(ranks);
  // Each rank's distinct experts (holes left out), sorted: rank r at [r * per_rank, + size).
  auto distinct = [per_rank, ranks](std::span<const int32_t> slots, std::vector<int32_t>& out,
                                    std::vector<size_t>& size) {
    out.assign(slots.begin(), slots.end());
    size.assign(static_cast<size_t>(ranks), 0);
    for (size_t r = 0; r < static_cast<size_t>(ranks); ++r) {
      const auto first = out.begin() + static_cast<std::ptrdiff_t>(r * per_rank);
      const auto last = first + static_cast<std::ptrdiff_t>(per_rank);
      std::sort(first, last);
      const auto held = std::lower_bound(first, last, 0);  // holes (-1) sort first
      size[r] = static_cast<size_t>(std::copy(held, std::unique(held, last), first) - first);
    }
  };
  std::vector<int32_t> mine, theirs;
  std::vector<size_t> mine_size, theirs_size;
  distinct(next, mine, mine_size);
  distinct(previous, theirs, theirs_size);
  // Experts rank i of `next` and rank j of `previous` both hold (merge of sorted lists).
  auto shared_experts = [&](size_t i, size_t j) {
    const int32_t* a = mine.data() + i * per_rank;
    const int32_t* b = theirs.data() + j * per_rank;
    const int32_t *a_end = a + mine_size[i], *b_end = b + theirs_size[j];
    int n = 0;
    while (a != a_end && b != b_end) {
      if (*a < *b) {
        ++a;
      } else if (*b < *a) {
        ++b;
      } else {
        ++n, ++a, ++b;
      }
    }
    return n;
  };
  std::vector<int32_t> renamed(next.size());
  std::vector<int> shared(static_cast<size_t>(ranks_per_node) * ranks_per_node);
  std::vector<int> target(static_cast<size_t>(ranks_per_node));
  std::vector<bool> taken(static_cast<size_t>(ranks_per_node));
  for (int base = 0; base < ranks; base += ranks_per_node) {
    for (int i = 0; i < ranks_per_node; ++i) {
      for (int j = 0; j < ranks_per_node; ++j)
        shared[i * ranks_per_node + j] = shared_experts(base + i, base + j);
    }
    std::fill(target.begin(), target.end(), -1);
    std::fill(taken.begin(), taken.end(), false);
    for (int round = 0; round < ranks_per_node; ++round) {
      int bi = -1, bj = -1;
      for (int i = 0; i < ranks_per_node; ++i) {
        if (target[i] >= 0) continue;
        for (int j = 0; j < ranks_per_node; ++j) {
          if (!taken[j] &&
              (bi < 0 || shared[i * ranks_per_node + j] > shared[bi * ranks_per_node + bj]))
            bi = i, bj = j;
        }
      }
      target[bi] = bj;
      taken[bj] = true;
    }
    for (int i = 0; i < ranks_per_node; ++i) {
      std::copy_n(next.begin() + (base + i) * per_rank, per_rank,
                  renamed.begin() + (base + target[i]) * per_rank);
    }
  }
  next = std::move(renamed);
}

void PreserveRows(std::span<const int32_t> previous, std::span<int32_t> next, int ranks) {
  const size_t per_rank = next.size() / static_cast<size_t>(ranks);
  std::vector<int32_t> rows(per_rank);
  std::vector<bool> placed(per_rank);
  for (size_t r = 0; r < static_cast<size_t>(ranks); ++r) {
    std::span<int32_t> mine = next.subspan(r * per_rank, per_rank);
    std::span<const int32_t> old = previous.subspan(r * per_rank, per_rank);
    std::fill(rows.begin(), rows.end(), -2);
    std::fill(placed.begin(), placed.end(), false);
    for (size_t i = 0; i < per_rank; ++i) {  // keep an expert in its old row
      for (size_t k = 0; k < per_rank; ++k) {
        if (!placed[k] && mine[k] == old[i] && old[i] >= 0) {
          rows[i] = mine[k];
          placed[k] = true;
          break;
        }
      }
    }
    size_t next_free = 0;
    for (size_t k = 0; k < per_rank; ++k) {  // the rest fill the free rows in order
      if (placed[k]) continue;
      while (rows[next_free] != -2) ++next_free;
      rows[next_free] = mine[k];
    }
    std::copy(rows.begin(), rows.end(), mine.begin());
  }
}

LayerMoves CountLayerMoves(std::span<const int32_t> previous, std::span<const int32_t> next,
                           int ranks) {
  LayerMoves m;
  const size_t per_rank = next.size() / static_cast<size_t>(ranks);
  for (size_t r = 0; r < static_cast<size_t>(ranks); ++r) {
    const std::set<int32_t> before(previous.begin() + r * per_rank,
                                   previous.begin() + (r + 1) * per_rank);
    std::set<int32_t> gained;
    for (size_t s = r * per_rank; s < (r + 1) * per_rank; ++s) {
      if (next[s] == previous[s]) {
        ++m.unchanged_slots;
      } else if (next[s] >= 0 && before.count(next[s])) {
        ++m.local_copies;
      } else if (next[s] >= 0) {
        gained.insert(next[s]);
      }
    }
    m.remote_copies += static_cast<int64_t>(gained.size());
  }
  return m;
}

}  // namespace eplbx::internal
