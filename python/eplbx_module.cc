// The `eplbx._eplbx` extension: plans and migrations as numpy arrays, and the C++
// EplbCommunicator for eplbx.vllm. Status codes become typed exceptions; the GIL is
// released in every call that can block.
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "eplbx/balancer.h"
#include "eplbx/bootstrap.h"
#include "eplbx/etcd.h"
#include "eplbx/layout.h"
#include "eplbx/migration.h"
#include "eplbx/policy.h"
#include "eplbx/rearrange.h"
#include "eplbx/serving.h"
#include "eplbx/transfer.h"
#include "tools/measure.h"

namespace py = pybind11;

namespace eplbx::python {
namespace {

// Exception classes, created in the module init.
struct Exceptions {
  PyObject* base = nullptr;
  std::map<Code, PyObject*> by_code;
};
Exceptions g_exc;

[[noreturn]] void Throw(const Status& s) {
  auto it = g_exc.by_code.find(s.code());
  PyErr_SetString(it != g_exc.by_code.end() ? it->second : g_exc.base, s.message().c_str());
  throw py::error_already_set();
}

template <typename T>
T Take(Result<T> r) {
  if (!r.ok()) Throw(r.status());
  return std::move(*r);
}

void Check(const Status& s) {
  if (!s.ok()) Throw(s);
}

Result<LoadMatrix> ToLoad(const py::array_t<double, py::array::c_style | py::array::forcecast>& a) {
  if (a.ndim() != 2) {
    return Status::InvalidArgument("load must be a 2-D array (layers x experts), got " +
                                   std::to_string(a.ndim()) + " dimensions");
  }
  std::vector<double> v(a.data(), a.data() + a.size());
  return LoadMatrix::Create(static_cast<int>(a.shape(0)), static_cast<int>(a.shape(1)),
                            std::move(v));
}

// A phy2log array of integers in [-1, 2^31 - 1]: a float, bool or wider id is an error,
// never truncated or wrapped (pybind11's forcecast would do both).
py::array_t<int32_t, py::array::c_style> IdArray(const py::object& obj, const char* what) {
  py::array a = py::array::ensure(obj);
  if (!a) throw py::value_error(std::string(what) + " is not an array");
  const char kind = a.dtype().kind();
  if (kind != 'i' && kind != 'u') {
    Check(Status::InvalidArgument(std::string(what) + " has dtype " +
                                  std::string(py::str(a.dtype())) +
                                  "; expert ids must be integers"));
  }
  py::array_t<int32_t, py::array::c_style> out(
      std::vector<py::ssize_t>(a.shape(), a.shape() + a.ndim()));
  auto put = [&](auto wide) {
    const auto* d = wide.data();
    for (py::ssize_t i = 0; i < wide.size(); ++i) {
      bool bad = d[i] > INT32_MAX;
      if constexpr (std::is_signed_v<std::remove_cvref_t<decltype(*d)>>) bad = bad || d[i] < -1;
      if (bad) {
        Check(Status::InvalidArgument(std::string(what) + " holds expert id " +
                                      std::to_string(d[i]) + " at flat index " + std::to_string(i) +
                                      ", outside [-1, 2147483647]"));
      }
      out.mutable_data()[i] = static_cast<int32_t>(d[i]);
    }
  };
  if (kind == 'u')
    put(py::array_t<uint64_t, py::array::c_style | py::array::forcecast>(a));
  else
    put(py::array_t<int64_t, py::array::c_style | py::array::forcecast>(a));
  return out;
}

Result<Placement> ToPlacement(const py::array_t<int32_t, py::array::c_style>& a, int experts) {
  if (a.ndim() != 2)
    return Status::InvalidArgument("a placement must be a 2-D phy2log array (layers x slots)");
  std::vector<int32_t> v(a.data(), a.data() + a.size());
  int e = experts;
  if (e <= 0) {
    for (int32_t x : v) e = std::max(e, x + 1);
  }
  return Placement::FromPhy2Log(static_cast<int>(a.shape(0)), static_cast<int>(a.shape(1)), e,
                                std::move(v));
}

py::array_t<int32_t> Array2(const std::vector<int32_t>& v, size_t rows, size_t cols) {
  py::array_t<int32_t> a({rows, cols});
  std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(int32_t));
  return a;
}

// The Balancer without a Rearranger: decides when and what to rebalance; the caller moves
// the weights (with EplbxCommunicator, say) and switches to the maps Commit returns.
class PyBalancer {
 public:
  PyBalancer(const py::object& initial, int experts, int ranks, int nodes, int groups,
             const std::string& policy, int window, int interval, double min_gain,
             double skip_above, double tolerance) {
    Placement p = Take(ToPlacement(IdArray(initial, "initial"), experts));
    BalancerOptions o;
    o.topology = {ranks, nodes, p.slots(), groups};
    o.policy = Take(ParsePolicy(policy));
    o.tolerance = tolerance;
    o.window = window;
    o.trigger = {.interval = interval, .min_gain = min_gain, .skip_above = skip_above};
    b_ = Take(Balancer::Create(std::move(p), o));
  }
  py::dict Step(const py::array_t<double, py::array::c_style | py::array::forcecast>& counts) {
    const Placement& p = b_->placement();
    if (counts.ndim() != 2 || counts.shape(0) != p.layers() || counts.shape(1) != p.experts()) {
      Check(Status::InvalidArgument("counts must be a layers x experts array (" +
                                    std::to_string(p.layers()) + " x " +
                                    std::to_string(p.experts()) + ")"));
    }
    BalancerStep st = Take([&] {
      std::span<const double> c(counts.data(), static_cast<size_t>(counts.size()));
      py::gil_scoped_release release;
      return b_->Step(c);
    }());
    return py::dict(py::arg("balancedness") = st.balancedness,
                    py::arg("decision") = std::string(TriggerDecisionName(st.decision)),
                    py::arg("began") = st.began);
  }
  py::list Commit() {
    BalancerCommit c = b_->Commit();
    py::list out;
    for (const CommittedLayer& l : c.layers) {
      py::array_t<int32_t> map(l.phy2log.size());
      std::memcpy(map.mutable_data(), l.phy2log.data(), l.phy2log.size() * sizeof(int32_t));
      out.append(py::make_tuple(l.layer, map));
    }
    return out;
  }
  py::array_t<int32_t> Phy2Log() const {
    const Placement& p = b_->placement();
    return Array2(p.phy2log(), p.layers(), p.slots());
  }
  py::dict Report() const {
    const BalancerReport& r = b_->report();
    py::list rebalances;
    for (const RebalanceRecord& x : r.rebalances) {
      rebalances.append(
          py::dict(py::arg("step") = x.step, py::arg("window_before") = x.window_before,
                   py::arg("window_after") = x.window_after, py::arg("copies") = x.copies,
                   py::arg("bytes") = x.bytes, py::arg("plan_s") = x.plan_s,
                   py::arg("migration_plan_s") = x.migration_plan_s));
    }
    return py::dict(py::arg("steps") = r.steps, py::arg("considered") = r.considered,
                    py::arg("skipped_balanced") = r.skipped_balanced,
                    py::arg("skipped_small_gain") = r.skipped_small_gain,
                    py::arg("rebalances") = rebalances);
  }
  std::string Prometheus() const { return PrometheusText(b_->report(), b_->progress()); }

