// Internal: `eplbx demo` — ranks as processes on this machine, rearranging real weights.
#ifndef EPLBX_SRC_CLI_DEMO_H_
#define EPLBX_SRC_CLI_DEMO_H_

#include <cstdint>
#include <string>

#include <map>

#include <CLI/CLI.hpp>

#include <nlohmann/json.hpp>

#include "eplbx/bootstrap.h"
#include "eplbx/status.h"
#include "transfer/shm/measure.h"

namespace eplbx::cli {

struct DemoOptions {
  int ranks = 4;
  int layers = 8;
  int experts = 64;
  int slots_per_rank = 18;
  int tensors = 3;
  std::string expert_bytes = "1M";
  int steps = 3;
  double deadline_s = 30;
  uint64_t seed = 1;
  bool json = false;
  std::string inject;  // "", or KIND:RANK
  std::string transport = "auto";
  // Parsed:
  uint64_t expert_bytes_value = 0;
  std::string fault;  // kind of --inject
  int fault_rank = -1;
  std::string fault_phase;  // exchange, transfer (default) or commit
};

// One rank's life, in its own process; reports to the coordinator through `boot`. Returns
// the process exit code.
// `report` (optional) receives the report this rank sent.
int RunDemoRank(const DemoOptions& o, int rank, SocketBootstrap& boot,
                nlohmann::json* report = nullptr);

// Registers the flags `eplbx demo` and `eplbx worker` share (all but --ranks).
void AddDemoFlags(CLI::App& cmd, DemoOptions& o);

// Checks and completes parsed demo flags (sizes, fault spec).
Status ParseDemo(DemoOptions& o);

// Prints the report built from the ranks' reports (JSON or text); the Status says whether
// every step verified, or names the failure.
// A member's message (a report or a progress line) as the coordinator may use it: the JSON
// is parsed and every field the coordinator reads is type-checked. A message that fails is
// replaced by a report whose error names the rank and the field (a progress line by a note),
// so nothing a peer sends can throw in the coordinator. Empty for unparsable bytes.
nlohmann::json CheckMemberMessage(uint32_t rank, std::string_view bytes);

Status ReportDemo(const DemoOptions& o, const std::map<int, nlohmann::json>& reports,
                  double memcpy_gbps, double wall_seconds, const Status& coordinator);

}  // namespace eplbx::cli

#endif  // EPLBX_SRC_CLI_DEMO_H_
