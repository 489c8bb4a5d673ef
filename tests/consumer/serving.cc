// Serves with eplbx::ServingGroup through the installed package, as a C++ engine would: four
// rank processes (fork) meet at a coordinator (this process: ServeSocketBootstrap with
// membership), each with its own agent and weights; rank 2 is killed mid-serving; the others
// notice at the step's collective, settle over themselves and serve on, each checking every
// row it serves against the placement in force at every step; experts only rank 2 held come
// from the node's host backup. Prints "serving ok".
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "eplbx/backup.h"
#include "eplbx/bootstrap.h"
#include "eplbx/serving.h"

namespace {

constexpr int kRanks = 4, kLayers = 2, kRows = 6, kExperts = 12, kSteps = 40, kKilled = 2;
constexpr int kKillStep = 12;
constexpr uint64_t kBytes = 512;

uint8_t Byte(int layer, int expert, uint64_t i) {
  return static_cast<uint8_t>((layer * 31 + expert * 7 + i) & 0xff);
}

// Skewed counts, the same on every rank, moving so that rebalances happen.
std::vector<double> Counts(int step) {
  std::vector<double> c;
  for (int l = 0; l < kLayers; ++l) {
    for (int e = 0; e < kExperts; ++e) c.push_back((e + step / 5) % kExperts < 2 ? 300.0 : 10.0);
  }
  return c;
}

int Fail(int rank, const std::string& why) {
  std::fprintf(stderr, "rank %d: %s\n", rank, why.c_str());
  return 1;
}

int Rank(int rank, int fd) {
  eplbx::SocketBootstrap boot(fd, rank, kRanks);
  eplbx::AgentConfig config;
  config.peer_timeout = std::chrono::seconds(2);
  auto agent = eplbx::Agent::Create("consumer" + std::to_string(rank), config);
  if (!agent.ok()) return Fail(rank, agent.status().ToString());
  std::vector<uint8_t> weights(static_cast<size_t>(kLayers) * kRows * kBytes);
  auto region = (*agent)->RegisterMemory(weights.data(), weights.size());
  if (!region.ok()) return Fail(rank, region.status().ToString());
  // Slot s holds expert s % 12: every expert twice, on two ranks.
  std::vector<int32_t> flat;
  for (int l = 0; l < kLayers; ++l) {
    for (int s = 0; s < kRanks * kRows; ++s) flat.push_back(s % kExperts);
  }
  auto initial = eplbx::Placement::FromPhy2Log(kLayers, kRanks * kRows, kExperts, flat);
  if (!initial.ok()) return Fail(rank, initial.status().ToString());
  eplbx::RankLayout layout;
  layout.rank = static_cast<uint32_t>(rank);
  for (int l = 0; l < kLayers; ++l) {
    uint8_t* base = weights.data() + static_cast<size_t>(l) * kRows * kBytes;
    for (int row = 0; row < kRows; ++row) {
      for (uint64_t i = 0; i < kBytes; ++i)
        base[row * kBytes + i] = Byte(l, initial->phy2log(l, rank * kRows + row), i);
    }
    layout.layers.push_back({eplbx::TensorSpec{"w",
                                               "u8",
                                               {static_cast<int64_t>(kBytes)},
                                               reinterpret_cast<uint64_t>(base),
                                               kBytes,
                                               kRows}});
  }
  eplbx::ServingOptions o;
  o.balancer.topology = {.ranks = kRanks, .nodes = 1, .slots = kRanks * kRows, .groups = 1};
  o.balancer.policy = eplbx::Policy::kIncremental;
  o.balancer.window = 5;
  o.balancer.trigger.interval = 5;
  o.balancer.bytes_per_expert = kBytes;
  o.rearrange.deadline = std::chrono::seconds(3);
  o.round_wait = std::chrono::seconds(4);
  // A host backup of every expert (rank 0 makes the file, the others open it through the
  // bootstrap, each captures what its rows hold): experts only a lost rank held come back.
  std::unique_ptr<eplbx::HostBackup> mine;
  if (rank == 0) {
    auto made = eplbx::HostBackup::Create("/tmp", layout, kExperts);
    if (!made.ok()) return Fail(rank, made.status().ToString());
    mine = std::move(*made);
  }
  auto backup = eplbx::ShareHostBackup(boot, 0, std::move(mine), std::chrono::seconds(4));
  if (!backup.ok()) return Fail(rank, backup.status().ToString());
  if (auto c = (*backup)->Capture(*initial, layout); !c.ok()) return Fail(rank, c.ToString());
  if (auto ready = boot.Barrier(std::chrono::seconds(4)); !ready.ok())
    return Fail(rank, ready.ToString());
  if (rank == 0) (void)(*backup)->Unlink();
  auto group =
      eplbx::ServingGroup::Create(agent->get(), &boot, layout, *initial, o, {backup->get()});
  if (!group.ok()) return Fail(rank, group.status().ToString());
  eplbx::ServingGroup& g = **group;
  for (int step = 0; step < kSteps; ++step) {
    if (rank == kKilled && step == kKillStep) raise(SIGKILL);  // as a crashed process would
    if (auto st = g.Step(Counts(step)); !st.ok()) return Fail(rank, st.status().ToString());
    (void)g.Commit();
    auto synced = g.Sync();
    if (!synced.ok()) return Fail(rank, synced.status().ToString());
    // Every row this rank serves holds the expert the placement in force names.
    for (int l = 0; l < kLayers; ++l) {
      const uint8_t* base = weights.data() + static_cast<size_t>(l) * kRows * kBytes;
      for (int row = 0; row < kRows; ++row) {
        const int32_t e = g.placement().phy2log(l, rank * kRows + row);
        for (uint64_t i = 0; e >= 0 && i < kBytes; ++i) {
          if (base[row * kBytes + i] != Byte(l, e, i)) {
            return Fail(rank, "step " + std::to_string(step) + " layer " + std::to_string(l) +
                                  " row " + std::to_string(row) + " does not hold expert " +
                                  std::to_string(e));
          }
        }
      }
    }
  }
  while (g.progress().rebalancing) (void)g.Commit();
  if (g.recoveries().size() != 1 || g.recoveries()[0].kind != "loss" ||
      g.recoveries()[0].members != std::vector<int>{0, 1, 3}) {
    return Fail(rank, "expected one loss, settled over ranks 0, 1 and 3");
  }
  if (auto done = boot.Barrier(std::chrono::seconds(4)); !done.ok())
    return Fail(rank, done.ToString());
  return 0;
}

}  // namespace

