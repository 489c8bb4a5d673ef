// Coordination on etcd (docs/deploy.md, "Coordination on etcd"): a group's membership,
// epochs and all-gather rounds kept in a replicated key-value store instead of one rank's
// coordinator, so no process eplbx runs is a single point of failure.
//
// Each rank's process holds a lease (renewed by a thread); its key under the group's prefix
// lives as long as the lease. The view (epoch and members) is replaced only by
// compare-and-swap, by whichever member sees a change first: a member whose key is gone (its
// process died or stopped past the lease) leaves, a new process for a rank outside the view
// joins. Rounds (the Bootstrap's AllGather) are keys too, and a round's outcome is decided
// once for everyone by a compare-and-swap against the view (src/coord/membership.h). The
// semantics are SocketBootstrap's with a membership coordinator: a round that a member set
// change interrupts fails with kAborted naming the new epoch and members, on every member.
#ifndef EPLBX_ETCD_H_
#define EPLBX_ETCD_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "eplbx/bootstrap.h"
#include "eplbx/status.h"

namespace eplbx {

namespace coord {
class EtcdClient;
}  // namespace coord

struct EtcdOptions {
  std::vector<std::string> endpoints;  // "host:port" of the etcd members (any number >= 1)
  std::string group;                   // the key prefix is /eplbx/<group>/
  std::string token;                   // every process of the group gives the same one
  // How long a process that stops renewing (killed, stopped, cut off) stays a member. etcd
  // grants whole seconds, at least its own minimum (about 2 s with default settings).
  std::chrono::seconds lease{2};
  // One request, members tried in turn; a round retries unanswered requests until its own
  // deadline (an election takes about etcd's election timeout).
  std::chrono::milliseconds request_timeout{3000};
  std::chrono::milliseconds start_timeout{60000};  // waiting for the view at Join
};

// "etcd://host:port[,host:port...]" -> endpoints; kInvalidArgument naming what is wrong.
Result<std::vector<std::string>> ParseEtcdUrl(const std::string& url);

class EtcdBootstrap final : public Bootstrap {
 public:
  // Takes rank `rank` of a group of `world` ranks: waits until every rank has a process
  // (the first view, epoch 1, all members), or joins a group under way (joining() true:
  // ServingGroup::Join). Refused by name: another token, a world of another size, a rank
  // held by another live process past start_timeout.
  static Result<std::unique_ptr<EtcdBootstrap>> Join(uint32_t rank, uint32_t world,
                                                     EtcdOptions options);
  // Leaves gracefully: the lease is revoked, so the others see this rank gone at once.
  ~EtcdBootstrap() override;

  uint32_t rank() const override { return rank_; }
  uint32_t size() const override { return world_; }
  Result<std::vector<std::string>> AllGather(std::string_view mine,
                                             std::chrono::milliseconds timeout) override;
  uint64_t epoch() const override { return epoch_; }
  std::vector<bool> members() const override { return members_; }
  bool joining() const { return joining_; }
  // Behave as a process that stopped: no more renewals, no revoke when destroyed (tests and
  // drills: the lease expires as after a SIGKILL).
  void StopRenewing();

  struct Stats {
    // polls: snapshots read; waits: waits for a change under the group's prefix.
    uint64_t rounds = 0, requests = 0, polls = 0, waits = 0;
  };
  Stats stats() const { return stats_; }

 private:
  EtcdBootstrap() = default;
  Status Start();
  Result<std::vector<std::string>> Round(std::string_view mine, std::chrono::milliseconds timeout);
  std::string Key(std::string_view rest) const { return prefix_ + std::string(rest); }
  // Until the watch has seen a change after `revision` (a lost member's key deleted, a view
  // written, a round completed), at most a second (a watch between members) and never past
  // `deadline`.
  void WaitPast(int64_t revision, std::chrono::steady_clock::time_point deadline);

  uint32_t rank_ = 0, world_ = 0;
  EtcdOptions options_;
  std::string prefix_;
  std::unique_ptr<coord::EtcdClient> client_, renew_client_, watch_client_;
  int64_t lease_ = 0, incarnation_ = 0;
  uint64_t epoch_ = 0, round_ = 0;
  std::vector<int64_t> view_;  // incarnations of the view in force
  std::vector<bool> members_;
  bool joining_ = false;
  Status failed_;  // a round that ended without an outcome: no more rounds
  std::atomic<bool> stop_{false}, expired_{false}, renewing_{true};
  std::thread renew_;
  // A watch on the group's keys but the contributions, streamed by a thread: `seen_` is the
  // last revision known to have changed one (or the store's revision when the stream was
  // created: whatever came before is in a snapshot read after it).
  std::thread watch_;
  std::mutex seen_mu_;
  std::condition_variable seen_cv_;
  int64_t seen_ = 0;
  Stats stats_;
};

}  // namespace eplbx

#endif  // EPLBX_ETCD_H_
