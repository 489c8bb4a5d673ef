// One rank of `eplbx demo`: real weights in shared memory, a real agent, a real Rearranger.
#include <malloc.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/demo.h"
#include "common/strings.h"
#include "eplbx/bootstrap.h"
#include "eplbx/env.h"
#include "eplbx/layout.h"
#include "eplbx/migration.h"
#include "eplbx/policy.h"
#include "eplbx/rearrange.h"
#include "eplbx/transfer.h"
#include "protocol/records.h"
#include "tools/measure.h"
#include "transfer/fault/fault_path.h"

namespace eplbx::cli {

using internal::StrCat;

uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

uint64_t PatternKey(uint32_t layer, uint32_t expert, uint32_t tensor) {
  return Mix((static_cast<uint64_t>(layer) << 42) ^ (static_cast<uint64_t>(expert) << 21) ^ tensor);
}

// The bytes of (layer, expert, tensor): word i is PatternWord(key, 8 i).
void Pattern(uint8_t* out, uint64_t n, uint32_t layer, uint32_t expert, uint32_t tensor) {
  const uint64_t key = PatternKey(layer, expert, tensor);
  uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const uint64_t w = Mix(key + i);
    std::memcpy(out + i, &w, 8);
  }
  const uint64_t tail = Mix(key + i);
  if (i < n) std::memcpy(out + i, &tail, n - i);
}

namespace {

// Load per layer: Zipf-like over a random permutation of experts.
std::vector<double> InitialLoad(const DemoOptions& o, std::mt19937_64& rng) {
  std::vector<double> load(static_cast<size_t>(o.layers) * o.experts);
  for (int l = 0; l < o.layers; ++l) {
    std::vector<int> perm(o.experts);
    for (int e = 0; e < o.experts; ++e) perm[e] = e;
    for (int e = o.experts - 1; e > 0; --e) std::swap(perm[e], perm[rng() % (e + 1)]);
    for (int e = 0; e < o.experts; ++e)
      load[l * o.experts + perm[e]] = 10000.0 / std::pow(e + 1.0, 1.0);
  }
  return load;
}

// Each expert's load times exp(N(0, 0.3)) (Box-Muller on the shared generator).
void Drift(std::vector<double>& load, std::mt19937_64& rng) {
  for (double& v : load) {
    const double u1 = (static_cast<double>(rng() >> 11) + 0.5) / 9007199254740992.0;
    const double u2 = static_cast<double>(rng() >> 11) / 9007199254740992.0;
    const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
    v *= std::exp(0.3 * z);
  }
}

}  // namespace

std::string NodeName() {
  if (std::string n = Env::Default()->GetVar("EPLBX_NODE").value_or(""); !n.empty()) return n;
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  return host;
}

void FillLayer(Weights& w, const Placement& map, int layer, int rank) {
  for (int row = 0; row < w.rows; ++row) {
    const uint32_t expert = static_cast<uint32_t>(map.phy2log(layer, rank * w.rows + row));
    for (size_t t = 0; t < w.bytes.size(); ++t) {
      const TensorSpec& s = w.layout.layers[layer][t];
      Pattern(reinterpret_cast<uint8_t*>(s.base) + w.Row(layer, row) * s.bytes_per_expert,
              s.bytes_per_expert, layer, expert, static_cast<uint32_t>(t));
    }
  }
}

// Checks every row of `layer` against `map`; returns the first wrong (row, tensor) or "".
std::string VerifyLayer(const Weights& w, const Placement& map, int layer, int rank) {
  std::vector<uint8_t> expect;
  for (int row = 0; row < w.rows; ++row) {
    const uint32_t expert = static_cast<uint32_t>(map.phy2log(layer, rank * w.rows + row));
    for (size_t t = 0; t < w.bytes.size(); ++t) {
      const TensorSpec& s = w.layout.layers[layer][t];
      expect.resize(s.bytes_per_expert);
      Pattern(expect.data(), s.bytes_per_expert, layer, expert, static_cast<uint32_t>(t));
      if (std::memcmp(
              expect.data(),
              reinterpret_cast<const uint8_t*>(s.base) + w.Row(layer, row) * s.bytes_per_expert,
              s.bytes_per_expert) != 0) {
        return StrCat("rank ", rank, " layer ", layer, " slot ", row, " (row ", w.Row(layer, row),
                      ") tensor ", t, " does not hold expert ", expert);
      }
    }
  }
  return "";
}

