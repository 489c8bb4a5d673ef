#include <algorithm>
#include <cctype>
#include <cinttypes>
#include <cstdio>
#include <limits>
#include <random>

#include "common/numbers.h"
#include "common/strings.h"
#include "coord/etcd_client.h"
#include "coord/membership.h"
#include "eplbx/etcd.h"

namespace eplbx {

using internal::StrCat;

namespace {

using coord::Decision;
using coord::EtcdCompare;
using coord::EtcdOp;

// The most comparisons one etcd transaction takes (its --max-txn-ops, 128 by default).
constexpr size_t kMaxCompares = 128;

std::string Pad(uint64_t x, int width) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%0*" PRIu64, width, x);
  return buf;
}

bool Digits(std::string_view s, size_t n) {
  return s.size() == n &&
         std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// "rank 2 left", "ranks 1, 3 joined; rank 2 left"
std::string Change(const std::vector<int64_t>& before, const std::vector<int64_t>& after) {
  std::vector<size_t> left, joined;
  for (size_t r = 0; r < before.size() && r < after.size(); ++r) {
    if (before[r] != 0 && after[r] != before[r]) left.push_back(r);
    if (after[r] != 0 && after[r] != before[r]) joined.push_back(r);
  }
  auto list = [](const std::vector<size_t>& v, const char* what) {
    std::string out = v.size() == 1 ? "rank " : "ranks ";
    for (size_t i = 0; i < v.size(); ++i) out += StrCat(i ? ", " : "", v[i]);
    return out + " " + what;
  };
  std::string out;
  if (!left.empty()) out = list(left, "left");
  if (!joined.empty()) out += (out.empty() ? "" : "; ") + list(joined, "joined");
  return out.empty() ? "the member set changed" : out;
}

// The rank a key under `prefix` names ("<prefix>00003"), or kCorruption naming the key (a key
// under the group's prefix that eplbx did not write).
Result<uint32_t> RankOfKey(const std::string& key, const std::string& prefix, uint32_t world,
                           const std::string& who) {
  const std::string rest = key.substr(std::min(prefix.size(), key.size()));
  if (!Digits(rest, 5) || std::stoul(rest) >= world) {
    return Status::Corruption(
        StrCat(who, ": a key under the group's prefix that eplbx did not write: '", key, "'"));
  }
  return static_cast<uint32_t>(std::stoul(rest));
}

// The view and the live processes of a snapshot whose first two reads are the view key and
// the members/ prefix. Returns the view's revision (0: no view yet).
Result<int64_t> ReadMembership(const coord::EtcdTxnResult& snap, const std::string& members,
                               uint32_t world, const std::string& who, coord::Snapshot* s) {
  s->alive.assign(world, 0);
  int64_t revision = 0;
  if (!snap.ranges[0].kvs.empty()) {
    revision = snap.ranges[0].kvs[0].mod_revision;
    EPLBX_ASSIGN_OR_RETURN(coord::View v,
                           coord::DecodeView(snap.ranges[0].kvs[0].value, world, revision));
    s->view = std::move(v);
  }
  for (const coord::EtcdKv& kv : snap.ranges[1].kvs) {
    EPLBX_ASSIGN_OR_RETURN(uint32_t r, RankOfKey(kv.key, members, world, who));
    s->alive[r] = kv.create_revision;
  }
  return revision;
}

// Calls `f` until it gives something other than kUnavailable (no etcd member answered: an
// election, a member restarting) or `deadline` passes.
template <typename F>
auto UntilAnswered(F f, std::chrono::steady_clock::time_point deadline) -> decltype(f()) {
  for (;;) {
    auto r = f();
    if (r.ok() || r.status().code() != Code::kUnavailable ||
        std::chrono::steady_clock::now() >= deadline) {
      return r;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

}  // namespace

Result<std::vector<std::string>> ParseEtcdUrl(const std::string& url) {
  const std::string scheme = "etcd://";
  if (url.rfind(scheme, 0) != 0) {
    return Status::InvalidArgument(
        StrCat("coordination '", url, "' is not etcd://HOST:PORT[,HOST:PORT...]"));
  }
  std::vector<std::string> out;
  std::string rest = url.substr(scheme.size());
  for (size_t at = 0; at <= rest.size();) {
    const size_t comma = std::min(rest.find(',', at), rest.size());
    std::string e = rest.substr(at, comma - at);
    const size_t colon = e.rfind(':');
    int port = 0;
    if (colon == std::string::npos || colon == 0 ||
        !Digits(e.substr(colon + 1), e.size() - colon - 1) || e.size() - colon - 1 > 5 ||
        (port = std::stoi(e.substr(colon + 1))) < 1 || port > 65535 ||
        e.find_first_of("/?#@ ") != std::string::npos) {
      return Status::InvalidArgument(StrCat("coordination '", url, "': endpoint '", e,
                                            "' is not HOST:PORT (e.g. 10.0.0.5:2379)"));
    }
    out.push_back(e);
    at = comma + 1;
  }
  return out;
}

Result<std::unique_ptr<EtcdBootstrap>> EtcdBootstrap::Join(uint32_t rank, uint32_t world,
                                                           EtcdOptions options) {
  if (world == 0 || world > 65536 || rank >= world) {
    return Status::InvalidArgument(StrCat("etcd: rank ", rank, " of a group of ", world, " ranks"));
  }
  if (options.group.empty() || options.group.size() > 64 ||
      !std::all_of(options.group.begin(), options.group.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.';
      })) {
    return Status::InvalidArgument(StrCat("etcd: group name '", options.group,
                                          "' must be 1-64 letters, digits, '-', '_' or '.'"));
  }
  if (options.token.empty()) return Status::InvalidArgument("etcd: the group's token is empty");
  if (options.lease.count() < 1) return Status::InvalidArgument("etcd: the lease must be >= 1 s");
  std::unique_ptr<EtcdBootstrap> b(new EtcdBootstrap());
  b->rank_ = rank;
  b->world_ = world;
  b->options_ = std::move(options);
  b->prefix_ = StrCat("/eplbx/", b->options_.group, "/");
  b->members_.assign(world, false);
  EPLBX_RETURN_IF_ERROR(b->Start());
  return b;
}

Status EtcdBootstrap::Start() {
  EPLBX_ASSIGN_OR_RETURN(client_,
                         coord::EtcdClient::Create(options_.endpoints, options_.request_timeout));
  EPLBX_ASSIGN_OR_RETURN(renew_client_,
                         coord::EtcdClient::Create(options_.endpoints, options_.request_timeout));
  EPLBX_ASSIGN_OR_RETURN(watch_client_,
                         coord::EtcdClient::Create(options_.endpoints, options_.request_timeout));
  // The watch: every key of the group but the contributions (`closed/`, `done`, `epoch`,
  // `identity`, `members/` sort before `round/`): a member's key gone or come, a view
  // written, a round completed. A stream from now on, created again every 10 s and on the
  // next member when one goes away; waits end when it has seen something.
  watch_ = std::thread([this] {
    auto seen = [this](const coord::EtcdWatchMessage& m) {
      if (m.created || m.changed) {
        std::lock_guard<std::mutex> lock(seen_mu_);
        seen_ = std::max(seen_, m.revision);
        seen_cv_.notify_all();
      }
      return !stop_;
    };
    while (!stop_) {
      if (!watch_client_->Watch(prefix_, Key("round/"), seen, std::chrono::seconds(10)).ok()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
  });
  const std::string who = StrCat("rank ", rank_, " of group '", options_.group, "'");
  // The group's token and size: written by the first process, checked by every other.
  const std::string identity = StrCat(world_, " ", options_.token);
  EPLBX_ASSIGN_OR_RETURN(
      coord::EtcdTxnResult t,
      client_->Txn({coord::VersionIs(Key("identity"), 0)},
                   {coord::PutOp(Key("identity"), identity)}, {coord::RangeOp(Key("identity"))}));
  if (!t.succeeded &&
      (t.ranges.empty() || t.ranges[0].kvs.empty() || t.ranges[0].kvs[0].value != identity)) {
    const std::string theirs =
        t.ranges.empty() || t.ranges[0].kvs.empty() ? "" : t.ranges[0].kvs[0].value;
    const size_t space = theirs.find(' ');
    if (space != std::string::npos && theirs.substr(0, space) != std::to_string(world_)) {
      return Status::InvalidArgument(StrCat(who, ": the group has ", theirs.substr(0, space),
                                            " ranks, this process says ", world_));
    }
    return Status::InvalidArgument(
        StrCat(who,
               ": another token is in use for this group (a different deployment under the "
               "same group name? choose another --group)"));
  }
  EPLBX_ASSIGN_OR_RETURN(lease_, client_->LeaseGrant(options_.lease.count()));
  // Our key: created only where no live process holds the rank (an old one's lease may still
  // run out: wait for it).
  const auto start_deadline = std::chrono::steady_clock::now() + options_.start_timeout;
  std::mt19937_64 rng(std::random_device{}());
  const std::string nonce = StrCat(rng());
  const std::string me = Key(StrCat("members/", Pad(rank_, 5)));
  for (;;) {
    EPLBX_ASSIGN_OR_RETURN(
        coord::EtcdTxnResult put,
        client_->Txn({coord::VersionIs(me, 0)}, {coord::PutOp(me, nonce, lease_)}));
    if (put.succeeded) {
      incarnation_ = put.revision;  // the key's create revision
      break;
    }
    if (std::chrono::steady_clock::now() > start_deadline) {
      (void)client_->LeaseRevoke(lease_);
      return Status::Unavailable(
          StrCat(who, ": another live process holds the rank (its key stayed for ",
                 options_.start_timeout.count(), " ms; two processes for one rank?)"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  renew_ = std::thread([this] {
    const auto every = std::max<std::chrono::milliseconds>(
        std::chrono::milliseconds(100),
        std::chrono::duration_cast<std::chrono::milliseconds>(options_.lease) / 3);
    while (!stop_) {
      for (auto slept = std::chrono::milliseconds(0); slept < every && !stop_;
           slept += std::chrono::milliseconds(20)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      if (stop_ || !renewing_) continue;
      Result<int64_t> ttl = renew_client_->LeaseKeepAlive(lease_);
      if (!ttl.ok() && ttl.status().code() == Code::kNotFound) expired_ = true;
    }
  });
  // Into a view: the first one (every rank started), or the group's under way as a joiner.
  for (;;) {
    if (std::chrono::steady_clock::now() > start_deadline) {
      return Status::Timeout(
          StrCat(who, ": not in the group's view after ", options_.start_timeout.count(), " ms"));
    }
    std::vector<EtcdOp> reads = {
        coord::RangeOp(Key("epoch")),
        coord::RangeOp(Key("members/"), coord::PrefixEnd(Key("members/")))};
    EPLBX_ASSIGN_OR_RETURN(coord::EtcdTxnResult snap,
                           UntilAnswered([&] { return client_->Txn({}, reads); }, start_deadline));
    if (snap.ranges.size() != 2)
      return Status::Corruption(StrCat(who, ": a snapshot without its reads"));
    coord::Snapshot s;
    EPLBX_RETURN_IF_ERROR(ReadMembership(snap, Key("members/"), world_, who, &s).status());
    const Decision d = coord::Decide(rank_, world_, incarnation_, 0, 0, s);
    switch (d.kind) {
      case Decision::Kind::kSucceeded:
        epoch_ = s.view->epoch;
        view_ = s.view->incarnation;
        members_ = s.view->members();
        round_ = 0;
        joining_ = s.view->epoch != 1;
        return Status::OK();
      case Decision::Kind::kCreateView:
        EPLBX_RETURN_IF_ERROR(client_
                                  ->Txn({coord::VersionIs(Key("epoch"), 0)},
                                        {coord::PutOp(Key("epoch"), coord::EncodeView(d.next))})
                                  .status());
        continue;
      case Decision::Kind::kLost:
        return Status::Unavailable(StrCat(who, ": ", d.why, "; start a new process"));
      default:  // waiting for every rank to start, or for the members to take it in
        WaitPast(snap.revision, start_deadline);
    }
  }
}

void EtcdBootstrap::WaitPast(int64_t revision, std::chrono::steady_clock::time_point deadline) {
  ++stats_.waits;
  std::unique_lock<std::mutex> lock(seen_mu_);
  seen_cv_.wait_until(
      lock, std::min(deadline, std::chrono::steady_clock::now() + std::chrono::seconds(1)),
      [&] { return seen_ > revision; });
}

EtcdBootstrap::~EtcdBootstrap() {
  stop_ = true;
  if (renew_.joinable()) renew_.join();
  if (client_ && lease_ != 0 && renewing_) (void)client_->LeaseRevoke(lease_);
  if (watch_client_) watch_client_->StopWatch();
  if (watch_.joinable()) watch_.join();
}

void EtcdBootstrap::StopRenewing() { renewing_ = false; }

Result<std::vector<std::string>> EtcdBootstrap::AllGather(std::string_view mine,
                                                          std::chrono::milliseconds timeout) {
  if (!failed_.ok()) return failed_;
  Result<std::vector<std::string>> r = Round(mine, timeout);
  // A round that ended without an outcome (etcd unreachable past the deadline, a round never
  // completed) leaves this process out of step with the others: it takes part no more.
  if (!r.ok() && r.status().code() != Code::kAborted) {
    failed_ = r.status().WithPrefix("an earlier all-gather failed (restart the process to rejoin)");
  }
  return r;
}

Result<std::vector<std::string>> EtcdBootstrap::Round(std::string_view mine,
                                                      std::chrono::milliseconds timeout) {
  const std::string who = StrCat("rank ", rank_, " of group '", options_.group, "'");
  if (expired_) {
    return Status::Unavailable(StrCat(
        who,
        ": its lease expired (the process was stopped or cut "
        "off for longer than ",
        options_.lease.count(), " s) and it was declared lost; start a new process to rejoin"));
  }
  const std::string round = Key(StrCat("round/", Pad(epoch_, 10), "/", Pad(round_, 12), "/"));
  const std::string closed = Key(StrCat("closed/", Pad(epoch_, 10)));
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const std::string contribution(mine);
  std::string waiting;
  for (uint64_t polls = 0;; ++polls) {
    if (std::chrono::steady_clock::now() > deadline) {
      return Status::Timeout(StrCat(who, ": all-gather round ", round_, " of epoch ", epoch_,
                                    " not complete after ", timeout.count(), " ms (", waiting,
                                    ")"));
    }
    std::vector<EtcdOp> reads = {coord::RangeOp(Key("epoch")),
                                 coord::RangeOp(Key("members/"), coord::PrefixEnd(Key("members/"))),
                                 coord::RangeOp(round, coord::PrefixEnd(round)),
                                 coord::RangeOp(closed)};
    std::vector<EtcdCompare> last;  // every other member has contributed
    std::vector<EtcdOp> completing;
    if (polls == 0) {
      // The first poll also writes this rank's contribution (one request, one write, and the
      // snapshot sees it); a retry after an unanswered request writes the same bytes again.
      reads.insert(reads.begin(), coord::PutOp(round + Pad(rank_, 5), contribution));
      // The member whose contribution completes the round also writes the `done` hint, in
      // the same transaction (etcd takes up to 128 comparisons): the others watch that, not
      // each contribution (a round is then N events, not N^2). Only a hint: the snapshot
      // decides, and waits end after a second anyway.
      for (uint32_t r = 0; r < world_; ++r) {
        if (members_[r] && r != rank_) last.push_back(coord::VersionAbove(round + Pad(r, 5), 0));
      }
      if (last.size() <= kMaxCompares) {
        completing = reads;
        completing.insert(completing.begin() + 1,
                          coord::PutOp(Key("done"), StrCat(epoch_, "/", round_)));
      }
    }
    EPLBX_ASSIGN_OR_RETURN(coord::EtcdTxnResult snap,
                           UntilAnswered(
                               [&] {
                                 return completing.empty() ? client_->Txn({}, reads)
                                                           : client_->Txn(last, completing, reads);
                               },
                               deadline));
    ++stats_.requests;
    ++stats_.polls;
    if (snap.ranges.size() != 4)
      return Status::Corruption(StrCat(who, ": a snapshot without its reads"));
    coord::Snapshot s;
    EPLBX_ASSIGN_OR_RETURN(const int64_t view_revision,
                           ReadMembership(snap, Key("members/"), world_, who, &s));
    s.contributed.assign(world_, false);
    std::vector<std::string> got(world_);
    for (const coord::EtcdKv& kv : snap.ranges[2].kvs) {
      EPLBX_ASSIGN_OR_RETURN(uint32_t r, RankOfKey(kv.key, round, world_, who));
      s.contributed[r] = true;
      got[r] = kv.value;
    }
    if (!snap.ranges[3].kvs.empty()) {
      // The last completed round of the epoch (-1: none).
      Result<int64_t> t = internal::ParseInteger<int64_t>(snap.ranges[3].kvs[0].value, closed, -1,
                                                          std::numeric_limits<int64_t>::max());
      if (!t.ok()) {
        return t.status().WithPrefix(
            StrCat(who, ": the closing round of epoch ", epoch_, " (was it written by eplbx?)"));
      }
      s.closed = *t;
    }
    const Decision d = coord::Decide(rank_, world_, incarnation_, epoch_, round_, s);
    waiting = d.why;
    switch (d.kind) {
      case Decision::Kind::kSucceeded: {
        if (polls == 0 && completing.empty()) {
          (void)client_->Put(Key("done"), StrCat(epoch_, "/", round_));  // (a larger group)
          ++stats_.requests;
        }
        for (uint32_t r = 0; r < world_; ++r) {
          if (members_[r] && !s.contributed[r]) {
            return Status::Unavailable(StrCat(who, ": round ", round_, " of epoch ", epoch_,
                                              " completed without it being able to read rank ", r,
                                              "'s contribution (it was left behind): rejoin"));
          }
          if (!members_[r]) got[r].clear();
        }
        // Every 32 rounds the lowest member clears everything before this round (every
        // member is past it), in one transaction: one more write per 32 steps.
        const uint32_t first = static_cast<uint32_t>(
            std::find(members_.begin(), members_.end(), true) - members_.begin());
        if (first == rank_ && round_ % 32 == 31) {
          (void)client_->Txn(
              {}, {coord::DeleteOp(Key("round/"), round), coord::DeleteOp(Key("closed/"), closed)});
          ++stats_.requests;
        }
        ++round_;
        ++stats_.rounds;
        return got;
      }
      case Decision::Kind::kAborted: {
        const std::string change = Change(view_, s.view->incarnation);
        epoch_ = s.view->epoch;
        view_ = s.view->incarnation;
        members_ = s.view->members();
        round_ = 0;
        return Status::Aborted(StrCat(change, ": ", coord::DescribeView(*s.view)));
      }
      case Decision::Kind::kLost:
        return Status::Unavailable(
            StrCat(who, ": ", d.why, "; declared lost: start a new process to rejoin"));
      case Decision::Kind::kProposeView: {
        // The view unchanged, and the contributions this round still misses still absent: no
        // round past `through` completed before the view moves (src/coord/membership.h).
        std::vector<coord::EtcdCompare> cmp = {coord::ModRevisionIs(Key("epoch"), view_revision)};
        for (uint32_t r : d.absent) cmp.push_back(coord::VersionIs(round + Pad(r, 5), 0));
        EPLBX_RETURN_IF_ERROR(UntilAnswered(
                                  [&] {
                                    return client_->Txn(
                                        cmp, {coord::PutOp(Key("epoch"), coord::EncodeView(d.next)),
                                              coord::PutOp(closed, StrCat(d.through))});
                                  },
                                  deadline)
                                  .status());
        ++stats_.requests;
        continue;
      }
      case Decision::Kind::kCreateView:  // (a view exists once a rank is in a round)
      case Decision::Kind::kWait:
        WaitPast(snap.revision, deadline);
        continue;
    }
  }
}

}  // namespace eplbx