 private:
  std::unique_ptr<Balancer> b_;
};

struct PlanResult {
  py::array_t<int32_t> phy2log, log2phy, logcnt;
  double balancedness = 0;
  py::array_t<double> balancedness_per_layer;
  py::object moves = py::none();
};

PlanResult DoPlan(const py::array_t<double, py::array::c_style | py::array::forcecast>& load,
                  int slots, int ranks, int nodes, int groups, const std::string& policy,
                  const py::object& previous, double tolerance) {
  LoadMatrix lm = Take(ToLoad(load));
  Topology topo{ranks, nodes, slots, groups};
  PlanOptions options;
  options.policy = Take(ParsePolicy(policy));
  options.tolerance = tolerance;
  std::optional<Placement> prev;
  if (!previous.is_none()) {
    prev = Take(ToPlacement(IdArray(previous, "previous"), lm.experts()));
    options.previous = &*prev;
  }
  Result<Placement> plan = [&] {
    py::gil_scoped_release release;
    return Plan(lm, topo, options);
  }();
  Placement p = Take(std::move(plan));
  PlanResult out;
  out.phy2log = Array2(p.phy2log(), p.layers(), p.slots());
  out.logcnt = Array2(p.logcnt(), p.layers(), p.experts());
  // log2phy is padded to the most replicas of any expert (a hot expert with thousands of
  // replicas multiplies it by the experts): refused past 2^26 entries (256 MiB).
  const int64_t padded_entries = int64_t{p.layers()} * p.experts() * std::max(p.max_replicas(), 1);
  if (padded_entries > (int64_t{1} << 26)) {
    Check(Status::InvalidArgument("log2phy padded to " + std::to_string(p.max_replicas()) +
                                  " replicas for each of " + std::to_string(p.experts()) +
                                  " experts in " + std::to_string(p.layers()) +
                                  " layers would hold " + std::to_string(padded_entries) +
                                  " entries; the limit is 67108864 (fewer slots)"));
  }
  std::vector<int32_t> padded = p.Log2PhyPadded();
  py::array_t<int32_t> l2p({static_cast<size_t>(p.layers()), static_cast<size_t>(p.experts()),
                            static_cast<size_t>(std::max(p.max_replicas(), 1))});
  std::memcpy(l2p.mutable_data(), padded.data(), padded.size() * sizeof(int32_t));
  out.log2phy = l2p;
  Balance b = Take(ComputeBalance(p, lm, ranks));
  out.balancedness = b.total;
  out.balancedness_per_layer = py::array_t<double>(b.per_layer.size(), b.per_layer.data());
  if (prev) {
    Moves m = Take(CountMoves(*prev, p, ranks));
    out.moves = py::dict(py::arg("remote_copies") = m.total.remote_copies,
                         py::arg("local_copies") = m.total.local_copies,
                         py::arg("unchanged_slots") = m.total.unchanged_slots);
  }
  return out;
}

py::dict DoMigrate(const py::object& old_obj, const py::object& new_obj, int ranks, int nodes,
                   uint64_t bytes_per_expert, double link_gbps) {
  const auto old_map = IdArray(old_obj, "old");
  const auto new_map = IdArray(new_obj, "new");
  int experts = 0;
  for (const auto* a : {&old_map, &new_map}) {
    for (py::ssize_t i = 0; i < a->size(); ++i) experts = std::max(experts, a->data()[i] + 1);
  }
  Placement from = Take(ToPlacement(old_map, experts));
  Placement to = Take(ToPlacement(new_map, experts));
  MigrationOptions o;
  o.ranks = ranks;
  o.nodes = nodes;
  o.bytes_per_expert = bytes_per_expert;
  o.link_gbps = link_gbps;
  MigrationPlan plan = Take(PlanMigration(from, to, o));
  py::list layers;
  for (const LayerMigration& l : plan.layers) {
    py::array_t<int32_t> t({l.transfers.size(), size_t{6}});
    auto tv = t.mutable_unchecked<2>();
    for (size_t i = 0; i < l.transfers.size(); ++i) {
      const RemoteRead& r = l.transfers[i];
      const int32_t row[6] = {r.src, r.src_row, r.dst, r.dst_row, r.expert, r.round};
      for (int k = 0; k < 6; ++k) tv(i, k) = row[k];
    }
    py::array_t<int32_t> c({l.local_copies.size(), size_t{5}});
    auto cv = c.mutable_unchecked<2>();
    for (size_t i = 0; i < l.local_copies.size(); ++i) {
      const LocalCopy& x = l.local_copies[i];
      const int32_t row[5] = {x.rank, x.src_row, x.dst_row, x.expert,
                              x.source == CopySource::kOld ? 0 : 1};
      for (int k = 0; k < 5; ++k) cv(i, k) = row[k];
    }
    layers.append(py::dict(py::arg("transfers") = t, py::arg("local_copies") = c,
                           py::arg("rounds") = l.rounds, py::arg("bytes_remote") = l.bytes_remote));
  }
  const MigrationSummary& s = plan.summary;
  return py::dict(py::arg("layers") = layers, py::arg("remote_transfers") = s.remote_transfers,
                  py::arg("local_copies") = s.local_copies, py::arg("bytes_moved") = s.bytes_moved,
                  py::arg("cross_node_bytes") = s.cross_node_bytes, py::arg("rounds") = s.rounds,
                  py::arg("time_lower_bound_s") = s.time_lower_bound_s);
}

// An all-gather through a Python callable (bytes -> list of bytes, one per rank of the
// group; empty for a rank that is not a member), e.g. one built on
// torch.distributed.all_gather_object, or on a key-value store among the live ranks: the
// gather of a MembersView (the library's engine-fed membership). Called without the GIL; takes
// it for the call. The callable is released with the GIL held, whichever thread drops it.
MembersView::Gather PyGather(uint32_t rank, py::function fn) {
  std::shared_ptr<py::function> held(new py::function(std::move(fn)), [](py::function* f) {
    py::gil_scoped_acquire gil;
    delete f;
  });
  return [rank, held](uint64_t, std::string_view mine,
                      std::chrono::milliseconds) -> Result<std::vector<std::string>> {
    py::gil_scoped_acquire gil;
    try {
      py::list got = (*held)(py::bytes(std::string(mine)));
      std::vector<std::string> out;
      for (auto item : got) out.push_back(item.cast<std::string>());
      return out;
    } catch (py::error_already_set& e) {
      return Status::Unavailable("rank " + std::to_string(rank) +
                                 ": all-gather failed: " + e.what());
    } catch (py::cast_error& e) {
      return Status::Corruption(
          "rank " + std::to_string(rank) +
          ": the all-gather returned something other than bytes: " + e.what());
    }
  };
}

// The layout of this rank's weights from Python: per layer, per tensor (name, dtype, expert
// shape, base address, bytes per expert, rows).
RankLayout ToLayout(uint32_t rank, const py::list& layers) {
  RankLayout layout;
  layout.rank = rank;
  for (auto l : layers) {
    std::vector<TensorSpec> tensors;
    for (auto t : l.cast<py::list>()) {
      auto x = t.cast<py::tuple>();
      TensorSpec s;
      s.name = x[0].cast<std::string>();
      s.dtype = x[1].cast<std::string>();
      s.expert_shape = x[2].cast<std::vector<int64_t>>();
      s.base = x[3].cast<uint64_t>();
      s.bytes_per_expert = x[4].cast<uint64_t>();
      s.rows = x[5].cast<uint32_t>();
      tensors.push_back(std::move(s));
    }
    layout.layers.push_back(std::move(tensors));
  }
  return layout;
}

// Agent + registered regions + communicator, owned together.
class Communicator {
 public:
  // `members` (optional, one flag per rank): the ranks that take part (an engine's live
  // ranks); the others are neither connected to nor read from, and the all-gather returns
  // nothing for them.
  Communicator(uint32_t rank, uint32_t world, py::function allgather, const py::list& layers,
               const py::list& regions, double timeout_s, const std::string& transport,
               const std::string& paths, const std::optional<std::vector<bool>>& members) {
    AgentConfig config;
    config.transport = Take(ParseTransport(transport));
    // "shm,cma,ucx": the data paths in order (docs/transfer.md); the agent checks the names.
    for (size_t at = 0; !paths.empty() && at <= paths.size();) {
      const size_t comma = std::min(paths.find(',', at), paths.size());
      config.paths.push_back(paths.substr(at, comma - at));
      at = comma + 1;
    }
    const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
    config.peer_timeout =
        std::max(std::chrono::milliseconds(100),
                 std::min<std::chrono::milliseconds>(timeout / 2, std::chrono::seconds(30)));
    agent_ = Take(Agent::Create("rank" + std::to_string(rank), config));
    for (auto r : regions) {
      auto t = r.cast<py::tuple>();
      regions_.push_back(Take(agent_->RegisterMemory(
          reinterpret_cast<void*>(t[0].cast<uintptr_t>()), t[1].cast<size_t>())));
    }
    const RankLayout layout = ToLayout(rank, layers);
    if (members && members->size() != world) {
      Throw(Status::InvalidArgument("members has " + std::to_string(members->size()) +
                                    " flags for a group of " + std::to_string(world) + " ranks"));
    }
    if (members && !(*members)[rank]) {
      Throw(Status::InvalidArgument("rank " + std::to_string(rank) +
                                    " is not among the members it was given"));
    }
    boot_ = std::make_unique<MembersView>(rank, world, PyGather(rank, std::move(allgather)),
                                          members.value_or(std::vector<bool>{}));
    RearrangeOptions o;
    o.deadline = timeout;
    Result<std::unique_ptr<EplbCommunicator>> comm = [&] {
      py::gil_scoped_release release;
      return EplbCommunicator::Create(agent_.get(), boot_.get(), layout, o);
    }();
    comm_ = Take(std::move(comm));
  }

