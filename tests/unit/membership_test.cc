// The membership rules of coordination on etcd (src/coord/membership.h), over thousands of
// random worlds: ranks as agents on a simulated linearizable key-value store (revisions,
// compare-and-swap), each taking a snapshot, deciding, and acting later (other agents act in
// between); ranks killed (their key expires some time later), stopped past their lease and
// resumed, restarted as new processes. What must hold in every world:
// - a round's outcome is one for everyone: every member that finishes round (e, n) sees the
//   same outcome, and on success the same contributions, one from every member of epoch e;
// - epochs only go forward, one view per epoch, each member set change by compare-and-swap;
// - with no more events, every live process ends in one view and completes rounds.
#include "coord/membership.h"

#include <gtest/gtest.h>

#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "common/strings.h"

namespace eplbx::coord {

using internal::StrCat;
namespace {

struct Kv {
  std::string value;
  int64_t create = 0, mod = 0;
};

struct Store {
  std::map<std::string, Kv> kv;
  int64_t revision = 1;
  void Put(const std::string& k, const std::string& v) {
    ++revision;
    auto it = kv.find(k);
    if (it == kv.end()) {
      kv[k] = {v, revision, revision};
    } else {
      it->second.value = v;
      it->second.mod = revision;
    }
  }
  int64_t Mod(const std::string& k) const {
    auto it = kv.find(k);
    return it == kv.end() ? 0 : it->second.mod;
  }
  void DeletePrefixBefore(const std::string& prefix, const std::string& end) {
    for (auto it = kv.lower_bound(prefix); it != kv.end() && it->first < end;) it = kv.erase(it);
  }
};

std::string Pad(uint64_t x, int width) {
  std::string s = std::to_string(x);
  return std::string(width > static_cast<int>(s.size()) ? width - s.size() : 0, '0') + s;
}
std::string MemberKey(uint32_t r) { return "members/" + Pad(r, 5); }
std::string RoundKey(uint64_t e, uint64_t n) {
  return "round/" + Pad(e, 10) + "/" + Pad(n, 12) + "/";
}
std::string ClosedKey(uint64_t e) { return "closed/" + Pad(e, 10); }

struct Agent {
  uint32_t rank = 0;
  int64_t incarnation = 0;
  bool running = true;   // false: killed or stopped
  bool stopped = false;  // stopped (will resume) rather than killed
  uint64_t epoch = 0;
  View view;  // adopted
  uint64_t n = 0;
  bool contributed = false;
  std::optional<Decision> pending;  // decided on a snapshot, acted on later
  Snapshot seen;
  std::vector<uint64_t> epochs;  // adopted, in order
  int64_t rounds_done = 0;
  bool lost = false;  // told it is no member any more
};

struct Outcome {
  bool succeeded = false;
  std::vector<std::string> contributions;  // per rank ("" for non-members)
};

class World {
 public:
  World(uint32_t size, uint64_t seed) : rng_(seed), size_(size) {
    for (uint32_t r = 0; r < size; ++r) Start(r);
  }

  void Start(uint32_t r) {
    store_.Put(MemberKey(r), "p");
    Agent a;
    a.rank = r;
    a.incarnation = store_.kv[MemberKey(r)].create;
    agents_.push_back(a);
  }

  Snapshot Read(const Agent& a) {
    Snapshot s;
    if (auto it = store_.kv.find("view"); it != store_.kv.end()) {
      Result<View> v = DecodeView(it->second.value, size_, it->second.mod);
      EXPECT_TRUE(v.ok()) << v.status().ToString();
      if (v.ok()) s.view = *v;
    }
    s.alive.assign(size_, 0);
    for (uint32_t r = 0; r < size_; ++r) {
      if (auto it = store_.kv.find(MemberKey(r)); it != store_.kv.end())
        s.alive[r] = it->second.create;
    }
    s.contributed.assign(size_, false);
    if (a.epoch != 0) {
      for (uint32_t r = 0; r < size_; ++r)
        s.contributed[r] = store_.kv.count(RoundKey(a.epoch, a.n) + Pad(r, 5)) > 0;
      if (auto it = store_.kv.find(ClosedKey(a.epoch)); it != store_.kv.end())
        s.closed = std::stoll(it->second.value);
    }
    return s;
  }

