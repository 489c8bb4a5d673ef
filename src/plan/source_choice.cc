#include "plan/source_choice.h"

#include <cstddef>
#include <deque>

namespace eplbx::internal {

namespace {

// Breadth-first search for an augmenting path that frees a slot for `read`: a chain
// read -> source s1 (full) -> some read r1 assigned to s1 -> source s2 ... -> source with
// load < cap. On success shifts the chain and assigns `read`; returns false otherwise.
bool Augment(int read, int cap, const std::vector<std::vector<int32_t>>& candidates,
             std::vector<int32_t>& choice, std::vector<int32_t>& load) {
  const int sources = static_cast<int>(load.size());
  // parent_read[s]: the read through which source s was reached (-1: unvisited).
  std::vector<int32_t> parent_read(static_cast<size_t>(sources), -1);
  std::deque<int32_t> queue;
  for (int32_t s : candidates[read]) {
    if (parent_read[s] < 0) {
      parent_read[s] = read;
      queue.push_back(s);
    }
  }
  // reads currently assigned to each source, in ascending read order
  std::vector<std::vector<int32_t>> assigned(static_cast<size_t>(sources));
  for (size_t r = 0; r < choice.size(); ++r) {
    if (choice[r] >= 0) assigned[choice[r]].push_back(static_cast<int32_t>(r));
  }
  while (!queue.empty()) {
    const int32_t s = queue.front();
    queue.pop_front();
    if (load[s] < cap) {  // free room: shift the chain back to `read`
      int32_t target = s;
      int32_t r = parent_read[s];
      while (true) {
        const int32_t previous = choice[r];
        choice[r] = target;
        if (r == read) break;
        target = previous;
        r = parent_read[previous];
      }
      ++load[s];
      return true;
    }
    for (int32_t r : assigned[s]) {
      for (int32_t t : candidates[r]) {
        if (parent_read[t] < 0) {
          parent_read[t] = r;
          queue.push_back(t);
        }
      }
    }
  }
  return false;
}

}  // namespace

std::vector<int32_t> ChooseSources(const std::vector<std::vector<int32_t>>& candidates,
                                   int sources) {
  std::vector<int32_t> choice(candidates.size(), -1);
  std::vector<int32_t> load(static_cast<size_t>(sources), 0);
  int cap = 1;
  for (size_t k = 0; k < candidates.size(); ++k) {
    const int read = static_cast<int>(k);
    while (true) {
      int32_t best = -1;
      for (int32_t s : candidates[k]) {  // ascending, so ties keep the lowest id
        if (load[s] < cap && (best < 0 || load[s] < load[best])) best = s;
      }
      if (best >= 0) {
        choice[k] = best;
        ++load[best];
        break;
      }
      if (Augment(read, cap, candidates, choice, load)) break;
      ++cap;  // no way to place this read under the cap: the cap itself is infeasible
    }
  }
  return choice;
}

}  // namespace eplbx::internal
