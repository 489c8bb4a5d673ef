#include "transfer/fault/fault_path.h"

#include <condition_variable>
#include <deque>
#include <map>
#include <set>
#include <thread>

#include "common/strings.h"

namespace eplbx::internal {

void FaultPlan::OnTransfers(Fault fault) {
  std::lock_guard<std::mutex> lock(mu_);
  transfer_rules_.push_back(Rule{std::move(fault), 0});
}

void FaultPlan::OnNotifications(Fault fault) {
  std::lock_guard<std::mutex> lock(mu_);
  notification_rules_.push_back(Rule{std::move(fault), 0});
}

void FaultPlan::Clear() {
  std::lock_guard<std::mutex> lock(mu_);
  transfer_rules_.clear();
  notification_rules_.clear();
}

uint64_t FaultPlan::injected() const {
  std::lock_guard<std::mutex> lock(mu_);
  return injected_;
}

std::optional<Fault> FaultPlan::Take(std::vector<Rule>& rules, const std::string& peer,
                                     std::optional<XferOp> op, std::string_view payload,
                                     uint64_t sent) {
  for (Rule& r : rules) {
    const Fault& f = r.fault;
    if (!f.peer.empty() && f.peer != peer) continue;
    if (op && f.op && *f.op != *op) continue;
    if (!op && f.match && !f.match(payload)) continue;
    if (sent < f.after) continue;
    if (f.times >= 0 && r.used >= f.times) continue;
    ++r.used;
    ++injected_;
    return f;
  }
  return std::nullopt;
}

std::optional<Fault> FaultPlan::ForTransfer(const std::string& agent, const std::string& peer,
                                            XferOp op, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t& sent = bytes_[{agent, peer}];
  std::optional<Fault> f = Take(transfer_rules_, peer, op, {}, sent + bytes);
  if (!f || (f->action != Fault::Action::kFail && f->action != Fault::Action::kLosePeer)) {
    sent += bytes;  // these bytes move
  }
  return f;
}

std::optional<Fault> FaultPlan::ForNotification(const std::string& agent, const std::string& peer,
                                                std::string_view payload) {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t& sent = notes_[{agent, peer}];
  std::optional<Fault> f = Take(notification_rules_, peer, std::nullopt, payload, sent);
  ++sent;
  return f;
}

namespace {

// Runs callbacks later, on its own thread; runs what is left at destruction.
class Timer {
 public:
  Timer() : thread_([this] { Loop(); }) {}
  ~Timer() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void After(std::chrono::milliseconds delay, std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      due_.emplace(std::chrono::steady_clock::now() + delay, std::move(fn));
    }
    cv_.notify_all();
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      if (due_.empty()) {
        if (stop_) return;
        cv_.wait(lock);
        continue;
      }
      auto first = due_.begin();
      if (!stop_ && std::chrono::steady_clock::now() < first->first) {
        cv_.wait_until(lock, first->first);
        continue;
      }
      std::function<void()> fn = std::move(first->second);
      due_.erase(first);
      lock.unlock();
      fn();
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::multimap<std::chrono::steady_clock::time_point, std::function<void()>> due_;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the members above exist
};

class FaultyPath final : public DataPath, public CoreListener {
 public:
  FaultyPath(std::unique_ptr<DataPath> inner, ListenerSlot* slot, std::shared_ptr<FaultPlan> plan,
             std::string agent)
      : inner_(std::move(inner)),
        core_(slot->target()),
        plan_(std::move(plan)),
        agent_(std::move(agent)) {
    slot->set_target(this);
  }
  ~FaultyPath() override {
    inner_.reset();  // its last completions still pass through here
    timer_.reset();  // delivers delayed completions
  }

