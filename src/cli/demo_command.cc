// `eplbx demo`: spawns the ranks as processes on this machine (the parent is their
// rendezvous), rearranges real weights over real UCX agents for a few steps of drifting load,
// verifies every byte, and reports (docs/cli.md, "eplbx demo").
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <iostream>
#include <map>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/demo.h"
#include "cli/flags.h"
#include "cli/serve_mode.h"
#include "common/strings.h"
#include "eplbx/bootstrap.h"
#include "eplbx/env.h"
#include "eplbx/policy.h"
#include "eplbx/rearrange.h"
#include "eplbx/transfer.h"

namespace eplbx::cli {
namespace {

using internal::StrCat;

// "4096", "64K", "1M" -> bytes, at most 256 MiB.
Result<uint64_t> ParseBytes(const std::string& text, const char* flag) {
  std::string b = text;
  uint64_t mult = 1;
  if (!b.empty() && (b.back() == 'K' || b.back() == 'k')) mult = 1ull << 10;
  if (!b.empty() && (b.back() == 'M' || b.back() == 'm')) mult = 1ull << 20;
  if (mult != 1) b.pop_back();
  Result<uint64_t> v = internal::ParseInteger<uint64_t>(b, flag, 1, 256ull << 20);
  if (!v.ok() || *v > (256ull << 20) / mult) {
    return Status::InvalidArgument(
        StrCat(flag, " '", text, "': expected bytes like 4096, 64K, 1M (at most 256M)"));
  }
  return *v * mult;
}

}  // namespace

// `--serve --inject kill:1@60,kill:3@200,stop:4@300 --resize add:1@300,remove:2@350`: every
// membership event of the drill, checked and in step order (DemoOptions::events). A
// KIND:RANK@recovery strikes during the recovery from the event listed before it.
Status ParseServeEvents(DemoOptions& o) {
  using Event = DemoOptions::Event;
  std::vector<Event> stepped;
  std::vector<std::pair<Event, int>> during;  // @recovery events, after stepped event k
  for (const bool inject : {true, false}) {
    const std::string& list = inject ? o.inject : o.resize;
    const std::string flag = inject ? "--inject" : "--resize";
    for (const std::string& spec : SplitPaths(list)) {
      const auto colon = spec.find(':');
      const auto at = spec.find('@');
      Event e;
      e.kind = spec.substr(0, std::min(colon, spec.size()));
      const bool known =
          inject ? e.kind == "kill" || e.kind == "stop" : e.kind == "remove" || e.kind == "add";
      if (colon == std::string::npos || at == std::string::npos || at < colon || !known) {
        return Status::InvalidArgument(
            inject ? StrCat("--inject '", spec,
                            "': with --serve expected kill:RANK@STEP or stop:RANK@STEP (the rank "
                            "is killed, or stopped with SIGSTOP, at the start of that step), or "
                            "KIND:RANK@recovery (during the recovery from the fault before it); "
                            "several separated by commas")
                   : StrCat("--resize '", spec,
                            "': expected remove:RANK@STEP (the rank is drained at that step, then "
                            "leaves) or add:RANK@STEP (the rank serves from that step on: a new "
                            "process joins and takes its share of experts); several separated "
                            "by commas"));
      }
      Result<int> rank =
          internal::ParseInteger<int>(std::string_view(spec).substr(colon + 1, at - colon - 1),
                                      StrCat(flag, " ", spec, ": the rank"), 0, o.ranks - 1);
      if (!rank.ok()) return rank.status();
      e.rank = *rank;
      if (inject && spec.substr(at + 1) == "recovery") {
        if (stepped.empty() ||
            (!during.empty() && during.back().second == static_cast<int>(stepped.size()) - 1)) {
          return Status::InvalidArgument(
              StrCat("--inject ", o.inject, ": ", spec,
                     " strikes during the recovery from the fault listed before it: list a "
                     "KIND:RANK@STEP first (one @recovery fault per recovery)"));
        }
        during.push_back({e, static_cast<int>(stepped.size()) - 1});
        continue;
      }
      Result<int> step =
          internal::ParseInteger<int>(std::string_view(spec).substr(at + 1),
                                      StrCat(flag, " ", spec, ": the step"), 1, o.steps - 1);
      if (!step.ok()) return step.status();
      e.step = *step;
      stepped.push_back(e);
    }
  }
  const std::string flags = StrCat(o.inject.empty() ? "" : "--inject " + o.inject,
                                   !o.inject.empty() && !o.resize.empty() ? " " : "",
                                   o.resize.empty() ? "" : "--resize " + o.resize);
  if (o.mode_list.size() != 1) {
    return Status::InvalidArgument(StrCat(flags,
                                          " with --serve drills one mode: pass --modes sync, "
                                          "--modes async or --modes off (not '",
                                          o.modes, "')"));
  }
  if (o.ranks < 3) {
    return Status::InvalidArgument(StrCat(
        flags, " with --serve needs at least 3 ranks (two ",
        stepped.size() == 1 && stepped[0].kind == "add" ? "serve before it joins)" : "go on)"));
  }
  // In step order (the @recovery ones after the event they follow); one event per step.
  std::vector<int> order(stepped.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return stepped[a].step < stepped[b].step; });
  // Who is a member along the way: a rank whose first event is `add` starts outside.
  std::vector<bool> member(o.ranks, true);
  for (int i : order) {
    if (stepped[i].kind == "add") {
      bool earlier = false;
      for (int j : order) {
        if (j == i) break;
        earlier |= stepped[j].rank == stepped[i].rank;
      }
      if (!earlier) member[stepped[i].rank] = false;
    }
  }
  const int at_start = static_cast<int>(std::count(member.begin(), member.end(), true));
  if (static_cast<int64_t>(at_start) * o.slots_per_rank < o.experts) {
    return Status::InvalidArgument(StrCat(
        flags, ": the ", at_start, " members at the start would have ", at_start * o.slots_per_rank,
        " slots for --experts ", o.experts, "; raise --ranks or --slots-per-rank"));
  }
  o.events.clear();
  int prev_step = -1;
  for (size_t k = 0; k < order.size(); ++k) {
    const Event& e = stepped[order[k]];
    const std::string spec = StrCat(e.kind, ":", e.rank, "@", e.step);
    if (e.step == prev_step) {
      return Status::InvalidArgument(
          StrCat(flags, ": two events at step ", e.step, "; one membership event per step"));
    }
    prev_step = e.step;
    if (e.kind == "add" ? member[e.rank] : !member[e.rank]) {
      return Status::InvalidArgument(
          StrCat(flags, ": ", spec, ": rank ", e.rank,
                 e.kind == "add" ? " is a member then (add a rank that was lost, removed or never "
                                   "started)"
                                 : " is no member then (lost or removed earlier, not added back)"));
    }
    member[e.rank] = e.kind == "add";
    o.events.push_back(e);
    for (const auto& [d, after] : during) {
      if (after != order[k]) continue;
      if (!member[d.rank] || d.rank == e.rank) {
        return Status::InvalidArgument(StrCat(flags, ": ", d.kind, ":", d.rank,
                                              "@recovery must strike a member other than "
                                              "the one of ",
                                              spec));
      }
      Event x = d;
      x.after = static_cast<int>(k);
      member[d.rank] = false;
      o.events.push_back(x);
    }
    const int members = static_cast<int>(std::count(member.begin(), member.end(), true));
    if (members < 2 || static_cast<int64_t>(members) * o.slots_per_rank < o.experts) {
      return Status::InvalidArgument(StrCat(flags, ": after ", spec, " the ", members,
                                            " members would have ", members * o.slots_per_rank,
                                            " slots for --experts ", o.experts,
                                            "; raise --ranks or --slots-per-rank"));
    }
  }
  // The first event names the drill (reports, the worker's checks); a @recovery one the
  // second fault.
  o.fault = o.events[0].kind;
  o.fault_rank = o.events[0].rank;
  o.fault_step = o.events[0].step;
  for (const Event& e : o.events) {
    if (e.step < 0 && o.fault2.empty()) {
      o.fault2 = e.kind;
      o.fault2_rank = e.rank;
    }
  }
  return Status::OK();
}

