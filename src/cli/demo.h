// Internal: `eplbx demo` — ranks as processes on this machine, rearranging real weights.
#ifndef EPLBX_SRC_CLI_DEMO_H_
#define EPLBX_SRC_CLI_DEMO_H_

#include <cstdint>
#include <string>
#include <vector>

#include <chrono>
#include <functional>
#include <map>
#include <mutex>

#include <CLI/CLI.hpp>

#include <nlohmann/json.hpp>

#include "eplbx/bootstrap.h"
#include "eplbx/layout.h"
#include "eplbx/placement.h"
#include "eplbx/status.h"
#include "eplbx/transfer.h"
#include "tools/measure.h"

namespace eplbx::cli {

struct DemoOptions {
  int ranks = 4;
  int layers = 8;
  int experts = 64;
  int slots_per_rank = 18;
  // Rows per layer beyond the slots (swap commit mode: READs land in them and a commit
  // publishes a new row table); 0: in place (staging, then a copy into the weights).
  int spare_rows = 0;
  // Layers the synchronous loop runs at once (RearrangeOptions::layers_in_flight); in place
  // the demo reserves a staging buffer for each.
  int layers_in_flight = 8;
  int tensors = 3;
  std::string expert_bytes = "1M";
  int steps = 3;
  double deadline_s = 30;
  // Coordination on etcd (eplbx worker --coordination): a lost member is seen when its lease
  // runs out, later than a closed socket: the rounds wait this much longer; and the
  // messages name etcd rather than rank 0's store.
  double lease_s = 0;
  std::string coordination;
  uint64_t seed = 1;
  bool json = false;
  std::string inject;  // "", or KIND:RANK
  std::string transport = "auto";
  std::string paths;  // "shm,cma,ucx": data paths in order; overrides transport
  // Parsed:
  uint64_t expert_bytes_value = 0;
  std::string fault;  // kind of --inject
  int fault_rank = -1;
  std::string fault_phase;  // exchange, transfer (default) or commit
  // --serve drills (KIND:RANK@STEP, KIND kill or stop): the step at which rank fault_rank
  // is killed or stopped; -1: no drill. The coordinator tracks membership then, and the
  // ranks keep a host backup in directory backup_dir (a private file, HostBackup).
  int fault_step = -1;
  std::string backup_dir;
  // `--inject KIND:RANK@STEP,KIND2:RANK2@recovery`: rank fault2_rank is killed or stopped
  // (fault2 "kill" or "stop") during the recovery from the first loss, as the move among the
  // survivors begins; "" / -1: no second fault.
  std::string fault2;
  int fault2_rank = -1;
  // `eplbx worker --serve`: any lost rank is survived as in the drills (membership, the
  // step's collective, recovery), with a backup of every expert on each node (in backup_dir,
  // made by the node's lowest rank); nothing needs to be injected.
  bool survive = false;
  // --serve --resize remove:RANK@STEP: rank RANK is drained at STEP and leaves (parsed into
  // fault "remove", fault_rank, fault_step).
  std::string resize;
  // Every membership event of a --serve drill, in step order (--inject kill|stop:RANK@STEP
  // and KIND:RANK@recovery, --resize remove|add:RANK@STEP); the first also sets fault,
  // fault_rank and fault_step, a @recovery one fault2 and fault2_rank.
  struct Event {
    std::string kind;  // kill, stop, remove, add
    int rank = -1;
    int step = -1;   // -1: during the recovery from the event before it (kill and stop)
    int after = -1;  // @recovery: the index among the stepped events it strikes after
  };
  std::vector<Event> events;
  // This process joins a group under way (a rank added by --resize add, or a lost rank's
  // process started again): ServingGroup::Join instead of Create.
  bool joining = false;
  // Rearrange with the asynchronous pipeline (Begin, Commit back to back) instead of the
  // synchronous loop.
  bool pipeline = false;
  // Measure the copy limit around every step (rank 0, before the first step and after every
  // step, the other ranks waiting) instead of once before the ranks start: each step's ratio
  // is to the mean of the two samples around it.
  bool limit_each_step = false;
  // --serve: forward steps of real expert work with EPLB off, synchronous, asynchronous.
  bool serve = false;
  bool steps_given = false;  // --steps was passed (else 3, or 300 with --serve)
  // The serving defaults were chosen with the simulator and confirmed on the serving demo
  // (docs/perf.md, "EPLB quality by default"): rebalance often, on a short window, only
  // when the placement has slipped and a new one gains enough to pay for the move.
  int interval = 5;               // steps between rebalances considered
  int window = 2;                 // steps of load a plan is built from (0: the interval)
  double min_gain = 0.05;         // TriggerOptions::min_gain
  double skip_above = 0.93;       // TriggerOptions::skip_above
  double tolerance = 0.002;       // incremental: balancedness loss allowed
  int async_steps = 1;            // AsyncOptions::target_steps
  int plan_lag = 1;               // BalancerOptions::plan_lag_steps
  int tokens = 512;               // tokens per forward step
  int top_k = 8;                  // experts per token
  std::string work_bytes = "4K";  // bytes of an expert's row one routed token works over
  std::string modes = "off,sync,async";
  std::string policy = "incremental";
  std::string plot;  // SVG file: step time over steps per mode
  uint64_t work_bytes_value = 0;
  std::vector<std::string> mode_list;
  // The WorkTurns (work_turns.h) the demo creates before forking: ranks do their expert work
  // one at a time, and on each layer close together in time.
  void* work_turns = nullptr;
};

// One rank's weights: every layer and tensor in one shared region, rows contiguous per
// tensor (slots, then spare rows); the row of slot s (row_of_slot) of (layer, tensor) holds
// the pattern of the expert the map puts in slot s.
struct Weights {
  RegisteredRegion region;
  RankLayout layout;            // true layout
  std::vector<uint64_t> bytes;  // per tensor bytes per expert
  int rows = 0;                 // slots per rank (the tensors have rows + spare rows)
  int spare = 0;
  std::vector<std::vector<uint32_t>> row_of_slot;  // [layer][slot] -> row in force
  uint64_t Row(int layer, int slot) const { return row_of_slot[layer][slot]; }
  // A commit's table (empty: a plan-only commit, nothing moved).
  void SetRows(int layer, const std::vector<uint32_t>& table) {
    if (!table.empty()) row_of_slot[layer] = table;
  }
};
Result<Weights> MakeWeights(const DemoOptions& o, int rank, Agent& agent);
// Layers in flight together (--layers-in-flight) as far as their staging buffers (a layer's
// rows each, in place) stay within 1 GiB per rank; at least 1. With a spare row per slot no
// layer takes a staging buffer: all of --layers-in-flight.
int StagingLayers(const DemoOptions& o);
// This rank's agent "rank<N><suffix>" (with the drill's fault wrappers when `drill`).
Result<std::unique_ptr<Agent>> MakeDemoAgent(const DemoOptions& o, int rank, bool drill,
                                             std::string_view suffix = {});
// The 8-byte word at byte `offset` (a multiple of 8) of the row of (layer, expert, tensor):
// a pattern anyone can recompute.
uint64_t PatternKey(uint32_t layer, uint32_t expert, uint32_t tensor);
uint64_t Mix(uint64_t x);
inline uint64_t PatternWord(uint64_t key, uint64_t offset) { return Mix(key + offset); }
// The demo's bytes of (layer, expert, tensor), n of them: word i is PatternWord(key, 8 i).
void Pattern(uint8_t* out, uint64_t n, uint32_t layer, uint32_t expert, uint32_t tensor);
void FillLayer(Weights& w, const Placement& map, int layer, int rank);
// Checks every row of `layer` against `map`; returns the first wrong (row, tensor) or "".
std::string VerifyLayer(const Weights& w, const Placement& map, int layer, int rank);

// One rank of `eplbx demo --serve`: forward steps of real expert work, EPLB off, synchronous
// and asynchronous (serve_rank.cc). Returns the process exit code; `sent` (if not null) gets
// the report sent to the coordinator (its "error" says why a failed rank failed).
// `send` carries messages to the coordinator (reports, progress, an `add`'s request for a
// process); over etcd there is none (each worker reports itself).
using SendToCoordinator = std::function<Status(const std::string&)>;
int RunServeRank(const DemoOptions& o, int rank, Bootstrap& boot, bool joining,
                 const SendToCoordinator& send, nlohmann::json* sent = nullptr);
// The same with `boot`'s own coordinator (SocketBootstrap::SendMessage, its welcome).
int RunServeRank(const DemoOptions& o, int rank, SocketBootstrap& boot,
                 nlohmann::json* sent = nullptr);
// The serving comparison from the ranks' reports (serve_report.cc).
Status ReportServing(const DemoOptions& o, const std::map<int, nlohmann::json>& reports,
                     double wall_seconds, const Status& coordinator);

// This rank's node: EPLBX_NODE, else the host name.
std::string NodeName();

// A rank's report before anything happened: nothing verified, no weights, no error.
nlohmann::json NewRankReport(int rank);

// One rank's life, in its own process; reports to the coordinator through `boot`. Returns
// the process exit code.
// `report` (optional) receives the report this rank sent.
int RunDemoRank(const DemoOptions& o, int rank, SocketBootstrap& boot,
                nlohmann::json* report = nullptr);

// Who is a member when step `step` begins, by the drill's events (a rank whose first event
// is `add` starts outside; @recovery faults strike with the event before them).
std::vector<bool> MembersAt(const DemoOptions& o, int step);

// "shm,cma,ucx" -> {"shm", "cma", "ucx"}; "" -> {}.
std::vector<std::string> SplitPaths(const std::string& list);

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

// `copy_limit_gbps`: two threads copying with streaming stores (0: not measured).
Status ReportDemo(const DemoOptions& o, const std::map<int, nlohmann::json>& reports,
                  double memcpy_gbps, double wall_seconds, const Status& coordinator,
                  double copy_limit_gbps = 0);

// The coordinator's side of a run, shared by `eplbx demo` (rank processes it forked) and
// `eplbx worker` rank 0 (ranks that joined its store): collects the ranks' reports, prints
// their progress lines, and decides when to stop waiting. Every rank's waits are bounded by
// the deadline: once one rank reported, the others get one deadline (plus 2 s) to report
// too. Thread-safe.
class ReportCollector {
 public:
  ReportCollector(const DemoOptions& o, bool print_progress);
  // A member's message: a report, or a progress line (printed when asked to).
  void OnMessage(uint32_t rank, std::string_view bytes);
  // True once every rank reported or `lost(rank)` says it never will, or the grace after
  // the first report passed.
  bool Settled(const std::function<bool(int rank)>& lost);
  bool Reported(int rank);
  // A report the coordinator writes itself (a rank it had to kill).
  void Add(int rank, nlohmann::json report);
  std::map<int, nlohmann::json> Reports();

 private:
  const int world_;
  const bool print_progress_;
  const std::chrono::milliseconds grace_;
  std::mutex mu_;
  std::map<int, nlohmann::json> reports_;
  std::chrono::steady_clock::time_point first_{};
};

}  // namespace eplbx::cli

#endif  // EPLBX_SRC_CLI_DEMO_H_