namespace {

// Resident memory of this process, MiB (/proc/self/statm).
double ResidentMiB() {
  std::ifstream in("/proc/self/statm");
  uint64_t size = 0, resident = 0;
  in >> size >> resident;
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE)) / (1 << 20);
}

// Bytes allocated with malloc and not yet freed, all arenas (glibc), in KiB. Unlike the
// resident size it does not move with page-cache or allocator slack, so a slow leak shows.
double HeapInUseKiB() {
  const struct mallinfo2 m = mallinfo2();
  return static_cast<double>(m.uordblks + m.hblkhd) / 1024;
}

// The fault drill of `--inject KIND:RANK[@transfer|@commit]` in layer 0, as rules of the
// fault-injecting wrappers around this rank's agent:
//   kill / stall: exit / SIGSTOP at the first READ this rank posts or READY it sends
//     (transfer: peers are reading from it, or it from them), or at its first DONE
//     (commit: its reads landed, peers may be committing);
//   bad-notify: its MAPS records (transfer) or DONE records (commit) to every peer go out
//     with an unsupported protocol version.
std::shared_ptr<internal::FaultPlan> DrillPlan(const DemoOptions& o) {
  using internal::Fault;
  using protocol::RecordKind;
  auto plan = std::make_shared<internal::FaultPlan>();
  auto is = [](std::string_view p, RecordKind kind) {
    Result<protocol::Record> r = protocol::DecodeRecord(p);
    return r.ok() && r->kind == kind;
  };
  const bool commit = o.fault_phase == "commit";
  if (o.fault == "bad-notify") {
    Fault f = Fault::Of(Fault::Action::kCorrupt);
    f.times = o.ranks - 1;  // one record to each peer
    f.match = [=](std::string_view p) {
      return is(p, commit ? RecordKind::kDone : RecordKind::kMaps);
    };
    f.rewrite = [](std::string p) {
      if (p.size() > 4) p[4] = 99;  // an unsupported record version
      return p;
    };
    plan->OnNotifications(f);
    return plan;
  }
  auto once = std::make_shared<std::once_flag>();
  const bool kill = o.fault == "kill";
  auto act = [once, kill] {
    std::call_once(*once, [kill] {
      if (kill) _exit(3);
      raise(SIGSTOP);
    });
  };
  Fault note = Fault::Of(Fault::Action::kRun);
  note.run = act;
  note.match = [=](std::string_view p) {
    return is(p, RecordKind::kDone) || (!commit && is(p, RecordKind::kReady));
  };
  plan->OnNotifications(note);
  if (!commit) {
    Fault read = Fault::Of(Fault::Action::kRun);
    read.op = internal::XferOp::kRead;
    read.run = act;
    plan->OnTransfers(read);
  }
  return plan;
}

}  // namespace

int StagingLayers(const DemoOptions& o) {
  if (o.spare_rows > 0 && o.spare_rows >= o.slots_per_rank) return std::max(o.layers_in_flight, 1);
  const uint64_t layer_bytes =
      o.expert_bytes_value * (static_cast<uint64_t>(o.slots_per_rank) + o.spare_rows);
  return static_cast<int>(std::clamp<uint64_t>((1ull << 30) / std::max<uint64_t>(layer_bytes, 1), 1,
                                               std::max(o.layers_in_flight, 1)));
}