  std::string_view name() const override { return inner_->name(); }
  PathCaps caps() const override { return inner_->caps(); }
  Status RegisterMemory(const LocalRegionView& r) override { return inner_->RegisterMemory(r); }
  void DeregisterMemory(uint64_t id) override { inner_->DeregisterMemory(id); }
  std::string Section(const std::vector<LocalRegionView>& r) const override {
    return inner_->Section(r);
  }
  Status Connect(const PeerView& peer) override { return inner_->Connect(peer); }
  bool Reaches(PeerId peer, uint32_t region, std::string* why) const override {
    return inner_->Reaches(peer, region, why);
  }
  void Disconnect(PeerId id) override { inner_->Disconnect(id); }

  Status Post(PathRequest req) override {
    uint64_t bytes = 0;
    for (const Segment& s : req.segments) bytes += s.bytes;
    std::optional<Fault> f = plan_->ForTransfer(agent_, req.peer_name, req.op, bytes);
    const std::string what = StrCat("agent '", agent_, "': ", OpName(req.op), " with '",
                                    req.peer_name, "' over ", inner_->name());
    if (f && f->action == Fault::Action::kFail) {
      core_->OnDataDone(req.id, Status::IoError(StrCat(what, ": injected failure")));
      return Status::OK();
    }
    if (f && f->action == Fault::Action::kLosePeer) {
      Status lost =
          Status::Unavailable(StrCat("agent '", agent_, "': peer unreachable: '", req.peer_name,
                                     "' (injected: lost after ", f->after, " bytes)"));
      core_->OnPeerFailed(req.peer, lost);
      core_->OnDataDone(req.id, lost);
      return Status::OK();
    }
    if (f && f->action == Fault::Action::kRun) {
      if (f->run) f->run();
      f.reset();
    }
    if (f) {
      std::lock_guard<std::mutex> lock(mu_);
      faults_[req.id] = *f;
    }
    Status s = inner_->Post(std::move(req));
    return s;
  }

  Status Cancel(TransferId id) override {
    bool dropped = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      dropped = dropped_.erase(id) != 0;
    }
    if (dropped) {
      core_->OnDataDone(id, Status::Aborted(StrCat("agent '", agent_, "': transfer ", id,
                                                   " cancelled (its completion was dropped)")));
      return Status::OK();
    }
    return inner_->Cancel(id);
  }

  // CoreListener: the inner path's reports.
  void OnDataDone(TransferId id, Status status) override {
    std::optional<Fault> f;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = faults_.find(id);
      if (it != faults_.end()) {
        f = it->second;
        faults_.erase(it);
        if (f->action == Fault::Action::kDrop) dropped_.insert(id);
      }
    }
    if (!f) {
      core_->OnDataDone(id, std::move(status));
      return;
    }
    switch (f->action) {
      case Fault::Action::kDelay:
        timer_->After(f->delay, [this, id, status] { core_->OnDataDone(id, status); });
        return;
      case Fault::Action::kDrop:
        return;
      case Fault::Action::kDuplicate:
        core_->OnDataDone(id, status);
        core_->OnDataDone(id, std::move(status));
        return;
      default:
        core_->OnDataDone(id, std::move(status));
    }
  }
  void OnNotification(std::string sender, std::string payload) override {
    core_->OnNotification(std::move(sender), std::move(payload));
  }
  void OnNotifications(std::string sender, std::vector<std::string> payloads) override {
    core_->OnNotifications(std::move(sender), std::move(payloads));
  }
  void OnPeerFailed(PeerId peer, Status reason) override {
    core_->OnPeerFailed(peer, std::move(reason));
  }

 private:
  std::unique_ptr<DataPath> inner_;
  CoreListener* const core_;
  const std::shared_ptr<FaultPlan> plan_;
  const std::string agent_;
  std::unique_ptr<Timer> timer_ = std::make_unique<Timer>();
  std::mutex mu_;
  std::map<TransferId, Fault> faults_;
  std::set<TransferId> dropped_;
};

class FaultyControl final : public ControlChannel {
 public:
  FaultyControl(std::unique_ptr<ControlChannel> inner, std::shared_ptr<FaultPlan> plan,
                std::string agent)
      : inner_(std::move(inner)), plan_(std::move(plan)), agent_(std::move(agent)) {}
  ~FaultyControl() override {
    timer_.reset();  // sends what was delayed
    inner_.reset();
  }