  // Maps arrive as int32 arrays already checked (integral, in range) by eplbx/vllm.py.
  void SetTransferContext(const py::array_t<int32_t, py::array::c_style>& old, uint32_t layer,
                          const std::optional<py::array_t<int32_t, py::array::c_style>>& next,
                          bool kept_rows_copied) {
    std::span<const int32_t> new_map;
    if (next) new_map = std::span<const int32_t>(next->data(), next->size());
    Check(comm_->SetTransferContext(std::span<const int32_t>(old.data(), old.size()), layer,
                                    new_map, kept_rows_copied));
  }
  void AddSend(uint32_t dst, uint32_t expert) { Check(comm_->AddSend(dst, expert)); }
  // `rows`: (address, bytes) of each receive row.
  void AddRecv(uint32_t src, uint32_t expert,
               const std::vector<std::pair<uintptr_t, uint64_t>>& rows) {
    std::vector<Descriptor> d;
    for (const auto& [addr, bytes] : rows) d.push_back({addr, bytes});
    Check(comm_->AddRecv(src, expert, d));
  }
  void Execute() {
    Status s;
    {
      py::gil_scoped_release release;
      s = comm_->Execute();
    }
    Check(s);
  }
  void Abort(const std::string& reason) {
    Status s = comm_->Abort(reason);
    if (!s.ok() && s.code() != Code::kAborted) Check(s);
  }
  bool failed() const { return comm_->failed(); }
  // Registers memory this rank only receives into (scratch rows): local, no exchange with the
  // peers, so any rank may call it at any time. Returns a handle for UnregisterLocal (before
  // the memory is freed).
  uint64_t RegisterLocal(uintptr_t addr, size_t bytes) {
    local_[++last_local_] = Take(agent_->RegisterMemory(reinterpret_cast<void*>(addr), bytes));
    return last_local_;
  }
  void UnregisterLocal(uint64_t handle) {
    if (local_.erase(handle) == 0) {
      Throw(Status::NotFound("no local region " + std::to_string(handle) + " is registered"));
    }
  }

