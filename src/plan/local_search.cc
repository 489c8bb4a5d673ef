#include "plan/local_search.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>

namespace eplbx::internal {

Layout::Layout(std::span<const double> w, std::vector<int32_t> slots, int r)
    : ranks(r),
      per_rank(static_cast<int>(slots.size()) / r),
      weight(w),
      expert(std::move(slots)),
      count(w.size(), 0),
      load(static_cast<size_t>(r), 0.0) {
  for (int32_t e : expert) {
    if (e >= 0) ++count[e];
  }
  Recompute();
}

bool Layout::holds(int rank, int32_t e) const {
  return held[static_cast<size_t>(rank) * count.size() + e] != 0;
}

int Layout::Heaviest() const {
  return static_cast<int>(std::max_element(load.begin(), load.end()) - load.begin());
}

void Layout::Recompute() {
  pairs_known_.assign(static_cast<size_t>(ranks), 0);
  shares.resize(count.size());
  for (size_t e = 0; e < count.size(); ++e) shares[e] = count[e] ? weight[e] / count[e] : 0.0;
  std::fill(load.begin(), load.end(), 0.0);
  held.assign(static_cast<size_t>(ranks) * count.size(), 0);
  for (size_t s = 0; s < expert.size(); ++s) {
    if (expert[s] < 0) continue;
    load[rank_of(s)] += share(expert[s]);
    ++held[static_cast<size_t>(rank_of(s)) * count.size() + expert[s]];
  }
}

void Layout::RecomputeRanks(std::span<const int> changed) {
  const size_t n = count.size();
  for (int r : changed) {
    pairs_known_[static_cast<size_t>(r)] = 0;
    std::fill_n(held.begin() + static_cast<ptrdiff_t>(r * n), n, 0);
    double sum = 0.0;
    for (int s = r * per_rank; s < (r + 1) * per_rank; ++s) {
      if (expert[s] < 0) continue;
      sum += share(expert[s]);
      ++held[static_cast<size_t>(r) * n + expert[s]];
    }
    load[r] = sum;
  }
}

namespace {

// The slot pairs of `rank` in slot order, (a, a2) for a < a2, into `out` (room for
// per_rank * (per_rank - 1) / 2).
void PairsOf(const Layout& l, int rank, SlotPair* out) {
  auto share = [&](int s) { return l.expert[s] >= 0 ? l.share(l.expert[s]) : 0.0; };
  const int first = rank * l.per_rank;
  for (int a = first; a < first + l.per_rank; ++a) {
    for (int a2 = a + 1; a2 < first + l.per_rank; ++a2) *out++ = {share(a) + share(a2), a, a2};
  }
}

}  // namespace

std::span<const SlotPair> Layout::SortedPairs(int rank) const {
  const size_t per = static_cast<size_t>(per_rank) * (per_rank - 1) / 2;
  if (pairs_.empty()) pairs_.resize(static_cast<size_t>(ranks) * per);  // one array, all ranks
  const std::span<SlotPair> pairs(pairs_.data() + rank * per, per);
  if (pairs_known_[rank]) return pairs;
  PairsOf(*this, rank, pairs.data());
  std::sort(pairs.begin(), pairs.end(), [](const SlotPair& x, const SlotPair& y) {
    return x.sum != y.sum ? x.sum < y.sum : std::pair(x.a, x.b) < std::pair(y.a, y.b);
  });
  pairs_known_[rank] = 1;
  return pairs;
}

namespace {

// 1 when expert e on `rank` is a copy: a (rank, expert) pair absent from `before`.
int Paid(const std::vector<uint8_t>* before, size_t experts, int rank, int32_t e) {
  return before && e >= 0 && !(*before)[static_cast<size_t>(rank) * experts + e] ? 1 : 0;
}

// The change in copies when x (on rank ra) and y (on rank rb) trade places: pairs created
// that are absent from `before`, minus those the trade removes. Counting the removals makes
// passing an already-paid copy on cost one copy, so a chain of trades (x to r2, r2's y to
// r3, ...) relieves several ranks at one copy each instead of two.
int SwapCost(const std::vector<uint8_t>* before, size_t experts, int ra, int32_t x, int rb,
             int32_t y) {
  return Paid(before, experts, rb, x) + Paid(before, experts, ra, y) -
         Paid(before, experts, ra, x) - Paid(before, experts, rb, y);
}

// Load above the layout's goal (the largest rank load that meets the target), or the load
// itself without a goal.
double Excess(const Layout& l, double load) {
  return l.goal > 0 ? std::max(0.0, load - l.goal) : load;
}

// What a move that changes two ranks' loads from (t, r) to (t2, r2) is worth: with a goal,
// the total load above it that disappears; without, the load removed from the heaviest rank
// t (the new worst being max(t2, r2)).
double Relief(const Layout& l, double t, double r, double t2, double r2) {
  if (l.goal > 0) return Excess(l, t) + Excess(l, r) - Excess(l, t2) - Excess(l, r2);
  return t - std::max(t2, r2);
}

// Keeps the candidate with the most relief per copy paid (moves that cost no copy, or save
// some, count four-fold; ties: the first found). With a goal, a relief within rounding of
// zero (at most 1e-9 of the goal) is no relief: two replicas of equal share traded back and
// forth each "relieved" 1e-14 by rounding, and the search ran to its step limit without
// changing the excess (4,096 moves a layer at EP256).
void Consider(const Layout& l, Move& best, double relief, int copies, Move candidate) {
  if (l.goal > 0 && !(relief > 1e-9 * l.goal)) return;
  const double gain = copies > 0 ? relief / copies : relief * 4;
  if (gain <= 0) return;
  if (gain > best.gain) {
    candidate.gain = gain;
    best = candidate;
  }
}

// Whether moves whose gain is at most `bound` cannot beat `best`. The bounds are tight (a
// move can reach one exactly), so a margin keeps rounding in the bound from skipping a
// move whose computed gain is a hair above the best: skipping never changes the answer.
bool CannotBeat(double bound, const Move& best) { return bound * (1 + 1e-9) < best.gain; }

// With a goal: the most a swap can take off rank t — its largest share, at most its excess.
double SwapCap(const Layout& l, int t) {
  double cap = 0;
  for (int a = t * l.per_rank; a < (t + 1) * l.per_rank; ++a) {
    if (l.expert[a] >= 0) cap = std::max(cap, l.share(l.expert[a]));
  }
  return std::min(cap, Excess(l, l.load[t]));
}

// NoGoalBound: without a goal, a trade of load d between `top` and a lighter rank r helps
// only if d < top - r, and relieves top - max(top - d, r + d) <= (top - r) / 2; at most
// four-fold as gain, 2 * (top - r). Ranks whose bound cannot beat the best are skipped.
//
// Swaps of the replica in slot a (on `top`) for each replica of rank r.
void ConsiderSwapsWith(const Layout& l, int top, int a, int r, const std::vector<uint8_t>* before,
                       Move& best) {
  const double top_load = l.load[top];
  const int32_t x = l.expert[a];
  const double sx = l.share(x);
  // With a goal, a rank at or above it gains all the excess `top` sheds: no relief.
  if (r == top || l.load[r] >= top_load || l.holds(r, x) || (l.goal > 0 && l.load[r] >= l.goal))
    return;
  if (l.goal <= 0 && CannotBeat(2 * (top_load - l.load[r]), best)) return;  // see NoGoalBound
  // With a goal, r takes at most goal - load[r] without excess of its own.
  if (l.goal > 0 && CannotBeat(4 * std::min({sx, Excess(l, top_load), l.goal - l.load[r]}), best))
    return;
  for (int b = r * l.per_rank; b < (r + 1) * l.per_rank; ++b) {
    const int32_t y = l.expert[b];
    const double sy = y >= 0 ? l.share(y) : 0.0;
    if (sy >= sx || (y >= 0 && l.holds(top, y))) continue;
    const double worst = std::max(top_load - sx + sy, l.load[r] - sy + sx);
    if (l.goal <= 0 && worst >= top_load * (1 - 1e-12)) continue;
    Consider(l, best, Relief(l, top_load, l.load[r], top_load - sx + sy, l.load[r] - sy + sx),
             SwapCost(before, l.count.size(), top, x, r, y), {a, b, -1, -1, -1});
  }
}

// Swaps of one replica of `top` for one of any other rank (of rank `only` alone when
// `only` >= 0).
void ConsiderSwaps(const Layout& l, int top, const std::vector<uint8_t>* before, Move& best,
                   int only = -1) {
  for (int a = top * l.per_rank; a < (top + 1) * l.per_rank; ++a) {
    const int32_t x = l.expert[a];
    if (x < 0) continue;
    const double sx = l.share(x);
    // A swap removes at most sx from `top` (and at most its excess with a goal), and gains
    // count at most four-fold: skip x when that cannot beat the best so far.
    if (CannotBeat(4 * (l.goal > 0 ? std::min(sx, Excess(l, l.load[top])) : sx), best)) continue;
    if (only >= 0) {
      ConsiderSwapsWith(l, top, a, only, before, best);
    } else {
      for (int r = 0; r < l.ranks; ++r) ConsiderSwapsWith(l, top, a, r, before, best);
    }
  }
}

// Two replicas of `top` for two of another rank r, when single swaps are stuck (their sums
// can differ by less than any single pair does). For each r, r's slot pairs are sorted by
// share sum; for each pair on `top` the pairs of r nearest the ideal difference (half the
// load gap) are checked, up to kPairProbe on each side.
constexpr int kPairProbe = 4;

void ConsiderPairSwaps(const Layout& l, int top, const std::vector<uint8_t>* before, Move& best) {
  const double top_load = l.load[top];
  const size_t n = l.count.size();
  std::vector<SlotPair> mine(static_cast<size_t>(l.per_rank) * (l.per_rank - 1) / 2);
  PairsOf(l, top, mine.data());
  // Lightest ranks first (ties: lowest rank): they offer the most relief, so without a
  // goal the bound stops the scan early.
  std::vector<int> by_load(static_cast<size_t>(l.ranks));
  std::iota(by_load.begin(), by_load.end(), 0);
  std::stable_sort(by_load.begin(), by_load.end(),
                   [&](int x, int y) { return l.load[x] < l.load[y]; });
  for (int r : by_load) {
    if (r == top || l.load[r] >= top_load) break;
    if (l.goal <= 0 && CannotBeat(2 * (top_load - l.load[r]), best)) break;  // see NoGoalBound
    const std::span<const SlotPair> theirs = l.SortedPairs(r);
    const double ideal = (top_load - l.load[r]) / 2;
    auto valid = [&](const SlotPair& p, const SlotPair& q) {
      const int32_t x = l.expert[p.a], x2 = l.expert[p.b];
      const int32_t y = l.expert[q.a], y2 = l.expert[q.b];
      return x >= 0 && x2 >= 0 && !l.holds(r, x) && !l.holds(r, x2) &&
             (y < 0 || !l.holds(top, y)) && (y2 < 0 || !l.holds(top, y2));
    };
    for (const SlotPair& p : mine) {
      const auto mid = std::lower_bound(theirs.begin(), theirs.end(), p.sum - ideal,
                                        [](const SlotPair& x, double v) { return x.sum < v; });
      const auto lo = mid - std::min<ptrdiff_t>(kPairProbe, mid - theirs.begin());
      const auto hi = mid + std::min<ptrdiff_t>(kPairProbe, theirs.end() - mid);
      for (auto q = lo; q != hi; ++q) {
        const double d = p.sum - q->sum;
        if (d <= 0) continue;
        const double worst = std::max(top_load - d, l.load[r] + d);
        if ((l.goal <= 0 && worst >= top_load * (1 - 1e-12)) || !valid(p, *q)) continue;
        const int copies = SwapCost(before, n, top, l.expert[p.a], r, l.expert[q->a]) +
                           SwapCost(before, n, top, l.expert[p.b], r, l.expert[q->b]);
        Consider(l, best, Relief(l, top_load, l.load[r], top_load - d, l.load[r] + d), copies,
                 {p.a, q->a, p.b, q->b, -1});
      }
    }
  }
}

// Evaluates re-pointing slot `a` (expert x, with several replicas) to expert y: x's other
// replicas get heavier, y's lighter. Only ranks holding x or y change load.
class RepointEvaluator {
 public:
  explicit RepointEvaluator(const Layout& l)
      : l_(l),
        first_(l.count.size() + 1, 0),
        delta_(static_cast<size_t>(l.ranks), 0.0),
        touched_flag_(static_cast<size_t>(l.ranks), 0) {
    // Each expert's ranks in slot order, as one array with offsets.
    for (int32_t e : l.expert) {
      if (e >= 0) ++first_[static_cast<size_t>(e) + 1];
    }
    for (size_t e = 0; e < l.count.size(); ++e) first_[e + 1] += first_[e];
    ranks_.resize(first_.back());
    std::vector<int> at(first_.begin(), first_.end() - 1);
    for (size_t s = 0; s < l.expert.size(); ++s) {
      if (l.expert[s] >= 0) ranks_[at[l.expert[s]]++] = l.rank_of(s);
    }
    if (l.goal <= 0) {  // the largest load is asked for only without a goal
      by_load_.resize(static_cast<size_t>(l.ranks));
      std::iota(by_load_.begin(), by_load_.end(), 0);
      std::stable_sort(by_load_.begin(), by_load_.end(),
                       [&](int a, int b) { return l.load[a] > l.load[b]; });
    }
  }