// Who is a member when step `step` begins, by the drill's events (a rank whose first event
// is `add` starts outside; @recovery faults strike with the event before them).
std::vector<bool> MembersAt(const DemoOptions& o, int step) {
  std::vector<bool> member(o.ranks, true);
  std::vector<bool> seen(o.ranks, false);
  for (const DemoOptions::Event& e : o.events) {
    if (!seen[e.rank] && e.kind == "add") member[e.rank] = false;
    seen[e.rank] = true;
  }
  int last = -1;
  for (const DemoOptions::Event& e : o.events) {
    const int at = e.step >= 0 ? e.step : last;
    if (at >= step) break;
    last = at;
    member[e.rank] = e.kind == "add";
  }
  return member;
}

Status ParseDemo(DemoOptions& o) {
  if (!o.steps_given) o.steps = o.serve ? 300 : 3;
  if (o.serve) {
    if (o.interval < 1 || o.interval > o.steps) {
      return Status::InvalidArgument(
          StrCat("--interval ", o.interval, ": expected 1..--steps (", o.steps, ")"));
    }
    if (o.tokens < 1 || o.top_k < 1 || o.top_k > o.experts) {
      return Status::InvalidArgument(StrCat("--tokens ", o.tokens, " and --top-k ", o.top_k,
                                            ": expected >= 1, and top-k <= --experts"));
    }
    Result<Policy> policy = ParsePolicy(o.policy);
    if (!policy.ok()) return policy.status().WithPrefix("--policy");
    o.mode_list = SplitPaths(o.modes);
    if (o.mode_list.empty()) return Status::InvalidArgument("--modes: expected off, sync, async");
    for (size_t i = 0; i < o.mode_list.size(); ++i) {
      const std::string& m = o.mode_list[i];
      if (m != "off" && m != "sync" && m != "async") {
        return Status::InvalidArgument(StrCat("--modes: unknown mode ", internal::Printable(m),
                                              " (expected off, sync, async)"));
      }
      if (std::find(o.mode_list.begin(), o.mode_list.begin() + i, m) != o.mode_list.begin() + i)
        return Status::InvalidArgument(StrCat("--modes: '", m, "' listed twice"));
    }
  }
  if (o.ranks < 2 || o.ranks > 64)
    return Status::InvalidArgument(StrCat("--ranks ", o.ranks, ": expected 2..64"));
  if (o.layers < 1 || o.layers > 4096)
    return Status::InvalidArgument(StrCat("--layers ", o.layers, ": expected 1..4096"));
  if (o.tensors < 1 || o.tensors > 16)
    return Status::InvalidArgument(StrCat("--tensors ", o.tensors, ": expected 1..16"));
  if (o.steps < 1)
    return Status::InvalidArgument(StrCat("--steps ", o.steps, ": expected at least 1"));
  if (!(o.deadline_s > 0))
    return Status::InvalidArgument(StrCat("--deadline ", o.deadline_s, ": expected > 0 seconds"));
  // The ranks' agents read EPLBX_TRANSPORT: a bad value is refused here, before any rank
  // starts, instead of by every rank.
  if (std::string env = Env::Default()->GetVar("EPLBX_TRANSPORT").value_or(""); !env.empty()) {
    Result<Transport> t = ParseTransport(env);
    if (!t.ok()) return t.status().WithPrefix("environment variable EPLBX_TRANSPORT");
  }
  if (o.deadline_s < 0.1) {
    return Status::InvalidArgument(
        StrCat("--deadline ", o.deadline_s, ": expected at least 0.1 seconds"));
  }
  if (!o.paths.empty()) {  // refused here, before any rank starts, not by every rank
    const std::vector<std::string> paths = SplitPaths(o.paths);
    for (size_t i = 0; i < paths.size(); ++i) {
      if (paths[i] != "shm" && paths[i] != "cma" && paths[i] != "ucx") {
        return Status::InvalidArgument(StrCat("--paths: unknown data path ",
                                              internal::Printable(paths[i]),
                                              " (expected shm, cma or ucx)"));
      }
      if (std::find(paths.begin(), paths.begin() + i, paths[i]) != paths.begin() + i) {
        return Status::InvalidArgument(StrCat("--paths: '", paths[i], "' listed twice"));
      }
    }
  }
  if (Result<Transport> t = ParseTransport(o.transport); !t.ok()) {
    return t.status().WithPrefix("--transport");
  }
  if (static_cast<int64_t>(o.ranks) * o.slots_per_rank < o.experts || o.experts < 1) {
    return Status::InvalidArgument(StrCat("--ranks ", o.ranks, " x --slots-per-rank ",
                                          o.slots_per_rank, " slots cannot hold --experts ",
                                          o.experts));
  }
  Result<uint64_t> v = ParseBytes(o.expert_bytes, "--expert-bytes");
  if (!v.ok()) return v.status();
  o.expert_bytes_value = *v;
  if (o.expert_bytes_value < 8ull * o.tensors || o.expert_bytes_value > (256ull << 20)) {
    return Status::InvalidArgument(
        StrCat("--expert-bytes ", o.expert_bytes_value, ": expected ", 8 * o.tensors, " .. 256M"));
  }
  if (o.serve) {
    Result<uint64_t> wb = ParseBytes(o.work_bytes, "--work-bytes");
    if (!wb.ok()) return wb.status();
    if (*wb < 8) {
      return Status::InvalidArgument(
          StrCat("--work-bytes ", *wb, ": expected at least 8 (one word of a row)"));
    }
    o.work_bytes_value = *wb;
  }
  if (o.spare_rows < 0 || o.spare_rows > (1 << 16)) {
    return Status::InvalidArgument(
        StrCat("--spare-rows ", o.spare_rows, ": expected 0 (in place) .. 65536"));
  }
  const uint64_t per_rank =
      o.expert_bytes_value * (static_cast<uint64_t>(o.slots_per_rank) + o.spare_rows) * o.layers;
  if (per_rank * o.ranks > (16ull << 30)) {
    return Status::InvalidArgument(
        StrCat("the demo would allocate ", (per_rank * o.ranks) >> 20,
               " MiB of weights; reduce --layers, --slots-per-rank, --spare-rows or "
               "--expert-bytes"));
  }
  if (!o.resize.empty() && !o.serve) {
    return Status::InvalidArgument("--resize drills the serving demo (--serve)");
  }
  if (o.limit_each_step && o.serve) {
    return Status::InvalidArgument(
        "--limit-each-step measures the rearrangement demo's steps (without --serve)");
  }
  if ((!o.inject.empty() && o.serve) || !o.resize.empty()) {  // membership events
    EPLBX_RETURN_IF_ERROR(ParseServeEvents(o));
  } else if (!o.inject.empty()) {
    const auto colon = o.inject.find(':');
    static const char* kFaults[] = {"stride-mismatch", "missing-tensor", "kill", "stall",
                                    "bad-notify"};
    o.fault = o.inject.substr(0, colon);
    bool known = false;
    for (const char* f : kFaults) known |= o.fault == f;
    if (colon == std::string::npos || !known) {
      return Status::InvalidArgument(
          StrCat("--inject '", o.inject,
                 "': expected KIND:RANK with KIND one of "
                 "stride-mismatch, missing-tensor, kill, stall, bad-notify"));
    }
    const auto at = o.inject.find('@');
    Result<int> rank = internal::ParseInteger<int>(
        std::string_view(o.inject).substr(
            colon + 1, at == std::string::npos ? std::string::npos : at - colon - 1),
        StrCat("--inject ", o.inject, ": the rank"), 0, o.ranks - 1);
    if (!rank.ok()) return rank.status();
    o.fault_rank = *rank;
    o.fault_phase = at == std::string::npos ? "transfer" : o.inject.substr(at + 1);
    if (o.fault == "stride-mismatch" || o.fault == "missing-tensor") o.fault_phase = "exchange";
    if (o.fault_phase != "exchange" && o.fault_phase != "transfer" && o.fault_phase != "commit") {
      return Status::InvalidArgument(StrCat(
          "--inject ", o.inject, ": the phase after @ must be exchange, transfer or commit"));
    }
    if (o.fault_rank < 0 || o.fault_rank >= o.ranks) {
      return Status::InvalidArgument(
          StrCat("--inject ", o.inject, ": rank must be 0..", o.ranks - 1));
    }
  }
  return Status::OK();
}

