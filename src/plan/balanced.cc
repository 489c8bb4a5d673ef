// The `balanced` policy: replica counts and packing chosen together, then local search.
#include <algorithm>
#include <bit>
#include <functional>
#include <limits>
#include <numeric>
#include <queue>

#include "plan/balanced_internal.h"
#include "plan/local_search.h"

namespace eplbx::internal {

namespace {

// Greedy replica counts: each slot beyond the first replica of every expert goes to the
// largest share weight / count (ties: lowest expert), at most `cap` replicas per expert.
std::vector<int32_t> GreedyCounts(std::span<const double> weight, int slots, int cap) {
  const int n = static_cast<int>(weight.size());
  std::vector<int32_t> count(static_cast<size_t>(n), 1);
  using Entry = std::pair<double, int32_t>;  // (share, -expert): max-heap, lowest id first
  std::priority_queue<Entry> heap;
  for (int32_t e = 0; e < n; ++e) heap.push({weight[e], -e});
  for (int i = n; i < slots; ++i) {
    while (count[-heap.top().second] >= cap) heap.pop();
    const int32_t e = -heap.top().second;
    heap.pop();
    ++count[e];
    heap.push({weight[e] / count[e], -e});
  }
  return count;
}

// Packs the replicas of `count` onto `ranks` ranks of `per_rank` slots: replicas by
// descending share (ties: lowest expert), each to the lightest rank with room that does not
// hold the expert (ties: lowest rank); a duplicate only when nothing else has room. For two
// slots per rank this is the optimal pairing (largest with smallest). Reusable scratch.
class Packer {
 public:
  Packer(std::span<const double> weight, int ranks, int per_rank)
      : weight_(weight),
        ranks_(ranks),
        per_rank_(per_rank),
        slots_(static_cast<size_t>(ranks) * per_rank),
        load_(static_cast<size_t>(ranks)),
        fill_(static_cast<size_t>(ranks)) {}

