// Internal: one mode of `eplbx demo --serve` on one rank (serve_rank.cc): its weights, agent
// and ServingGroup, the expert work of a step over the weights (every row it uses checked
// against the map in force), and the mode's report.
#ifndef EPLBX_SRC_CLI_SERVE_MODE_H_
#define EPLBX_SRC_CLI_SERVE_MODE_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/demo.h"
#include "cli/work_turns.h"
#include "eplbx/backup.h"
#include "eplbx/serving.h"
#include "eplbx/simulate.h"

namespace eplbx::cli {

// The gate's load of `eplbx demo --serve`: the simulator's skewed, drifting trace, the same
// on every rank (and in the coordinator's report, for the hindsight ceiling).
Result<LoadTrace> DemoTrace(const DemoOptions& o);

struct ModeRun {
  std::vector<double> cpu_s;  // steps x layers: this rank's work on each layer
  std::vector<double> balancedness;
  std::vector<int64_t> enter_ns, exit_ns;
  std::vector<int> rebalancing;  // 1 while a rebalance was in flight during the step
  std::vector<int> committed;    // layers whose map changed at this step's Commit
  uint64_t rows_checked = 0, bad_rows = 0;
  uint64_t checksum = 0;  // of the work (reported, so the compiler keeps it)
  std::string first_bad, error;
  bool verified = false;
};

// One mode's world on this rank: its own weights and agent, its ServingGroup (the Balancer,
// the Rearranger, the settling of member-set changes), what it measured.
struct Mode {
  std::string name;
  std::unique_ptr<Agent> agent;
  Weights w;
  std::unique_ptr<ServingGroup> group;
  ModeRun m;
  // The group's row tables (swap mode) into the weights the work reads.
  void TakeRowTables();
};

// The expert work of one step on `mode` (the `mode_index`-th of the run's modes): every row
// this rank holds, each routed token over `work` bytes of tensor 0 (which `segments` cycle
// through), checked against the pattern of the expert the placement in force names. With
// a `meeting`, each layer after the ranks met at it and in this rank's turn.
void Work(const DemoOptions& o, int rank, int step, std::span<const double> counts, Mode& mode,
          int mode_index, uint64_t work, uint64_t segments, Meeting* meeting);
nlohmann::json ModeReport(Mode& mode);
// The node's host backup for a drill with losses (`joiner`: a backup of its own, every
// expert loaded). On one host rank 0's file holds what every rank's slots hold under
// `initial`; `eplbx worker` (o.survive) loads every expert into each node's, as from the
// checkpoint: the demo's weights are a function of layer, expert and tensor.
Result<std::unique_ptr<HostBackup>> DemoBackup(const DemoOptions& o, Bootstrap& boot,
                                               const Weights& w, const Placement& initial,
                                               bool joiner, std::chrono::milliseconds wait);
// The ServingGroup options of mode `mode` (off, sync, async) from the demo's flags; the
// drill's `KIND:RANK@recovery` faults strike through its before_move (`modes[0]`'s group).
ServingOptions ModeOptions(const DemoOptions& o, int rank, const std::string& mode, Policy policy,
                           const std::vector<bool>& live, const std::vector<Mode>& modes);
// The drill's events of `step` on this rank: a kill or stop of this rank strikes; an `add`
// makes the lowest member ask the coordinator for the new process (*asked_ns: when).
Status StrikeEvents(const DemoOptions& o, int rank, int step, int64_t step_t0,
                    const std::function<Status(const std::string&)>& send, int64_t* asked_ns);

// What this rank saw of a drill's membership events (docs/cli.md, "Serving through a lost
// rank"): the step times around the ServingGroup's records.
struct DrillLog {
  int detected_step = -1;        // the step of the first event this rank settled
  double detect_wait_s = 0;      // from that step's start (a join: the request) until known here
  std::vector<int64_t> step_ns;  // wall-clock time of every step here, recovery included
};
// The rank report's "drill": the first settling's figures (and its phases), the members and
// epoch at the end, and every settling ("events").
nlohmann::json DrillReport(const ServingGroup& g, const DrillLog& log, uint64_t backup_bytes);

}  // namespace eplbx::cli

#endif  // EPLBX_SRC_CLI_SERVE_MODE_H_