  // One move of agent i: contribute, or snapshot-and-decide, or act on the last decision.
  void Move(Agent& a) {
    if (!a.running || a.lost) return;
    if (a.epoch != 0 && !a.contributed) {
      store_.Put(RoundKey(a.epoch, a.n) + Pad(a.rank, 5),
                 StrCat(a.rank, "@", a.incarnation, ":", a.epoch, ":", a.n));
      a.contributed = true;
      return;
    }
    if (!a.pending) {
      a.seen = Read(a);
      a.pending = Decide(a.rank, size_, a.incarnation, a.epoch, a.n, a.seen);
      return;
    }
    // Acting on a decision takes a while (a request in flight): others move meanwhile.
    if (std::uniform_int_distribution<int>(0, 2)(rng_) != 0) return;
    const Decision d = *a.pending;
    a.pending.reset();
    switch (d.kind) {
      case Decision::Kind::kWait:
        break;
      case Decision::Kind::kCreateView:
        if (store_.kv.count("view") == 0) {
          store_.Put("view", EncodeView(d.next));
          ++views_written_;
        }
        break;
      case Decision::Kind::kProposeView: {
        // The compare-and-swap: the view unchanged and the missing contributions still absent.
        bool ok = store_.Mod("view") == a.seen.view->revision;
        for (uint32_t r : d.absent)
          ok = ok && store_.kv.count(RoundKey(a.epoch, a.n) + Pad(r, 5)) == 0;
        if (ok) {
          EXPECT_EQ(d.next.epoch, a.seen.view->epoch + 1);
          EXPECT_EQ(d.through, static_cast<int64_t>(a.n) - (d.absent.empty() ? 0 : 1));
          store_.Put("view", EncodeView(d.next));
          store_.Put(ClosedKey(a.epoch), std::to_string(d.through));
          ++views_written_;
        }
        break;
      }
      case Decision::Kind::kSucceeded: {
        if (a.epoch == 0) {  // taken into the view
          Adopt(a, *a.seen.view);
          break;
        }
        Outcome o;
        o.succeeded = true;
        o.contributions.assign(size_, "");
        bool complete = true;
        const std::vector<bool> members = a.view.members();
        for (uint32_t r = 0; r < size_; ++r) {
          if (!members[r]) continue;
          auto it = store_.kv.find(RoundKey(a.epoch, a.n) + Pad(r, 5));
          if (it == store_.kv.end()) {
            complete = false;
            break;
          }
          o.contributions[r] = it->second.value;
        }
        if (!complete) {  // cleaned up: only possible for a rank the others left behind
          a.lost = true;
          break;
        }
        Record(a, o);
        // The lowest member cleans everything before this round (everyone is past it).
        if (a.rank == FirstMember(a.view)) {
          store_.DeletePrefixBefore("round/", RoundKey(a.epoch, a.n));
          store_.DeletePrefixBefore("closed/", ClosedKey(a.epoch));
        }
        ++a.n;
        a.contributed = false;
        ++a.rounds_done;
        break;
      }
      case Decision::Kind::kAborted:
        Record(a, Outcome{});
        Adopt(a, *a.seen.view);
        break;
      case Decision::Kind::kLost:
        a.lost = true;
        break;
    }
  }

  void Adopt(Agent& a, const View& v) {
    if (!a.epochs.empty()) {
      EXPECT_GT(v.epoch, a.epochs.back()) << "rank " << a.rank;
    }
    a.epochs.push_back(v.epoch);
    a.epoch = v.epoch;
    a.view = v;
    a.n = 0;
    a.contributed = false;
  }

  static uint32_t FirstMember(const View& v) {
    for (uint32_t r = 0; r < v.incarnation.size(); ++r)
      if (v.incarnation[r] != 0) return r;
    return 0;
  }

  void Record(const Agent& a, const Outcome& o) {
    const auto key = std::make_pair(a.epoch, a.n);
    auto it = outcomes_.find(key);
    if (it == outcomes_.end()) {
      outcomes_[key] = o;
      return;
    }
    EXPECT_EQ(it->second.succeeded, o.succeeded)
        << "round " << a.epoch << "/" << a.n << ": rank " << a.rank << " saw another outcome";
    if (o.succeeded && it->second.succeeded) {
      EXPECT_EQ(it->second.contributions, o.contributions) << "round " << a.epoch << "/" << a.n;
    }
  }