int main() {
  std::vector<int> fds(kRanks);
  std::vector<pid_t> pids(kRanks);
  for (int r = 0; r < kRanks; ++r) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return 1;
    std::fflush(stdout);
    pids[r] = fork();
    if (pids[r] == 0) {
      close(sv[0]);
      for (int k = 0; k < r; ++k) close(fds[k]);
      _exit(Rank(r, sv[1]));
    }
    close(sv[1]);
    fds[r] = sv[0];
  }
  eplbx::Status served =
      eplbx::ServeSocketBootstrap(fds, {.idle_timeout = std::chrono::seconds(20),
                                        .round_timeout = std::chrono::milliseconds(1600),
                                        .membership = true});
  int bad = 0;
  for (int r = 0; r < kRanks; ++r) {
    int st = 0;
    waitpid(pids[r], &st, 0);
    const bool killed = WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL;
    if (r == kKilled ? !killed : !(WIFEXITED(st) && WEXITSTATUS(st) == 0)) {
      std::fprintf(stderr, "rank %d ended with status %d\n", r, st);
      ++bad;
    }
  }
  if (!served.ok()) std::fprintf(stderr, "coordinator: %s\n", served.ToString().c_str());
  if (bad > 0) return 1;
  std::printf("serving ok\n");
  return 0;
}