  // Returns the largest rank load; slots() and loads() describe the packing. With `held`
  // (ranks x experts flags), a replica first goes to the lightest rank that held the expert
  // and stays within `cap` (so it costs no copy), else as above.
  // With `bound`, gives up (returning infinity) as soon as a rank reaches it: loads only
  // grow, so such a packing cannot beat the bound.
  double Pack(std::span<const int32_t> count, const uint8_t* held = nullptr, double cap = 0,
              double bound = std::numeric_limits<double>::infinity()) {
    // Experts by descending share (ties: lowest expert).
    // Only the experts whose count changed since the last call get a new share and a new
    // place in the order (the order is total, so the result is the one a full sort gives).
    const int n = static_cast<int>(count.size());
    auto before = [&](int32_t a, int32_t b) {
      return share_[a] != share_[b] ? share_[a] > share_[b] : a < b;
    };
    if (order_.size() != static_cast<size_t>(n)) {
      share_.resize(static_cast<size_t>(n));
      last_count_.assign(count.begin(), count.end());
      for (int32_t e = 0; e < n; ++e) share_[e] = count[e] > 0 ? weight_[e] / count[e] : 0.0;
      order_.resize(static_cast<size_t>(n));
      std::iota(order_.begin(), order_.end(), 0);
      std::sort(order_.begin(), order_.end(), before);
    } else {
      // One expert at a time: its new share, then from its place to where it now belongs
      // (the others keep theirs, so the order stays sorted), shifting only those between.
      for (int32_t e = 0; e < n; ++e) {
        if (count[e] == last_count_[e]) continue;
        last_count_[e] = count[e];
        share_[e] = count[e] > 0 ? weight_[e] / count[e] : 0.0;
        const auto at = std::find(order_.begin(), order_.end(), e);
        const auto to = std::upper_bound(order_.begin(), at, e, before);
        if (to != at) {  // earlier: the ones from `to` move up by one
          std::move_backward(to, at, at + 1);
          *to = e;
        } else {  // later (or where it is): the ones before its new place move down by one
          const auto end = std::upper_bound(at + 1, order_.end(), e, before);
          std::move(at + 1, end, at);
          *(end - 1) = e;
        }
      }
    }
    auto share = [&](int32_t e) { return share_[e]; };
    std::fill(load_.begin(), load_.end(), 0.0);
    std::fill(fill_.begin(), fill_.end(), 0);
    fast_path_ = false;
    if (held == nullptr && per_rank_ == 2 && !general_) {
      const double m = PackTwo(count, bound);
      fast_path_ = m >= 0;
      if (m >= 0) return m;
      std::fill(load_.begin(), load_.end(), 0.0);  // not for this input: the heap below
      std::fill(fill_.begin(), fill_.end(), 0);
    }
    if (held == nullptr && ranks_ <= kScanRanks && !general_) {
      fast_path_ = true;  // (not the heap)
      // (Eight ranks, a node's in the usual shapes, with the scan's length known.)
      return ranks_ == 8 ? PackByScan<8>(count, bound) : PackByScan<0>(count, bound);
    }
    // Ranks with room by (load, rank): the lightest first, ties to the lowest rank. A rank
    // that takes a replica of e returns to the heap only after e's last replica, so no rank
    // gets two replicas of e unless fewer ranks than replicas have room.
    heap_.clear();
    for (int r = 0; r < ranks_; ++r) heap_.push_back({Key(0.0), r});
    for (int32_t e : order_) {
      if (count[e] == 0) continue;
      const double s = share(e);
      taken_.clear();
      for (int k = 0; k < count[e]; ++k) {
        int r = held ? StickyRank(e, s, held, cap) : -1;
        // Sticky ranks stay in the heap until e is done; popping skips them (they return
        // below with their new load).
        while (r < 0 && !heap_.empty()) {
          std::pop_heap(heap_.begin(), heap_.end(), std::greater<>());
          const int top = heap_.back().second;
          heap_.pop_back();
          if (std::find(taken_.begin(), taken_.end(), top) == taken_.end()) r = top;
        }
        if (r < 0) r = DuplicateRank();
        slots_[static_cast<size_t>(r) * per_rank_ + fill_[r]++] = e;
        load_[r] += s;
        if (load_[r] >= bound) return std::numeric_limits<double>::infinity();
        if (std::find(taken_.begin(), taken_.end(), r) == taken_.end()) taken_.push_back(r);
      }
      if (held) {  // sticky ranks were not popped: drop them (re-added below)
        std::erase_if(heap_, [&](const std::pair<uint64_t, int>& h) {
          return std::find(taken_.begin(), taken_.end(), h.second) != taken_.end();
        });
        std::make_heap(heap_.begin(), heap_.end(), std::greater<>());
      }
      for (int r : taken_) {
        if (fill_[r] < per_rank_) {
          heap_.push_back({Key(load_[r]), r});
          std::push_heap(heap_.begin(), heap_.end(), std::greater<>());
        }
      }
    }
    return *std::max_element(load_.begin(), load_.end());
  }

  const std::vector<int32_t>& slots() const { return slots_; }
  // Tests: every per_rank through the heap (the reference PackTwo is checked against).
  void set_general(bool general) { general_ = general; }
  bool fast_path() const { return fast_path_; }  // the last Pack() did not use the heap

  const std::vector<double>& loads() const { return load_; }

 private:
  // The lightest rank (ties: lowest) that held e, has room, has not taken e yet and stays
  // within cap with share s; -1 if none.
  int StickyRank(int32_t e, double s, const uint8_t* held, double cap) const {
    const size_t n = weight_.size();
    int best = -1;
    for (int r = 0; r < ranks_; ++r) {
      if (!held[static_cast<size_t>(r) * n + e] || fill_[r] == per_rank_ || load_[r] + s > cap ||
          std::find(taken_.begin(), taken_.end(), r) != taken_.end()) {
        continue;
      }
      if (best < 0 || load_[r] < load_[best]) best = r;
    }
    return best;
  }

