// `eplbx worker`: one rank of the demo as its own process, for runs where each host starts
// its own ranks; configured by EPLBX_MASTER_ADDR/PORT, EPLBX_RANK, EPLBX_WORLD_SIZE and
// EPLBX_TOKEN (docs/deploy.md). Rank 0 serves the rendezvous store and prints the report.
// `eplbx store`: the same store as a process of its own.
#include <algorithm>
#include <chrono>
#include <iostream>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "cli/commands.h"
#include "cli/demo.h"
#include "cli/flags.h"
#include "common/strings.h"
#include "eplbx/bootstrap.h"
#include "eplbx/env.h"

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

Status RunWorker(DemoOptions o, bool ranks_given) {
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
  worker->callback(
      [&run, o, ranks] { run = [o, ranks] { return RunWorker(*o, ranks->count() > 0); }; });

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
