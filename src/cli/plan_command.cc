// `eplbx plan`: a placement for a load file.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <string>

#include "cli/commands.h"
#include "cli/demo.h"  // SplitPaths
#include "cli/flags.h"
#include "common/strings.h"
#include "eplbx/env.h"
#include "eplbx/policy.h"
#include "eplbx/survivors.h"
#include "io/json_output.h"
#include "io/load_file.h"

namespace eplbx::cli {

namespace {

struct PlanArgs {
  std::string load;
  std::string out = "-";
  std::string policy = "deepseek";
  std::string format = "json";
  std::string previous;
  double tolerance = 0.002;
  Topology topology;
  std::string lost;             // "2,5": ranks lost (re-place over the survivors)
  int add_ranks = 0;            // elastic resize: ranks joining with empty slots
  std::string remove_ranks;     // elastic resize: "2,5": ranks leaving once drained
  std::string backup = "none";  // none or all: may orphaned experts come from a backup
};

// "2,5" -> {2, 5} as flags (true: not listed), each in [0, ranks), none twice; errors name
// `flag`.
Result<std::vector<bool>> ParseRankList(const std::string& list, int ranks,
                                        const std::string& flag) {
  std::vector<bool> live(ranks, true);
  for (const std::string& item : SplitPaths(list)) {
    size_t used = 0;
    long r = -1;
    try {
      r = std::stol(item, &used);
    } catch (...) {
      used = 0;
    }
    if (item.empty() || used != item.size() || r < 0 || r >= ranks) {
      return Status::InvalidArgument(internal::StrCat(flag, ": ", internal::Printable(item),
                                                      " is not a rank (expected 0..", ranks - 1,
                                                      ", comma-separated)"));
    }
    if (!live[r])
      return Status::InvalidArgument(internal::StrCat(flag, ": rank ", r, " listed twice"));
    live[r] = false;
  }
  return live;
}

// Numbers a plan's JSON may hold (phy2log, logcnt and the padded log2phy): about 1 GiB of
// memory while it is built.
constexpr int64_t kMaxJsonEntries = int64_t{1} << 24;

std::string Fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, v);
  return buf;
}

// Every layer's rank loads, replicas and slot ids (--format table-full).
std::string FormatFullTable(const Placement& p, const LoadMatrix& load, const Topology& t,
                            const Balance& balance) {
  std::ostringstream out;
  for (int l = 0; l < p.layers(); ++l) {
    const std::vector<double> loads = RankLoads(p, load, l, t.ranks);
    double max = 0, total = 0;
    for (double v : loads) {
      max = std::max(max, v);
      total += v;
    }
    out << "\nlayer " << l << "  balancedness " << Fixed(balance.per_layer[l], 4)
        << "  max rank load " << Fixed(max, 1) << "  mean " << Fixed(total / t.ranks, 1) << "\n";
    out << "  rank loads:";
    for (double v : loads) out << " " << Fixed(v, 0);
    out << "\n  replicated (expert x replicas):";
    bool any = false;
    for (int e = 0; e < p.experts(); ++e) {
      if (p.logcnt(l, e) > 1) {
        out << " " << e << "x" << p.logcnt(l, e);
        any = true;
      }
    }
    out << (any ? "\n" : " none\n");
    out << "  slots by rank:";
    for (int r = 0; r < t.ranks; ++r) {
      out << (r ? " |" : " ");
      for (int s = r * t.slots_per_rank(); s < (r + 1) * t.slots_per_rank(); ++s) {
        out << " " << p.phy2log(l, s);
      }
    }
    out << "\n";
  }
  return out.str();
}