  std::string_view name() const override { return inner_->name(); }
  std::string ConnectionInfo() const override { return inner_->ConnectionInfo(); }
  bool WaitHere(std::chrono::milliseconds timeout, int wake_fd) override {
    return inner_->WaitHere(timeout, wake_fd);
  }
  Status Connect(PeerId id, std::string_view peer_name, std::string_view conn_info) override {
    EPLBX_RETURN_IF_ERROR(inner_->Connect(id, peer_name, conn_info));
    std::lock_guard<std::mutex> lock(mu_);
    names_[id] = std::string(peer_name);
    return Status::OK();
  }
  void Disconnect(PeerId id) override {
    inner_->Disconnect(id);
    std::lock_guard<std::mutex> lock(mu_);
    names_.erase(id);
  }

  Status Notify(PeerId peer, std::string payload, std::function<void(Status)> sent) override {
    std::string name;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (auto it = names_.find(peer); it != names_.end()) name = it->second;
    }
    std::optional<Fault> f = plan_->ForNotification(agent_, name, payload);
    if (f && f->action == Fault::Action::kRun) {
      if (f->run) f->run();
      f.reset();
    }
    if (f && f->action == Fault::Action::kCorrupt) {
      if (f->rewrite) payload = f->rewrite(std::move(payload));
      f.reset();
    }
    if (!f) return inner_->Notify(peer, std::move(payload), std::move(sent));
    switch (f->action) {
      case Fault::Action::kFail:
        return Status::IoError(
            StrCat("agent '", agent_, "': notification to '", name, "': injected failure"));
      case Fault::Action::kLosePeer:
        return Status::Unavailable(StrCat("agent '", agent_, "': peer unreachable: '", name,
                                          "' (injected: lost at a notification)"));
      case Fault::Action::kDrop:
        if (sent) sent(Status::OK());
        return Status::OK();
      case Fault::Action::kDuplicate: {
        EPLBX_RETURN_IF_ERROR(inner_->Notify(peer, payload, nullptr));
        return inner_->Notify(peer, std::move(payload), std::move(sent));
      }
      case Fault::Action::kDelay:
        timer_->After(f->delay,
                      [this, peer, payload = std::move(payload), sent = std::move(sent)]() mutable {
                        Status s = inner_->Notify(peer, std::move(payload), sent);
                        if (!s.ok() && sent) sent(s);
                      });
        return Status::OK();
      case Fault::Action::kRun:
      case Fault::Action::kCorrupt:
        break;  // handled above
    }
    return Status::OK();
  }

 private:
  std::unique_ptr<ControlChannel> inner_;
  const std::shared_ptr<FaultPlan> plan_;
  const std::string agent_;
  std::unique_ptr<Timer> timer_ = std::make_unique<Timer>();
  std::mutex mu_;
  std::map<PeerId, std::string> names_;
};

}  // namespace

PartsDecorator InjectFaults(std::shared_ptr<FaultPlan> plan, std::string agent) {
  return [plan, agent](AgentParts& parts, ListenerSlot*,
                       const std::vector<ListenerSlot*>& slots) -> Status {
    parts.control = std::make_unique<FaultyControl>(std::move(parts.control), plan, agent);
    for (size_t i = 0; i < parts.paths.size(); ++i) {
      parts.paths[i] =
          std::make_unique<FaultyPath>(std::move(parts.paths[i]), slots.at(i), plan, agent);
    }
    return Status::OK();
  };
}

Result<std::unique_ptr<Agent>> CreateFaultyAgent(std::string name, AgentConfig config,
                                                 std::shared_ptr<FaultPlan> plan) {
  PartsDecorator decorate = InjectFaults(std::move(plan), name);
  return AgentFactory::Create(std::move(name), std::move(config), std::move(decorate));
}

}  // namespace eplbx::internal
