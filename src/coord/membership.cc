#include "coord/membership.h"

#include <sstream>

#include "common/strings.h"

namespace eplbx::coord {

using internal::StrCat;

std::vector<bool> View::members() const {
  std::vector<bool> m(incarnation.size());
  for (size_t r = 0; r < m.size(); ++r) m[r] = incarnation[r] != 0;
  return m;
}

std::string EncodeView(const View& v) {
  std::string out = StrCat("eplbx-view 1 ", v.epoch);
  for (int64_t x : v.incarnation) out += StrCat(" ", x);
  return out;
}

Result<View> DecodeView(const std::string& value, uint32_t world, int64_t revision) {
  auto bad = [&](const std::string& why) {
    return Status::Corruption(StrCat("the group's view (revision ", revision, ") ", why, ": '",
                                     value.substr(0, 80), "'; was it written by eplbx?"));
  };
  if (value.size() > 64 + 21 * static_cast<size_t>(world)) return bad("is too long");
  std::istringstream in(value);
  std::string magic;
  int version = 0;
  View v;
  v.revision = revision;
  if (!(in >> magic >> version) || magic != "eplbx-view" || version != 1)
    return bad("does not start with 'eplbx-view 1'");
  long long epoch = 0;
  if (!(in >> epoch) || epoch < 1) return bad("has no epoch >= 1");
  v.epoch = static_cast<uint64_t>(epoch);
  for (uint32_t r = 0; r < world; ++r) {
    long long x = -1;
    if (!(in >> x) || x < 0) return bad(StrCat("has no incarnation >= 0 for rank ", r));
    v.incarnation.push_back(x);
  }
  std::string rest;
  if (in >> rest) return bad(StrCat("names more than ", world, " ranks"));
  bool any = false;
  for (int64_t x : v.incarnation) any = any || x != 0;
  if (!any) return bad("has no member");
  return v;
}

std::string DescribeView(const View& v) {
  std::string out = StrCat("epoch ", v.epoch, ", members ");
  bool first = true;
  for (size_t r = 0; r < v.incarnation.size(); ++r) {
    if (v.incarnation[r] == 0) continue;
    out += StrCat(first ? "" : ", ", r);
    first = false;
  }
  return first ? out + "none" : out;
}

Decision Decide(uint32_t self, uint32_t world, int64_t incarnation, uint64_t epoch, uint64_t round,
                const Snapshot& s) {
  Decision d;
  auto alive = [&](uint32_t r) { return r < s.alive.size() ? s.alive[r] : int64_t{0}; };
  if (alive(self) != incarnation) {  // this process's lease ran out (it was stopped, cut off)
    d.kind = Decision::Kind::kLost;
    d.why = StrCat("rank ", self, "'s lease expired (its key is gone or another process's)");
    return d;
  }
  if (!s.view) {
    View first;
    first.epoch = 1;
    for (uint32_t r = 0; r < world; ++r) {
      if (alive(r) == 0) {
        d.why = StrCat("waiting for rank ", r, " to start");
        return d;  // kWait
      }
      first.incarnation.push_back(alive(r));
    }
    d.kind = Decision::Kind::kCreateView;
    d.next = first;
    return d;
  }
  const View& v = *s.view;
  if (epoch == 0) {  // in no view yet: adopt one that takes this process in, else wait
    if (v.incarnation[self] == incarnation) d.kind = Decision::Kind::kSucceeded;
    d.why = "waiting to be taken into the view";
    return d;
  }
  if (v.epoch != epoch) {
    if (v.epoch < epoch || !s.closed) {
      d.why = StrCat("the view says epoch ", v.epoch, " but epoch ", epoch,
                     v.epoch < epoch ? " is this rank's" : " has no closing round");
      return d;  // kWait: views never go back, and a view change writes closed/ with it
    }
    if (static_cast<int64_t>(round) <= *s.closed) {
      d.kind = Decision::Kind::kSucceeded;  // completed before the view moved
      return d;
    }
    d.kind = v.incarnation[self] == incarnation ? Decision::Kind::kAborted : Decision::Kind::kLost;
    d.why = StrCat("the member set changed: ", DescribeView(v), " (this rank was at epoch ", epoch,
                   ")");
    return d;
  }
  if (v.incarnation[self] != incarnation) {
    d.kind = Decision::Kind::kLost;
    d.why = StrCat("rank ", self, " was declared lost at ", DescribeView(v));
    return d;
  }
  std::vector<uint32_t> absent;
  for (uint32_t r = 0; r < world; ++r) {
    if (v.incarnation[r] != 0 && !(r < s.contributed.size() && s.contributed[r]))
      absent.push_back(r);
  }
  // Losses first: a member whose key is gone, or belongs to another process now.
  View next = v;
  next.epoch = v.epoch + 1;
  bool lost = false, joins = false;
  for (uint32_t r = 0; r < world; ++r) {
    if (v.incarnation[r] != 0 && alive(r) != v.incarnation[r]) {
      next.incarnation[r] = 0;
      lost = true;
    }
  }
  if (!lost) {
    for (uint32_t r = 0; r < world; ++r) {
      if (v.incarnation[r] == 0 && alive(r) != 0) {
        next.incarnation[r] = alive(r);
        joins = true;
      }
    }
  }
  if (lost || joins) {
    d.kind = Decision::Kind::kProposeView;
    d.next = next;
    // This round completed if nothing is missing; else it ends with the view.
    d.through = static_cast<int64_t>(round) - (absent.empty() ? 0 : 1);
    d.absent = std::move(absent);
    d.why = lost ? "members lost" : "processes joining";
    return d;
  }
  if (absent.empty()) {  // every member's contribution is there under this view
    d.kind = Decision::Kind::kSucceeded;
    return d;
  }
  d.why = StrCat("waiting for rank ", absent.front(), "'s contribution");
  return d;
}

}  // namespace eplbx::coord