// What a person reads at a glance (--format table): balancedness over the layers, the
// replication, and the least balanced layer's rank loads as bars (ties: the lower layer).
std::string FormatSummary(const Placement& p, const LoadMatrix& load, const Topology& t,
                          const Balance& balance) {
  std::ostringstream out;
  const int layers = p.layers();
  std::vector<int> order(layers);
  for (int l = 0; l < layers; ++l) order[l] = l;
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return balance.per_layer[a] < balance.per_layer[b]; });
  const int worst = order.front(), best = order.back(), median = order[layers / 2];
  out << "balancedness (mean / max rank load, 1 = perfect): total " << Fixed(balance.total, 4)
      << "\n  per layer: min " << Fixed(balance.per_layer[worst], 4) << " (layer " << worst
      << "), median " << Fixed(balance.per_layer[median], 4) << ", max "
      << Fixed(balance.per_layer[best], 4) << " (layer " << best << ")\n";
  int fewest = p.experts(), most = 0, top = 1;
  for (int l = 0; l < layers; ++l) {
    int replicated = 0;
    for (int e = 0; e < p.experts(); ++e) {
      replicated += p.logcnt(l, e) > 1;
      top = std::max(top, p.logcnt(l, e));
    }
    fewest = std::min(fewest, replicated);
    most = std::max(most, replicated);
  }
  out << "replicated experts per layer: " << fewest << (fewest == most ? "" : "-")
      << (fewest == most ? std::string() : std::to_string(most)) << " of " << p.experts()
      << "; most replicas of one expert: " << top << "\n";
  const std::vector<double> loads = RankLoads(p, load, worst, t.ranks);
  double max = 0, total = 0;
  for (double v : loads) {
    max = std::max(max, v);
    total += v;
  }
  out << "\nrank loads of layer " << worst << " (the least balanced; bar = load / max "
      << Fixed(max, 1) << ", mean " << Fixed(total / t.ranks, 1) << "):\n";
  constexpr int kWidth = 40;
  const int digits = static_cast<int>(std::to_string(t.ranks - 1).size());
  for (int r = 0; r < t.ranks; ++r) {
    const int filled = max > 0 ? static_cast<int>(loads[r] / max * kWidth + 0.5) : 0;
    std::string bar;
    for (int i = 0; i < kWidth; ++i) bar += i < filled ? "#" : ".";
    char label[32];
    std::snprintf(label, sizeof(label), "  rank %*d ", digits, r);
    out << label << bar << " " << Fixed(loads[r], 0) << "\n";
  }
  out << "\n(--format table-full: every layer's rank loads, replicas and slots)\n";
  return out.str();
}

std::string FormatTable(const Placement& p, const LoadMatrix& load, const Topology& t,
                        const Balance& balance, std::string_view policy, double plan_ms,
                        bool full) {
  std::ostringstream out;
  out << "policy " << policy << ": " << p.layers() << " layers, " << p.experts() << " experts -> "
      << p.slots() << " slots on " << t.ranks << " ranks / " << t.nodes << " nodes ("
      << (IsHierarchical(t) ? "hierarchical" : "global") << "), planned in " << Fixed(plan_ms, 3)
      << " ms\n";
  if (!full) return out.str() + FormatSummary(p, load, t, balance);
  out << FormatFullTable(p, load, t, balance);
  out << "\nbalancedness_total " << Fixed(balance.total, 4) << "\n";
  return out.str();
}