Result<Weights> MakeWeights(const DemoOptions& o, int rank, Agent& agent) {
  // Every layer and tensor in one shared region, rows contiguous per tensor.
  Weights w;
  w.rows = o.slots_per_rank;
  w.spare = o.spare_rows;
  const int rows = w.rows + w.spare;
  uint64_t left = o.expert_bytes_value;
  for (int t = 0; t < o.tensors; ++t) {
    const uint64_t b = t + 1 < o.tensors
                           ? std::max<uint64_t>(8, (o.expert_bytes_value / o.tensors) & ~7ull)
                           : left;
    w.bytes.push_back(b);
    left -= std::min(left, b);
  }
  const uint64_t per_layer = o.expert_bytes_value * rows;
  EPLBX_ASSIGN_OR_RETURN(w.region, agent.AllocateShared(per_layer * o.layers));
  // Spare rows exist before anything is timed, as an engine's allocated tensors do (the
  // slots' rows are written by FillLayer).
  if (w.spare > 0) std::memset(w.region.data(), 0, per_layer * o.layers);
  w.layout.rank = static_cast<uint32_t>(rank);
  w.layout.spare_rows = static_cast<uint32_t>(w.spare);
  uint64_t cursor = w.region.addr();
  static const char* kNames[] = {"w13", "w2", "w13_scale", "w2_scale"};
  for (int l = 0; l < o.layers; ++l) {
    std::vector<TensorSpec> tensors;
    for (int t = 0; t < o.tensors; ++t) {
      TensorSpec s;
      s.name = t < 4 ? kNames[t] : StrCat("t", t);
      s.dtype = t < 2 ? "bf16" : "f32";
      s.expert_shape = {static_cast<int64_t>(w.bytes[t] / (t < 2 ? 2 : 4))};
      s.base = cursor;
      s.bytes_per_expert = w.bytes[t];
      s.rows = static_cast<uint32_t>(rows);
      cursor += w.bytes[t] * rows;
      tensors.push_back(std::move(s));
    }
    w.layout.layers.push_back(std::move(tensors));
    w.row_of_slot.emplace_back();
    for (int s = 0; s < w.rows; ++s) w.row_of_slot.back().push_back(static_cast<uint32_t>(s));
  }
  return w;
}

Result<std::unique_ptr<Agent>> MakeDemoAgent(const DemoOptions& o, int rank, bool drill,
                                             std::string_view suffix) {
  const auto deadline = std::chrono::milliseconds(static_cast<int64_t>(o.deadline_s * 1000));
  AgentConfig config;
  config.peer_timeout = std::min<std::chrono::milliseconds>(deadline / 2, std::chrono::seconds(30));
  Result<Transport> transport = ParseTransport(o.transport);
  config.transport = transport.ok() ? *transport : Transport::kAuto;
  config.paths = SplitPaths(o.paths);
  // A drill during the rearrangement runs inside this rank's transfer engine, through the
  // fault-injecting wrappers: no protocol record is forged and the Rearranger has no hooks.
  const std::string name = StrCat("rank", rank, suffix);
  return drill ? internal::CreateFaultyAgent(name, config, DrillPlan(o))
               : Agent::Create(name, config);
}

nlohmann::json NewRankReport(int rank) {
  return {{"rank", rank},
          {"verified", false},
          {"weights_intact", false},
          {"weights_created", false},
          {"error", ""}};
}