namespace {

Status RunDemo(DemoOptions o) {
  EPLBX_RETURN_IF_ERROR(ParseDemo(o));
  const double memcpy_gbps = internal::MeasureMemcpyGbps();
  const double copy_limit_gbps =
      o.serve || o.limit_each_step ? 0.0 : internal::MeasureCopyLimitGbps(2);
  std::vector<int> fds(o.ranks);
  std::vector<pid_t> pids(o.ranks);
  if (o.serve) {
    Result<WorkTurns*> turns = CreateWorkTurns();
    if (!turns.ok()) return turns.status();
    o.work_turns = *turns;
  }
  if (o.fault_step >= 0) {
    const std::string dir = Env::Default()->GetVar("EPLBX_BACKUP_DIR").value_or("/dev/shm");
    o.backup_dir = dir;
  }
  // A rank that does not report in time (stopped, hung) is killed.
  std::vector<bool> gone(o.ranks, false), reaped(o.ranks, false), closed(o.ranks, false);
  // Starts rank r's process (`joining`: it joins the group under way); returns the
  // coordinator's end of its socket.
  auto start = [&](int r, bool joining) -> Result<int> {
    std::cout.flush();
    std::cerr.flush();
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
      return Status::Unavailable(StrCat("socketpair: ", std::strerror(errno)));
    }
    pids[r] = fork();
    if (pids[r] == 0) {
      close(sv[0]);
      for (int k = 0; k < o.ranks; ++k) {
        if (k != r && fds[k] >= 0) close(fds[k]);
      }
      SocketBootstrap boot(sv[1], static_cast<uint32_t>(r), static_cast<uint32_t>(o.ranks));
      DemoOptions mine = o;
      mine.joining = joining;
      _exit(o.serve ? RunServeRank(mine, r, boot) : RunDemoRank(mine, r, boot));
    }
    close(sv[1]);
    if (pids[r] < 0) {
      close(sv[0]);
      return Status::Unavailable(StrCat("fork: ", std::strerror(errno)));
    }
    return sv[0];
  };
  // `--resize add:RANK@STEP`: RANK's process starts when a member asks (at STEP), and joins
  // (a rank whose first event is `add` starts outside the group; one lost or removed earlier
  // comes back as a new process).
  std::vector<int> adds(o.ranks, 0);  // add events left per rank
  std::vector<bool> late(o.ranks, false);
  for (const DemoOptions::Event& e : o.events) {
    if (e.kind != "add") continue;
    if (adds[e.rank] == 0) {
      bool before = false;
      for (const DemoOptions::Event& x : o.events) {
        if (&x == &e) break;
        before |= x.rank == e.rank;
      }
      late[e.rank] = !before;
    }
    ++adds[e.rank];
  }
  std::vector<std::pair<uint32_t, int>> joining;
  std::string start_error;
  for (int r = 0; r < o.ranks; ++r) {
    fds[r] = -1;
    pids[r] = -1;
    if (late[r]) continue;
    EPLBX_ASSIGN_OR_RETURN(fds[r], start(r, false));
  }
  if (!o.json && o.serve) {
    std::cerr << "eplbx demo --serve: " << o.ranks << " ranks, " << o.layers << " layers x "
              << o.experts << " experts, " << o.slots_per_rank << " slots per rank, "
              << o.expert_bytes_value << " bytes per expert, " << o.steps << " steps of "
              << o.tokens << " tokens x top-" << o.top_k << ", rebalance every " << o.interval
              << " steps (" << o.policy << "), modes " << o.modes
              << (o.inject.empty() ? "" : ", inject " + o.inject)
              << (o.resize.empty() ? "" : ", resize " + o.resize) << "\n";
  } else if (!o.json) {
    std::cerr << "eplbx demo: " << o.ranks << " ranks, " << o.layers << " layers x " << o.experts
              << " experts, " << o.slots_per_rank << " slots per rank, " << o.tensors
              << " tensors, " << o.expert_bytes_value << " bytes per expert, " << o.steps
              << " steps" << (o.inject.empty() ? "" : ", inject " + o.inject) << "\n";
  }
  ReportCollector collector(o, !o.json);
  const auto t0 = Env::Default()->Now();
  std::vector<int> retired;  // lost processes' ends, once their rank has a new process
  CoordinatorOptions co;
  co.idle_timeout = std::chrono::milliseconds(static_cast<int64_t>(o.deadline_s * 1000) + 10000);
  co.on_message = [&](uint32_t rank, std::string bytes) {
    if (bytes.find("\"spawn\"") != std::string::npos) {
      const nlohmann::json ask = nlohmann::json::parse(bytes, nullptr, false);
      const int64_t r = ask.is_object() && ask.contains("spawn") && ask["spawn"].is_number_integer()
                            ? ask["spawn"].get<int64_t>()
                            : -1;
      if (r >= 0 && r < o.ranks && adds[r] > 0) {
        --adds[r];
        if (pids[r] >= 0 && !reaped[r]) {  // the lost process: gone for good
          kill(pids[r], SIGKILL);
          kill(pids[r], SIGCONT);
          waitpid(pids[r], nullptr, 0);
        }
        // The lost process's end is closed once the coordinator returns (it hears it no
        // more; closing it now could hand its number to the new socket while still polled).
        retired.push_back(fds[r]);
        fds[r] = -1;
        gone[r] = reaped[r] = closed[r] = false;
        Result<int> fd = start(static_cast<int>(r), true);
        if (fd.ok()) {
          joining.push_back({static_cast<uint32_t>(r), *fd});
        } else {
          start_error = fd.status().message();
        }
        return;
      }
    }
    collector.OnMessage(rank, bytes);
  };
  co.stop = [&] {
    // A rank that exited or is stopped never reports (a stopped one never will).
    return collector.Settled([&](int r) {
      if (gone[r]) return true;
      if (pids[r] < 0) return !start_error.empty();  // not started (yet)
      // An exited rank counts once its socket is drained to the end: a report it sent
      // just before exiting is still read (issue 17, item 14).
      int st = 0;
      if (!reaped[r] && waitpid(pids[r], &st, WNOHANG | WUNTRACED) == pids[r]) {
        reaped[r] = !WIFSTOPPED(st);
        gone[r] = !reaped[r];  // stopped
      }
      if (reaped[r] && closed[r]) gone[r] = true;
      return static_cast<bool>(gone[r]);
    });
  };
  // The coordinator gives up on a setup round before the ranks do, so it can name who is
  // missing.
  co.round_timeout = std::chrono::milliseconds(static_cast<int64_t>(o.deadline_s * 800));
  co.on_lost = [&](uint32_t rank) { closed[rank] = true; };
  co.membership = o.fault_step >= 0;
  co.joins = [&] { return std::exchange(joining, {}); };
  Status served = ServeSocketBootstrap(fds, co);
  for (int f : retired) {
    if (f >= 0) close(f);
  }
  // Every rank has reported or left; a stopped one is removed now.
  for (int r = 0; r < o.ranks; ++r) {
    if (fds[r] >= 0) close(fds[r]);
    if (pids[r] < 0) {
      if (!collector.Reported(r)) {
        collector.Add(r, {{"error", start_error.empty()
                                        ? StrCat("rank ", r,
                                                 " was never started (no member "
                                                 "asked for it)")
                                        : StrCat("rank ", r, " could not start: ", start_error)},
                          {"verified", false},
                          {"weights_created", false}});
      }
      continue;
    }
    if (!collector.Reported(r) && !reaped[r]) {
      kill(pids[r], SIGKILL);
      kill(pids[r], SIGCONT);
      // Said as what happened, not as "exited without a report" (issue 17, item 14).
      collector.Add(r, {{"error", StrCat("rank ", r, " did not report within the deadline (",
                                         gone[r] ? "stopped" : "hung or slow",
                                         "): killed by the coordinator")},
                        {"verified", false},
                        {"weights_created", false}});
    }
    if (!reaped[r]) waitpid(pids[r], nullptr, 0);
  }
  const double wall = std::chrono::duration<double>(Env::Default()->Now() - t0).count();
  if (o.serve) return ReportServing(o, collector.Reports(), wall, served);
  return ReportDemo(o, collector.Reports(), memcpy_gbps, wall, served, copy_limit_gbps);
}

}  // namespace