 private:
  std::unique_ptr<Agent> agent_;
  std::vector<RegisteredRegion> regions_;
  std::map<uint64_t, RegisteredRegion> local_;
  uint64_t last_local_ = 0;
  std::unique_ptr<MembersView> boot_;
  std::unique_ptr<EplbCommunicator> comm_;
};

py::array_t<int32_t> Phy2Log(const Placement& p) {
  py::array_t<int32_t> out({static_cast<size_t>(p.layers()), static_cast<size_t>(p.slots())});
  std::memcpy(out.mutable_data(), p.phy2log().data(), p.phy2log().size() * sizeof(int32_t));
  return out;
}

// The built-in coordinator (the TCP store with membership and epochs) served on a thread of
// this process: one host, development, tests (docs/python.md, "Serving").
class Store {
 public:
  Store(const std::string& addr, uint16_t port, const std::string& token, uint32_t world,
        double deadline_s) {
    auto s = Take(TcpStore::Listen(addr, port, token, world));
    s->set_membership(true);
    store_ = std::move(s);
    const auto deadline = std::chrono::milliseconds(static_cast<int64_t>(deadline_s * 1000));
    thread_ = std::thread([this, deadline] {
      status_ = store_->Serve(
          deadline, deadline * 100, [](uint32_t, std::string) {}, [this] { return stop_.load(); },
          deadline * 4 / 5);
    });
  }
  ~Store() { Close(); }
  uint16_t port() const { return store_->port(); }
  void Close() {
    stop_ = true;
    if (thread_.joinable()) {
      py::gil_scoped_release release;
      thread_.join();
    }
  }