  // Random events and moves; then quiet until everyone live is settled.
  void Run(int moves, int events) {
    std::vector<int> event_at;
    for (int i = 0; i < events; ++i)
      event_at.push_back(std::uniform_int_distribution<int>(0, moves)(rng_));
    std::sort(event_at.begin(), event_at.end());
    size_t next_event = 0;
    for (int m = 0; m < moves; ++m) {
      while (next_event < event_at.size() && event_at[next_event] == m) {
        Event();
        ++next_event;
      }
      Expire();
      Agent& a = agents_[std::uniform_int_distribution<size_t>(0, agents_.size() - 1)(rng_)];
      Move(a);
    }
    // Quiet: expiries happen, stopped processes resume, lost ones restart; then progress.
    for (auto& [key, at] : expiry_) at = 0;
    Expire();
    for (Agent& a : agents_) {
      if (a.stopped) {
        a.running = true;
        a.stopped = false;
      }
    }
    std::vector<int64_t> start(agents_.size());
    for (size_t i = 0; i < agents_.size(); ++i) start[i] = agents_[i].rounds_done;
    for (int m = 0; m < 40000; ++m) {
      // A process told it is no member any more is replaced by a new one for its rank.
      for (size_t i = 0; i < agents_.size(); ++i) {
        if (agents_[i].lost && agents_[i].running) {
          agents_[i].running = false;
          if (RunningFor(agents_[i].rank) == 0) {
            Start(agents_[i].rank);
            start.push_back(0);
          }
        }
      }
      bool all = true;
      for (size_t i = 0; i < agents_.size(); ++i) {
        const Agent& a = agents_[i];
        if (a.running && !a.lost && a.rounds_done - start[i] < 3) all = false;
      }
      if (all) break;
      Agent& a = agents_[std::uniform_int_distribution<size_t>(0, agents_.size() - 1)(rng_)];
      Move(a);
    }
    // Everyone live completed rounds, in one view.
    std::set<uint64_t> epochs;
    int live = 0;
    for (size_t i = 0; i < agents_.size(); ++i) {
      const Agent& a = agents_[i];
      if (!a.running || a.lost) continue;
      ++live;
      EXPECT_GE(a.rounds_done - start[i], 3)
          << "rank " << a.rank << " made no progress (epoch " << a.epoch << "): " << Story(a);
      epochs.insert(a.epoch);
    }
    EXPECT_LE(epochs.size(), 1u);
    EXPECT_GE(live, 1);
  }

 private:
  std::string Story(const Agent& me) {
    std::string out =
        StrCat("incarnation ", me.incarnation,
               "; view: ", store_.kv.count("view") ? store_.kv["view"].value : "none", "; keys:");
    for (const auto& [k, v] : store_.kv) out += StrCat(" ", k, "@", v.create);
    out += "; agents:";
    for (const Agent& a : agents_) {
      out += StrCat(" [rank ", a.rank, " inc ", a.incarnation, a.running ? " running" : "",
                    a.lost ? " lost" : "", a.stopped ? " stopped" : "", " epoch ", a.epoch, "]");
    }
    const Decision d = Decide(me.rank, size_, me.incarnation, me.epoch, me.n, Read(me));
    return out + StrCat("; decides ", static_cast<int>(d.kind), " ", d.why);
  }
  int RunningFor(uint32_t rank) const {
    int n = 0;
    for (const Agent& a : agents_) n += a.rank == rank && a.running;
    return n;
  }

  void Event() {
    std::vector<size_t> live;
    int members = 0;  // running processes in a view
    for (size_t i = 0; i < agents_.size(); ++i) {
      if (agents_[i].running && !agents_[i].lost) live.push_back(i);
      members += agents_[i].running && !agents_[i].lost && agents_[i].epoch != 0;
    }
    if (live.size() <= 1 || members <= 1) return;  // keep a member serving: the group goes on
    Agent& a = agents_[live[std::uniform_int_distribution<size_t>(0, live.size() - 1)(rng_)]];
    const int kind = std::uniform_int_distribution<int>(0, 2)(rng_);
    // Its lease runs out some moves later (0: at once).
    expiry_[a.rank] = std::uniform_int_distribution<int>(0, 60)(rng_);
    a.running = false;
    if (kind == 1) a.stopped = true;  // resumes later (then finds it was declared lost)
    if (kind == 2) restart_.push_back(a.rank);
  }