std::vector<std::string> SplitPaths(const std::string& list) {
  std::vector<std::string> out;
  for (size_t at = 0; !list.empty() && at <= list.size();) {
    const size_t comma = std::min(list.find(',', at), list.size());
    out.push_back(list.substr(at, comma - at));
    at = comma + 1;
  }
  return out;
}

ReportCollector::ReportCollector(const DemoOptions& o, bool print_progress)
    : world_(o.ranks),
      print_progress_(print_progress),
      grace_(static_cast<int64_t>(o.deadline_s * 1000) + 2000) {}

void ReportCollector::OnMessage(uint32_t rank, std::string_view bytes) {
  nlohmann::json j = CheckMemberMessage(rank, bytes);
  if (j.is_null()) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (j.contains("progress")) {
    if (print_progress_) std::cerr << "  " << j["progress"].get<std::string>() << "\n";
    return;
  }
  if (reports_.empty()) first_ = Env::Default()->Now();
  reports_[static_cast<int>(rank)] = std::move(j);
}

bool ReportCollector::Settled(const std::function<bool(int rank)>& lost) {
  std::lock_guard<std::mutex> lock(mu_);
  int settled = 0;
  for (int r = 0; r < world_; ++r) settled += reports_.count(r) != 0 || lost(r) ? 1 : 0;
  return settled == world_ || (!reports_.empty() && Env::Default()->Now() - first_ > grace_);
}

