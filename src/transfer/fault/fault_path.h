// Internal, for tests: a fault-injecting data path and control channel (LevelDB's
// ErrorEnv). Each wraps a real part of an agent and, per the rules of a shared FaultPlan,
// fails, delays, drops or duplicates a transfer's completion or an outgoing notification,
// or loses a peer after some bytes. With them the layers above (the Rearranger, the
// communicator) are tested in-process, in milliseconds, at every phase.
#ifndef EPLBX_SRC_TRANSFER_FAULT_FAULT_PATH_H_
#define EPLBX_SRC_TRANSFER_FAULT_FAULT_PATH_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "eplbx/transfer.h"
#include "transfer/agent_core.h"
#include "transfer/backend.h"

namespace eplbx::internal {

struct Fault {
  enum class Action {
    kFail,       // transfer: ends with kIoError, nothing moved; notification: Notify fails
    kDelay,      // transfer: completion reported `delay` late; notification: sent late
    kDrop,       // transfer: data moves, completion never reported (until Cancel);
                 // notification: never sent, reported as sent
    kDuplicate,  // transfer: completion reported twice; notification: sent twice
    kLosePeer,   // the peer is reported lost; the transfer (or notification) fails
    kRun,        // `run` is called first, then all proceeds as without a fault (drills:
                 // `eplbx demo --inject` exits or stops the process right there)
    kCorrupt,    // notification: `rewrite(payload)` is sent instead
  };
  Action action = Action::kFail;
  std::string peer;          // the peer agent's name; empty: any peer
  std::optional<XferOp> op;  // transfers: READ or WRITE only; nullopt: both
  // Transfers: applies from the transfer that brings the bytes sent to the peer through
  // wrapped paths (this one included) to `after` or more. Notifications: once `after`
  // notifications (of any kind) went to the peer before this one.
  uint64_t after = 0;
  int times = -1;  // how many times it applies; -1: every time
  std::chrono::milliseconds delay{0};
  // Notifications only: which payloads (null: every one).
  std::function<bool(std::string_view payload)> match;
  std::function<void()> run;                        // kRun
  std::function<std::string(std::string)> rewrite;  // kCorrupt

  // `action` for `peer` (empty: any), once `after` bytes or notifications went to it,
  // `times` times (-1: always); set the other fields on the result.
  static Fault Of(Action action, std::string peer = {}, uint64_t after = 0, int times = -1) {
    Fault f;
    f.action = action;
    f.peer = std::move(peer);
    f.after = after;
    f.times = times;
    return f;
  }
};

// The rules one or more agents follow. Thread-safe; rules may change while agents run.
class FaultPlan {
 public:
  void OnTransfers(Fault fault);
  void OnNotifications(Fault fault);
  void Clear();
  // How many faults were injected so far.
  uint64_t injected() const;

  // For the wrappers: the fault for a transfer of `bytes` to `peer`, or nullopt (counts it).
  std::optional<Fault> ForTransfer(const std::string& agent, const std::string& peer, XferOp op,
                                   uint64_t bytes);
  std::optional<Fault> ForNotification(const std::string& agent, const std::string& peer,
                                       std::string_view payload);

 private:
  struct Rule {
    Fault fault;
    int used = 0;
  };
  std::optional<Fault> Take(std::vector<Rule>& rules, const std::string& peer,
                            std::optional<XferOp> op, std::string_view payload, uint64_t sent);

  mutable std::mutex mu_;
  std::vector<Rule> transfer_rules_;
  std::vector<Rule> notification_rules_;
  std::map<std::pair<std::string, std::string>, uint64_t> bytes_;  // (agent, peer)
  std::map<std::pair<std::string, std::string>, uint64_t> notes_;  // (agent, peer)
  uint64_t injected_ = 0;
};

// Wraps every part of an agent (its control channel and each data path) in the fault
// wrappers driven by `plan`.
PartsDecorator InjectFaults(std::shared_ptr<FaultPlan> plan, std::string agent);

// An agent whose parts follow `plan`.
Result<std::unique_ptr<Agent>> CreateFaultyAgent(std::string name, AgentConfig config,
                                                 std::shared_ptr<FaultPlan> plan);

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_TRANSFER_FAULT_FAULT_PATH_H_
