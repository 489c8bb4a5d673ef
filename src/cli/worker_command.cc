// `eplbx worker`: one rank of the demo as its own process, for runs where each host starts
// its own ranks; configured by EPLBX_MASTER_ADDR/PORT, EPLBX_RANK, EPLBX_WORLD_SIZE and
// EPLBX_TOKEN (docs/deploy.md). Rank 0 serves the rendezvous store and prints the report.
// `eplbx store`: the same store as a process of its own.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <iostream>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "cli/commands.h"
#include "cli/demo.h"
#include "cli/flags.h"
#include "common/numbers.h"
#include "common/strings.h"
#include "eplbx/bootstrap.h"
#include "eplbx/env.h"
#include "eplbx/etcd.h"

namespace eplbx::cli {
namespace {

using internal::StrCat;

// Serves the store on a thread; the ReportCollector gathers the ranks' reports.
class StoreThread {
 public:
  StoreThread(std::unique_ptr<TcpStore> store, const DemoOptions& o, bool print_progress)
      : store_(std::move(store)), collector_(o, print_progress) {
    const auto deadline = std::chrono::milliseconds(static_cast<int64_t>(o.deadline_s * 1000));
    // `--resize add:RANK@STEP` for a rank that was never a member: the start does not wait
    // for RANK; its worker (started any time, a standby or later) is held until a member asks
    // for it at STEP. A worker restarted for a rank that was a member (lost) is let in at once.
    std::vector<bool> late(static_cast<size_t>(o.ranks), false), seen = late;
    for (const DemoOptions::Event& e : o.events) {
      if (!seen[e.rank] && e.kind == "add") late[e.rank] = true;
      seen[e.rank] = true;
    }
    if (o.serve) {
      store_->set_late_ranks(late);
      store_->set_admit([this, late](uint32_t rank) {
        if (late[rank] && asked_.count(rank) == 0) return false;
        // A new process for the rank: it will report (a lost one's report is not awaited).
        std::lock_guard<std::mutex> lock(mu_);
        lost_.erase(static_cast<int>(rank));
        return true;
      });
    }
    thread_ = std::thread([this, deadline] {
      status_ = store_->Serve(
          deadline, deadline + std::chrono::seconds(10),
          [&](uint32_t rank, std::string bytes) {
            if (bytes.find("\"spawn\"") != std::string::npos) {  // a member asks for a rank
              const nlohmann::json ask = nlohmann::json::parse(bytes, nullptr, false);
              if (ask.is_object() && ask.contains("spawn") && ask["spawn"].is_number_integer()) {
                asked_.insert(ask["spawn"].get<uint32_t>());
                return;
              }
            }
            collector_.OnMessage(rank, bytes);
          },
          [&] {
            // A rank that left, missed a round, or whose link died never reports.
            std::lock_guard<std::mutex> lock(mu_);
            return collector_.Settled([&](int r) { return lost_.count(r) != 0; });
          },
          // The store gives up on a round before the ranks do, so it can name who is missing.
          deadline * 4 / 5,
          [&](uint32_t rank) {
            std::lock_guard<std::mutex> lock(mu_);
            lost_.insert(static_cast<int>(rank));
          });
    });
  }
  std::map<int, nlohmann::json> Finish(Status* status) {
    thread_.join();
    *status = status_;
    for (const std::string& r : store_->refusals())
      std::cerr << "eplbx: rendezvous refused: " << r << "\n";
    return collector_.Reports();
  }