  // The ranks holding expert e, one entry per replica, in slot order.
  std::span<const int> Holders(int32_t e) const {
    return std::span<const int>(ranks_).subspan(first_[e], first_[e + 1] - first_[e]);
  }

  // With a goal: the relief of re-pointing slot `a` to y, the same value Worst sums. When
  // every rank holding x (slot a's among them) is at or below the goal before and after x's
  // share rises, Worst adds exact zeros for them ahead of y's other ranks, so the sum is y's
  // part alone (Part): a rank holding both adds zero there too (y's drop only lowers it,
  // and rounding is monotonic). A hot expert's ranks are many, and re-points of cold
  // replicas to it, or of its replicas to anything, keep asking about them.
  double Relief(int a, int32_t y) {
    const int32_t x = l_.expert[a];
    const int ra = l_.rank_of(static_cast<size_t>(a));
    const double sx_new = l_.weight[x] / (l_.count[x] - 1);
    const Part& px = Of(x, sx_new - l_.share(x));
    // ra's change as Worst adds it up: x's rise for each replica on ra, then y in, x out.
    double d = 0;
    for (int i = 0; i < l_.held[static_cast<size_t>(ra) * l_.count.size() + x]; ++i) d += px.step;
    d += l_.weight[y] / (l_.count[y] + 1) - sx_new;
    const bool plain = (px.bad == 0 || (px.bad == 1 && px.bad_rank == ra)) &&
                       Excess(l_, l_.load[ra]) == 0 && Excess(l_, l_.load[ra] + d) == 0;
    if (!plain) {
      double relief;
      Worst(a, y, &relief);
      return relief;
    }
    return Of(y, l_.weight[y] / (l_.count[y] + 1) - l_.share(y)).sum;
  }

