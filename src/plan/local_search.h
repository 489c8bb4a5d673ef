// Internal: one layer's slots as a mutable layout, and the local-search moves shared by
// the `balanced` and `incremental` policies. Not installed.
#ifndef EPLBX_SRC_PLAN_LOCAL_SEARCH_H_
#define EPLBX_SRC_PLAN_LOCAL_SEARCH_H_

#include <cstdint>
#include <span>
#include <vector>

namespace eplbx::internal {

// Two slots of one rank and the sum of their experts' shares.
struct SlotPair {
  double sum;
  int a, b;
};

struct Layout {
  Layout(std::span<const double> weight, std::vector<int32_t> slots, int ranks);

  int ranks, per_rank;
  std::span<const double> weight;  // per expert
  std::vector<int32_t> expert;     // slot -> expert (-1: empty)
  std::vector<int32_t> count;      // expert -> replicas
  std::vector<double> load;        // rank -> sum of weight / count over its slots
  double goal = 0;                 // a rank load that is good enough (moves gain nothing below it)
  bool repoints = true;            // consider re-pointing redundant replicas (changes counts)
  bool repoint_bounds = true;      // tests: false evaluates every re-point in full (bounds and
                                   // shortcuts never change the move, only how fast)
  std::vector<uint8_t> held;       // ranks x experts: replicas of the expert on the rank
  std::vector<double> shares;      // expert -> weight / count (0 without replicas)

  double share(int32_t e) const { return shares[e]; }
  int rank_of(size_t slot) const { return static_cast<int>(slot) / per_rank; }
  bool holds(int rank, int32_t e) const;
  int Heaviest() const;  // lowest rank among equals
  // Loads, holdings and shares from `expert` and `count` again (after any change to them).
  void Recompute();
  // The same after slots changed experts only within these ranks and no count changed: only
  // their loads (summed in slot order, as Recompute does: the same values) and holdings.
  void RecomputeRanks(std::span<const int> changed);

  // Per rank, its slot pairs by ascending sum (ties: lower slots), kept until the rank
  // changes (two-for-two swaps ask for the same ranks again between moves).
  std::span<const SlotPair> SortedPairs(int rank) const;

 private:
  mutable std::vector<SlotPair> pairs_;  // per_rank * (per_rank - 1) / 2 per rank
  mutable std::vector<uint8_t> pairs_known_;
};

// A swap of the experts in slots a and b (different ranks) and, when a2 >= 0, also in slots
// a2 and b2 (same two ranks); or (b < 0) re-pointing slot a to expert `to` (a redundant
// replica becomes a replica of another expert).
struct Move {
  int a = -1, b = -1, a2 = -1, b2 = -1;
  int32_t to = -1;
  int32_t from = -1;  // a re-point: the expert slot a held (BestMove fills it in)
  double gain = 0;    // relief (load removed from the heaviest rank, or above the goal) per copy
};

// The best move that lowers the load of rank `top` (the heaviest) without raising any rank
// to or above it, never putting two replicas of an expert on one rank. Swaps of two
// replicas for two are tried only when no single swap or re-point helps; re-points only
// with layout.repoints. Without a goal, moves are ranked by the load they remove from
// `top`. With layout.goal > 0 (incremental), by the total load above the goal they
// remove, and single swaps from every rank above the goal compete as well. With `before`
// (ranks x experts flags: the rank held the expert before), a move pays one copy for each
// (rank, expert) pair it creates that was absent before and gets one back for each such
// pair it removes (so passing a copy already paid on costs one, not two), and value is
// divided by copies (moves that cost none count four-fold). Ties: the first found (lower
// ranks and slots, then lower experts; for two-for-two swaps, lighter other ranks first).
// Returns a Move with a < 0 when none helps.
// With `cache` (and a goal), single swaps come from the cache instead of a full scan: the
// same move, found faster when moves keep changing only two ranks.
class SwapCache;
Move BestMove(const Layout& layout, int top, const std::vector<uint8_t>* before,
              SwapCache* cache = nullptr);

// The best single swap between each ordered pair of ranks (from the first to the second),
// kept across moves: a swap changes the loads and holdings of its two ranks only, so only
// pairs with one of them are searched again; a re-point changes the two experts' shares,
// so pairs with a rank holding either (or the re-pointed slot's rank) are. A pair's entry
// is stale when it was computed before either rank last changed (stamps, so forgetting a
// rank costs one write, not a row and a column).
// Rows are kept only for the ranks swaps are asked from (those above the goal). Each row
// also keeps its best entry (the most gain, then the lowest slot on the row's rank, then the
// lowest other rank: the one a scan of the row in rank order keeps), brought up to date from
// the ranks changed since (a log), or by a scan of the row when its own rank or the rank of
// its best changed.
class SwapCache {
 public:
  explicit SwapCache(int ranks);
  // Empty again, for a layout of `ranks` ranks; the memory stays (a thread plans layer after
  // layer with one cache: no fresh pages to fault in for each).
  void Reset(int ranks);
  // The best swap from rank `from` to rank `to` (a < 0: none).
  Move Get(const Layout& layout, int from, int to, const std::vector<uint8_t>* before);
  // The best swap from rank `from` to any rank below the goal (a < 0: none).
  Move RowBest(const Layout& layout, int from, const std::vector<uint8_t>* before);
  void Invalidate(const Layout& layout, const Move& applied);

 private:
  void Forget(int rank) {
    log_.push_back(rank);
    changed_[static_cast<size_t>(rank)] = ++clock_;
  }
  int Row(int rank);

  int ranks_;
  std::vector<int> row_;  // per rank: its row in best_ and computed_, -1 for none
  std::vector<Move> best_;
  std::vector<uint64_t> computed_;  // per pair: the clock after its last search
  std::vector<uint64_t> changed_;   // per rank: the clock when it last changed
  std::vector<int> log_;            // the rank forgotten at each tick of the clock (-1: all)
  std::vector<Move> row_best_;
  std::vector<uint64_t> row_seen_;  // per row: the clock when row_best_ was last brought up
  std::vector<uint8_t> row_known_;  // per row: row_best_ was computed
  uint64_t clock_ = 0, all_changed_ = 0;
};

void Apply(Layout& layout, const Move& move);

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_PLAN_LOCAL_SEARCH_H_