  void Expire() {
    for (auto it = expiry_.begin(); it != expiry_.end();) {
      if (it->second-- <= 0) {
        store_.kv.erase(MemberKey(it->first));
        ++store_.revision;
        for (uint32_t r : restart_) {
          if (r == it->first && RunningFor(r) == 0) Start(r);  // a new process for the rank
        }
        restart_.erase(std::remove(restart_.begin(), restart_.end(), it->first), restart_.end());
        it = expiry_.erase(it);
      } else {
        ++it;
      }
    }
  }

  std::mt19937_64 rng_;
  uint32_t size_;
  Store store_;
  std::vector<Agent> agents_;
  std::map<uint32_t, int> expiry_;
  std::vector<uint32_t> restart_;
  std::map<std::pair<uint64_t, uint64_t>, Outcome> outcomes_;
  int views_written_ = 0;
};

TEST(MembershipTest, ViewsRoundTripAndForeignValuesAreRefusedByName) {
  View v;
  v.epoch = 7;
  v.incarnation = {5, 0, 9};
  Result<View> back = DecodeView(EncodeView(v), 3, 42);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->epoch, 7u);
  EXPECT_EQ(back->incarnation, v.incarnation);
  EXPECT_EQ(back->revision, 42);
  EXPECT_EQ(DescribeView(*back), "epoch 7, members 0, 2");
  for (const char* bad : {"", "garbage", "eplbx-view 2 1 1 1 1", "eplbx-view 1 0 1 1 1",
                          "eplbx-view 1 3 1 1", "eplbx-view 1 3 1 1 1 1", "eplbx-view 1 3 0 0 0",
                          "eplbx-view 1 3 1 -4 1", "eplbx-view 1 3 1 x 1"}) {
    Result<View> got = DecodeView(bad, 3, 9);
    ASSERT_FALSE(got.ok()) << bad;
    EXPECT_EQ(got.status().code(), Code::kCorruption) << bad;
    EXPECT_NE(got.status().message().find("revision 9"), std::string::npos)
        << got.status().ToString();
  }
}

TEST(MembershipTest, LossesComeBeforeJoinsAndARestartedProcessIsANewIncarnation) {
  Snapshot s;
  View v;
  v.epoch = 4;
  v.incarnation = {10, 11, 12};
  v.revision = 50;
  s.view = v;
  s.alive = {10, 30, 0};  // rank 1 restarted (new key), rank 2 gone
  Decision d = Decide(0, 3, 10, 4, 7, s);
  ASSERT_EQ(d.kind, Decision::Kind::kProposeView) << d.why;
  EXPECT_EQ(d.next.epoch, 5u);
  EXPECT_EQ(d.next.incarnation, (std::vector<int64_t>{10, 0, 0}));
  EXPECT_EQ(d.through, 6);  // round 7 had not completed
  EXPECT_EQ(d.absent, (std::vector<uint32_t>{0, 1, 2}));
  s.view = d.next;
  d = Decide(0, 3, 10, 5, 0, s);  // then the new process joins
  ASSERT_EQ(d.kind, Decision::Kind::kProposeView) << d.why;
  EXPECT_EQ(d.next.incarnation, (std::vector<int64_t>{10, 30, 0}));
  // The old process of rank 1, resumed, learns it was declared lost.
  s.alive[1] = 11;  // (its key as it was)
  s.closed = 6;
  EXPECT_EQ(Decide(1, 3, 11, 4, 7, s).kind, Decision::Kind::kLost);
  EXPECT_EQ(Decide(1, 3, 11, 4, 6, s).kind, Decision::Kind::kSucceeded);  // done before
}

TEST(MembershipTest, ARoundsOutcomeIsOneForEveryoneOverRandomWorlds) {
  for (uint64_t seed = 0; seed < 3000; ++seed) {
    SCOPED_TRACE(StrCat("seed ", seed));
    std::mt19937_64 pick(seed);
    const uint32_t size = std::uniform_int_distribution<uint32_t>(1, 6)(pick);
    const int events = std::uniform_int_distribution<int>(0, 4)(pick);
    World w(size, seed);
    w.Run(std::uniform_int_distribution<int>(50, 2000)(pick), events);
    if (::testing::Test::HasFailure()) break;
  }
}

}  // namespace
}  // namespace eplbx::coord
