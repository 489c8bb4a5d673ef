#include "transfer/loopback/loopback_path.h"

#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>

#include "common/strings.h"

namespace eplbx::internal {
namespace {

class LoopbackControl;

// Every loopback control channel in the process, by connection info.
struct Fabric {
  std::recursive_mutex mu;
  std::map<std::string, LoopbackControl*> by_conn;
  std::map<std::string, LoopbackControl*> by_name;
  std::set<std::string> unreachable;  // agent names
  uint64_t next = 1;
};

Fabric& GetFabric() {
  static Fabric* fabric = new Fabric();  // never destroyed: agents may outlive statics
  return *fabric;
}

// REQUIRES: fabric lock held. Whether `from` can reach the agent named `to`.
bool Reachable(const std::string& from, const std::string& to) {
  Fabric& f = GetFabric();
  return f.by_name.count(to) != 0 && f.unreachable.count(to) == 0 && f.unreachable.count(from) == 0;
}

Status Unreachable(const std::string& from, const std::string& to) {
  return Status::Unavailable(
      StrCat("agent '", from, "': peer unreachable: '", to, "' (loopback peer gone or cut off)"));
}

class LoopbackControl final : public ControlChannel {
 public:
  LoopbackControl(const PartOptions& options, CoreListener* listener)
      : name_(options.agent_name), listener_(listener) {
    Fabric& f = GetFabric();
    std::lock_guard<std::recursive_mutex> lock(f.mu);
    conn_ = StrCat("loopback:", f.next++);
    f.by_conn[conn_] = this;
    f.by_name[name_] = this;
  }
  ~LoopbackControl() override {
    Fabric& f = GetFabric();
    std::lock_guard<std::recursive_mutex> lock(f.mu);
    f.by_conn.erase(conn_);
    if (auto it = f.by_name.find(name_); it != f.by_name.end() && it->second == this) {
      f.by_name.erase(it);
    }
  }

  std::string_view name() const override { return "loopback"; }
  std::string ConnectionInfo() const override { return conn_; }

  Status Connect(PeerId id, std::string_view peer_name, std::string_view conn_info) override {
    Fabric& f = GetFabric();
    std::lock_guard<std::recursive_mutex> lock(f.mu);
    if (f.by_conn.find(std::string(conn_info)) == f.by_conn.end()) {
      return Status::Unavailable(StrCat("agent '", name_, "': loopback peer '", peer_name,
                                        "' is not in this process (or was destroyed)"));
    }
    peers_[id] = std::string(peer_name);
    return Status::OK();
  }

  void Disconnect(PeerId id) override {
    std::lock_guard<std::recursive_mutex> lock(GetFabric().mu);
    peers_.erase(id);
  }

  Status Notify(PeerId peer, std::string payload, std::function<void(Status)> sent) override {
    {
      Fabric& f = GetFabric();
      std::lock_guard<std::recursive_mutex> lock(f.mu);
      auto it = peers_.find(peer);
      if (it == peers_.end())
        return Status::NotFound(StrCat("agent '", name_, "': no peer ", peer));
      if (!Reachable(name_, it->second)) {
        Status s = Unreachable(name_, it->second);
        listener_->OnPeerFailed(peer, s);
        return s;
      }
      f.by_name[it->second]->listener_->OnNotification(name_, std::move(payload));
    }
    if (sent) sent(Status::OK());
    return Status::OK();
  }

 private:
  const std::string name_;
  CoreListener* const listener_;
  std::string conn_;
  std::map<PeerId, std::string> peers_;
};

class LoopbackPath final : public DataPath {
 public:
  LoopbackPath(const PartOptions& options, CoreListener* listener)
      : name_(options.agent_name), listener_(listener) {}

  std::string_view name() const override { return "loopback"; }
  PathCaps caps() const override {
    PathCaps c;
    c.kinds = (1u << static_cast<unsigned>(MemoryKind::kHost)) |
              (1u << static_cast<unsigned>(MemoryKind::kHostFile));
    c.same_host = true;
    c.other_hosts = true;  // "hosts" are a test's fiction here
    return c;
  }
  Status RegisterMemory(const LocalRegionView&) override { return Status::OK(); }
  void DeregisterMemory(uint64_t) override {}
  std::string Section(const std::vector<LocalRegionView>&) const override { return {}; }

  Status Connect(const PeerView& peer) override {
    std::lock_guard<std::recursive_mutex> lock(GetFabric().mu);
    peers_[peer.id] = peer.name;
    return Status::OK();
  }
  bool Reaches(PeerId, uint32_t, std::string*) const override { return true; }
  void Disconnect(PeerId id) override {
    std::lock_guard<std::recursive_mutex> lock(GetFabric().mu);
    peers_.erase(id);
  }

  Status Post(PathRequest req) override {
    {
      Fabric& f = GetFabric();
      std::lock_guard<std::recursive_mutex> lock(f.mu);
      auto it = peers_.find(req.peer);
      if (it == peers_.end()) {
        return Status::NotFound(StrCat("agent '", name_, "': no peer ", req.peer));
      }
      if (!Reachable(name_, it->second)) {
        Status s = Unreachable(name_, it->second);
        listener_->OnPeerFailed(req.peer, s);
        return s;
      }
      for (const Segment& s : req.segments) {
        void* local = reinterpret_cast<void*>(static_cast<uintptr_t>(s.local));
        void* remote = reinterpret_cast<void*>(static_cast<uintptr_t>(s.remote));
        if (req.op == XferOp::kRead) {
          std::memmove(local, remote, s.bytes);
        } else {
          std::memmove(remote, local, s.bytes);
        }
      }
    }
    listener_->OnDataDone(req.id, Status::OK());
    return Status::OK();
  }

  Status Cancel(TransferId) override { return Status::OK(); }  // transfers finish in Post

 private:
  const std::string name_;
  CoreListener* const listener_;
  std::map<PeerId, std::string> peers_;
};

}  // namespace

std::unique_ptr<ControlChannel> CreateLoopbackControl(const PartOptions& options,
                                                      CoreListener* listener) {
  return std::make_unique<LoopbackControl>(options, listener);
}

std::unique_ptr<DataPath> CreateLoopbackPath(const PartOptions& options, CoreListener* listener) {
  return std::make_unique<LoopbackPath>(options, listener);
}

void SetLoopbackReachable(std::string_view agent, bool reachable) {
  Fabric& f = GetFabric();
  std::lock_guard<std::recursive_mutex> lock(f.mu);
  if (reachable) {
    f.unreachable.erase(std::string(agent));
  } else {
    f.unreachable.insert(std::string(agent));
  }
}

}  // namespace eplbx::internal
