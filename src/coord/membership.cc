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

Decision Decide(uint32_t self, uint32_t world, int64_t incarnation, uint64_t epoch,
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
  if (epoch != 0 && s.done) {  // decisive, whatever the view says now
    d.kind = Decision::Kind::kSucceeded;
    return d;
  }
  if (epoch != 0 && v.epoch != epoch) {
    if (v.epoch < epoch) {
      d.why = StrCat("the view says epoch ", v.epoch, ", older than this rank's ", epoch);
      return d;  // kWait: views never go back; a stale read passes
    }
    d.kind = v.incarnation[self] == incarnation ? Decision::Kind::kAborted : Decision::Kind::kLost;
    d.why = StrCat("the member set changed: ", DescribeView(v), " (this rank was at epoch ", epoch,
                   ")");
    return d;
  }
  if (epoch == 0 && v.incarnation[self] == incarnation) {
    d.kind = Decision::Kind::kSucceeded;  // in the view: adopt it
    return d;
  }
  if (epoch != 0 && v.incarnation[self] != incarnation) {
    d.kind = Decision::Kind::kLost;
    d.why = StrCat("rank ", self, " was declared lost at ", DescribeView(v));
    return d;
  }
  // Losses first: a member whose key is gone, or belongs to another process now.
  View next = v;
  next.epoch = v.epoch + 1;
  bool lost = false;
  for (uint32_t r = 0; r < world; ++r) {
    if (v.incarnation[r] != 0 && alive(r) != v.incarnation[r]) {
      next.incarnation[r] = 0;
      lost = true;
    }
  }
  bool anyone = false;
  for (int64_t x : next.incarnation) anyone = anyone || x != 0;
  if (lost && anyone) {
    d.kind = Decision::Kind::kProposeView;
    d.next = next;
    d.why = "members lost";
    return d;
  }
  if (lost) {  // every member gone: the group ends (a new one starts with a new view)
    d.why = "every member of the view is gone";
    return d;
  }
  bool joins = false;
  for (uint32_t r = 0; r < world; ++r) {
    if (v.incarnation[r] == 0 && alive(r) != 0) {
      next.incarnation[r] = alive(r);
      joins = true;
    }
  }
  if (joins) {
    d.kind = Decision::Kind::kProposeView;
    d.next = next;
    d.why = "processes joining";
    return d;
  }
  if (epoch == 0) {
    d.why = "waiting to be taken into the view";
    return d;
  }
  for (uint32_t r = 0; r < world; ++r) {
    if (v.incarnation[r] != 0 && !(r < s.contributed.size() && s.contributed[r])) {
      d.why = StrCat("waiting for rank ", r, "'s contribution");
      return d;
    }
  }
  d.kind = Decision::Kind::kDeclareDone;
  return d;
}

}  // namespace eplbx::coord
