// `eplbx trace synth` (synthetic load traces) and `eplbx simulate` (what-if replay of EPLB
// settings on a trace, with --sweep over combinations and --plot).
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/flags.h"
#include "common/strings.h"
#include "eplbx/env.h"
#include "eplbx/simulate.h"
#include "io/json_output.h"
#include "io/trace_file.h"

namespace eplbx::cli {

namespace {

using internal::StrCat;
using nlohmann::json;

struct SynthArgs {
  SynthOptions options;
  std::string out = "-";
};

Status RunSynth(const SynthArgs& args) {
  EPLBX_ASSIGN_OR_RETURN(LoadTrace trace, SynthTrace(args.options));
  std::ostringstream text;
  io::WriteTrace(trace, text);
  return io::WriteOutput(args.out, text.str());
}

struct SimulateArgs {
  std::string trace, policy = "deepseek", sweep, plot, out = "-";
  SimulateOptions options;
  bool json = false;
};

// --sweep "window=100,1000,interval=50,200,policy=deepseek,balanced": a token with '='
// starts a key, the tokens after it (without '=') are more values of that key.
Result<std::vector<std::pair<std::string, std::vector<std::string>>>> ParseSweep(
    const std::string& spec) {
  std::vector<std::pair<std::string, std::vector<std::string>>> axes;
  std::stringstream in(spec);
  std::string token;
  while (std::getline(in, token, ',')) {
    const size_t eq = token.find('=');
    if (eq != std::string::npos) {
      const std::string key = token.substr(0, eq);
      if (key != "window" && key != "interval" && key != "policy" && key != "min_gain" &&
          key != "skip_above" && key != "lag") {
        return Status::InvalidArgument(
            StrCat("--sweep: unknown setting '", key,
                   "' (expected window, interval, policy, min_gain, skip_above or lag)"));
      }
      for (const auto& a : axes) {
        if (a.first == key) return Status::InvalidArgument(StrCat("--sweep: '", key, "' twice"));
      }
      axes.push_back({key, {}});
      token = token.substr(eq + 1);
    } else if (axes.empty()) {
      return Status::InvalidArgument(
          StrCat("--sweep: '", token, "' comes before any setting (expected KEY=V1,V2,...)"));
    }
    if (token.empty()) return Status::InvalidArgument("--sweep: empty value");
    axes.back().second.push_back(token);
  }
  if (axes.empty()) return Status::InvalidArgument("--sweep is empty (expected KEY=V1,V2,...)");
  return axes;
}

Status Apply(SimulateOptions& o, const std::string& key, const std::string& value) {
  const std::string what = StrCat("--sweep: ", key);
  if (key == "policy") {
    EPLBX_ASSIGN_OR_RETURN(o.policy, ParsePolicy(value));
    return Status::OK();
  }
  if (key == "window") {
    EPLBX_ASSIGN_OR_RETURN(o.window, internal::ParseInteger<int>(value, what, 1, 100000000));
  } else if (key == "interval") {
    EPLBX_ASSIGN_OR_RETURN(o.trigger.interval,
                           internal::ParseInteger<int>(value, what, 1, 100000000));
  } else if (key == "min_gain") {
    EPLBX_ASSIGN_OR_RETURN(o.trigger.min_gain, internal::ParseReal(value, what, 0, 1));
  } else if (key == "skip_above") {
    EPLBX_ASSIGN_OR_RETURN(o.trigger.skip_above, internal::ParseReal(value, what, 0, 2));
  } else if (key == "lag") {
    EPLBX_ASSIGN_OR_RETURN(o.lag_steps, internal::ParseInteger<int>(value, what, 0, 1000000));
  }
  return Status::OK();
}

json Summary(const SimulateResult& r, const SimulateOptions& o) {
  return {{"policy", PolicyName(o.policy)},
          {"window", o.window},
          {"interval", o.trigger.interval},
          {"min_gain", o.trigger.min_gain},
          {"skip_above", o.trigger.skip_above},
          {"lag", o.lag_steps},
          {"mean_balancedness", r.mean_balancedness},
          {"p5_balancedness", r.p5_balancedness},
          {"hindsight_mean_balancedness", r.hindsight_mean_balancedness},
          {"steady_mean_balancedness", r.steady_mean_balancedness},
          {"steady_p5_balancedness", r.steady_p5_balancedness},
          {"rebalances", r.rebalances},
          {"considered", r.considered},
          {"skipped_balanced", r.skipped_balanced},
          {"skipped_small_gain", r.skipped_small_gain},
          {"copies", r.copies},
          {"bytes_moved", r.bytes_moved},
          {"stall_seconds_est", r.stall_seconds_est}};
}

json Series(const SimulateResult& r) {
  json bal = json::array(), events = json::array();
  for (const SimulateStep& s : r.steps) bal.push_back(s.balancedness);
  for (const RebalanceEvent& e : r.events) {
    events.push_back({{"step", e.step},
                      {"window_before", e.window_before},
                      {"window_after", e.window_after},
                      {"copies", e.copies},
                      {"bytes", e.bytes},
                      {"stall_s", e.stall_s}});
  }
  return {{"balancedness", bal}, {"rebalance_events", events}};
}

std::string Text(const SimulateResult& r, const SimulateOptions& o) {
  char buf[512];
  std::snprintf(
      buf, sizeof buf,
      "%s, window %d, interval %d, lag %d: balancedness mean %.4f, p5 %.4f (after the first "
      "rebalance: %.4f, %.4f; hindsight ceiling %.4f); %lld rebalances "
      "(%lld considered, %lld skipped as balanced, %lld for small gain), %lld copies, "
      "%.2f GiB moved, stall estimate %.3f s\n",
      std::string(PolicyName(o.policy)).c_str(), o.window, o.trigger.interval, o.lag_steps,
      r.mean_balancedness, r.p5_balancedness, r.steady_mean_balancedness, r.steady_p5_balancedness,
      r.hindsight_mean_balancedness, static_cast<long long>(r.rebalances),
      static_cast<long long>(r.considered), static_cast<long long>(r.skipped_balanced),
      static_cast<long long>(r.skipped_small_gain), static_cast<long long>(r.copies),
      static_cast<double>(r.bytes_moved) / (1 << 30), r.stall_seconds_est);
  return buf;
}

std::string Row(const SimulateResult& r, const SimulateOptions& o) {
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "%-12s %6d  %8d  %3d  %8.3f  %10.3f  %8.4f  %6.4f  %11.4f  %9.4f  %9.4f  %10lld  "
                "%6lld  %9.2f  %7.3f\n",
                std::string(PolicyName(o.policy)).c_str(), o.window, o.trigger.interval,
                o.lag_steps, o.trigger.min_gain, o.trigger.skip_above, r.mean_balancedness,
                r.p5_balancedness, r.steady_mean_balancedness, r.steady_p5_balancedness,
                r.hindsight_mean_balancedness, static_cast<long long>(r.rebalances),
                static_cast<long long>(r.copies), static_cast<double>(r.bytes_moved) / (1 << 30),
                r.stall_seconds_est);
  return buf;
}

// The plotting script: EPLBX_PLOT_SCRIPT, else the installed copy, else the source tree's.
std::string PlotScript() {
  if (std::optional<std::string> env = Env::Default()->GetVar("EPLBX_PLOT_SCRIPT")) return *env;
  for (const char* p : {EPLBX_INSTALLED_PLOT_SCRIPT, EPLBX_SOURCE_PLOT_SCRIPT}) {
    if (std::filesystem::exists(p)) return p;
  }
  return EPLBX_SOURCE_PLOT_SCRIPT;
}

// Checked before anything runs: the extension, and a directory that exists.
Status CheckPlotPath(const std::string& path) {
  const std::filesystem::path p(path);
  const std::string ext = p.extension().string();
  if (ext != ".png" && ext != ".svg") {
    return Status::InvalidArgument(StrCat("--plot ", path, ": expected a .png or .svg file name"));
  }
  const std::filesystem::path dir = p.has_parent_path() ? p.parent_path() : ".";
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    return Status::InvalidArgument(
        StrCat("--plot ", path, ": directory ", dir.string(), " does not exist"));
  }
  return Status::OK();
}