 private:
  std::unique_ptr<TcpStore> store_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  Status status_;
};

// eplbx.ServingGroup's C++ half: this rank's agent, registered weights, bootstrap (the
// store) and ServingGroup, owned together. Every blocking call releases the GIL.
class PyServingGroup {
 public:
  PyServingGroup(uint32_t rank, uint32_t world, const std::string& addr, uint16_t port,
                 const std::string& token, const py::list& layers, const py::list& regions,
                 const py::object& initial, int experts, int nodes, const std::string& policy,
                 int window, int interval, const std::string& mode, double deadline_s,
                 const std::string& backup_dir, const std::string& node, const std::string& group) {
    const auto deadline = std::chrono::milliseconds(static_cast<int64_t>(deadline_s * 1000));
    AgentConfig config;
    config.peer_timeout =
        std::max(std::chrono::milliseconds(100),
                 std::min<std::chrono::milliseconds>(deadline / 2, std::chrono::seconds(30)));
    agent_ = Take(Agent::Create("serving" + std::to_string(rank), config));
    for (auto r : regions) {
      auto t = r.cast<py::tuple>();
      regions_.push_back(Take(agent_->RegisterMemory(
          reinterpret_cast<void*>(t[0].cast<uintptr_t>()), t[1].cast<size_t>())));
    }
    const RankLayout layout = ToLayout(rank, layers);
    const int rows = layout.layers.empty() ? 0 : static_cast<int>(layout.slots(0));
    ServingOptions o;
    o.balancer.topology = {.ranks = static_cast<int>(world),
                           .nodes = nodes,
                           .slots = static_cast<int>(world) * rows,
                           .groups = 1};
    o.balancer.policy = Take(ParsePolicy(policy));
    o.balancer.window = window;
    o.balancer.trigger.interval = interval;
    if (mode != "async" && mode != "sync") {
      Throw(Status::InvalidArgument("mode is '" + mode + "': expected 'async' or 'sync'"));
    }
    o.balancer.mode = mode == "sync" ? BalancerMode::kSynchronous : BalancerMode::kAsynchronous;
    uint64_t row_bytes = 0;
    for (const std::vector<TensorSpec>& l : layout.layers) {
      for (const TensorSpec& t : l) row_bytes += t.bytes_per_expert;
    }
    o.balancer.bytes_per_expert = layout.layers.empty() ? 0 : row_bytes / layout.layers.size();
    o.rearrange.deadline = deadline;
    o.round_wait = deadline * 2;
    // The initial placement (a joiner's comes from the members; None is fine then).
    std::optional<Placement> start;
    if (!initial.is_none()) {
      auto a = py::array_t<int32_t, py::array::c_style | py::array::forcecast>::ensure(initial);
      if (!a || a.ndim() != 2) {
        Throw(Status::InvalidArgument("initial must be a 2-D array (layers x slots)"));
      }
      start = Take(Placement::FromPhy2Log(static_cast<int>(a.shape(0)),
                                          static_cast<int>(a.shape(1)), experts,
                                          std::vector<int32_t>(a.data(), a.data() + a.size())));
    }
    Status set_up;
    {
      py::gil_scoped_release release;
      set_up = SetUp(addr, port, token, group, rank, world, deadline, layout, experts, o, start,
                     backup_dir, node);
    }
    Check(set_up);
  }

