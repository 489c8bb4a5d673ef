// Internal: choosing a source for every remote read so that the most reads any source
// serves is as small as possible (a min-max bipartite b-matching).
#ifndef EPLBX_SRC_PLAN_SOURCE_CHOICE_H_
#define EPLBX_SRC_PLAN_SOURCE_CHOICE_H_

#include <cstdint>
#include <vector>

namespace eplbx::internal {

// candidates[k]: the sources read k may use, ascending, non-empty. `sources` bounds the ids.
// Returns the chosen source of every read. The largest number of reads assigned to any
// source is the minimum possible. Reads are taken in order; each goes to the candidate
// serving the fewest reads so far that is below the current cap (ties: lowest id); when
// all are at the cap, an augmenting path (breadth-first, candidates ascending) moves
// earlier reads to make room; only when none exists is the cap raised. Deterministic.
std::vector<int32_t> ChooseSources(const std::vector<std::vector<int32_t>>& candidates,
                                   int sources);

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_PLAN_SOURCE_CHOICE_H_