 private:
  std::unique_ptr<TcpStore> store_;
  ReportCollector collector_;
  std::thread thread_;
  std::mutex mu_;
  std::set<int> lost_;        // ranks that will not report
  std::set<uint32_t> asked_;  // ranks a member asked for (`--resize add`; the store's thread)
  Status status_;
};

// `eplbx worker --serve --coordination etcd://...`: membership, epochs and the step's
// collective on etcd (docs/deploy.md, "Coordination on etcd"); no process of eplbx's own is
// central: any rank, rank 0 included, can be lost. Each worker reports itself.
Status RunEtcdWorker(DemoOptions o, bool ranks_given, const std::string& url,
                     const std::string& group) {
  Env* env = Env::Default();
  auto var = [env](const char* name) { return env->GetVar(name).value_or(""); };
  const std::string token = var("EPLBX_TOKEN");
  if (token.empty()) return Status::InvalidArgument("eplbx worker: EPLBX_TOKEN is not set");
  EPLBX_ASSIGN_OR_RETURN(
      const uint32_t world,
      internal::ParseInteger<uint32_t>(var("EPLBX_WORLD_SIZE"), "EPLBX_WORLD_SIZE", 1, 1u << 16));
  EPLBX_ASSIGN_OR_RETURN(const uint32_t rank, internal::ParseInteger<uint32_t>(
                                                  var("EPLBX_RANK"), "EPLBX_RANK", 0, world - 1));
  if (ranks_given && static_cast<uint32_t>(o.ranks) != world) {
    return Status::InvalidArgument(StrCat("--ranks ", o.ranks, " but EPLBX_WORLD_SIZE=", world));
  }
  if (!o.serve) {
    return Status::InvalidArgument(
        "eplbx worker --coordination etcd://... runs the serving drill: add --serve");
  }
  o.ranks = static_cast<int>(world);
  EPLBX_RETURN_IF_ERROR(ParseDemo(o));
  if (o.mode_list.size() != 1) {
    return Status::InvalidArgument(
        StrCat("eplbx worker --serve runs one mode: pass --modes "
               "async, --modes sync or --modes off (not '",
               o.modes, "')"));
  }
  for (const DemoOptions::Event& e : o.events) {
    if (e.kind == "add") {
      return Status::InvalidArgument(StrCat(
          "eplbx worker --coordination etcd: --resize add:", e.rank,
          " asks a coordinator to start a process, and there is none: start the worker for rank ",
          e.rank, " yourself (with the same command); it joins the group where it is"));
    }
  }
  o.survive = true;
  o.backup_dir = env->GetVar("EPLBX_BACKUP_DIR").value_or("/dev/shm");
  EPLBX_ASSIGN_OR_RETURN(std::vector<std::string> endpoints, ParseEtcdUrl(url));
  EtcdOptions eo;
  eo.endpoints = std::move(endpoints);
  eo.group = group;
  eo.token = token;
  // A rank that stops renewing is lost after its lease: --deadline, at least etcd's 2 s.
  eo.lease =
      std::chrono::seconds(std::max<int64_t>(2, static_cast<int64_t>(std::ceil(o.deadline_s))));
  o.lease_s = static_cast<double>(eo.lease.count());
  o.coordination = url;
  eo.start_timeout = std::chrono::milliseconds(static_cast<int64_t>(o.deadline_s * 20000));
  const auto t0 = env->Now();
  EPLBX_ASSIGN_OR_RETURN(std::unique_ptr<EtcdBootstrap> boot, EtcdBootstrap::Join(rank, world, eo));
  const bool joining = boot->joining();
  nlohmann::json mine;
  const int code = RunServeRank(
      o, static_cast<int>(rank), *boot, joining,
      [&o](const std::string& message) {  // progress lines; the report is printed below
        nlohmann::json m = nlohmann::json::parse(message, nullptr, false);
        if (!o.json && m.is_object() && m.contains("progress") && m["progress"].is_string())
          std::cerr << "eplbx: " << m["progress"].get<std::string>() << "\n";
        return Status::OK();
      },
      &mine);
  const double wall = std::chrono::duration<double>(env->Now() - t0).count();
  mine["coordination"] = {{"etcd", url},
                          {"group", group},
                          {"epoch", boot->epoch()},
                          {"rounds", boot->stats().rounds},
                          {"requests", boot->stats().requests},
                          {"waits", boot->stats().waits}};
  mine["wall_s"] = wall;
  boot.reset();  // leaves the group (its lease revoked)
  if (o.json) {
    std::cout << mine.dump(1) << "\n";
  } else {
    std::vector<int> members;
    int64_t steps = 0;
    if (mine.contains("drill") && mine["drill"].is_object())
      members = mine["drill"].value("members", std::vector<int>{});
    if (mine.contains("modes") && mine["modes"].is_object()) {
      for (const auto& [name, m] : mine["modes"].items()) steps = m.value("steps", int64_t{0});
    }
    std::cout << "rank " << rank << " (etcd coordination, group '" << group
              << "'): " << (code == 0 ? "served" : "failed") << ", epoch "
              << mine["coordination"]["epoch"] << ", members at the end";
    for (int m : members) std::cout << " " << m;
    std::cout << "; every row checked: " << (mine.value("verified", false) ? "yes" : "no") << "\n";
    if (mine.contains("drill") && mine["drill"].contains("events")) {
      for (const auto& e : mine["drill"]["events"])
        std::cout << "  " << e.value("kind", std::string()) << " at step " << e.value("step", -1)
                  << ": serving again " << e.value("recovery_s", 0.0) << " s after noticing it\n";
    }
    (void)steps;
  }
  if (code == 0) return Status::OK();
  return Status::Aborted(StrCat("rank ", rank, ": ", mine.value("error", std::string("failed"))));
}

Status RunWorker(DemoOptions o, bool ranks_given, const std::string& coordination,
                 const std::string& group) {
  const std::string url = coordination.empty()
                              ? Env::Default()->GetVar("EPLBX_COORDINATION").value_or("")
                              : coordination;
  if (!url.empty()) return RunEtcdWorker(std::move(o), ranks_given, url, group);
  Result<RendezvousEnv> env = RendezvousFromEnv();
  if (!env.ok()) return env.status().WithPrefix("eplbx worker");
  if (ranks_given && static_cast<uint32_t>(o.ranks) != env->world) {
    return Status::InvalidArgument(
        StrCat("--ranks ", o.ranks, " but EPLBX_WORLD_SIZE=", env->world));
  }
  o.ranks = static_cast<int>(env->world);
  EPLBX_RETURN_IF_ERROR(ParseDemo(o));
  if (o.serve) {
    // Serving over several hosts survives a lost rank (docs/deploy.md, "Serving on several
    // hosts"): membership on the store, the step's collective, a backup of every expert on
    // each node.
    if (o.mode_list.size() != 1) {
      return Status::InvalidArgument(
          StrCat("eplbx worker --serve runs one mode (it goes on over the survivors of a lost "
                 "rank): pass --modes async, --modes sync or --modes off (not '",
                 o.modes, "')"));
    }
    if (!o.plot.empty()) {
      return Status::InvalidArgument(
          "eplbx worker --serve prints the serving drill's report; --plot draws the demo's "
          "comparison of modes (eplbx demo --serve)");
    }
    if (std::any_of(o.events.begin(), o.events.end(),
                    [](const auto& e) { return e.rank == 0 && e.kind != "add"; })) {
      return Status::InvalidArgument(
          StrCat("eplbx worker --serve: rank 0 serves the rendezvous store, so it cannot be the "
                 "rank lost or removed; pick another rank"));
    }
    o.survive = true;
    const std::string dir = Env::Default()->GetVar("EPLBX_BACKUP_DIR").value_or("/dev/shm");
    o.backup_dir = dir;
  }
  const auto deadline = std::chrono::milliseconds(static_cast<int64_t>(o.deadline_s * 1000));
  const double memcpy_gbps = env->rank == 0 ? internal::MeasureMemcpyGbps() : 0.0;
  std::unique_ptr<StoreThread> store;
  if (env->rank == 0) {
    Result<std::unique_ptr<TcpStore>> s =
        TcpStore::Listen(env->addr, env->port, env->token, env->world);
    if (!s.ok()) return s.status();
    (*s)->set_membership(o.serve);
    store = std::make_unique<StoreThread>(std::move(*s), o, !o.json);
  }
  const auto t0 = Env::Default()->Now();
  Result<std::unique_ptr<SocketBootstrap>> boot =
      JoinTcpStore(env->addr, env->port, env->token, env->rank, env->world, deadline);
  int code = 1;
  nlohmann::json mine;
  if (boot.ok()) {
    code = o.serve ? RunServeRank(o, static_cast<int>(env->rank), **boot, &mine)
                   : RunDemoRank(o, static_cast<int>(env->rank), **boot, &mine);
    boot->reset();  // closes the socket: the store sees this rank leave
  }
  if (env->rank != 0) {
    if (!boot.ok()) return boot.status();
    return code == 0 ? Status::OK()
                     : Status::Aborted(StrCat("rank ", env->rank, ": ",
                                              mine.is_object() && mine.contains("error") &&
                                                      mine["error"].is_string() &&
                                                      !mine["error"].get<std::string>().empty()
                                                  ? mine["error"].get<std::string>()
                                                  : std::string("failed"),
                                              " (rank 0 prints the whole report, if it runs)"));
  }
  Status served;
  std::map<int, nlohmann::json> reports = store->Finish(&served);
  if (!boot.ok() && served.ok()) served = boot.status();
  const double wall = std::chrono::duration<double>(Env::Default()->Now() - t0).count();
  if (o.serve) return ReportServing(o, reports, wall, served);
  return ReportDemo(o, reports, memcpy_gbps, wall, served);
}

Status RunStore(const std::string& listen, double timeout_s) {
  Result<RendezvousEnv> env = RendezvousFromEnv(/*need_rank=*/false);
  if (!env.ok()) return env.status().WithPrefix("eplbx store");
  Result<std::unique_ptr<TcpStore>> s =
      TcpStore::Listen(listen.empty() ? env->addr : listen, env->port, env->token, env->world);
  if (!s.ok()) return s.status();
  const auto t = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  Status served = (*s)->Serve(t, t, [](uint32_t, std::string) {});
  for (const std::string& r : (*s)->refusals())
    std::cerr << "eplbx: rendezvous refused: " << r << "\n";
  return served;
}

}  // namespace

void AddWorkerCommand(CLI::App& app, Action& run) {
  auto o = std::make_shared<DemoOptions>();
  CLI::App* worker =
      app.add_subcommand("worker", "One rank of the demo; ranks meet through EPLBX_* variables");
  CLI::Option* ranks =
      worker->add_option("--ranks", o->ranks, "must equal EPLBX_WORLD_SIZE when given")
          ->check(IntIn<int>(0, 1 << 20));
  AddDemoFlags(*worker, *o);
  auto coordination = std::make_shared<std::string>();
  auto group = std::make_shared<std::string>("eplbx");
  worker->add_option("--coordination", *coordination,
                     "etcd://HOST:PORT[,HOST:PORT...]: membership and the step's collective on "
                     "etcd, no rank central (also EPLBX_COORDINATION; --serve)");
  worker->add_option("--group", *group, "the group's name on etcd (its key prefix)")
      ->capture_default_str();
  worker->callback([&run, o, ranks, coordination, group] {
    run = [o, ranks, coordination, group] {
      return RunWorker(*o, ranks->count() > 0, *coordination, *group);
    };
  });

  auto listen = std::make_shared<std::string>();
  auto timeout = std::make_shared<double>(600);
  CLI::App* store =
      app.add_subcommand("store", "A standalone rendezvous store for EPLBX_WORLD_SIZE ranks");
  store->add_option("--listen", *listen, "address to listen on (default: EPLBX_MASTER_ADDR)");
  // Every wait has a deadline: no limit (inf) is not offered.
  store->add_option("--timeout", *timeout, "seconds to wait for ranks and between frames")
      ->capture_default_str()
      ->check(RealIn(0.1, 86400));
  store->callback(
      [&run, listen, timeout] { run = [listen, timeout] { return RunStore(*listen, *timeout); }; });
}

}  // namespace eplbx::cli