Status RunPlan(const PlanArgs& args) {
  if (args.format != "json" && args.format != "table" && args.format != "table-full") {
    return Status::InvalidArgument(
        internal::StrCat("--format is '", args.format, "' (expected json, table or table-full)"));
  }
  Result<Policy> policy = ParsePolicy(args.policy);
  if (!policy.ok()) return policy.status().WithPrefix("--policy");
  Result<LoadMatrix> load = io::ReadLoadFile(args.load);
  if (!load.ok()) return load.status();
  EPLBX_RETURN_IF_ERROR(
      args.topology.Validate(load->experts())
          .WithPrefix(internal::StrCat(args.load, " (", load->experts(), " experts)")));
  PlanOptions options;
  options.policy = *policy;
  options.tolerance = args.tolerance;
  Result<Placement> previous = Status::NotFound("no previous placement");
  if (!args.previous.empty()) {
    previous = io::ReadPlacementFile(args.previous, load->experts());
    if (!previous.ok()) return previous.status();
    options.previous = &*previous;
  } else if (*policy == Policy::kIncremental) {
    return Status::InvalidArgument(
        "--policy incremental needs --previous FILE (the placement in force, e.g. an earlier "
        "plan's output)");
  }
  if (!args.lost.empty() && (args.add_ranks != 0 || !args.remove_ranks.empty()))
    return Status::InvalidArgument("--lost and --add-ranks / --remove-ranks: one at a time");
  if (!args.lost.empty()) {
    if (options.previous == nullptr) {
      return Status::InvalidArgument(
          "--lost needs --previous FILE (the placement in force when the ranks were lost)");
    }
    if (args.backup != "none" && args.backup != "all") {
      return Status::InvalidArgument(internal::StrCat(
          "--backup is ", internal::Printable(args.backup), " (expected none or all)"));
    }
    Result<std::vector<bool>> live = ParseRankList(args.lost, args.topology.ranks, "--lost");
    if (!live.ok()) return live.status();
    SurvivorOptions so;
    so.policy = *policy == Policy::kDeepSeek ? Policy::kIncremental : *policy;
    so.tolerance = args.tolerance;
    if (args.backup == "all") so.backup = [](int, int) { return true; };
    const auto start = Env::Default()->Now();
    Result<SurvivorPlan> sp = PlanSurvivors(*previous, *load, args.topology, *live, so);
    const double plan_ms =
        std::chrono::duration<double, std::milli>(Env::Default()->Now() - start).count();
    if (!sp.ok()) return sp.status();
    Result<Balance> balance = ComputeBalance(sp->placement, *load, args.topology.ranks);
    if (!balance.ok()) return balance.status();
    const MigrationSummary& m = sp->migration.summary;
    nlohmann::json recovered = nlohmann::json::array();
    for (const RecoveredSlot& r : sp->recovered)
      recovered.push_back({{"layer", r.layer}, {"expert", r.expert}, {"slot", r.slot}});
    nlohmann::json survivors = {{"lost_ranks", sp->lost_ranks},
                                {"experts_recovered", sp->experts_recovered},
                                {"recovered_slots", recovered},
                                {"migration",
                                 {{"remote_transfers", m.remote_transfers},
                                  {"local_copies", m.local_copies},
                                  {"rounds", m.rounds}}}};
    if (args.format == "json") {
      nlohmann::json json = io::PlanToJson(PolicyName(so.policy), sp->placement, *balance, plan_ms);
      json["survivors"] = std::move(survivors);
      return io::WriteOutput(args.out, json.dump() + "\n");
    }
    std::string lost_list;
    for (int r : sp->lost_ranks) lost_list += internal::StrCat(lost_list.empty() ? "" : ", ", r);
    const std::string text =
        FormatTable(sp->placement, *load, args.topology, *balance, PolicyName(so.policy), plan_ms,
                    args.format == "table-full") +
        internal::StrCat("\nlost ranks ", lost_list, ": their slots are empty; ",
                         m.remote_transfers, " remote reads and ", m.local_copies,
                         " local copies among the survivors, then ", sp->recovered.size(),
                         " slots (", sp->experts_recovered,
                         " experts no survivor held) filled from the backup\n");
    return io::WriteOutput(args.out, text);
  }
  if (args.add_ranks != 0 || !args.remove_ranks.empty()) {
    if (options.previous == nullptr) {
      return Status::InvalidArgument(
          "--add-ranks / --remove-ranks need --previous FILE (the placement in force)");
    }
    ResizeRequest request;
    request.add = args.add_ranks;
    if (!args.remove_ranks.empty()) {
      Result<std::vector<bool>> stay =
          ParseRankList(args.remove_ranks, args.topology.ranks, "--remove-ranks");
      if (!stay.ok()) return stay.status();
      for (int r = 0; r < args.topology.ranks; ++r) {
        if (!(*stay)[r]) request.remove.push_back(r);
      }
    }
    SurvivorOptions so;
    so.policy = *policy == Policy::kDeepSeek ? Policy::kIncremental : *policy;
    so.tolerance = args.tolerance;
    const auto start = Env::Default()->Now();
    Result<ResizePlan> rp = PlanResize(*previous, *load, args.topology, request, so);
    const double plan_ms =
        std::chrono::duration<double, std::milli>(Env::Default()->Now() - start).count();
    if (!rp.ok()) return rp.status();
    Result<Balance> balance = ComputeBalance(rp->after, *load, rp->topology.ranks);
    if (!balance.ok()) return balance.status();
    const MigrationSummary& m = rp->migration.summary;
    if (args.format == "json") {
      nlohmann::json json = io::PlanToJson(PolicyName(so.policy), rp->after, *balance, plan_ms);
      json["resize"] = {{"added_ranks", rp->added_ranks},
                        {"removed_ranks", rp->removed_ranks},
                        {"members", rp->members},
                        {"ranks", rp->topology.ranks},
                        {"nodes", rp->topology.nodes},
                        {"migration",
                         {{"remote_transfers", m.remote_transfers},
                          {"local_copies", m.local_copies},
                          {"rounds", m.rounds}}}};
      return io::WriteOutput(args.out, json.dump() + "\n");
    }
    return io::WriteOutput(
        args.out, FormatTable(rp->after, *load, rp->topology, *balance, PolicyName(so.policy),
                              plan_ms, args.format == "table-full") +
                      internal::StrCat("\nresize: ", rp->added_ranks.size(), " ranks added, ",
                                       rp->removed_ranks.size(), " removed (drained first); ",
                                       rp->topology.ranks, " ranks after, on ", rp->topology.nodes,
                                       " nodes; ", m.remote_transfers, " remote reads and ",
                                       m.local_copies, " local copies\n"));
  }
  const auto start = Env::Default()->Now();
  Result<Placement> placement = Plan(*load, args.topology, options);
  const double plan_ms =
      std::chrono::duration<double, std::milli>(Env::Default()->Now() - start).count();
  if (!placement.ok()) return placement.status();
  Result<Balance> balance = ComputeBalance(*placement, *load, args.topology.ranks);
  if (!balance.ok()) return balance.status();
  const bool as_json = args.format == "json";
  if (as_json) {
    // log2phy is padded to the most replicas of any expert: a hot expert with thousands of
    // replicas multiplies it by the experts (issue 17, item 11).
    const int64_t entries =
        int64_t{placement->layers()} *
        (placement->slots() + int64_t{placement->experts()} * (1 + placement->max_replicas()));
    if (entries > kMaxJsonEntries) {
      return Status::InvalidArgument(internal::StrCat(
          "the plan's JSON would hold ", entries, " numbers (log2phy padded to ",
          placement->max_replicas(), " replicas for each of ", placement->experts(), " experts in ",
          placement->layers(), " layers); the limit is ", kMaxJsonEntries,
          ": use --format table, or fewer slots"));
    }
  }
  nlohmann::json json =
      as_json ? io::PlanToJson(args.policy, *placement, *balance, plan_ms) : nlohmann::json();
  std::string moves_line;
  if (options.previous != nullptr) {
    Result<Moves> moves = CountMoves(*options.previous, *placement, args.topology.ranks);
    if (!moves.ok()) return moves.status();
    if (as_json) json["moves"] = io::MovesToJson(*moves);
    moves_line = internal::StrCat("\nmoves from --previous: ", moves->total.remote_copies,
                                  " remote copies, ", moves->total.local_copies, " local copies, ",
                                  moves->total.unchanged_slots, " unchanged slots\n");
  }
  const std::string text = args.format == "json"
                               ? json.dump() + "\n"
                               : FormatTable(*placement, *load, args.topology, *balance,
                                             args.policy, plan_ms, args.format == "table-full") +
                                     moves_line;
  return io::WriteOutput(args.out, text);
}

}  // namespace