  // Pack() for two slots per rank (EP256-like shapes), without the heap, the same choices:
  // while every rank is empty a rank takes the lowest free index (all shares so far are > 0,
  // so every used rank is heavier than an empty one); the first `ranks` replicas thus go to
  // ranks 0, 1, ... in order, and their loads do not increase with the rank. Each later
  // replica fills the rank it goes to, so the heap's pops are one pass over the ranks by
  // (load, rank) ascending: equal loads from the last rank backward, each run ascending.
  // Ranks that took the expert already are skipped (the heap holds them back until its last
  // replica). Returns -1 when the input is not of that form (a share of 0 among the first
  // `ranks` replicas, or not 2 x ranks replicas): the caller packs with the heap then.
  double PackTwo(std::span<const int32_t> count, double bound) {
    size_t replicas = 0;
    for (int32_t e : order_) replicas += static_cast<size_t>(std::max(count[e], 0));
    if (replicas != 2 * static_cast<size_t>(ranks_)) return -1;
    // Phase one: replica k < ranks to rank k.
    size_t k = 0, at = 0;  // replicas placed; order_ position
    int32_t e = -1;        // the expert whose replicas are being placed
    int left = 0;          // of its replicas
    taken_.clear();
    while (k < static_cast<size_t>(ranks_)) {
      if (left == 0) {
        do e = order_[at++];
        while (count[e] <= 0);
        left = count[e];
        taken_.clear();
        if (!(share_[e] > 0)) return -1;
      }
      const int r = static_cast<int>(k++);
      slots_[static_cast<size_t>(r) * 2] = e;
      fill_[r] = 1;
      load_[r] = share_[e];
      if (load_[r] >= bound) return std::numeric_limits<double>::infinity();
      taken_.push_back(r);
      --left;
    }
    // Phase two: ranks by (load, rank) ascending.
    rank_order_.clear();
    for (int hi = ranks_ - 1; hi >= 0;) {
      int lo = hi;
      while (lo > 0 && Key(load_[lo - 1]) == Key(load_[hi])) --lo;
      for (int r = lo; r <= hi; ++r) rank_order_.push_back(r);
      hi = lo - 1;
    }
    size_t front = 0;  // rank_order_[0, front) are full
    for (;;) {
      if (left == 0) {
        while (at < order_.size() && count[order_[at]] <= 0) ++at;
        if (at == order_.size()) break;
        e = order_[at++];
        left = count[e];
        taken_.clear();
      }
      const double s = share_[e];
      while (front < rank_order_.size() && fill_[rank_order_[front]] == 2) ++front;
      int r = -1;
      for (size_t i = front; i < rank_order_.size() && r < 0; ++i) {
        const int c = rank_order_[i];
        if (fill_[c] < 2 && std::find(taken_.begin(), taken_.end(), c) == taken_.end()) r = c;
      }
      if (r < 0) r = DuplicateRank();
      slots_[static_cast<size_t>(r) * 2 + fill_[r]++] = e;
      load_[r] += s;
      if (load_[r] >= bound) return std::numeric_limits<double>::infinity();
      if (std::find(taken_.begin(), taken_.end(), r) == taken_.end()) taken_.push_back(r);
      --left;
    }
    return *std::max_element(load_.begin(), load_.end());
  }

