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
//   done/<e>/<n>          round (e, n) complete: written only by a compare-and-swap that
//                         the view is still the one of epoch e
// A round's outcome is decided once for everyone: it succeeded if and only if done/<e>/<n>
// exists. done can only be written while the view is epoch e's; once the view moved on it
// can never be written, so a member that finds the view moved and no done key knows the
// round failed for every member. There is no fixed leader: whichever member sees a change
// first writes the new view or the done key; the others' compare-and-swaps fail harmlessly.
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
  bool done = false;              // done/<epoch>/<n> present
};

struct Decision {
  enum class Kind {
    kWait,         // nothing to do until the keys change
    kCreateView,   // write `view` (epoch 1, every rank) if none exists yet
    kProposeView,  // replace the view (compare its revision) with `next`
    kDeclareDone,  // write done/<epoch>/<n> (compare the view's revision)
    kSucceeded,    // the round completed: read the contributions of view.members
    kAborted,      // the round failed: the member set changed (view says how)
    kLost,         // this rank is no member of the view any more: rejoin as a new process
  };
  Kind kind = Kind::kWait;
  View next;  // kCreateView, kProposeView
  std::string why;
};

// What rank `self` of `world` (whose members/ key has create revision `incarnation`) should
// do in round n of `epoch`, given `s`. kLost when its own key is gone or another
// process's (its lease ran out). `epoch` 0: the rank is in no view yet (it starts or
// joins); kSucceeded then means "the view includes this incarnation: adopt it". Member set
// changes are proposed in two kinds, losses first: members whose key is gone or belongs to
// another incarnation leave; then live processes of ranks outside the view join. The first
// view (epoch 1) is written once every rank of the world has a live process.
Decision Decide(uint32_t self, uint32_t world, int64_t incarnation, uint64_t epoch,
                const Snapshot& s);

// "epoch 3, members 0, 2, 3" (for messages).
std::string DescribeView(const View& v);

}  // namespace eplbx::coord

#endif  // EPLBX_COORD_MEMBERSHIP_H_
