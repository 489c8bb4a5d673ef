// `eplbx migrate`: the transfers that turn one placement into another.
#include <cstdio>
#include <memory>
#include <sstream>
#include <string>

#include "cli/commands.h"
#include "cli/flags.h"
#include "common/strings.h"
#include "eplbx/migration.h"
#include "io/json_output.h"
#include "io/load_file.h"

namespace eplbx::cli {

namespace {

struct MigrateArgs {
  std::string from, to;
  std::string out = "-";
  std::string format = "json";
  MigrationOptions options;
};

std::string HumanBytes(uint64_t bytes) {
  char buf[64];
  const double b = static_cast<double>(bytes);
  if (b >= 1 << 30) {
    std::snprintf(buf, sizeof(buf), "%.2f GiB", b / (1 << 30));
  } else if (b >= 1 << 20) {
    std::snprintf(buf, sizeof(buf), "%.2f MiB", b / (1 << 20));
  } else {
    std::snprintf(buf, sizeof(buf), "%llu B", static_cast<unsigned long long>(bytes));
  }
  return buf;
}

std::string FormatTable(const MigrationPlan& plan, const MigrationOptions& o) {
  std::ostringstream out;
  const MigrationSummary& s = plan.summary;
  for (const LayerMigration& m : plan.layers) {
    out << "layer " << m.layer << ": " << m.transfers.size() << " remote reads in " << m.rounds
        << " rounds (lower bound " << m.rounds_lower_bound << "), " << m.local_copies.size()
        << " local copies, " << HumanBytes(m.bytes_remote) << " over the network ("
        << HumanBytes(m.bytes_cross_node) << " across nodes)\n";
    int round = -1;
    for (const RemoteRead& t : m.transfers) {
      if (t.round != round) {
        round = t.round;
        out << "  round " << round << ":";
      }
      out << "  " << t.src << "->" << t.dst << " e" << t.expert;
      if (&t == &m.transfers.back() || (&t)[1].round != round) out << "\n";
    }
  }
  char time[64];
  std::snprintf(time, sizeof(time), "%.6g", s.time_lower_bound_s);
  out << "\ntotal: " << s.remote_transfers << " remote reads, " << s.local_copies
      << " local copies, " << HumanBytes(s.bytes_moved) << " over the network ("
      << HumanBytes(s.cross_node_bytes) << " across nodes), " << s.rounds << " rounds (lower bound "
      << s.rounds_lower_bound << "); time lower bound at " << o.link_gbps << " Gb/s: " << time
      << " s\n";
  return out.str();
}

Status RunMigrate(const MigrateArgs& args) {
  if (args.format != "json" && args.format != "table") {
    return Status::InvalidArgument(
        internal::StrCat("--format is '", args.format, "' (expected json or table)"));
  }
  Result<Placement> from = io::ReadPlacementFile(args.from);
  if (!from.ok()) return from.status();
  Result<Placement> to = io::ReadPlacementFile(args.to);
  if (!to.ok()) return to.status();
  Result<MigrationPlan> plan = PlanMigration(*from, *to, args.options);
  if (!plan.ok()) return plan.status();
  const std::string text = args.format == "json"
                               ? io::MigrationToJson(*plan, args.options).dump() + "\n"
                               : FormatTable(*plan, args.options);
  return io::WriteOutput(args.out, text);
}

}  // namespace

void AddMigrateCommand(CLI::App& app, Action& run) {
  auto args = std::make_shared<MigrateArgs>();
  CLI::App* cmd =
      app.add_subcommand("migrate", "Plan the transfers that turn an old placement into a new one");
  cmd->add_option("--old", args->from, "Old placement: JSON with key \"phy2log\"")->required();
  cmd->add_option("--new", args->to, "New placement: JSON with key \"phy2log\"")->required();
  cmd->add_option("--ranks", args->options.ranks, "Expert-parallel ranks")
      ->required()
      ->check(IntIn<int>(0, 1 << 20));
  cmd->add_option("--nodes", args->options.nodes, "Nodes")
      ->capture_default_str()
      ->check(IntIn<int>(0, 1 << 20));
  cmd->add_option("--bytes-per-expert", args->options.bytes_per_expert,
                  "Bytes of one expert row (all its tensors)")
      ->capture_default_str()
      ->check(IntIn<uint64_t>(0, uint64_t{1} << 48));
  cmd->add_option("--link-gbps", args->options.link_gbps,
                  "Per-rank link bandwidth in Gb/s, for the time lower bound")
      ->capture_default_str()
      ->check(RealIn(1e-3, 1e6));
  cmd->add_option("--out", args->out, "Output file ('-' for stdout)")->capture_default_str();
  cmd->add_option("--format", args->format, "json or table")->capture_default_str();
  cmd->callback([&run, args] { run = [args] { return RunMigrate(*args); }; });
}

}  // namespace eplbx::cli