  // Joins the store, then joins the group (welcomed as a joiner) or creates it with the
  // others (the node's backup first, when a directory is given). Without the GIL.
  Status SetUp(const std::string& addr, uint16_t port, const std::string& token,
               const std::string& group, uint32_t rank, uint32_t world,
               std::chrono::milliseconds deadline, const RankLayout& layout, int experts,
               const ServingOptions& o, std::optional<Placement>& start,
               const std::string& backup_dir, const std::string& node) {
    bool joining = false;
    if (addr.rfind("etcd://", 0) == 0) {  // coordination on etcd: no coordinator process
      EtcdOptions eo;
      EPLBX_ASSIGN_OR_RETURN(eo.endpoints, ParseEtcdUrl(addr));
      eo.group = group;
      eo.token = token;
      eo.lease = std::chrono::seconds(
          std::max<int64_t>(2, std::chrono::duration_cast<std::chrono::seconds>(deadline).count()));
      eo.start_timeout = deadline * 5;
      EPLBX_ASSIGN_OR_RETURN(std::unique_ptr<EtcdBootstrap> b,
                             EtcdBootstrap::Join(rank, world, std::move(eo)));
      joining = b->joining();
      boot_ = std::move(b);
    } else {
      EPLBX_ASSIGN_OR_RETURN(std::unique_ptr<SocketBootstrap> b,
                             JoinTcpStore(addr, port, token, rank, world, deadline * 5));
      joining = b->joining();
      boot_ = std::move(b);
    }
    if (joining) {
      EPLBX_ASSIGN_OR_RETURN(group_,
                             ServingGroup::Join(agent_.get(), boot_.get(), layout, experts, o));
      return Status::OK();
    }
    if (!start) {
      return Status::InvalidArgument(
          "initial is None, but this process starts with the group (not a joiner): pass the "
          "placement in force");
    }
    std::vector<const BackupSource*> backups;
    if (!backup_dir.empty()) {
      EPLBX_ASSIGN_OR_RETURN(
          backup_, SetUpNodeBackup(*boot_, node, backup_dir, layout, experts, *start, deadline));
      backups.push_back(backup_.get());
    }
    EPLBX_ASSIGN_OR_RETURN(group_, ServingGroup::Create(agent_.get(), boot_.get(), layout,
                                                        std::move(*start), o, backups));
    return Status::OK();
  }

  py::dict Step(const py::array_t<double, py::array::c_style | py::array::forcecast>& counts) {
    ServingGroup& g = group();
    Result<BalancerStep> r = Status::Internal("not stepped");
    {
      std::span<const double> c(counts.data(), counts.size());
      py::gil_scoped_release release;
      r = g.Step(c);
    }
    const BalancerStep st = Take(std::move(r));
    return py::dict(py::arg("balancedness") = st.balancedness, py::arg("began") = st.began);
  }
  void Poll() {
    ServingGroup& g = group();
    py::gil_scoped_release release;
    g.Poll();
  }
  // [(layer, phy2log, row_of_slot)] in force from now on.
  py::list Commit() {
    ServingGroup& g = group();
    BalancerCommit c;
    {
      py::gil_scoped_release release;
      c = g.Commit();
    }
    py::list out;
    for (const CommittedLayer& l : c.layers) {
      out.append(py::make_tuple(l.layer, py::array_t<int32_t>(l.phy2log.size(), l.phy2log.data()),
                                py::array_t<uint32_t>(l.row_of_slot.size(), l.row_of_slot.data())));
    }
    return out;
  }
  bool Sync() {
    ServingGroup& g = group();
    Result<bool> r = [&] {
      py::gil_scoped_release release;
      return g.Sync();
    }();
    return Take(std::move(r));
  }
  void Drain(uint32_t rank) {
    ServingGroup& g = group();
    Status s;
    {
      py::gil_scoped_release release;
      s = g.Drain(rank);
    }
    Check(s);
  }
  void Close() {
    py::gil_scoped_release release;
    group_.reset();
    boot_.reset();
  }
  py::list Recoveries() {
    py::list out;
    for (const RecoveryRecord& r : group().recoveries()) {
      out.append(
          py::dict(py::arg("kind") = r.kind, py::arg("step") = r.step, py::arg("epoch") = r.epoch,
                   py::arg("members") = r.members, py::arg("recovery_s") = r.recovery_s,
                   py::arg("experts_recovered") = r.experts_recovered,
                   py::arg("rows_recovered") = r.rows_recovered,
                   py::arg("bytes_moved") = r.bytes_moved, py::arg("placements") = r.placements,
                   py::arg("restarts") = r.restarts, py::arg("interrupted") = r.interrupted));
    }
    return out;
  }
  ServingGroup& group() {
    if (group_ == nullptr) Throw(Status::InvalidArgument("the serving group was closed"));
    return *group_;
  }