  // The largest rank load after the change (without a goal; 0 with one); *relief: the
  // total excess (Excess) it removes from the ranks it changes.
  double Worst(int a, int32_t y, double* relief) {
    const int32_t x = l_.expert[a];
    const int ra = l_.rank_of(static_cast<size_t>(a));
    const double sx = l_.share(x), sx_new = l_.weight[x] / (l_.count[x] - 1);
    const double sy = l_.share(y), sy_new = l_.weight[y] / (l_.count[y] + 1);
    for (int k = first_[x]; k < first_[x + 1]; ++k) Touch(ranks_[k], sx_new - sx);
    for (int k = first_[y]; k < first_[y + 1]; ++k) Touch(ranks_[k], sy_new - sy);
    Touch(ra, sy_new - sx_new);  // slot a: x's new share leaves, y's arrives
    double worst = 0;
    *relief = 0;
    for (int r : touched_) {
      worst = std::max(worst, l_.load[r] + delta_[r]);
      *relief += Excess(l_, l_.load[r]) - Excess(l_, l_.load[r] + delta_[r]);
    }
    for (int r : by_load_) {  // the heaviest rank that does not change
      if (!touched_flag_[r]) {
        worst = std::max(worst, l_.load[r]);
        break;
      }
    }
    for (int r : touched_) {
      delta_[r] = 0;
      touched_flag_[r] = 0;
    }
    touched_.clear();
    return l_.goal > 0 ? 0 : worst;
  }

