// The serving comparison of `eplbx demo --serve`, built from the ranks' reports.
//
// A step's time, per mode: for every layer the slowest rank's expert work on it (thread CPU
// time: the layer's all-to-all makes the slowest rank set the pace), summed over layers, plus the
// Balancer's cost at that step, from the moment the last rank entered Step/Commit to the moment the
// last one left (CLOCK_MONOTONIC; a synchronous rearrangement is all of it, an asynchronous one
// only its polls and commits). The oracle is the same work perfectly balanced (the ranks' mean)
// with no cost of moving anything.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>

#include <nlohmann/json.hpp>

#include "cli/demo.h"
#include "cli/serve_mode.h"
#include "common/strings.h"

namespace eplbx::cli {
namespace {

using internal::StrCat;
using nlohmann::json;

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t k = static_cast<size_t>(q * static_cast<double>(v.size() - 1) + 0.5);
  return v[std::min(k, v.size() - 1)];
}

// A number array of `n` entries at rep[mode][key], or empty when absent or malformed.
std::vector<double> Numbers(const json& rep, const std::string& mode, const char* key, size_t n) {
  std::vector<double> out;
  if (!rep.contains("modes") || !rep["modes"].is_object() || !rep["modes"].contains(mode))
    return out;
  const json& m = rep["modes"][mode];
  if (!m.is_object() || !m.contains(key) || !m[key].is_array() || m[key].size() != n) return out;
  for (const json& v : m[key]) {
    if (!v.is_number()) return {};
    out.push_back(v.get<double>());
  }
  return out;
}

struct ModeSummary {
  std::string mode;
  std::vector<double> step_ms, balancedness;
  std::vector<int> rebalancing, commits;
  double tokens_per_s = 0, p50 = 0, p99 = 0, p99_rebalancing = 0, p99_quiet = 0;
  double stall_ms = 0;  // mean over rebalances of the largest per-step cost during it
  double mean_balancedness = 0;
  // Where the time went: the slowest ranks' work, the ranks' mean work (what the oracle
  // takes) and the Balancer's cost, summed over steps (seconds).
  double work_s = 0, mean_work_s = 0, cost_s = 0;
  uint64_t bytes_read = 0, bytes_copied = 0, rows_checked = 0, bad_rows = 0;
  int rebalances = 0, failed = 0;
  json log = json::array();                       // rank 0's rebalances, with phase timings
  json bytes_by_path = json::object();            // all ranks
  std::vector<std::vector<uint64_t>> pairs;       // bytes read: [source rank][reading rank]
  std::vector<std::vector<uint64_t>> node_pairs;  // the same per node: [source][reader]
};

// The plot: step time (ms) over steps, one line per mode, rebalances marked.
void WriteSvg(const std::string& file, const std::vector<ModeSummary>& modes, int steps) {
  const double w = 900, h = 380, left = 60, right = 20, top = 30, bottom = 40;
  double most = 1;
  for (const auto& m : modes) {
    for (double v : m.step_ms) most = std::max(most, v);
  }
  most = std::min(most, 3 * std::max(1.0, modes.empty() ? 1.0 : modes[0].p99));
  auto x = [&](double i) { return left + (w - left - right) * i / std::max(1, steps - 1); };
  auto y = [&](double v) { return top + (h - top - bottom) * (1 - std::min(v, most) / most); };
  static const char* kColours[] = {"#888888", "#d62728", "#1f77b4", "#2ca02c"};
  std::ofstream out(file);
  out << "<svg xmlns='http://www.w3.org/2000/svg' width='" << w << "' height='" << h
      << "' font-family='sans-serif' font-size='12'>\n<rect width='100%' height='100%' "
         "fill='white'/>\n";
  out << "<text x='" << left << "' y='18'>eplbx demo --serve: step time (ms) over steps; "
      << "ticks: layers committed</text>\n";
  out << "<line x1='" << left << "' y1='" << y(0) << "' x2='" << w - right << "' y2='" << y(0)
      << "' stroke='black'/>\n<line x1='" << left << "' y1='" << top << "' x2='" << left << "' y2='"
      << y(0) << "' stroke='black'/>\n";
  for (int k = 0; k <= 4; ++k) {
    const double v = most * k / 4;
    out << "<text x='4' y='" << y(v) + 4 << "'>" << StrCat(static_cast<int>(v * 10) / 10.0)
        << "</text>\n";
  }
  out << "<text x='" << w / 2 << "' y='" << h - 8 << "'>step</text>\n";
  for (size_t i = 0; i < modes.size(); ++i) {
    const char* c = kColours[i % 4];
    out << "<polyline fill='none' stroke='" << c << "' stroke-width='1' points='";
    for (size_t s = 0; s < modes[i].step_ms.size(); ++s)
      out << x(static_cast<double>(s)) << "," << y(modes[i].step_ms[s]) << " ";
    out << "'/>\n";
    for (size_t s = 0; s < modes[i].commits.size(); ++s) {
      if (modes[i].commits[s] == 0) continue;
      out << "<line x1='" << x(static_cast<double>(s)) << "' y1='" << top + 4 * i << "' x2='"
          << x(static_cast<double>(s)) << "' y2='" << top + 4 * i + 8 << "' stroke='" << c
          << "'/>\n";
    }
    out << "<text x='" << w - right - 220 << "' y='" << top + 16 * (i + 1) << "' fill='" << c
        << "'>" << modes[i].mode << ": " << static_cast<int64_t>(modes[i].tokens_per_s)
        << " tokens/s</text>\n";
  }
  out << "</svg>\n";
}

// `--serve --inject kill|stop:RANK@STEP`: what the survivors saw, did and served
// (docs/cli.md, "Serving through a lost rank"). Step times are wall-clock on each survivor
// (the step's collective keeps them in step); a step's time is the slowest survivor's.
Status ReportServingDrill(const DemoOptions& o, const std::map<int, json>& reports, double wall,
                          const Status& served) {
  std::string error;
  const std::string& mode = o.mode_list[0];
  std::vector<int> survivors;
  const bool add = o.fault == "add";  // every rank serves at the end, the new one too
  // `eplbx worker --serve` with nothing injected: who was lost is found at run time, from
  // the members a survivor reports (nobody lost: every rank).
  const bool found = o.survive && o.fault_step < 0;
  std::vector<int> lost;
  if (found) {
    // The members a survivor reports: one that ended well first, else one that failed later
    // (a failed run still says who was lost before it failed).
    for (const bool clean : {true, false}) {
      for (const auto& [r, rep] : reports) {
        if (survivors.empty() && rep.contains("drill") && rep["drill"].is_object() &&
            rep["drill"].value("detected_step", -1) >= 0 && rep["drill"].contains("members") &&
            rep["drill"]["members"].is_array() && rep.value("error", "").empty() == clean) {
          for (const json& m : rep["drill"]["members"]) {
            if (m.is_number_integer()) survivors.push_back(m.get<int>());
          }
        }
      }
    }
    if (survivors.empty()) {
      for (int r = 0; r < o.ranks; ++r) survivors.push_back(r);
    }
    for (int r = 0; r < o.ranks; ++r) {
      if (std::find(survivors.begin(), survivors.end(), r) == survivors.end()) lost.push_back(r);
    }
  } else {  // the members at the end, by the events
    const std::vector<bool> at_end = MembersAt(o, o.steps);
    for (int r = 0; r < o.ranks; ++r) {
      if (at_end[r]) survivors.push_back(r);
    }
  }
  // A rank whose process joined (added, or a lost rank started again) settled differently
  // from the others (its first event is its join).
  auto joined = [&](int r) {
    const auto it = reports.find(r);
    return (it != reports.end() && it->second.value("joined", false)) ||
           std::any_of(o.events.begin(), o.events.end(),
                       [&](const DemoOptions::Event& e) { return e.kind == "add" && e.rank == r; });
  };
  // Several events (or a process that joined): a joined rank's first event is its join.
  const bool several =
      o.events.size() > 1 ||
      std::any_of(survivors.begin(), survivors.end(), [&](int r) { return found && joined(r); });
  for (const DemoOptions::Event& e : o.events) {  // a drained rank reports before it leaves
    if (e.kind != "remove" ||
        std::find(survivors.begin(), survivors.end(), e.rank) != survivors.end()) {
      continue;
    }
    const auto it = reports.find(e.rank);
    if (!error.empty()) break;
    if (it == reports.end()) {
      error = StrCat("rank ", e.rank, " (drained) left without a report");
    } else if (std::string why = it->second.value("error", ""); !why.empty()) {
      error = StrCat("rank ", e.rank, " (drained): ", why);
    } else if (!it->second.value("left", false)) {
      error = StrCat("rank ", e.rank, " was to be drained and leave but did not say it left");
    }
  }
  auto number = [](const json& j, const char* key) {
    return j.contains(key) && j[key].is_number() ? j[key].get<double>() : -1.0;
  };
  std::vector<double> step_s;
  double recovery_s = 0, detect_wait_s = 0, drain_s = 0, setup_s = 0, plan_s = 0, move_s = 0,
         restore_s = 0, balancer_s = 0, backup_bytes = 0;
  double detected = -1, epoch = -1, experts_recovered = -1, placements = 0;
  json restarts = json::array();
  uint64_t rows_recovered = 0, bytes_moved = 0, rows_checked = 0, bad_rows = 0;
  int rebalances_after = 0;
  bool counted_rebalances = false;  // from the first survivor with a report
  json members, interrupted = "";
  json events = json::array();  // every membership event, as the members settled them
  // Every survivor's figures count, also after an error (the first error is the run's): a
  // failed run reports what happened up to the failure.
  for (int r : survivors) {
    if (reports.count(r) == 0) {
      if (error.empty()) error = StrCat("rank ", r, " (a member) exited without a report");
      continue;
    }
    const json& rep = reports.at(r);
    const std::string failed = rep.value("error", "");
    if (!failed.empty() && error.empty()) error = StrCat("rank ", r, ": ", failed);
    if (!rep.contains("drill") || !rep["drill"].is_object() || !rep.contains("modes") ||
        !rep["modes"].is_object() || !rep["modes"].contains(mode) ||
        !rep["modes"][mode].is_object()) {
      if (error.empty()) error = StrCat("rank ", r, " sent no drill report");
      continue;
    }
    const json& d = rep["drill"];
    const double det = number(d, "detected_step"), ep = number(d, "epoch"),
                 rec = number(d, "experts_recovered");
    if (!joined(r) && events.empty() && d.contains("events") && d["events"].is_array())
      events = d["events"];
    if (!joined(r) && d.contains("events") && d["events"].is_array()) {
      // The slowest member's time for each event (the others waited for it).
      for (size_t k = 0; k < d["events"].size() && k < events.size(); ++k) {
        const double t = number(d["events"][k], "recovery_s");
        if (t > number(events[k], "recovery_s")) events[k]["recovery_s"] = t;
      }
    }
    if (joined(r) && several) {
      // (its detection and recovery figures are its join's; the members' are the run's)
      if (failed.empty() && error.empty() &&
          (number(d, "epoch") != epoch || d.value("members", json::array()) != members) &&
          detected >= 0) {
        error = StrCat("rank ", r, " (joined) ended at epoch ", number(d, "epoch"),
                       " with members ", d.value("members", json::array()).dump(),
                       "; the others at epoch ", epoch, " with ", members.dump());
      }
    } else if (detected < 0) {
      detected = det;
      epoch = ep;
      experts_recovered = rec;
      members = d.value("members", json::array());
      interrupted = d.value("interrupted", json(""));
      placements = number(d, "placements");
      restarts = d.value("restarts", json::array());
    } else if (failed.empty() && error.empty() &&
               (det != detected || ep != epoch || rec != experts_recovered ||
                d.value("members", json::array()) != members)) {
      error = StrCat("the survivors disagree: rank ", survivors[0], " recovered at step ", detected,
                     " (epoch ", epoch, ", ", experts_recovered, " experts from the backup), rank ",
                     r, " at step ", det, " (epoch ", ep, ", ", rec, ")");
    }
    // The phases of the survivor that took longest (the others waited for it). A joining
    // rank's own time runs from its start (it waits for the members to reach the step's
    // collective): the members' time is the one reported.
    if (number(d, "recovery_s") >= recovery_s && !(add && r == o.fault_rank) &&
        !(joined(r) && several)) {
      recovery_s = number(d, "recovery_s");
      drain_s = number(d, "drain_s");
      setup_s = number(d, "setup_s");
      balancer_s = number(d, "balancer_s");
      plan_s = number(d, "plan_s");
      move_s = number(d, "move_s");
      restore_s = number(d, "restore_s");
    }
    detect_wait_s = std::max(detect_wait_s, number(d, "detect_wait_s"));
    backup_bytes = std::max(backup_bytes, number(d, "backup_bytes"));
    rows_recovered += static_cast<uint64_t>(std::max(0.0, number(d, "rows_recovered")));
    bytes_moved += static_cast<uint64_t>(std::max(0.0, number(d, "bytes_moved")));
    const json& mj = rep["modes"][mode];
    rows_checked += mj.value("rows_checked", uint64_t{0});
    bad_rows += mj.value("bad_rows", uint64_t{0});
    if (!counted_rebalances && mj.contains("rebalances") && mj["rebalances"].is_array()) {
      counted_rebalances = true;
      for (const json& x : mj["rebalances"]) {
        if (x.is_object() && number(x, "step") > detected && x.value("ok", false))
          ++rebalances_after;
      }
    }
    if (d.contains("step_ns") && d["step_ns"].is_array()) {
      const json& ns = d["step_ns"];
      step_s.resize(std::max(step_s.size(), ns.size()), 0.0);
      for (size_t i = 0; i < ns.size(); ++i) {
        if (ns[i].is_number()) step_s[i] = std::max(step_s[i], ns[i].get<double>() * 1e-9);
      }
    }
  }
  if (error.empty() && detected < 0 && !found) error = "no survivor detected the loss";
  if (found && several) {
    // Who was lost along the way (a lost rank's process may have come back): from the
    // members before and after each loss.
    std::vector<int> before(o.ranks);
    for (int r = 0; r < o.ranks; ++r) before[r] = r;
    lost.clear();
    for (const json& e : events) {
      std::vector<int> after;
      for (const json& m : e.value("members", json::array())) {
        if (m.is_number_integer()) after.push_back(m.get<int>());
      }
      for (int r : before) {
        if (e.value("kind", "") == "loss" &&
            std::find(after.begin(), after.end(), r) == after.end() &&
            std::find(lost.begin(), lost.end(), r) == lost.end())
          lost.push_back(r);
      }
      before = after;
    }
  }
  if (!served.ok())
    error = error.empty() ? served.message() : StrCat(served.message(), "; ", error);
  // Tokens per second before the fault, from it until serving again, and after.
  auto rate = [&](size_t from, size_t to) {
    double t = 0;
    for (size_t i = from; i < to && i < step_s.size(); ++i) t += step_s[i];
    const size_t n = std::min(to, step_s.size()) > from ? std::min(to, step_s.size()) - from : 0;
    return t > 0 ? static_cast<double>(o.tokens) * static_cast<double>(n) / t : 0.0;
  };
  const size_t fault = o.fault_step >= 0 ? static_cast<size_t>(o.fault_step)
                       : detected >= 0   ? static_cast<size_t>(detected)
                                         : step_s.size();
  const size_t back = detected >= 0 ? static_cast<size_t>(detected) + 1 : fault;
  const double before = rate(0, fault), during = rate(fault, back),
               after = rate(back, step_s.size());
  double during_s = 0;
  for (size_t i = fault; i < back && i < step_s.size(); ++i) during_s += step_s[i];
  const bool verified = error.empty() && bad_rows == 0 && rows_checked > 0;
  json out = {
      {"ranks", o.ranks},
      {"steps", o.steps},
      {"mode", mode},
      {"tokens_per_step", o.tokens},
      {"expert_bytes", o.expert_bytes_value},
      {"wall_seconds", wall},
      {"drill",
       {{"fault", found ? (lost.empty() ? "none" : "lost") : o.fault},
        {"rank", found ? (lost.empty() ? -1 : lost[0]) : o.fault_rank},
        {"lost_ranks", lost},
        {"step", o.fault_step},
        {"detected_step", detected},
        {"detect_wait_s", detect_wait_s},
        {"recovery_s", recovery_s},
        {"recovery_target_s", 1.0},
        {"phases_s",
         {{"end_rebalance_and_agree_maps", drain_s},
          {"rearranger_over_members", setup_s},
          {"plan", plan_s},
          {"move_among_survivors", move_s},
          {"restore_from_backup", restore_s},
          {"balancer_over_members", balancer_s}}},
        {"epoch", epoch},
        {"members", members},
        {"interrupted_rebalance", interrupted},
        {"experts_recovered", experts_recovered},
        {"rows_recovered", rows_recovered},
        {"bytes_moved_among_survivors", bytes_moved},
        {"backup_bytes", backup_bytes},
        {"rebalances_after", rebalances_after},
        {"placements", placements},
        {"restarts", restarts},
        {"events", events},
        {"second_fault", o.fault2.empty() ? json(nullptr)
                                          : json{{"fault", o.fault2},
                                                 {"rank", o.fault2_rank},
                                                 {"when",
                                                  "recovery, as the move among the survivors "
                                                  "begins"}}}}},
      {"tokens_per_s", {{"before", before}, {"during", during}, {"after", after}}},
      {"seconds_from_fault_to_serving", during_s},
      {"step_time_model",
       "wall-clock time of each step on the slowest survivor (work, Balancer, the step's "
       "collective, recovery)"},
      {"rows_checked", rows_checked},
      {"bad_rows", bad_rows},
      {"verified", verified}};
  if (!error.empty()) out["error"] = error;
  if (o.json) {
    std::cout << out.dump(1) << "\n";
  } else {
    if (found) {
      const std::string what = lost.empty() ? "no rank was lost"
                                            : StrCat("lost ", json(lost).dump(), " at step ",
                                                     detected, ", the others went on");
      std::printf("serving on %d ranks (%s mode): %s\n", o.ranks, mode.c_str(), what.c_str());
    } else {
      std::printf("drill: %s rank %d at step %d (%s mode)\n", o.fault.c_str(), o.fault_rank,
                  o.fault_step, mode.c_str());
    }
    if (detected >= 0 && add) {
      std::printf(
          "  rank %d asked for at step %d, a member from step %.0f: %.3f s from the request to "
          "the members learning it joined (the new process starting, or a standby let in, and "
          "asking), then %.3f s to "
          "serving with it holding its share (target <= 1 s in all: %.3f s): agree on the maps "
          "%.3f, Rearranger over the members %.3f, plan %.3f, move "
          "its experts onto it %.3f (%.1f MiB), Balancer %.3f; epoch %.0f, members %s\n",
          o.fault_rank, o.fault_step, detected, detect_wait_s, recovery_s,
          detect_wait_s + recovery_s, drain_s, setup_s, plan_s, move_s,
          static_cast<double>(bytes_moved) / 1048576.0, balancer_s, epoch, members.dump().c_str());
    } else if (detected >= 0 && o.fault == "remove") {
      std::printf(
          "  rank %d drained and gone: %.3f s from the step's end to serving over the members "
          "%s (epoch %.0f): end the rebalance in flight %.3f, plan the drain %.3f, move its "
          "experts to the others %.3f (%.1f MiB), Rearranger rebuilt "
          "over "
          "the members %.3f, Balancer %.3f\n",
          o.fault_rank, recovery_s, members.dump().c_str(), epoch, drain_s, plan_s, move_s,
          static_cast<double>(bytes_moved) / 1048576.0, setup_s, balancer_s);
    } else if (detected >= 0) {
      std::printf(
          "  detected at step %.0f after %.3f s of that step; epoch %.0f, members %s\n"
          "  recovery (detection to serving with every expert present): %.3f s (target <= 1 s): "
          "end the rebalance in flight and agree on the maps %.3f, "
          "Rearranger rebuilt over the members %.3f, plan %.3f, move among survivors %.3f "
          "(%.1f MiB), restore from the host backup %.3f (%llu rows of %.0f experts; backup "
          "holds %.1f MiB), Balancer over the members %.3f\n",
          detected, detect_wait_s, epoch, members.dump().c_str(), recovery_s, drain_s, setup_s,
          plan_s, move_s, static_cast<double>(bytes_moved) / 1048576.0, restore_s,
          static_cast<unsigned long long>(rows_recovered), experts_recovered,
          backup_bytes / 1048576.0, balancer_s);
      if (interrupted.is_string() && !interrupted.get<std::string>().empty())
        std::printf("  the rebalance in flight: %s\n", interrupted.get<std::string>().c_str());
      if (!o.fault2.empty()) {
        std::printf(
            "  second fault: %s rank %d during the recovery; %.0f placements over the "
            "members:\n",
            o.fault2.c_str(), o.fault2_rank, placements);
        for (const json& why : restarts) {
          if (why.is_string()) std::printf("    again after %s\n", why.get<std::string>().c_str());
        }
      }
    }
    if (events.size() > 1) {
      std::printf("  membership events:\n");
      for (const json& e : events) {
        std::printf(
            "    step %.0f: %s, epoch %.0f, members %s, settled in %.3f s (%.0f experts "
            "from the backup)\n",
            number(e, "step"), e.value("kind", "").c_str(), number(e, "epoch"),
            e.value("members", json::array()).dump().c_str(), number(e, "recovery_s"),
            number(e, "experts_recovered"));
      }
    }
    if (found && lost.empty()) {
      std::printf("  tokens/s %.0f; rebalances: %d\n", before, rebalances_after);
    } else {
      std::printf(
          "  tokens/s before %.0f, from the fault to serving again %.0f (%.3f s), after %.0f; "
          "rebalances after: %d\n",
          before, during, during_s, after, rebalances_after);
    }
    std::printf("  every row a step used checked against its map: %s (%llu rows); wall %.1f s\n",
                bad_rows == 0 && rows_checked > 0 ? "yes" : "NO",
                static_cast<unsigned long long>(rows_checked), wall);
  }
  if (!error.empty()) return Status::Aborted(error);
  if (!verified) return Status::Internal("the serving drill did not verify (see the report)");
  return Status::OK();
}

}  // namespace