 private:
  std::unique_ptr<Agent> agent_;
  std::vector<RegisteredRegion> regions_;
  std::unique_ptr<Bootstrap> boot_;  // the store's (SocketBootstrap) or etcd's
  std::unique_ptr<HostBackup> backup_;
  std::unique_ptr<ServingGroup> group_;
};

}  // namespace
}  // namespace eplbx::python

PYBIND11_MODULE(_eplbx, m) {
  using namespace eplbx;
  using namespace eplbx::python;
  m.doc() = "eplbx: expert-parallel load balancing (plans, migrations, rearrangement)";

  static py::exception<std::runtime_error> base(m, "EplbxError", PyExc_RuntimeError);
  g_exc.base = base.ptr();
  struct Def {
    Code code;
    const char* name;
    PyObject* also;
  };
  const Def defs[] = {
      {Code::kInvalidArgument, "InvalidArgumentError", PyExc_ValueError},
      {Code::kOutOfRange, "OutOfRangeError", PyExc_ValueError},
      {Code::kMismatch, "MismatchError", PyExc_ValueError},
      {Code::kNotFound, "NotFoundError", PyExc_LookupError},
      {Code::kIoError, "IoError", PyExc_OSError},
      {Code::kCorruption, "CorruptionError", PyExc_ValueError},
      {Code::kTimeout, "TimeoutError", PyExc_TimeoutError},
      {Code::kAborted, "AbortedError", nullptr},
      {Code::kUnavailable, "UnavailableError", PyExc_ConnectionError},
      {Code::kNotSupported, "NotSupportedError", PyExc_NotImplementedError},
      {Code::kInternal, "InternalError", nullptr},
  };
  for (const Def& d : defs) {
    PyObject* bases =
        d.also != nullptr ? PyTuple_Pack(2, base.ptr(), d.also) : PyTuple_Pack(1, base.ptr());
    PyObject* cls = PyErr_NewException((std::string("eplbx.") + d.name).c_str(), bases, nullptr);
    Py_DECREF(bases);
    m.add_object(d.name, py::handle(cls));
    g_exc.by_code[d.code] = cls;
  }

  py::class_<PlanResult>(m, "PlanResult")
      .def_readonly("phy2log", &PlanResult::phy2log,
                    "layers x slots: logical expert in each physical slot")
      .def_readonly("log2phy", &PlanResult::log2phy,
                    "layers x experts x max replicas: slots, padded with -1")
      .def_readonly("logcnt", &PlanResult::logcnt, "layers x experts: replica counts")
      .def_readonly("balancedness", &PlanResult::balancedness,
                    "sum of mean rank loads / sum of max rank loads")
      .def_readonly("balancedness_per_layer", &PlanResult::balancedness_per_layer)
      .def_readonly("moves", &PlanResult::moves,
                    "with previous: remote_copies, local_copies, unchanged_slots");

  m.def("plan", &DoPlan, py::arg("load"), py::arg("slots"), py::arg("ranks"), py::arg("nodes") = 1,
        py::arg("groups") = 1, py::arg("policy") = "deepseek", py::arg("previous") = py::none(),
        py::arg("tolerance") = 0.002,
        "Places every layer's experts into slots (see docs/placement.md).");
  m.def("migrate", &DoMigrate, py::arg("old"), py::arg("new"), py::arg("ranks"),
        py::arg("nodes") = 1, py::arg("bytes_per_expert") = 1, py::arg("link_gbps") = 100.0,
        "Transfers that turn placement `old` into `new` (see docs/migration.md). transfers rows: "
        "(src, src_row, dst, dst_row, expert, round); local_copies rows: (rank, src_row, dst_row, "
        "expert, "
        "from_new).");

  m.def(
      "_copy_limit_gbps",
      [](int threads) {
        py::gil_scoped_release release;
        return internal::MeasureCopyLimitGbps(threads);
      },
      py::arg("threads") = 2,
      "GB/s of `threads` threads copying 64 MiB blocks at once with eplbx's streaming copy: "
      "the fastest this machine copies each byte once (for benchmarks).");

  py::class_<PyBalancer>(m, "Balancer",
                         "The EPLB loop without moving weights: step(counts) after every forward "
                         "step, commit() at the safe point returns [(layer, new phy2log)] "
                         "(docs/python.md).")
      .def(py::init<const py::object&, int, int, int, int, const std::string&, int, int, double,
                    double, double>(),
           py::arg("initial"), py::arg("experts"), py::arg("ranks"), py::arg("nodes") = 1,
           py::arg("groups") = 1, py::arg("policy") = "incremental", py::arg("window") = 1000,
           py::arg("interval") = 1000, py::arg("min_gain") = 0.0, py::arg("skip_above") = 1.01,
           py::arg("tolerance") = 0.002)
      .def("step", &PyBalancer::Step, py::arg("counts"))
      .def("commit", &PyBalancer::Commit)
      .def_property_readonly("phy2log", &PyBalancer::Phy2Log)
      .def_property_readonly("report", &PyBalancer::Report)
      .def("prometheus", &PyBalancer::Prometheus);

  py::class_<Store>(m, "Store",
                    "The built-in coordinator (a TCP store with membership and epochs) on a "
                    "thread of this process (docs/python.md, \"Serving\").")
      .def(py::init<const std::string&, uint16_t, const std::string&, uint32_t, double>(),
           py::arg("addr"), py::arg("port"), py::arg("token"), py::arg("world"),
           py::arg("deadline_s") = 10.0)
      .def_property_readonly("port", &Store::port,
                             "The port it listens on (the system's choice where port 0 was asked)")
      .def("close", &Store::Close);

  py::class_<PyServingGroup>(m, "_ServingGroup")
      .def(py::init<uint32_t, uint32_t, const std::string&, uint16_t, const std::string&,
                    const py::list&, const py::list&, const py::object&, int, int,
                    const std::string&, int, int, const std::string&, double, const std::string&,
                    const std::string&, const std::string&>(),
           py::arg("rank"), py::arg("world"), py::arg("addr"), py::arg("port"), py::arg("token"),
           py::arg("layers"), py::arg("regions"), py::arg("initial"), py::arg("experts"),
           py::arg("nodes"), py::arg("policy"), py::arg("window"), py::arg("interval"),
           py::arg("mode"), py::arg("deadline_s"), py::arg("backup_dir"), py::arg("node"),
           py::arg("group") = "eplbx")
      .def("step", &PyServingGroup::Step, py::arg("counts"))
      .def("commit", &PyServingGroup::Commit)
      .def("poll", &PyServingGroup::Poll)
      .def("sync", &PyServingGroup::Sync)
      .def("drain", &PyServingGroup::Drain, py::arg("rank"))
      .def("close", &PyServingGroup::Close)
      .def_property_readonly("recoveries", &PyServingGroup::Recoveries)
      .def_property_readonly("placement",
                             [](PyServingGroup& g) { return Phy2Log(g.group().placement()); })
      .def("row_table", [](PyServingGroup& g, uint32_t layer) { return g.group().RowTable(layer); })
      .def("prometheus", [](PyServingGroup& g) { return PrometheusText(g.group()); })
      .def_property_readonly("step_count", [](PyServingGroup& g) { return g.group().step(); })
      .def_property_readonly("epoch", [](PyServingGroup& g) { return g.group().epoch(); })
      .def_property_readonly("members",
                             [](PyServingGroup& g) {
                               std::vector<int> out;
                               const std::vector<bool> m = g.group().members();
                               for (size_t r = 0; r < m.size(); ++r) {
                                 if (m[r]) out.push_back(static_cast<int>(r));
                               }
                               return out;
                             })
      .def_property_readonly("left", [](PyServingGroup& g) { return g.group().left(); })
      .def_property_readonly("rebalancing",
                             [](PyServingGroup& g) { return g.group().progress().rebalancing; });

  py::class_<Communicator>(m, "_Communicator")
      .def(py::init<uint32_t, uint32_t, py::function, const py::list&, const py::list&, double,
                    const std::string&, const std::string&,
                    const std::optional<std::vector<bool>>&>(),
           py::arg("rank"), py::arg("world"), py::arg("allgather"), py::arg("layers"),
           py::arg("regions"), py::arg("timeout_s"), py::arg("transport") = "auto",
           py::arg("paths") = "", py::arg("members") = py::none())
      .def("set_transfer_context", &Communicator::SetTransferContext, py::arg("old"),
           py::arg("layer"), py::arg("new_map") = py::none(), py::arg("kept_rows_copied") = false)
      .def("add_send", &Communicator::AddSend)
      .def("add_recv", &Communicator::AddRecv)
      .def("abort", &Communicator::Abort)
      .def("execute", &Communicator::Execute)
      .def("register_local", &Communicator::RegisterLocal, py::arg("addr"), py::arg("bytes"))
      .def("unregister_local", &Communicator::UnregisterLocal, py::arg("handle"))
      .def_property_readonly("failed", &Communicator::failed);
}