int RunDemoRank(const DemoOptions& o, int rank, SocketBootstrap& boot, nlohmann::json* sent) {
  nlohmann::json report = NewRankReport(rank);
  auto finish = [&](int code) {
    // When it failed (wall clock, microseconds): the report names the first failure, which
    // is the cause; later ones (peers that saw the first failing rank leave) are effects.
    if (!report["error"].get<std::string>().empty()) {
      report["failed_at_us"] = std::chrono::duration_cast<std::chrono::microseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count();
    }
    (void)boot.SendMessage(report.dump());
    if (sent != nullptr) *sent = report;
    return code;
  };
  const auto deadline = std::chrono::milliseconds(static_cast<int64_t>(o.deadline_s * 1000));
  const bool drill = o.fault_rank == rank && !o.fault.empty() && o.fault_phase != "exchange" &&
                     (o.fault == "kill" || o.fault == "stall" || o.fault == "bad-notify");
  Result<std::unique_ptr<Agent>> agent = MakeDemoAgent(o, rank, drill);
  if (!agent.ok()) {
    report["error"] = agent.status().message();
    return finish(1);
  }

  Result<Weights> made = MakeWeights(o, rank, **agent);
  if (!made.ok()) {
    report["error"] = made.status().message();
    return finish(1);
  }
  Weights w = std::move(*made);
  report["weights_created"] = true;

  // The same loads and plans on every rank (same seed, deterministic planners).
  std::mt19937_64 rng(o.seed);
  std::vector<double> load_values = InitialLoad(o, rng);
  Topology topo{o.ranks, 1, o.ranks * o.slots_per_rank, 1};
  Result<LoadMatrix> load0 = LoadMatrix::Create(o.layers, o.experts, load_values);
  Result<Placement> current = load0.ok() ? Plan(*load0, topo) : Result<Placement>(load0.status());
  if (!current.ok()) {
    report["error"] = current.status().message();
    return finish(1);
  }
  for (int l = 0; l < o.layers; ++l) FillLayer(w, *current, l, rank);

  // The layout this rank declares (faults lie here, the memory stays as it is).
  RankLayout declared = w.layout;
  if (o.fault == "stride-mismatch" && o.fault_rank == rank) {
    for (auto& tensors : declared.layers) {
      tensors[0].bytes_per_expert /= 2;
      tensors[0].dtype = "fp8_e4m3";
    }
  }
  if (o.fault == "missing-tensor" && o.fault_rank == rank) {
    for (auto& tensors : declared.layers) tensors.pop_back();
  }
  auto verify_all = [&](const std::vector<const Placement*>& maps) {
    std::string bad;
    for (int l = 0; l < o.layers && bad.empty(); ++l) bad = VerifyLayer(w, *maps[l], l, rank);
    return bad;
  };
  // A failure before anything moved: the weights must still match the initial maps.
  auto fail_setup = [&](const std::string& why) {
    report["error"] = why;
    report["weights_intact"] =
        verify_all(std::vector<const Placement*>(o.layers, &*current)).empty();
    return finish(1);
  };
  RearrangeOptions ro;
  ro.deadline = deadline;
  ro.layers_in_flight = o.layers_in_flight;
  // Ranks on one host form a node: the migration planner reads from the same node first
  // (when nodes are contiguous, equal groups of ranks) and the report counts cross-node bytes.
  Result<std::vector<std::string>> nodes = boot.AllGather(NodeName(), deadline);
  if (!nodes.ok()) return fail_setup(nodes.status().message());
  std::vector<std::string> names;
  for (const std::string& n : *nodes) {
    auto at = std::find(names.begin(), names.end(), n);
    ro.node_of_rank.push_back(static_cast<uint32_t>(at - names.begin()));
    if (at == names.end()) names.push_back(n);
  }
  const int per_node = o.ranks / static_cast<int>(names.size());
  bool contiguous = o.ranks % static_cast<int>(names.size()) == 0;
  for (int r = 0; r < o.ranks && contiguous; ++r)
    contiguous = ro.node_of_rank[r] == static_cast<uint32_t>(r / per_node);
  ro.nodes = contiguous ? static_cast<int>(names.size()) : 1;
  const bool faulty = o.fault_rank == rank;
  if (faulty && o.fault_phase == "exchange") {
    if (o.fault == "kill") _exit(3);
    if (o.fault == "stall") raise(SIGSTOP);
    if (o.fault == "bad-notify") {
      // A contribution that is not metadata + layout: every other rank must name this one.
      (void)boot.AllGather("not an eplbx contribution", deadline);
      return fail_setup("injected a bad contribution");
    }
  }
  Result<std::unique_ptr<Rearranger>> rearranger =
      Rearranger::Create(agent->get(), &boot, declared, ro);
  if (!rearranger.ok()) return fail_setup(rearranger.status().message());
  if (o.pipeline || (o.spare_rows == 0 && o.layers_in_flight > 1)) {
    // Staging for the pipeline or for layers in flight in place, before anything is timed:
    // in place a buffer (a layer's rows) per layer in flight, at most 1 GiB of them.
    AsyncOptions staging;
    staging.max_layers_in_flight = StagingLayers(o);
    Status reserved = (*rearranger)->Reserve(staging);
    if (!reserved.ok()) return fail_setup(reserved.message());
  }

  // Per-step figures, kept compact (turned into JSON at the end) so that the soak's
  // resident-memory check measures the library, not this report.
  struct StepFigures {
    double before, after;
    uint64_t bytes_read, bytes_cross_node, experts_read, bytes_copied, layers_swapped;
    double seconds;
    std::vector<PathTotals> paths;
  };
  std::vector<StepFigures> steps;
  steps.reserve(static_cast<size_t>(o.steps));
  // --limit-each-step: rank 0 measures the copy limit before the first step and after every
  // step (every rank past it, none checking its weights yet) while the other ranks wait, so
  // the yardstick is taken on the machine state of the steps around it. Not right before a
  // step: steps that started right after a measurement ran 14% slower (docs/perf.md); here
  // each starts after the checking and planning, as without the flag.
  std::vector<double> limits;
  limits.reserve(static_cast<size_t>(o.steps) + 1);
  std::optional<internal::CopyLimitProbe> probe;
  if (o.limit_each_step && rank == 0) probe.emplace(2);
  auto sample_limit = [&]() -> Status {
    if (!o.limit_each_step) return Status::OK();
    EPLBX_RETURN_IF_ERROR(boot.Barrier(deadline));
    if (probe) limits.push_back(probe->Sample(3));
    return boot.Barrier(deadline);  // nobody checks its weights meanwhile
  };
  bool ok = true;
  double rss_warm = 0, heap_warm = 0;
  const int heap_warm_step = std::min(o.steps, 10);  // UCX's pools fill in the first steps
  if (Status sampled = sample_limit(); !sampled.ok()) {
    report["error"] = sampled.message();
    ok = false;
  }
  for (int s = 1; s <= o.steps && ok; ++s) {
    Drift(load_values, rng);
    Result<LoadMatrix> load = LoadMatrix::Create(o.layers, o.experts, load_values);
    PlanOptions po;
    po.policy = Policy::kIncremental;
    po.previous = &*current;
    Result<Placement> next = load.ok() ? Plan(*load, topo, po) : Result<Placement>(load.status());
    if (!next.ok()) {
      report["error"] = next.status().message();
      ok = false;
      break;
    }
    Result<Balance> before = ComputeBalance(*current, *load, o.ranks);
    Result<Balance> after = ComputeBalance(*next, *load, o.ranks);
    // Start together, so a step's time is the rearrangement's, not another rank's checking.
    Status sync = boot.Barrier(deadline);
    if (!sync.ok()) {
      report["error"] = sync.message();
      ok = false;
      break;
    }
    RearrangeReport rr;
    if (o.pipeline) {
      // The asynchronous pipeline with no engine around it: Commit() whenever one is due
      // (AwaitCommit: no vote rounds while nothing changes), no budget (every READ posted as
      // soon as its READY comes), as many layers in flight as the synchronous loop
      // (StagingLayers: all of --layers-in-flight with a spare row per slot).
      const auto t0 = std::chrono::steady_clock::now();
      MigrationOptions mo;
      mo.ranks = o.ranks;
      mo.nodes = ro.nodes;
      Result<MigrationPlan> plan = PlanMigration(*current, *next, mo);
      AsyncOptions ao;
      ao.step_budget_bytes = UINT64_MAX / 4;
      ao.max_bytes_in_flight = UINT64_MAX / 4;
      ao.max_layers_in_flight = StagingLayers(o);
      Status begun = plan.ok() ? (*rearranger)->Begin(*current, *next, *plan, ao) : plan.status();
      rr.status = begun;
      while (begun.ok() && (*rearranger)->busy()) {
        if (!(*rearranger)->AwaitCommit(std::chrono::milliseconds(100))) continue;
        CommitResult c = (*rearranger)->Commit();
        if (c.finished) rr = (*rearranger)->async_report();
      }
      rr.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    } else {
      rr = (*rearranger)->Rearrange(*current, *next);
    }
    // End together too: on a host with fewer cores than ranks (this one: 2 for 4), a rank
    // that finished and checks every byte of its weights would take the cores of ranks
    // still finishing the last layer, and the step's time would count that checking.
    if (rr.status.ok()) {
      Status done = boot.Barrier(deadline);
      if (done.ok()) done = sample_limit();
      if (!done.ok()) rr.status = done.WithPrefix("after the rearrangement");
    }
    std::vector<const Placement*> published(o.layers, &*current);
    uint64_t copied = 0, swapped = 0;
    for (const LayerOutcome& lo : rr.layers) {
      if (lo.committed) published[lo.layer] = &*next;
      copied += lo.bytes_copied;
      swapped += lo.committed && lo.swapped;
    }
    for (int l = 0; l < o.layers; ++l) w.SetRows(l, (*rearranger)->RowTable(l));
    const std::string bad = verify_all(published);
    report["weights_intact"] = bad.empty();
    steps.push_back({before.ok() ? before->total : 0.0, after.ok() ? after->total : 0.0,
                     rr.bytes_read, rr.bytes_cross_node, rr.experts_read, copied, swapped,
                     rr.seconds, rr.bytes_by_path});
    if (!rr.status.ok()) {
      report["error"] = rr.status.message();
      ok = false;
    } else if (!bad.empty()) {
      report["error"] = StrCat("verification failed: ", bad);
      ok = false;
    } else {
      current = std::move(next);
      if (s == 1) rss_warm = ResidentMiB();
      if (s == heap_warm_step) heap_warm = HeapInUseKiB();
      if (rank == 0) {
        (void)boot.SendMessage(nlohmann::json{
            {"progress", StrCat("step ", s, "/", o.steps, ": ", rr.bytes_read >> 20,
                                " MiB read by rank 0 in ", rr.seconds, " s, every byte verified")}}
                                   .dump());
      }
    }
  }
  // Nobody tears its agent down while a peer may still be finishing the last layer (it
  // would see this rank vanish).
  if (ok) {
    Status sync = boot.Barrier(deadline);
    if (!sync.ok()) {
      report["error"] = sync.message();
      ok = false;
    }
  }
  const double rss_end = ResidentMiB(), heap_end = HeapInUseKiB();
  nlohmann::json js = nlohmann::json::array();
  for (const StepFigures& f : steps) {
    js.push_back({{"balancedness_before", f.before},
                  {"balancedness_after", f.after},
                  {"bytes_read", f.bytes_read},
                  {"bytes_cross_node", f.bytes_cross_node},
                  {"experts_read", f.experts_read},
                  {"bytes_copied", f.bytes_copied},
                  {"layers_swapped", f.layers_swapped},
                  {"seconds", f.seconds}});
    nlohmann::json paths = nlohmann::json::object();
    for (const PathTotals& p : f.paths) {
      if (p.bytes > 0) paths[p.path] = p.bytes;
    }
    js.back()["bytes_by_path"] = std::move(paths);
  }
  report["steps"] = std::move(js);
  if (!limits.empty()) report["copy_limit_samples_gbps"] = limits;
  report["rss_mib_after_first_step"] = rss_warm;
  report["rss_mib_end"] = rss_end;
  report["heap_kib_warm"] = heap_warm;
  report["heap_kib_end"] = heap_end;
  report["verified"] = ok;
  if (ok) report["weights_intact"] = true;
  return finish(ok ? 0 : 1);
}

}  // namespace eplbx::cli