// Draws the runs with Debian's matplotlib (scripts/plot_simulation.py). The script's
// stderr is kept; its last line goes into the error, not a traceback onto the terminal.
Status Plot(const json& runs, const std::string& path) {
  EPLBX_RETURN_IF_ERROR(CheckPlotPath(path));
  char tmpl[] = "/tmp/eplbx-simulate-XXXXXX";
  const int fd = mkstemp(tmpl);
  if (fd < 0) return Status::Internal("cannot create a temporary file for --plot");
  close(fd);
  {
    std::ofstream out(tmpl);
    out << runs.dump();
  }
  const std::string script = PlotScript();
  char err_tmpl[] = "/tmp/eplbx-plot-err-XXXXXX";
  const int err_fd = mkstemp(err_tmpl);
  const pid_t pid = fork();
  if (pid == 0) {
    if (err_fd >= 0) dup2(err_fd, STDERR_FILENO);
    execl("/usr/bin/python3", "python3", script.c_str(), tmpl, path.c_str(),
          static_cast<char*>(nullptr));
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  std::remove(tmpl);
  std::string last;
  if (err_fd >= 0) {
    close(err_fd);
    std::ifstream in(err_tmpl);
    for (std::string line; std::getline(in, line);) {
      if (!line.empty()) last = line.substr(0, 200);
    }
    std::remove(err_tmpl);
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    const bool no_matplotlib = last.find("matplotlib") != std::string::npos ||
                               (WIFEXITED(status) && WEXITSTATUS(status) == 127);
    return Status::Unavailable(StrCat(
        "--plot: ", script, " failed (exit ", WIFEXITED(status) ? WEXITSTATUS(status) : -1,
        last.empty() ? "" : ": " + last, ")",
        no_matplotlib
            ? "; it needs /usr/bin/python3 with matplotlib: apt-get install python3-matplotlib"
            : ""));
  }
  return Status::OK();
}

Status RunSimulate(SimulateArgs args) {
  EPLBX_ASSIGN_OR_RETURN(args.options.policy, ParsePolicy(args.policy));
  if (!args.plot.empty()) EPLBX_RETURN_IF_ERROR(CheckPlotPath(args.plot));
  EPLBX_ASSIGN_OR_RETURN(LoadTrace trace, io::ReadTraceFile(args.trace));
  // The combinations to run: one, or the cross product of --sweep's values.
  std::vector<SimulateOptions> runs{args.options};
  if (!args.sweep.empty()) {
    EPLBX_ASSIGN_OR_RETURN(auto axes, ParseSweep(args.sweep));
    for (const auto& [key, values] : axes) {
      std::vector<SimulateOptions> next;
      for (const SimulateOptions& base : runs) {
        for (const std::string& v : values) {
          SimulateOptions o = base;
          EPLBX_RETURN_IF_ERROR(Apply(o, key, v));
          next.push_back(o);
        }
      }
      runs = std::move(next);
    }
  }
  json all = json::array();
  std::string text;
  if (runs.size() > 1) {
    text =
        "policy       window  interval  lag  min_gain  skip_above  mean_bal  p5_bal  steady_mean  "
        "steady_p5  hindsight  rebalances  copies  GiB_moved  stall_s\n";
  }
  for (const SimulateOptions& o : runs) {
    Result<SimulateResult> r = Simulate(trace, o);
    if (!r.ok()) return r.status().WithPrefix(args.trace);
    json entry = Summary(*r, o);
    if (runs.size() == 1 || !args.plot.empty()) entry["series"] = Series(*r);
    all.push_back(entry);
    text += runs.size() > 1 ? Row(*r, o) : Text(*r, o);
  }
  if (!args.plot.empty()) EPLBX_RETURN_IF_ERROR(Plot(all, args.plot));
  if (!args.json) return io::WriteOutput(args.out, text);
  if (runs.size() == 1) return io::WriteOutput(args.out, all[0].dump() + "\n");
  for (json& e : all) e.erase("series");
  return io::WriteOutput(args.out, json{{"runs", all}}.dump() + "\n");
}

}  // namespace