 private:
  void Touch(int r, double d) {
    if (!touched_flag_[r]) {
      touched_flag_[r] = 1;
      touched_.push_back(r);
    }
    delta_[r] += d;
  }

  const Layout& l_;
  std::vector<int> first_, ranks_;  // expert e's ranks: ranks_[first_[e], first_[e + 1])
  std::vector<int> by_load_;        // without a goal: ranks by load, heaviest first
  std::vector<double> delta_;
  std::vector<uint8_t> touched_flag_;
  std::vector<int> touched_;
  // An expert's ranks when its share changes by `step` a replica (one fewer replica for x,
  // one more for y): the excess they lose in all, summed in Worst's order (for y), and how
  // many of them are above the goal before or after (for x), the first such rank.
  struct Part {
    double step = 0, sum = 0;
    int bad = 0, bad_rank = -1;
  };
  // Expert e's Part for this step (each expert is asked with one step in a search: one
  // replica fewer as an x, a positive step; one more as a y, negative, or positive only for
  // a y without replicas, which is never an x; zero only for a zero weight, the same Part
  // either way), kept apart by the step's sign.
  const Part& Of(int32_t e, double step) {
    const bool as_x = step > 0;
    std::vector<Part>& parts = as_x ? x_part_ : y_part_;
    std::vector<uint8_t>& known = as_x ? x_known_ : y_known_;
    if (known.empty()) {
      known.assign(l_.count.size(), 0);
      parts.resize(l_.count.size());
    }
    Part& p = parts[static_cast<size_t>(e)];
    if (known[static_cast<size_t>(e)]) return p;
    known[static_cast<size_t>(e)] = 1;
    p = Part{.step = step};
    for (int k = first_[e]; k < first_[e + 1];) {
      const int r = ranks_[k];
      double d = 0;
      for (; k < first_[e + 1] && ranks_[k] == r; ++k) d += step;
      const double before = Excess(l_, l_.load[r]), after = Excess(l_, l_.load[r] + d);
      p.sum += before - after;
      if (before != 0 || after != 0) {
        if (p.bad++ == 0) p.bad_rank = r;
      }
    }
    return p;
  }