  // Pack() for a few ranks (a node's 8 in hierarchical mode): a scan for the lightest rank
  // with room that has not taken the expert (ties: lowest rank) instead of the heap; the
  // same choices, as the heap holds exactly those ranks. `room` holds each rank's load, or
  // infinity when it is full (a load never is: weights are finite floats); `open` the same
  // for the expert being placed, with the ranks that took it at infinity too.
  static constexpr int kScanRanks = 16;
  template <int kRanks>  // ranks_ when > 0
  double PackByScan(std::span<const int32_t> count, double bound) {
    const int ranks = kRanks > 0 ? kRanks : ranks_;
    constexpr double kFull = std::numeric_limits<double>::infinity();
    double room[kScanRanks], open[kScanRanks];
    for (int c = 0; c < ranks; ++c) room[c] = per_rank_ > 0 ? 0.0 : kFull;
    for (int32_t e : order_) {
      if (count[e] <= 0) continue;
      const double s = share_[e];
      taken_.clear();
      std::copy(room, room + ranks, open);
      for (int k = 0; k < count[e]; ++k) {
        int r = Lightest(open, ranks);
        if (r < 0) r = DuplicateRank();
        slots_[static_cast<size_t>(r) * per_rank_ + fill_[r]++] = e;
        load_[r] += s;
        room[r] = fill_[r] == per_rank_ ? kFull : load_[r];
        if (load_[r] >= bound) return std::numeric_limits<double>::infinity();
        if (open[r] != kFull) taken_.push_back(r);  // not a duplicate
        open[r] = kFull;
      }
    }
    return *std::max_element(load_.begin(), load_.end());
  }

  // The lowest index of the smallest of v[0, n), or -1 when every one is infinite.
  // Branch-free: the loads are random.
  static int Lightest(const double* v, int n) {
    int r = -1;
    double lightest = std::numeric_limits<double>::infinity();
    for (int c = 0; c < n; ++c) {
      const bool lighter = v[c] < lightest;
      lightest = lighter ? v[c] : lightest;
      r = lighter ? c : r;
    }
    return r;
  }

  // A duplicate, when every rank with room took the expert already: the lightest rank with
  // room among those that took it (ties: lowest rank).
  int DuplicateRank() const {
    return *std::min_element(taken_.begin(), taken_.end(), [&](int a, int b) {
      return fill_[a] == per_rank_   ? false
             : fill_[b] == per_rank_ ? true
                                     : std::pair(load_[a], a) < std::pair(load_[b], b);
    });
  }