void AddSimulateCommands(CLI::App& app, Action& run) {
  CLI::App* trace = app.add_subcommand("trace", "Load traces (JSON lines, one step per line)");
  trace->require_subcommand(1);
  auto sa = std::make_shared<SynthArgs>();
  CLI::App* synth = trace->add_subcommand(
      "synth", "Synthetic trace: Zipf base load, log-normal drift, hot-expert bursts, phases");
  SynthOptions& so = sa->options;
  synth->add_option("--layers", so.layers, "MoE layers")->required()->check(IntIn<int>(0, 4096));
  synth->add_option("--experts", so.experts, "Logical experts per layer")
      ->required()
      ->check(IntIn<int>(0, 65536));
  synth->add_option("--steps", so.steps, "Steps")->required()->check(IntIn<int64_t>(0, 100000000));
  synth->add_option("--seed", so.seed, "Seed (same trace on every machine)")
      ->capture_default_str()
      ->check(IntIn<uint64_t>(0, UINT64_MAX));
  synth->add_option("--zipf", so.zipf, "Zipf exponent of the base load")
      ->capture_default_str()
      ->check(RealIn(0, 10));
  synth->add_option("--drift", so.drift, "Per-step log-normal drift sigma")
      ->capture_default_str()
      ->check(RealIn(0, 2));
  synth
      ->add_option("--reversion", so.reversion,
                   "Per-step pull back toward the phase's base load (0: random walk)")
      ->capture_default_str()
      ->check(RealIn(0, 1));
  synth->add_option("--burst-prob", so.burst_prob, "Burst probability per layer and step")
      ->capture_default_str()
      ->check(RealIn(0, 1));
  synth->add_option("--burst-factor", so.burst_factor, "How much hotter a bursting expert runs")
      ->capture_default_str()
      ->check(RealIn(1, 1000));
  synth->add_option("--burst-steps", so.burst_steps, "Burst length in steps")
      ->capture_default_str()
      ->check(IntIn<int>(1, 1000000));
  synth->add_option("--phase-steps", so.phase_steps, "New traffic mix every N steps (0: never)")
      ->capture_default_str()
      ->check(IntIn<int64_t>(0, 100000000));
  synth->add_option("--tokens", so.tokens, "Tokens per step")
      ->capture_default_str()
      ->check(IntIn<int>(1, 1 << 30));
  synth->add_option("--top-k", so.top_k, "Experts per token")
      ->capture_default_str()
      ->check(IntIn<int>(1, 65536));
  synth->add_option("--out", sa->out, "Output file ('-' for stdout)")->capture_default_str();
  synth->callback([&run, sa] { run = [sa] { return RunSynth(*sa); }; });

  auto a = std::make_shared<SimulateArgs>();
  SimulateOptions& o = a->options;
  CLI::App* sim = app.add_subcommand("simulate", "Replay EPLB settings on a load trace");
  sim->add_option("--trace", a->trace, "Trace: JSON lines {\"step\": i, \"load\": [[...]]}")
      ->required();
  sim->add_option("--slots", o.topology.slots, "Physical expert slots per layer")
      ->required()
      ->check(IntIn<int>(0, 1 << 20));
  sim->add_option("--ranks", o.topology.ranks, "Expert-parallel ranks")
      ->required()
      ->check(IntIn<int>(0, 1 << 20));
  sim->add_option("--nodes", o.topology.nodes, "Nodes")
      ->capture_default_str()
      ->check(IntIn<int>(0, 1 << 20));
  sim->add_option("--groups", o.topology.groups, "Expert groups")
      ->capture_default_str()
      ->check(IntIn<int>(0, 1 << 20));
  sim->add_option("--policy", a->policy, "deepseek, balanced or incremental")
      ->capture_default_str();
  sim->add_option("--tolerance", o.tolerance, "incremental: balancedness loss allowed")
      ->capture_default_str()
      ->check(RealIn(0, 1));
  sim->add_option("--window", o.window, "Steps of load each plan is built from")
      ->capture_default_str()
      ->check(IntIn<int>(0, 100000000));
  sim->add_option("--interval", o.trigger.interval, "Consider a rebalance every N steps")
      ->capture_default_str()
      ->check(IntIn<int>(0, 100000000));
  sim->add_option("--min-gain", o.trigger.min_gain,
                  "Rebalance only if predicted balancedness gains at least this")
      ->capture_default_str()
      ->check(RealIn(0, 1));
  sim->add_option("--skip-above", o.trigger.skip_above,
                  "Skip when current balancedness on the window is at least this (>1: never)")
      ->capture_default_str()
      ->check(RealIn(0, 2));
  sim->add_option("--lag", o.lag_steps,
                  "Steps a new placement waits beyond the next step (asynchronous: plan lag + "
                  "READ steps)")
      ->capture_default_str()
      ->check(IntIn<int>(0, 1000000));
  sim->add_option("--bytes-per-expert", o.bytes_per_expert, "Bytes of one expert (all tensors)")
      ->capture_default_str()
      ->check(IntIn<uint64_t>(0, uint64_t{1} << 48));
  sim->add_option("--link-gbps", o.link_gbps, "Per-rank link bandwidth for the stall estimate")
      ->capture_default_str()
      ->check(RealIn(1e-3, 1e6));
  sim->add_option("--sweep", a->sweep,
                  "Combinations: window=100,1000,interval=50,200,policy=deepseek,balanced");
  sim->add_option("--plot", a->plot, "Draw balancedness over time to FILE.png or FILE.svg");
  sim->add_flag("--json", a->json, "JSON summary (with per-step series for one run)");
  sim->add_option("--out", a->out, "Output file ('-' for stdout)")->capture_default_str();
  sim->callback([&run, a] { run = [a] { return RunSimulate(*a); }; });
}

}  // namespace eplbx::cli