  std::vector<Part> x_part_, y_part_;
  std::vector<uint8_t> x_known_, y_known_;
};

// Re-pointing a redundant replica: one on `top` to an expert `top` lacks (top sheds load),
// or one elsewhere to an expert `top` holds (that expert's share on `top` shrinks).
// With a goal, a bound skips a candidate before it is evaluated when it cannot beat the best:
// re-pointing slot a (expert x on rank ra) to y changes ra by y's new share minus x's share,
// makes the ranks holding x heavier (x has one replica fewer) and those holding y lighter by
// y's share drop, so the excess it removes is at most min(excess of ra, x's share - y's new
// share) plus, over y's replicas, min(excess of the replica's rank, y's share drop), minus
// the excess that x's heavier share adds on the ranks holding x but neither y nor slot a
// (exactly what those ranks lose: their load changes by x's share rise alone).
void ConsiderRepoints(const Layout& l, int top, const std::vector<uint8_t>* before, Move& best) {
  const int n = static_cast<int>(l.count.size());
  const double top_load = l.load[top];
  const int k = l.per_rank;
  std::vector<double> y_relief;   // with a goal: the bound's part from y's replicas
  std::vector<double> x_penalty;  // with a goal: per expert, the excess its share's rise adds
  // The excess that x's share rise (one replica fewer) adds on rank r, for each of r's
  // replicas of x (a rank may hold several).
  auto rise = [&](int r, int32_t x) {
    const double dx = l.weight[x] / (l.count[x] - 1) - l.share(x);
    const double load = l.load[r];
    return Excess(l, load + l.held[static_cast<size_t>(r) * n + x] * dx) - Excess(l, load);
  };
  if (l.goal > 0) {
    x_penalty.assign(static_cast<size_t>(n), 0.0);
    for (int r = 0; r < l.ranks; ++r) {
      for (int s = r * k; s < (r + 1) * k; ++s) {
        const int32_t e = l.expert[s];
        if (e < 0 || l.count[e] < 2 || std::find(&l.expert[r * k], &l.expert[s], e) != &l.expert[s])
          continue;  // (once per rank)
        x_penalty[e] += rise(r, e);
      }
    }
    // (A rank without excess adds nothing: the drop is never negative.)
    y_relief.assign(static_cast<size_t>(n), 0.0);
    for (int r = 0; r < l.ranks; ++r) {
      const double excess = Excess(l, l.load[r]);
      if (!(excess > 0)) continue;
      for (int s = r * k; s < (r + 1) * k; ++s) {
        const int32_t e = l.expert[s];
        if (e < 0) continue;
        const double drop = l.share(e) - l.weight[e] / (l.count[e] + 1);
        y_relief[e] += std::min(excess, drop);
      }
    }
  }
  // With a goal, built at once (its ranks of each expert serve the bound); without, for the
  // first candidate evaluated.
  std::optional<RepointEvaluator> eval;
  if (l.goal > 0) eval.emplace(l);
  // With a goal: y's share with one replica more, per expert (asked for every slot).
  std::vector<double> sy_new_of;
  if (l.goal > 0) {
    sy_new_of.resize(static_cast<size_t>(n));
    for (int32_t y = 0; y < n; ++y) sy_new_of[y] = l.weight[y] / (l.count[y] + 1);
  }
  // The parts of the bound that depend on the slot alone (x, its rank ra), computed once a
  // slot: the excess of ra, x's share less y's new one at most, and the penalty of x's
  // other ranks before those holding y are taken out.
  struct SlotTerms {
    double excess, share, penalty;
    int paid;
  };
  auto slot_terms = [&](int a, int ra) {
    const int32_t x = l.expert[a];
    return SlotTerms{Excess(l, l.load[ra]), l.share(x),
                     l.goal > 0 ? x_penalty[x] - rise(ra, x) : 0.0,
                     Paid(before, l.count.size(), ra, x)};
  };
  auto consider = [&](int a, int ra, int32_t y, const SlotTerms& t) {
    const int32_t x = l.expert[a];
    if (y == x || l.count[y] >= l.ranks || l.holds(ra, y)) return;
    const int copies = Paid(before, l.count.size(), ra, y) - t.paid;
    if (l.goal > 0 && l.repoint_bounds) {
      const double sy_new = sy_new_of[y];
      // x's ranks but ra and those holding y (each once; rises are never negative).
      // Both lists are in rank order, so walking the shorter one subtracts the same rises in
      // the same order.
      double penalty = t.penalty;
      const std::span<const int> x_ranks = eval->Holders(x), y_ranks = eval->Holders(y);
      const bool by_x = x_ranks.size() < y_ranks.size();
      const std::span<const int> walk = by_x ? x_ranks : y_ranks;
      for (size_t i = 0; i < walk.size(); ++i) {
        const int r = walk[i];
        if (r != ra && (i == 0 || walk[i - 1] != r) && l.holds(r, by_x ? y : x))
          penalty -= rise(r, x);
      }
      // (plus a hair for rounding in the evaluation's sums)
      const double bound = std::min(t.excess, std::max(0.0, t.share - sy_new)) + y_relief[y] -
                           std::max(0.0, penalty) + 1e-12 * l.goal;
      if (CannotBeat(copies > 0 ? bound / copies : 4 * bound, best)) return;
    }
    if (!eval) eval.emplace(l);
    double relief;
    if (l.goal > 0 && l.repoint_bounds) {
      relief = eval->Relief(a, y);
    } else if (l.goal > 0) {
      eval->Worst(a, y, &relief);
    } else {
      const double worst = eval->Worst(a, y, &relief);
      if (worst >= top_load * (1 - 1e-12)) return;
      relief = top_load - worst;
    }
    Consider(l, best, relief, copies, {a, -1, -1, -1, y, x});
  };
  // Only replicas of experts with several can be re-pointed (the same candidates in the
  // same order as every slot against every expert: the others are rejected at once):
  // first those on `top` against every expert, then every other one (in slot order)
  // against each expert of `top`.
  auto redundant = [&](int s) { return l.expert[s] >= 0 && l.count[l.expert[s]] >= 2; };
  // Slots of `top` against every expert it lacks that has room for a replica. With a goal,
  // a y that no rank holding x holds has the slot's penalty as it is, so its bound is
  // checked here from per-expert values before `consider` works it out again (the same
  // bound: the same candidates skipped, in the same order).
  const bool cheap_bounds = l.goal > 0 && l.repoint_bounds;
  std::vector<int32_t> top_ys;     // the experts `top` lacks with room for one more replica
  std::vector<int> top_paid;       // per expert: Paid on `top`
  std::vector<int> mark;           // per expert: the slot whose x a rank holding it holds
  std::vector<int64_t> last_rank;  // per expert: the (rank + slot * ranks) last counted on
  std::vector<double> taken_off;
  if (cheap_bounds) {
    top_paid.resize(static_cast<size_t>(n));
    mark.assign(static_cast<size_t>(n), -1);
    last_rank.assign(static_cast<size_t>(n), -1);
    taken_off.resize(static_cast<size_t>(n));
  }
  for (int32_t y = 0; y < n; ++y) {
    if (l.count[y] >= l.ranks || l.holds(top, y)) continue;
    top_ys.push_back(y);
    if (cheap_bounds) top_paid[y] = Paid(before, l.count.size(), top, y);
  }
  for (int a = top * k; a < (top + 1) * k; ++a) {
    if (!redundant(a)) continue;
    const SlotTerms t = slot_terms(a, top);
    if (!cheap_bounds) {
      for (int32_t y : top_ys) consider(a, top, y, t);
      continue;
    }
    // What the ranks holding x (but `top`) take off the penalty of each y they hold: each
    // such rank's rise once.
    const int32_t x = l.expert[a];
    const std::span<const int> x_ranks = eval->Holders(x);
    for (size_t i = 0; i < x_ranks.size(); ++i) {
      const int r = x_ranks[i];
      if (r == top || (i > 0 && x_ranks[i - 1] == r)) continue;  // (a rank's replicas together)
      const double off = rise(r, x);
      for (int s = r * k; s < (r + 1) * k; ++s) {
        const int32_t e = l.expert[s];
        const int64_t stamp = r + int64_t{a} * l.ranks;
        if (e < 0 || last_rank[e] == stamp) continue;  // once per rank
        last_rank[e] = stamp;
        if (mark[e] != a) {
          mark[e] = a;
          taken_off[e] = 0;
        }
        taken_off[e] += off;
      }
    }
    for (int32_t y : top_ys) {
      // y's penalty as `consider` subtracts it, up to rounding (a hair less, so the bound is
      // never below the one `consider` computes)
      double penalty = t.penalty;
      if (mark[y] == a)
        penalty = (penalty - taken_off[y]) - 1e-9 * (std::abs(penalty) + taken_off[y]);
      const double bound = std::min(t.excess, std::max(0.0, t.share - sy_new_of[y])) + y_relief[y] -
                           std::max(0.0, penalty) + 1e-12 * l.goal;
      const int copies = top_paid[y] - t.paid;
      if (CannotBeat(copies > 0 ? bound / copies : 4 * bound, best)) continue;
      consider(a, top, y, t);
    }
  }
  struct Other {
    int a, r;
    SlotTerms t;
  };
  std::vector<Other> elsewhere;  // the others, slot order
  for (int r = 0; r < l.ranks; ++r) {
    if (r == top) continue;
    for (int a = r * k; a < (r + 1) * k; ++a) {
      if (redundant(a)) elsewhere.push_back({a, r, slot_terms(a, r)});
    }
  }
  for (int j = top * k; j < (top + 1) * k; ++j) {
    const int32_t y = l.expert[j];
    if (y < 0 || l.count[y] >= l.ranks) continue;
    for (const Other& o : elsewhere) consider(o.a, o.r, y, o.t);
  }
}

}  // namespace

SwapCache::SwapCache(int ranks) { Reset(ranks); }

void SwapCache::Reset(int ranks) {
  ranks_ = ranks;
  row_.assign(static_cast<size_t>(ranks), -1);
  best_.clear();
  computed_.clear();
  changed_.assign(static_cast<size_t>(ranks), 0);
  log_.clear();
  row_best_.clear();
  row_seen_.clear();
  row_known_.clear();
  clock_ = 0;
  all_changed_ = 0;
}

int SwapCache::Row(int t) {
  if (row_[t] < 0) {
    row_[t] = static_cast<int>(row_best_.size());
    best_.resize(best_.size() + static_cast<size_t>(ranks_));
    computed_.resize(best_.size(), 0);
    row_best_.emplace_back();
    row_seen_.push_back(0);
    row_known_.push_back(0);
  }
  return row_[t];
}

Move SwapCache::Get(const Layout& l, int t, int r, const std::vector<uint8_t>* before) {
  const size_t k = static_cast<size_t>(Row(t)) * ranks_ + r;
  if (computed_[k] <= std::max({all_changed_, changed_[t], changed_[r]})) {
    best_[k] = Move{};
    ConsiderSwaps(l, t, before, best_[k], r);
    computed_[k] = clock_ + 1;  // newer than every change so far, older than the next
  }
  return best_[k];
}

Move SwapCache::RowBest(const Layout& l, int t, const std::vector<uint8_t>* before) {
  const int row = Row(t);
  const uint64_t seen = row_seen_[row];
  Move best = row_best_[row];
  auto other = [&](const Move& m) { return l.rank_of(static_cast<size_t>(m.b)); };
  // A rank at or above the goal takes no swap: its entries are empty, so not asked. A swap
  // with r relieves at most the share it takes off t, t's excess and r's room below the
  // goal (ConsiderSwapsWith's bound): a rank whose bound cannot beat the row's best is not
  // asked (its entry, if stale, stays so: it is worked out when a scan asks for it).
  const double t_cap = SwapCap(l, t);
  auto offer = [&](int r) {
    if (r < 0 || l.load[r] >= l.goal) return;
    if (best.a >= 0 && CannotBeat(4 * std::min(t_cap, l.goal - l.load[r]), best)) return;
    const Move m = Get(l, t, r, before);
    if (m.a < 0) return;
    if (best.a < 0 || m.gain > best.gain ||
        (m.gain == best.gain && (m.a < best.a || (m.a == best.a && r < other(best))))) {
      best = m;
    }
  };
  const bool scan = !row_known_[row] || all_changed_ > seen || changed_[t] > seen ||
                    (best.a >= 0 && changed_[other(best)] > seen);
  if (scan) {
    best = Move{};
    for (int r = 0; r < ranks_; ++r) offer(r);
  } else {  // entries of ranks unchanged since are as they were, none above the best
    for (uint64_t i = seen; i < clock_; ++i) offer(log_[i]);
  }
  row_best_[row] = best;
  row_seen_[row] = clock_;
  row_known_[row] = 1;
  return best;
}

void SwapCache::Invalidate(const Layout& l, const Move& applied) {
  Forget(l.rank_of(static_cast<size_t>(applied.a)));
  if (applied.b >= 0) {
    Forget(l.rank_of(static_cast<size_t>(applied.b)));
    return;
  }
  // A re-point: the shares of both experts changed on every rank holding either (the slot's
  // own rank held the old one). Without the old expert (a move not from BestMove): all.
  if (applied.from < 0) {
    log_.push_back(-1);
    all_changed_ = ++clock_;
    return;
  }
  for (int r = 0; r < ranks_; ++r) {
    if (l.holds(r, applied.from) || l.holds(r, applied.to)) Forget(r);
  }
}

Move BestMove(const Layout& layout, int top, const std::vector<uint8_t>* before, SwapCache* cache) {
  Move best;
  if (cache != nullptr && layout.goal > 0) {
    // The same move as the search below, in another order: the best swap from the cached
    // row of each rank (top first, then in rank order, a later one only with more gain: its
    // row best is the one a scan of its entries in rank order keeps), and a re-point only
    // with more gain than every swap. Re-points are sought right after top's swaps, so that
    // a rank whose swaps cannot beat the better of the two (SwapCap, four-fold as gain) is
    // not brought up to date: a re-point that wins relieves many ranks at once, and brought
    // every row it touched out of date.
    Move swap = cache->RowBest(layout, top, before);
    if (swap.a < 0) swap = Move{};
    Move repoint = swap;  // a re-point with more gain than top's swaps, if any
    if (layout.repoints) ConsiderRepoints(layout, top, before, repoint);
    const bool repointed = repoint.a >= 0 && repoint.b < 0;
    for (int r = 0; r < layout.ranks; ++r) {
      if (r == top || layout.load[r] <= layout.goal) continue;
      const Move& bar = repointed && repoint.gain > swap.gain ? repoint : swap;
      if (bar.a >= 0 && CannotBeat(4 * SwapCap(layout, r), bar)) continue;
      const Move m = cache->RowBest(layout, r, before);
      if (m.a >= 0 && m.gain > swap.gain) swap = m;
    }
    best = repointed && repoint.gain > swap.gain ? repoint : swap;
  } else {
    ConsiderSwaps(layout, top, before, best);
    if (layout.goal > 0) {  // with a goal, swaps on every rank above it compete too
      for (int r = 0; r < layout.ranks; ++r) {
        if (r != top && layout.load[r] > layout.goal) ConsiderSwaps(layout, r, before, best);
      }
    }
    if (layout.repoints) ConsiderRepoints(layout, top, before, best);
  }
  if (best.a < 0) ConsiderPairSwaps(layout, top, before, best);
  return best;
}

void Apply(Layout& layout, const Move& move) {
  if (move.b >= 0) {  // a swap: only the two ranks change
    std::swap(layout.expert[move.a], layout.expert[move.b]);
    if (move.a2 >= 0) std::swap(layout.expert[move.a2], layout.expert[move.b2]);
    const int changed[] = {layout.rank_of(static_cast<size_t>(move.a)),
                           layout.rank_of(static_cast<size_t>(move.b))};
    layout.RecomputeRanks(changed);
    return;
  }
  // A re-point changes the shares of its two experts only: the ranks holding either (slot
  // a's among them) are summed again, in slot order as Recompute does (the same values).
  const int32_t x = layout.expert[move.a], y = move.to;
  std::vector<int> changed;
  for (int r = 0; r < layout.ranks; ++r) {
    if (layout.holds(r, x) || layout.holds(r, y)) changed.push_back(r);
  }
  --layout.count[x];
  ++layout.count[y];
  layout.expert[move.a] = y;
  for (const int32_t e : {x, y})
    layout.shares[e] = layout.count[e] ? layout.weight[e] / layout.count[e] : 0.0;
  layout.RecomputeRanks(changed);
}

}  // namespace eplbx::internal