bool ReportCollector::Reported(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  return reports_.count(rank) != 0;
}

void ReportCollector::Add(int rank, nlohmann::json report) {
  std::lock_guard<std::mutex> lock(mu_);
  reports_[rank] = std::move(report);
}

std::map<int, nlohmann::json> ReportCollector::Reports() {
  std::lock_guard<std::mutex> lock(mu_);
  return reports_;
}

nlohmann::json CheckMemberMessage(uint32_t rank, std::string_view bytes) {
  using nlohmann::json;
  json j = json::parse(bytes, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return json();
  auto bad = [&](const std::string& field, const json& v, const char* want) {
    return json{{"error", StrCat("rank ", rank, " sent a malformed report: '", field, "' is a ",
                                 v.type_name(), " (expected ", want, ")")},
                {"verified", false},
                {"weights_intact", false}};
  };
  if (!j.is_object()) return bad("report", j, "an object");
  if (j.contains("progress")) {
    if (!j["progress"].is_string())
      return json{{"progress", StrCat("rank ", rank, " sent a malformed progress line")}};
    return j;
  }
  auto check = [&](const json& obj, const std::string& prefix, const char* key,
                   bool (json::*is)() const, const char* want) -> std::optional<json> {
    auto it = obj.find(key);
    if (it == obj.end() || ((*it).*is)()) return std::nullopt;
    return bad(prefix + key, *it, want);
  };
  const std::pair<const char*, bool (json::*)() const> bools[] = {
      {"verified", &json::is_boolean},
      {"weights_intact", &json::is_boolean},
      {"weights_created", &json::is_boolean}};
  for (const auto& [key, is] : bools) {
    if (auto e = check(j, "", key, is, "true or false")) return *e;
  }
  if (auto e = check(j, "", "error", &json::is_string, "a string")) return *e;
  if (auto e = check(j, "", "failed_at_us", &json::is_number_integer, "an integer")) return *e;
  for (const char* key :
       {"rss_mib_after_first_step", "rss_mib_end", "heap_kib_warm", "heap_kib_end"}) {
    if (auto e = check(j, "", key, &json::is_number, "a number")) return *e;
  }
  if (auto e = check(j, "", "steps", &json::is_array, "an array")) return *e;
  if (j.contains("steps")) {
    for (size_t s = 0; s < j["steps"].size(); ++s) {
      const json& st = j["steps"][s];
      const std::string at = StrCat("steps[", s, "].");
      if (!st.is_object()) return bad(at, st, "an object");
      for (const char* key :
           {"bytes_read", "experts_read", "bytes_cross_node", "bytes_copied", "layers_swapped"}) {
        if (auto e = check(st, at, key, &json::is_number_unsigned, "a count")) return *e;
      }
      for (const char* key : {"seconds", "balancedness_before", "balancedness_after"}) {
        if (auto e = check(st, at, key, &json::is_number, "a number")) return *e;
      }
      if (auto e = check(st, at, "bytes_by_path", &json::is_object, "an object")) return *e;
      if (st.contains("bytes_by_path")) {
        for (const auto& [path, bytes] : st["bytes_by_path"].items()) {
          if (!bytes.is_number_unsigned()) {
            return bad(StrCat(at, "bytes_by_path.", path), bytes, "a count");
          }
        }
      }
    }
  }
  return j;
}

namespace {
// ", over shm 12.0 MiB, cma 3.0 MiB" (empty when nothing moved).
std::string PathsText(const nlohmann::json& step) {
  std::string out;
  if (!step.contains("bytes_by_path")) return out;
  for (const auto& [path, n] : step["bytes_by_path"].items()) {
    char mib[32];
    std::snprintf(mib, sizeof(mib), "%.1f", n.get<uint64_t>() / 1048576.0);
    out += StrCat(out.empty() ? ", over " : ", ", path, " ", mib, " MiB");
  }
  return out;
}
}  // namespace

Status ReportDemo(const DemoOptions& o, const std::map<int, nlohmann::json>& reports,
                  double memcpy_gbps, double wall, const Status& served, double copy_limit_gbps) {
  // Aggregate: steps from the ranks' reports, errors from the survivors.
  nlohmann::json out;
  bool verified = static_cast<int>(reports.size()) == o.ranks;
  // A rank that failed before it created its weights cannot have changed them: intact is
  // over the ranks that did (issue 17, item 14: "weights intact: NO" though none existed).
  bool intact = true;
  int with_weights = 0;
  // Prefer a survivor's error: it names the rank that failed.
  std::string survivor_error, faulty_error;
  int64_t survivor_at = 0;
  for (int r = 0; r < o.ranks; ++r) {
    if (reports.count(r) == 0) {
      if (survivor_error.empty() && o.fault_rank != r)
        survivor_error = StrCat("rank ", r, " exited without a report");
      continue;
    }
    const auto& rep = reports.at(r);
    verified = verified && rep.value("verified", false);
    if (rep.value("weights_created", true)) {
      ++with_weights;
      intact = intact && rep.value("weights_intact", false);
    }
    const std::string e = rep.value("error", "");
    if (e.empty()) continue;
    if (r == o.fault_rank) {
      if (faulty_error.empty()) faulty_error = e;
      continue;
    }
    // The survivor that failed first names the cause; later failures are its effects.
    const int64_t at = rep.value("failed_at_us", int64_t{0});
    if (survivor_error.empty() || at < survivor_at) {
      survivor_error = e;
      survivor_at = at;
    }
  }
  std::string error = survivor_error.empty() ? faulty_error : survivor_error;
  // The coordinator's failure (a rank that never joined, a refused token) explains the rest.
  if (!served.ok())
    error = error.empty() ? served.message() : StrCat(served.message(), "; ", error);
  // --limit-each-step: rank 0's samples, one before the first step and one after each; a
  // step's yardstick is the mean of the two around it, the run's their median.
  std::vector<double> limits;
  if (o.limit_each_step && reports.count(0) != 0 &&
      reports.at(0).contains("copy_limit_samples_gbps")) {
    // A rank's report is read like any peer's: finite, positive, at most one per step and
    // one more; the rest is dropped.
    for (const auto& v : reports.at(0)["copy_limit_samples_gbps"]) {
      if (!v.is_number() || !(v.get<double>() > 0) || !std::isfinite(v.get<double>()) ||
          static_cast<int>(limits.size()) > o.steps)
        break;
      limits.push_back(v.get<double>());
    }
  }
  if (!limits.empty()) {
    std::vector<double> sorted = limits;
    std::sort(sorted.begin(), sorted.end());
    copy_limit_gbps = sorted[sorted.size() / 2];
  }
  nlohmann::json steps = nlohmann::json::array();
  for (int s = 0; s < o.steps; ++s) {
    uint64_t bytes = 0, experts = 0, cross = 0, copied = 0, swapped = 0;
    double seconds = 0;
    nlohmann::json by_path = nlohmann::json::object();
    nlohmann::json first;
    bool any = false;
    for (auto& [r, rep] : reports) {
      if (!rep.contains("steps") || static_cast<int>(rep["steps"].size()) <= s) continue;
      const auto& st = rep["steps"][s];
      bytes += st.value("bytes_read", uint64_t{0});
      experts += st.value("experts_read", uint64_t{0});
      cross += st.value("bytes_cross_node", uint64_t{0});
      copied += st.value("bytes_copied", uint64_t{0});
      swapped += st.value("layers_swapped", uint64_t{0});
      if (st.contains("bytes_by_path")) {
        for (const auto& [path, n] : st["bytes_by_path"].items()) {
          by_path[path] = by_path.value(path, uint64_t{0}) + n.get<uint64_t>();
        }
      }
      seconds = std::max(seconds, st.value("seconds", 0.0));
      if (!any) first = st;
      any = true;
    }
    if (!any) break;
    const double gbps = seconds > 0 ? bytes / seconds / 1e9 : 0.0;
    const double limit = static_cast<size_t>(s) + 1 < limits.size()
                             ? (limits[s] + limits[s + 1]) / 2
                             : (o.limit_each_step ? 0.0 : copy_limit_gbps);
    steps.push_back({{"balancedness_before", first.value("balancedness_before", 0.0)},
                     {"balancedness_after", first.value("balancedness_after", 0.0)},
                     {"experts_moved", experts},
                     {"bytes_moved", bytes},
                     {"cross_node_bytes", cross},
                     {"bytes_copied", copied},
                     {"rank_layers_swapped", swapped},
                     {"bytes_by_path", by_path},
                     {"seconds", seconds},
                     {"gbps", gbps},
                     {"memcpy_ratio", memcpy_gbps > 0 ? gbps / memcpy_gbps : 0.0},
                     {"copy_limit_gbps", limit},
                     {"copy_limit_ratio", limit > 0 ? gbps / limit : 0.0}});
  }
  verified = verified && error.empty() && static_cast<int>(steps.size()) == o.steps;
  out["verified"] = verified;
  out["weights_intact"] = intact;
  out["ranks_with_weights"] = with_weights;
  out["steps"] = steps;
  out["memcpy_gbps"] = memcpy_gbps;
  out["copy_limit_gbps"] = copy_limit_gbps;
  if (o.limit_each_step) out["copy_limit_samples_gbps"] = limits;
  out["pipeline"] = o.pipeline;
  out["layers_in_flight"] = o.pipeline ? StagingLayers(o) : o.layers_in_flight;
  out["commit_mode"] = o.spare_rows > 0 ? "swap" : "in place";
  out["spare_rows"] = o.spare_rows;
  out["ranks"] = o.ranks;
  out["wall_seconds"] = wall;
  // Resident memory per rank after the first step (warm-up) and at the end (soak checks).
  nlohmann::json rss = nlohmann::json::array();
  double growth = 0;
  for (const auto& [r, rep] : reports) {
    const double warm = rep.value("rss_mib_after_first_step", 0.0),
                 end = rep.value("rss_mib_end", 0.0);
    rss.push_back({{"rank", r}, {"after_first_step_mib", warm}, {"end_mib", end}});
    if (warm > 0) growth = std::max(growth, end - warm);
  }
  out["rss"] = rss;
  out["rss_growth_mib"] = growth;
  // Heap in use (malloc'd, not freed) after step min(10, steps) and at the end, per rank.
  double heap_growth = 0;
  for (const auto& [r, rep] : reports) {
    const double warm = rep.value("heap_kib_warm", 0.0), end = rep.value("heap_kib_end", 0.0);
    if (warm > 0) heap_growth = std::max(heap_growth, end - warm);
  }
  out["heap_growth_kib"] = heap_growth;
  uint64_t cross_total = 0;
  for (const auto& st : steps) cross_total += st["cross_node_bytes"].get<uint64_t>();
  out["cross_node_bytes"] = cross_total;
  if (!error.empty()) out["error"] = error;
  if (o.json) {
    std::cout << out.dump(1) << "\n";
  } else {
    for (size_t s = 0; s < steps.size(); ++s) {
      const auto& st = steps[s];
      std::printf(
          "step %zu: balancedness %.3f -> %.3f, %llu experts (%.1f MiB) moved in %.3f s, %.1f MiB "
          "copied within ranks (%.2f GB/s, %.2f x memcpy, %.2f x the copy limit)%s\n",
          s + 1, st["balancedness_before"].get<double>(), st["balancedness_after"].get<double>(),
          static_cast<unsigned long long>(st["experts_moved"].get<uint64_t>()),
          st["bytes_moved"].get<uint64_t>() / 1048576.0, st["seconds"].get<double>(),
          st["bytes_copied"].get<uint64_t>() / 1048576.0, st["gbps"].get<double>(),
          st["memcpy_ratio"].get<double>(), st["copy_limit_ratio"].get<double>(),
          PathsText(st).c_str());
    }
    std::printf(
        "verified: %s, weights intact: %s, memcpy %.2f GB/s, copy limit %.2f GB/s%s, wall %.2f "
        "s, resident memory growth "
        "after the first step %.1f MiB, heap growth after step 10 %.0f KiB (largest rank)\n",
        verified ? "yes" : "NO",
        with_weights == 0 ? "n/a (no rank created its weights)" : (intact ? "yes" : "NO"),
        memcpy_gbps, copy_limit_gbps,
        limits.empty()
            ? ""
            : StrCat(" (median of ", limits.size(), " samples around the steps)").c_str(),
        wall, growth, heap_growth);
  }
  if (!error.empty()) return Status::Aborted(error);
  if (!verified) return Status::Internal("the demo did not verify (see the report)");
  return Status::OK();
}

void AddDemoFlags(CLI::App& cmd, DemoOptions& o) {
  cmd.add_option("--layers", o.layers, "MoE layers")
      ->capture_default_str()
      ->check(IntIn<int>(0, 1 << 20));
  cmd.add_option("--experts", o.experts, "logical experts per layer")
      ->capture_default_str()
      ->check(IntIn<int>(0, 1 << 20));
  cmd.add_option("--slots-per-rank", o.slots_per_rank, "expert slots per rank")
      ->capture_default_str()
      ->check(IntIn<int>(0, 1 << 20));
  cmd.add_option("--spare-rows", o.spare_rows,
                 "rows per layer beyond the slots: READs land in them and commits swap row "
                 "tables (swap commit mode); 0: in place")
      ->capture_default_str()
      ->check(IntIn<int>(0, 1 << 16));
  cmd.add_option("--layers-in-flight", o.layers_in_flight,
                 "layers the synchronous loop (and --pipeline) runs at once (their messages and "
                 "READs overlap; each commits whole, in order); in place each takes a staging "
                 "buffer of a layer")
      ->capture_default_str()
      ->check(IntIn<int>(1, 4096));
  cmd.add_option("--tensors", o.tensors, "weight tensors per expert")
      ->capture_default_str()
      ->check(IntIn<int>(0, 1 << 20));
  cmd.add_option("--expert-bytes", o.expert_bytes, "bytes per expert, all tensors (K, M)")
      ->capture_default_str();
  cmd.add_option("--steps", o.steps, "rebalancing steps (with --serve: forward steps, 300)")
      ->capture_default_str()
      ->check(IntIn<int>(0, 1 << 30))
      ->each([&o](const std::string&) { o.steps_given = true; });
  // Every wait has a deadline (docs/protocol.md): no limit (inf) is not offered.
  cmd.add_option("--deadline", o.deadline_s, "seconds every phase may take (0.1 .. 86400)")
      ->capture_default_str()
      ->check(RealIn(0, 86400));
  cmd.add_option("--seed", o.seed, "load generator seed (same on every rank)")
      ->capture_default_str()
      ->check(IntIn<uint64_t>(0, UINT64_MAX));
  cmd.add_option("--transport", o.transport, "auto, shm or tcp")->capture_default_str();
  cmd.add_option("--paths", o.paths,
                 "data paths in order of preference, e.g. shm,cma,ucx (overrides --transport)");
  cmd.add_option("--inject", o.inject,
                 "fault drill KIND:RANK[@exchange|transfer|commit], KIND one of stride-mismatch, "
                 "missing-tensor, kill, stall, bad-notify; with --serve kill:RANK@STEP or "
                 "stop:RANK@STEP (a rank lost while serving; the others recover), optionally "
                 "followed by ,kill:RANK2@recovery or ,stop:RANK2@recovery (a second loss "
                 "during the recovery)");
  cmd.add_flag("--json", o.json, "print one JSON report on stdout (worker: rank 0)");
  cmd.add_flag("--serve", o.serve,
               "serving mode: forward steps of real expert work with EPLB off, synchronous "
               "and asynchronous; prints throughput and step times");
  cmd.add_option("--resize", o.resize,
                 "--serve: remove:RANK@STEP drains rank RANK at that step, then it leaves and "
                 "the others serve on over the members; add:RANK@STEP: rank RANK joins at that "
                 "step (demo: its process is started then; worker: its worker, started any "
                 "time, is let in then)");
  cmd.add_option("--interval", o.interval, "--serve: steps between rebalances considered")
      ->capture_default_str()
      ->check(IntIn<int>(0, 1 << 30));
  cmd.add_option("--window", o.window,
                 "--serve: steps of load a plan is built from (0: the interval; the load drifts "
                 "every step, so the last two forecast the next ones best)")
      ->capture_default_str()
      ->check(IntIn<int>(0, 1 << 30));
  cmd.add_option("--min-gain", o.min_gain,
                 "--serve: rebalance only when the plan's balancedness on the window beats the "
                 "current one's by at least this")
      ->capture_default_str()
      ->check(RealIn(0, 1));
  cmd.add_option("--skip-above", o.skip_above,
                 "--serve: no plan at a due step while the placement's balancedness on the "
                 "window is at least this (> 1: always plan)")
      ->capture_default_str()
      ->check(RealIn(0, 2));
  cmd.add_option("--async-steps", o.async_steps,
                 "--serve, async: steps a rebalance's READs are spread over "
                 "(AsyncOptions::target_steps)")
      ->capture_default_str()
      ->check(IntIn<int>(1, 1 << 20));
  cmd.add_option("--plan-lag", o.plan_lag,
                 "--serve, async: steps between the due step and the rebalance's begin (the "
                 "plan is computed meanwhile on a thread; 0: inside Step)")
      ->capture_default_str()
      ->check(IntIn<int>(0, 1 << 20));
  cmd.add_option("--tolerance", o.tolerance,
                 "--serve, incremental: balancedness below balanced's it may keep to move less")
      ->capture_default_str()
      ->check(RealIn(0, 1));
  cmd.add_option("--tokens", o.tokens, "--serve: tokens per forward step")
      ->capture_default_str()
      ->check(IntIn<int>(0, 1 << 24));
  cmd.add_option("--top-k", o.top_k, "--serve: experts per token")
      ->capture_default_str()
      ->check(IntIn<int>(0, 1 << 20));
  cmd.add_option("--work-bytes", o.work_bytes,
                 "--serve: bytes of an expert's row one routed token works over (K, M)")
      ->capture_default_str();
  cmd.add_option("--modes", o.modes, "--serve: modes to run, of off, sync, async")
      ->capture_default_str();
  cmd.add_option("--policy", o.policy, "--serve: deepseek, balanced or incremental")
      ->capture_default_str();
  cmd.add_option("--plot", o.plot, "--serve: write an SVG of step time over steps");
}

void AddDemoCommand(CLI::App& app, Action& run) {
  auto o = std::make_shared<DemoOptions>();
  CLI::App* demo =
      app.add_subcommand("demo", "Rearrange real weights between rank processes on this machine");
  demo->add_option("--ranks", o->ranks, "rank processes")
      ->capture_default_str()
      ->check(IntIn<int>(0, 1 << 20));
  AddDemoFlags(*demo, *o);
  demo->add_flag("--pipeline", o->pipeline,
                 "rearrange with the asynchronous pipeline (Begin, then Commit whenever "
                 "AwaitCommit says one is due: layers in flight together, no budget) instead "
                 "of the synchronous loop");
  demo->add_flag("--limit-each-step", o->limit_each_step,
                 "measure the copy limit before the first step and after every step (rank 0, the "
                 "other ranks waiting) and give each step's ratio to the mean of the two "
                 "samples around it, instead of measuring once before the ranks start");
  demo->callback([&run, o] { run = [o] { return RunDemo(*o); }; });
}

}  // namespace eplbx::cli
