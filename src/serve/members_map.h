// Internal: the members' map exchange after a member-set change (docs/deploy.md, "After a
// lost rank", step 3): each member sends the step it is at (a joiner: none), whether its last
// placement over the members succeeded and at which epoch (0: none yet), and what its own
// slots hold (a lost rank may have voted a layer ready to some survivors only, or a move may
// have stopped half way: each member vouches for its own slots). The placement in force is
// assembled from them. The bytes come from peers: versioned, every length and value checked
// (fuzz_members_map).
//
// Format (little-endian): u8 version 2, u32 step + 1 (0: a joiner), u64 placed_at, u32 n,
// then n i32 experts (-1: an empty slot), layer by layer, the member's rows in order; then
// u32 w (0, or layers x experts) and w f64 window loads (the member's Balancer window: a
// joiner has none; the lowest member's is the one every member plans from, so a joiner
// plans as the members do); then u32 b (0, or layers x experts) and b bytes, 1 where the
// member's backups hold that (layer, expert) (0: none held). An expert counts as
// recoverable only when every member's backups hold it: every member plans the same, and
// whichever member the plan has restore it can.
#ifndef EPLBX_SRC_SERVE_MEMBERS_MAP_H_
#define EPLBX_SRC_SERVE_MEMBERS_MAP_H_

#include <cstdint>
#include <string>
#include <vector>

#include "eplbx/placement.h"
#include "eplbx/status.h"

namespace eplbx::internal {

// `step` -1: a joiner. `own`: layers x rows, what this member's slots hold.
// `window`: layers x experts loads, or empty; `backed`: layers x experts flags, or empty.
std::string EncodeMembersMap(int step, uint64_t placed_at, const std::vector<int32_t>& own,
                             const std::vector<double>& window = {},
                             const std::vector<uint8_t>& backed = {});

struct MembersRound {
  Placement in_force;  // assembled from every member's own slots
  int step = -1;       // the members' (they are in step: the step's collective)
  bool all_placed = true;
  uint64_t placed_at = 0;       // the epoch they all placed at (when all_placed)
  std::string not_placed;       // "rank 2" of those that did not
  std::vector<double> window;   // the lowest member's that sent one (empty: none did)
  std::vector<uint8_t> backed;  // layers x experts: 1 where every member's backups hold it
};

// Decodes an all-gather of EncodeMembersMap blobs, one per rank of the group (empty: not a
// member), each member holding `rows` slots of each of `layers` layers of `experts` experts.
// A malformed or inconsistent blob (version, size, a step beyond 2^31, an expert out of
// range, a load that is negative or not finite, members not in step) is a named Corruption or
// Internal error.
Result<MembersRound> DecodeMembersRound(const std::vector<std::string>& all, int layers, int rows,
                                        int experts);

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_SERVE_MEMBERS_MAP_H_