void AddPlanCommand(CLI::App& app, Action& run) {
  auto args = std::make_shared<PlanArgs>();
  CLI::App* cmd = app.add_subcommand("plan", "Place experts into slots for a load file");
  cmd->add_option("--load", args->load,
                  "Load per layer and logical expert: .json (2-D array or {\"load\": ...}), "
                  ".csv (one layer per line) or .npy (2-D)")
      ->required();
  cmd->add_option("--slots", args->topology.slots, "Physical slots in total (P)")
      ->required()
      ->check(IntIn<int>(0, 1 << 20));
  cmd->add_option("--ranks", args->topology.ranks, "Expert-parallel ranks (GPUs)")
      ->required()
      ->check(IntIn<int>(0, 1 << 20));
  cmd->add_option("--nodes", args->topology.nodes, "Nodes (hosts)")
      ->capture_default_str()
      ->check(IntIn<int>(0, 1 << 20));
  cmd->add_option("--groups", args->topology.groups, "Expert groups")
      ->capture_default_str()
      ->check(IntIn<int>(0, 1 << 20));
  cmd->add_option("--policy", args->policy, "Placement policy: deepseek, balanced or incremental")
      ->capture_default_str();
  cmd->add_option("--previous", args->previous,
                  "The placement in force (JSON with key \"phy2log\"): kept rows stay put; "
                  "required by --policy incremental; adds \"moves\" to the output");
  cmd->add_option("--tolerance", args->tolerance,
                  "incremental: allowed balancedness loss per layer against balanced")
      ->capture_default_str()
      ->check(RealIn(0, 1));
  cmd->add_option("--lost", args->lost,
                  "Ranks lost, comma-separated: re-place over the survivors from --previous "
                  "(incremental unless --policy balanced); adds \"survivors\" to the output");
  cmd->add_option("--backup", args->backup,
                  "--lost: none (an expert only lost ranks held is an error, named) or all (a "
                  "backup holds every expert: those are listed as recovered)")
      ->capture_default_str();
  cmd->add_option("--add-ranks", args->add_ranks,
                  "Elastic resize: ranks joining with empty slots (numbered after the existing "
                  "ones); re-place from --previous; the output is the placement after, with "
                  "\"resize\" (members, migration)")
      ->check(IntIn<int>(0, 1 << 16));
  cmd->add_option("--remove-ranks", args->remove_ranks,
                  "Elastic resize: ranks leaving gracefully, comma-separated (drained first: "
                  "the migration may read from them); ranks after are renumbered in order");
  cmd->add_option("--out", args->out, "Output file ('-' for stdout)")->capture_default_str();
  cmd->add_option("--format", args->format,
                  "json, table (a summary: balancedness, replication, the least balanced "
                  "layer's rank loads as bars) or table-full (every layer's loads and slots)")
      ->capture_default_str();
  cmd->callback([&run, args] { run = [args] { return RunPlan(*args); }; });
}

}  // namespace eplbx::cli