Status ReportServing(const DemoOptions& o, const std::map<int, json>& reports, double wall,
                     const Status& served) {
  if (o.fault_step >= 0 || o.survive) return ReportServingDrill(o, reports, wall, served);
  std::string error;
  for (int r = 0; r < o.ranks && error.empty(); ++r) {
    if (reports.count(r) == 0) {
      error = StrCat("rank ", r, " exited without a report");
    } else if (std::string e = reports.at(r).value("error", ""); !e.empty()) {
      error = StrCat("rank ", r, ": ", e);
    }
  }
  if (!served.ok())
    error = error.empty() ? served.message() : StrCat(served.message(), "; ", error);
  const size_t n = static_cast<size_t>(o.steps);
  const double routed = static_cast<double>(o.tokens);  // tokens per step (each to top_k experts)
  std::vector<ModeSummary> modes;
  std::vector<double> oracle_ms(n, 0);
  // The mean work of each layer at each step (the first mode's): the oracle's, and with the
  // hindsight ceiling's imbalance the ceiling's.
  std::vector<double> mean_ms(n * static_cast<size_t>(o.layers), 0);
  for (const std::string& mode : o.mode_list) {
    ModeSummary m;
    m.mode = mode;
    std::vector<std::vector<double>> cpu, enter, exit;
    for (int r = 0; r < o.ranks && error.empty(); ++r) {
      const json& rep = reports.at(r);
      cpu.push_back(Numbers(rep, mode, "cpu_s", n * static_cast<size_t>(o.layers)));
      enter.push_back(Numbers(rep, mode, "enter_ns", n));
      exit.push_back(Numbers(rep, mode, "exit_ns", n));
      if (cpu.back().empty() || enter.back().empty() || exit.back().empty()) {
        error = StrCat("rank ", r, " sent no per-step figures for mode ", mode);
        break;
      }
      const json& mj = rep["modes"][mode];
      m.bytes_read += mj.value("bytes_read", uint64_t{0});
      m.bytes_copied += mj.value("bytes_copied", uint64_t{0});
      m.rows_checked += mj.value("rows_checked", uint64_t{0});
      m.bad_rows += mj.value("bad_rows", uint64_t{0});
      if (mj.contains("rebalances") && mj["rebalances"].is_array()) {
        m.pairs.resize(o.ranks, std::vector<uint64_t>(o.ranks, 0));
        for (const json& x : mj["rebalances"]) {
          if (x.is_object() && x.contains("bytes_from_rank") && x["bytes_from_rank"].is_array()) {
            const json& from = x["bytes_from_rank"];
            for (size_t src = 0; src < from.size() && src < static_cast<size_t>(o.ranks); ++src) {
              if (from[src].is_number_unsigned()) m.pairs[src][r] += from[src].get<uint64_t>();
            }
          }
          if (!x.is_object() || !x.contains("bytes_by_path") || !x["bytes_by_path"].is_object())
            continue;
          for (const auto& [path, b] : x["bytes_by_path"].items()) {
            if (b.is_number_unsigned())
              m.bytes_by_path[path] = m.bytes_by_path.value(path, uint64_t{0}) + b.get<uint64_t>();
          }
        }
      }
      if (r == 0) {
        m.balancedness = Numbers(rep, mode, "balancedness", n);
        for (double v : Numbers(rep, mode, "rebalancing", n)) m.rebalancing.push_back(v != 0);
        for (double v : Numbers(rep, mode, "committed", n))
          m.commits.push_back(static_cast<int>(v));
        if (mj.contains("rebalances") && mj["rebalances"].is_array()) {
          m.rebalances = static_cast<int>(mj["rebalances"].size());
          m.log = mj["rebalances"];
        }
        m.failed = mj.value("failed", 0);
      }
    }
    if (!error.empty()) break;
    double total_s = 0;
    std::vector<double> cost_ms(n);
    for (size_t s = 0; s < n; ++s) {
      double slowest = 0, mean = 0, last_in = 0, last_out = 0;
      for (int l = 0; l < o.layers; ++l) {
        double most = 0, layer_mean = 0;
        for (int r = 0; r < o.ranks; ++r) {
          const double c = cpu[r][s * static_cast<size_t>(o.layers) + l];
          most = std::max(most, c);
          layer_mean += c / o.ranks;
        }
        slowest += most;
        mean += layer_mean;
        if (modes.empty()) mean_ms[s * static_cast<size_t>(o.layers) + l] = layer_mean * 1e3;
      }
      for (int r = 0; r < o.ranks; ++r) {
        last_in = std::max(last_in, enter[r][s]);
        last_out = std::max(last_out, exit[r][s]);
      }
      cost_ms[s] = std::max(0.0, (last_out - last_in) * 1e-6);
      m.work_s += slowest;
      m.mean_work_s += mean;
      m.cost_s += cost_ms[s] * 1e-3;
      m.step_ms.push_back(slowest * 1e3 + cost_ms[s]);
      total_s += m.step_ms.back() * 1e-3;
      if (modes.empty()) oracle_ms[s] = mean * 1e3;
    }
    m.tokens_per_s = total_s > 0 ? routed * static_cast<double>(n) / total_s : 0;
    m.p50 = Percentile(m.step_ms, 0.5);
    m.p99 = Percentile(m.step_ms, 0.99);
    std::vector<double> busy, quiet;
    double stall_sum = 0, stall_now = 0;
    int stalls = 0;
    for (size_t s = 0; s < n; ++s) {
      const bool reb = s < m.rebalancing.size() && m.rebalancing[s];
      (reb ? busy : quiet).push_back(m.step_ms[s]);
      if (reb) stall_now = std::max(stall_now, cost_ms[s]);
      if (!reb && stall_now > 0) {
        stall_sum += stall_now;
        ++stalls;
        stall_now = 0;
      }
    }
    if (stall_now > 0) {
      stall_sum += stall_now;
      ++stalls;
    }
    m.stall_ms = stalls > 0 ? stall_sum / stalls : 0;
    m.p99_rebalancing = Percentile(busy, 0.99);
    m.p99_quiet = Percentile(quiet, 0.99);
    for (double b : m.balancedness) m.mean_balancedness += b / static_cast<double>(n);
    modes.push_back(std::move(m));
  }
  json out;
  out["ranks"] = o.ranks;
  out["steps"] = o.steps;
  out["tokens_per_step"] = o.tokens;
  out["top_k"] = o.top_k;
  out["work_bytes_per_token"] = o.work_bytes_value;
  out["expert_bytes"] = o.expert_bytes_value;
  out["interval"] = o.interval;
  out["window"] = o.window > 0 ? o.window : o.interval;
  out["min_gain"] = o.min_gain;
  out["skip_above"] = o.skip_above;
  out["async_steps"] = o.async_steps;
  out["plan_lag"] = o.plan_lag;
  out["layers_in_flight"] = StagingLayers(o);
  out["tolerance"] = o.tolerance;
  out["policy"] = o.policy;
  out["wall_seconds"] = wall;
  out["step_time_model"] =
      "sum over layers of the slowest rank's expert work on the layer (thread CPU time) + Balancer "
      "cost (last rank in to last rank "
      "out of Step/Commit, CLOCK_MONOTONIC)";
  double oracle_s = 0;
  for (double v : oracle_ms) oracle_s += v * 1e-3;
  const double oracle_tps = oracle_s > 0 ? routed * static_cast<double>(n) / oracle_s : 0;
  // The hindsight ceiling: each interval under the placement planned (`balanced`) on that
  // interval's own gate load, moved for free; a layer's time is its mean work over the
  // ceiling's balancedness of the layer at that step (over every rank).
  double hindsight_tps = 0;
  if (error.empty() && !modes.empty()) {
    Result<LoadTrace> trace = DemoTrace(o);
    Result<std::vector<Balance>> ceiling =
        trace.ok() ? HindsightBalance(*trace, Topology{o.ranks, 1, o.ranks * o.slots_per_rank, 1},
                                      o.interval)
                   : Result<std::vector<Balance>>(trace.status());
    if (ceiling.ok() && ceiling->size() == n) {
      double total_s = 0;
      for (size_t s = 0; s < n; ++s) {
        for (int l = 0; l < o.layers; ++l) {
          const double b = (*ceiling)[s].per_layer[l];
          total_s += mean_ms[s * static_cast<size_t>(o.layers) + l] * 1e-3 / (b > 0 ? b : 1.0);
        }
      }
      hindsight_tps = total_s > 0 ? routed * static_cast<double>(n) / total_s : 0;
    }
  }
  json jm = json::object();
  double off_tps = 0;
  uint64_t bad = 0;
  for (const ModeSummary& m : modes) {
    if (m.mode == "off") off_tps = m.tokens_per_s;
    bad += m.bad_rows;
    jm[m.mode] = {{"tokens_per_s", m.tokens_per_s},
                  {"vs_off", 0.0},
                  {"vs_oracle", oracle_tps > 0 ? m.tokens_per_s / oracle_tps : 0.0},
                  {"step_ms_p50", m.p50},
                  {"step_ms_p99", m.p99},
                  {"step_ms_p99_rebalancing", m.p99_rebalancing},
                  {"step_ms_p99_quiet", m.p99_quiet},
                  {"stall_ms_per_rebalance", m.stall_ms},
                  {"mean_balancedness", m.mean_balancedness},
                  {"time_s",
                   {{"work_slowest_rank", m.work_s},
                    {"work_mean_rank", m.mean_work_s},
                    {"balancer", m.cost_s},
                    {"work_balancedness", m.work_s > 0 ? m.mean_work_s / m.work_s : 0.0}}},
                  {"rebalances", m.rebalances},
                  {"failed_rebalances", m.failed},
                  {"bytes_read", m.bytes_read},
                  {"bytes_copied", m.bytes_copied},
                  {"rows_checked", m.rows_checked},
                  {"bad_rows", m.bad_rows},
                  {"bytes_by_path", m.bytes_by_path},
                  {"bytes_by_rank_pair", m.pairs},
                  {"rebalance_log_rank0", m.log},
                  {"step_ms", m.step_ms},
                  {"balancedness", m.balancedness},
                  {"layers_committed", m.commits}};
  }
  // Of the gain over EPLB off that the oracle (or the hindsight ceiling) shows, the share a
  // mode captured.
  auto captured = [&](double tps, double ceiling) {
    return ceiling > off_tps && off_tps > 0 ? (tps - off_tps) / (ceiling - off_tps) : 0.0;
  };
  for (const ModeSummary& m : modes) {
    if (off_tps > 0) jm[m.mode]["vs_off"] = m.tokens_per_s / off_tps;
    jm[m.mode]["oracle_gain_captured"] = captured(m.tokens_per_s, oracle_tps);
    jm[m.mode]["hindsight_gain_captured"] = captured(m.tokens_per_s, hindsight_tps);
  }
  // Nodes: each rank names its host (EPLBX_NODE, else the host name); pairs of them.
  std::vector<std::string> nodes;
  std::vector<size_t> node_of(o.ranks, 0);
  for (int r = 0; r < o.ranks; ++r) {
    const auto it = reports.find(r);
    const std::string name =
        it != reports.end() && it->second.contains("node") && it->second["node"].is_string()
            ? it->second["node"].get<std::string>()
            : "?";
    const auto at = std::find(nodes.begin(), nodes.end(), name);
    node_of[r] = static_cast<size_t>(at - nodes.begin());
    if (at == nodes.end()) nodes.push_back(name);
  }
  for (ModeSummary& m : modes) {
    m.node_pairs.assign(nodes.size(), std::vector<uint64_t>(nodes.size(), 0));
    for (size_t src = 0; src < m.pairs.size(); ++src) {
      for (size_t dst = 0; dst < m.pairs[src].size(); ++dst)
        m.node_pairs[node_of[src]][node_of[dst]] += m.pairs[src][dst];
    }
    jm[m.mode]["bytes_by_node_pair"] = m.node_pairs;
  }
  out["nodes"] = nodes;
  out["modes"] = jm;
  out["oracle"] = {{"tokens_per_s", oracle_tps},
                   {"design", "the same work spread evenly over the ranks, nothing moved"}};
  out["hindsight"] = {
      {"tokens_per_s", hindsight_tps},
      {"design",
       "each interval under the balanced placement of its own load (known only afterwards), "
       "moved for free: each layer's mean work over that placement's balancedness"}};
  const bool verified = error.empty() && bad == 0 && modes.size() == o.mode_list.size();
  out["verified"] = verified;
  out["commit_mode"] = o.spare_rows > 0 ? "swap" : "in place";
  out["spare_rows"] = o.spare_rows;
  if (!error.empty()) out["error"] = error;
  if (!o.plot.empty() && !modes.empty()) WriteSvg(o.plot, modes, o.steps);
  if (o.json) {
    std::cout << out.dump(1) << "\n";
  } else if (!modes.empty()) {
    std::printf("%-7s %10s %7s %9s %8s %13s %11s %13s %6s %10s %11s %12s\n", "mode", "tokens/s",
                "vs off", "p50 ms", "p99 ms", "p99 rebal ms", "stall ms", "balancedness", "rebal",
                "MiB moved", "MiB copied", "rows checked");
    for (const ModeSummary& m : modes) {
      std::printf("%-7s %10.0f %7.2f %9.2f %8.2f %13.2f %11.2f %13.3f %6d %10.1f %11.1f %12llu\n",
                  m.mode.c_str(), m.tokens_per_s, off_tps > 0 ? m.tokens_per_s / off_tps : 0.0,
                  m.p50, m.p99, m.p99_rebalancing, m.stall_ms, m.mean_balancedness, m.rebalances,
                  static_cast<double>(m.bytes_read) / 1048576.0,
                  static_cast<double>(m.bytes_copied) / 1048576.0,
                  static_cast<unsigned long long>(m.rows_checked));
    }
    std::printf("%-7s %10.0f %7.2f   (the same work perfectly balanced, nothing moved)\n", "oracle",
                oracle_tps, off_tps > 0 ? oracle_tps / off_tps : 0.0);
    std::printf(
        "%-9s %8.0f %7.2f   (each interval planned on its own load, known afterwards, moved "
        "free)\n",
        "hindsight", hindsight_tps, off_tps > 0 ? hindsight_tps / off_tps : 0.0);
    for (const ModeSummary& m : modes) {
      if (m.mode == "off") continue;
      std::printf(
          "%s captures %.0f%% of the oracle's gain over off, %.0f%% of the hindsight "
          "ceiling's\n",
          m.mode.c_str(), 100 * captured(m.tokens_per_s, oracle_tps),
          100 * captured(m.tokens_per_s, hindsight_tps));
    }
    std::printf(
        "step time = sum over layers of the slowest rank's work on it (thread CPU time) + the "
        "Balancer's cost (last rank in to last rank out); commits %s; every row a step used "
        "checked against its map: %s; wall "
        "%.1f s%s\n",
        o.spare_rows > 0 ? StrCat("swap row tables (", o.spare_rows, " spare rows)").c_str()
                         : "in place (staging -> weights)",
        bad == 0 ? "yes" : "NO", wall, o.plot.empty() ? "" : StrCat(", plot: ", o.plot).c_str());
  }
  if (!error.empty()) return Status::Aborted(error);
  if (!verified) return Status::Internal("the serving demo did not verify (see the report)");
  return Status::OK();
}

}  // namespace eplbx::cli
