#include "plan/round_coloring.h"

#include <algorithm>
#include <cstddef>

namespace eplbx::internal {

int RoundsLowerBound(const std::vector<std::pair<int32_t, int32_t>>& pairs, int ranks) {
  std::vector<int> reads(static_cast<size_t>(ranks), 0), serves(static_cast<size_t>(ranks), 0);
  int bound = 0;
  for (const auto& [reader, server] : pairs) {
    bound = std::max({bound, ++reads[reader], ++serves[server]});
  }
  return bound;
}

std::vector<int32_t> ColorRounds(const std::vector<std::pair<int32_t, int32_t>>& pairs, int ranks,
                                 int* rounds_used) {
  const int colors = RoundsLowerBound(pairs, ranks);
  // Vertices: readers 0..ranks-1, servers ranks..2*ranks-1. at[v * colors + c] is the
  // pair index using colour c at v, or -1.
  const size_t width = static_cast<size_t>(colors);
  std::vector<int32_t> at(2 * static_cast<size_t>(ranks) * width, -1);
  std::vector<int32_t> color(pairs.size(), -1);
  auto slot = [&](int32_t v, int c) -> int32_t& { return at[static_cast<size_t>(v) * width + c]; };
  auto lowest_free = [&](int32_t v) {
    int c = 0;
    while (slot(v, c) >= 0) ++c;
    return c;
  };
  for (size_t i = 0; i < pairs.size(); ++i) {
    const int32_t u = pairs[i].first, v = ranks + pairs[i].second;
    const int a = lowest_free(u);  // free at the reader
    const int b = lowest_free(v);  // free at the server
    if (slot(v, a) >= 0) {
      // a is taken at v: swap a and b along the path from v that alternates a, b, a, ...
      // In a bipartite graph that path never reaches u, so afterwards a is free at both.
      std::vector<int32_t> path;
      int32_t x = v;
      int c = a;
      while (slot(x, c) >= 0) {
        const int32_t e = slot(x, c);
        path.push_back(e);
        const int32_t y = pairs[e].first == x ? ranks + pairs[e].second : pairs[e].first;
        x = y;
        c = c == a ? b : a;
      }
      for (int32_t e : path) {  // clear, then re-set with the colours swapped
        slot(pairs[e].first, color[e]) = -1;
        slot(ranks + pairs[e].second, color[e]) = -1;
      }
      for (int32_t e : path) {
        color[e] = color[e] == a ? b : a;
        slot(pairs[e].first, color[e]) = e;
        slot(ranks + pairs[e].second, color[e]) = e;
      }
    }
    color[i] = a;
    slot(u, a) = static_cast<int32_t>(i);
    slot(v, a) = static_cast<int32_t>(i);
  }
  if (rounds_used != nullptr) {
    *rounds_used = pairs.empty() ? 0 : *std::max_element(color.begin(), color.end()) + 1;
  }
  return color;
}

}  // namespace eplbx::internal