  std::span<const double> weight_;
  int ranks_, per_rank_;
  bool general_ = false, fast_path_ = false;
  std::vector<int> rank_order_;
  std::vector<int32_t> slots_, order_, last_count_;
  std::vector<double> load_, share_;
  std::vector<int> fill_, taken_;
  // (load, rank) with the load's bits as the key: loads are never negative, and the bits of
  // non-negative doubles order as the numbers do (integer compares, no NaN branches).
  static uint64_t Key(double load) { return std::bit_cast<uint64_t>(load); }
  std::vector<std::pair<uint64_t, int>> heap_;
};

// Replica counts searched together with the packing: from the greedy counts, repeatedly
// give one more replica to an expert on the heaviest rank (one of its kTakers largest
// shares; ties: lowest expert) and take one from an expert that loses least by it (the
// kCheapest smallest weight / (count - 1); ties: lowest expert), keeping the change that
// lowers the packed maximum the most (ties: the first tried). Stops when no change helps
// or after `budget` changes. Returns the counts; `packer` holds their packing.
constexpr int kCheapest = 6;
constexpr size_t kTakers = 3;

// Stops early, too, once the packed maximum is at most `enough`.
std::vector<int32_t> SearchCounts(std::span<const double> weight, int slots, int cap,
                                  Packer& packer, int budget, double enough) {
  const int n = static_cast<int>(weight.size());
  std::vector<int32_t> count = GreedyCounts(weight, slots, cap);
  double best = packer.Pack(count);
  bool packed = true;  // the packer holds the packing of `count` (no trial packed since)
  std::vector<int32_t> donors, takers;
  for (int step = 0; step < budget && best > enough; ++step) {
    const auto& load = packer.loads();
    const int top = static_cast<int>(std::max_element(load.begin(), load.end()) - load.begin());
    const int per_rank = slots / static_cast<int>(load.size());
    takers.assign(packer.slots().begin() + top * per_rank,
                  packer.slots().begin() + (top + 1) * per_rank);
    std::sort(takers.begin(), takers.end());
    takers.erase(std::unique(takers.begin(), takers.end()), takers.end());
    std::stable_sort(takers.begin(), takers.end(), [&](int32_t a, int32_t b) {
      return weight[a] / count[a] > weight[b] / count[b];
    });
    if (takers.size() > kTakers) takers.resize(kTakers);
    donors.clear();
    for (int32_t e = 0; e < n; ++e) {
      if (count[e] > 1) donors.push_back(e);
    }
    auto loss = [&](int32_t e) { return weight[e] / (count[e] - 1); };
    const size_t keep = std::min<size_t>(kCheapest, donors.size());
    std::partial_sort(donors.begin(), donors.begin() + keep, donors.end(),
                      [&](int32_t a, int32_t b) {
                        const double la = loss(a), lb = loss(b);
                        return la != lb ? la < lb : a < b;
                      });
    donors.resize(keep);
    int32_t give = -1, take = -1;
    double improved = best;
    for (int32_t j : takers) {
      if (count[j] >= cap) continue;
      for (int32_t i : donors) {
        if (i == j) continue;
        --count[i];
        ++count[j];
        const double m = packer.Pack(count, nullptr, 0, improved * (1 - 1e-12));
        packed = false;
        if (m < improved * (1 - 1e-12)) {
          improved = m;
          give = j;
          take = i;
        }
        ++count[i];
        --count[j];
      }
    }
    if (give < 0) break;
    --count[take];
    ++count[give];
    best = packer.Pack(count);  // the packer holds the accepted counts' packing again
    packed = true;
  }
  if (!packed) packer.Pack(count);
  return count;
}

}  // namespace

namespace {

// At most one replica per rank while the slots allow it.
int ReplicaCap(int experts, int slots, int ranks) {
  return std::max(ranks, (slots + experts - 1) / experts);
}

}  // namespace

double BalancedFloor(std::span<const double> weight, int slots, int ranks) {
  const int cap = ReplicaCap(static_cast<int>(weight.size()), slots, ranks);
  double total = 0, largest = 0;
  for (double w : weight) {
    total += w;
    largest = std::max(largest, w);
  }
  return std::max(total / ranks, largest / cap);
}

double BalancedSlots(std::span<const double> weight, int slots, int ranks, std::span<int32_t> out,
                     double enough) {
  const int n = static_cast<int>(weight.size());
  const int per_rank = slots / ranks;
  const int cap = ReplicaCap(n, slots, ranks);
  Packer packer(weight, ranks, per_rank);
  SearchCounts(weight, slots, cap, packer, /*budget=*/2 * ranks, enough);
  // Local search on the heaviest rank: swaps of one or two replicas. (Re-pointing replicas
  // adds little after the count search and doubles the time: measured, docs/placement.md.)
  Layout layout(weight, packer.slots(), ranks);
  layout.repoints = false;
  for (int iter = 0; iter < 64 * ranks && layout.load[layout.Heaviest()] > enough; ++iter) {
    const Move move = BestMove(layout, layout.Heaviest(), nullptr);
    if (move.a < 0) break;
    Apply(layout, move);
  }
  std::copy(layout.expert.begin(), layout.expert.end(), out.begin());
  return layout.load[layout.Heaviest()];
}

double PackReplicas(std::span<const double> weight, std::span<const int32_t> count, int ranks,
                    int per_rank, bool general, std::span<int32_t> out, double bound, bool* fast) {
  Packer packer(weight, ranks, per_rank);
  packer.set_general(general);
  const double m = packer.Pack(count, nullptr, 0, bound);
  if (fast != nullptr) *fast = packer.fast_path();
  std::copy(packer.slots().begin(), packer.slots().end(), out.begin());
  return m;
}

std::vector<std::vector<int32_t>> PackEach(std::span<const double> weight,
                                           const std::vector<std::vector<int32_t>>& counts,
                                           int ranks, int per_rank) {
  Packer packer(weight, ranks, per_rank);
  std::vector<std::vector<int32_t>> slots;
  for (const std::vector<int32_t>& count : counts) {
    packer.Pack(count);
    slots.push_back(packer.slots());
  }
  return slots;
}

void StickySlots(std::span<const double> weight, std::span<const int32_t> count,
                 std::span<const uint8_t> held, int ranks, double cap, std::span<int32_t> out) {
  Packer packer(weight, ranks, static_cast<int>(out.size()) / ranks);
  packer.Pack(count, held.data(), cap);
  std::copy(packer.slots().begin(), packer.slots().end(), out.begin());
}

std::vector<int32_t> AssignGroupsToNodes(std::span<const double> group_load, int nodes) {
  const int g = static_cast<int>(group_load.size());
  const int per_node = g / nodes;
  std::vector<int32_t> order(static_cast<size_t>(g));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return group_load[a] > group_load[b]; });
  // Greedy start: heaviest group to the lightest node with room (ties: lowest node).
  std::vector<int32_t> best(static_cast<size_t>(g)), cur(static_cast<size_t>(g));
  std::vector<double> load(static_cast<size_t>(nodes), 0.0);
  std::vector<int> fill(static_cast<size_t>(nodes), 0);
  for (int32_t k : order) {
    int pick = -1;
    for (int n = 0; n < nodes; ++n) {
      if (fill[n] < per_node && (pick < 0 || load[n] < load[pick])) pick = n;
    }
    best[k] = pick;
    load[pick] += group_load[k];
    ++fill[pick];
  }
  double best_max = *std::max_element(load.begin(), load.end());
  // Exact branch and bound over the rest, within a budget.
  std::fill(load.begin(), load.end(), 0.0);
  std::fill(fill.begin(), fill.end(), 0);
  struct Search {
    std::span<const double> group_load;
    const std::vector<int32_t>& order;
    int nodes, per_node;
    std::vector<double>& load;
    std::vector<int>& fill;
    std::vector<int32_t>& cur;
    std::vector<int32_t>& best;
    double& best_max;
    int64_t budget = 2'000'000;

    void From(size_t i) {
      if (--budget < 0) return;
      if (i == order.size()) {
        const double m = *std::max_element(load.begin(), load.end());
        if (m < best_max * (1 - 1e-12)) {
          best_max = m;
          best = cur;
        }
        return;
      }
      const int32_t k = order[i];
      bool tried_empty = false;
      for (int n = 0; n < nodes; ++n) {
        if (fill[n] == per_node) continue;
        if (fill[n] == 0) {  // empty nodes are interchangeable: try only the first
          if (tried_empty) continue;
          tried_empty = true;
        }
        if (load[n] + group_load[k] >= best_max * (1 - 1e-12)) continue;
        load[n] += group_load[k];
        ++fill[n];
        cur[k] = n;
        From(i + 1);
        load[n] -= group_load[k];
        --fill[n];
      }
    }
  } search{group_load, order, nodes, per_node, load, fill, cur, best, best_max};
  search.From(0);
  return best;
}

double NodeBalancedness(std::span<const double> group_load, std::span<const int32_t> node,
                        int nodes) {
  std::vector<double> load(static_cast<size_t>(nodes), 0.0);
  for (size_t k = 0; k < group_load.size(); ++k) load[node[k]] += group_load[k];
  const double max = *std::max_element(load.begin(), load.end());
  const double total = std::accumulate(load.begin(), load.end(), 0.0);
  return max > 0 ? total / nodes / max : 1.0;
}

}  // namespace eplbx::internal
