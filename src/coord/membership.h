// The membership rules of a group coordinated through a replicated key-value store (etcd):
// pure, no I/O (docs/deploy.md, "Coordination on etcd"). The driver (EtcdBootstrap) reads
// one consistent snapshot of the group's keys per poll and does what Decide() says; the
// random-world test (tests/unit/membership_test.cc) runs the same rules against a simulated
// linearizable store with ranks lost, stopped and coming back at any point.
//
// Keys under the group's prefix:
//   members/<rank>        a live process for the rank (written with its lease: it vanishes
//                         when the process stops renewing it)
//   view                  the epoch, and each member's incarnation (the create revision of
//                         its members/ key: a process started again for a rank is a new
//                         incarnation, first lost, then joining); replaced only by a
//                         compare-and-swap on its mod revision
//   round/<e>/<n>/<rank>  the rank's contribution to all-gather round n of epoch e
//   closed/<e>            written with the view that ends epoch e: T, the last round of
//                         epoch e that completed
// A round's outcome is decided once for everyone, with one write per member per round: while
// the view is epoch e's, round (e, n) succeeded once every member's contribution is there.
// The view that ends epoch e is written by a compare-and-swap on the view's revision that
// also requires the contributions still missing from the proposer's round n to be absent,
// and records T = n - 1 in closed/<e> (T = n when nothing is missing): so no round past T can
// have completed before the view moved, and every member, whenever it looks, decides round n of
// epoch e the same way (succeeded if every contribution is there under view e, or n <= T once the
// view moved). There is no fixed leader: whichever member sees a change first proposes the next
// view; the others' compare-and-swaps fail harmlessly. A process in no view yet (a joiner) proposes
// nothing: the members, polling every step, take it in.
#ifndef EPLBX_COORD_MEMBERSHIP_H_
#define EPLBX_COORD_MEMBERSHIP_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "eplbx/status.h"

namespace eplbx::coord {

struct View {
  uint64_t epoch = 0;
  std::vector<int64_t>
      incarnation;       // per rank: 0 no member, else its members/ key's create revision
  int64_t revision = 0;  // the view key's mod revision (what a compare-and-swap compares)
  std::vector<bool> members() const;
};

// "eplbx-view 1 <epoch> <incarnation per rank>"; DecodeView refuses anything else
// (kCorruption naming what is wrong: a key someone else wrote).
std::string EncodeView(const View& v);
Result<View> DecodeView(const std::string& value, uint32_t world, int64_t revision);

// One consistent read of the group's keys for round (epoch, n) of this rank.
struct Snapshot {
  std::optional<View> view;       // none: the group has no view yet (starting)
  std::vector<int64_t> alive;     // per rank: members/<rank>'s create revision, 0 absent
  std::vector<bool> contributed;  // round/<epoch>/<n>/<rank> present
  std::optional<int64_t> closed;  // closed/<epoch>: the last round of the epoch that completed
};

struct Decision {
  enum class Kind {
    kWait,         // nothing to do until the keys change
    kCreateView,   // write `view` (epoch 1, every rank) if none exists yet
    kProposeView,  // replace the view (compare its revision) with `next`
    kSucceeded,    // the round completed: read the contributions of view.members
    kAborted,      // the round failed: the member set changed (view says how)
    kLost,         // this rank is no member of the view any more: rejoin as a new process
  };
  Kind kind = Kind::kWait;
  View next;  // kCreateView, kProposeView
  // kProposeView: the last completed round of the epoch it ends (written to closed/<epoch>),
  // and the ranks whose contribution to this rank's round must still be absent.
  int64_t through = -1;
  std::vector<uint32_t> absent;
  std::string why;
};

// What rank `self` of `world` (whose members/ key has create revision `incarnation`) should
// do in round n of `epoch`, given `s`. kLost when its own key is gone or another
// process's (its lease ran out). `epoch` 0: the rank is in no view yet (it starts or
// joins); kSucceeded then means "the view includes this incarnation: adopt it". Member set
// changes are proposed in two kinds, losses first: members whose key is gone or belongs to
// another incarnation leave; then live processes of ranks outside the view join. The first
// view (epoch 1) is written once every rank of the world has a live process.
Decision Decide(uint32_t self, uint32_t world, int64_t incarnation, uint64_t epoch, uint64_t round,
                const Snapshot& s);

// "epoch 3, members 0, 2, 3" (for messages).
std::string DescribeView(const View& v);

}  // namespace eplbx::coord

#endif  // EPLBX_COORD_MEMBERSHIP_H_
