#include "transfer/loopback/loopback_backend.h"

#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>

#include "common/strings.h"

namespace eplbx::internal {
namespace {

class LoopbackBackend;

// Every loopback backend in the process, by connection info.
struct Fabric {
  std::recursive_mutex mu;
  std::map<std::string, LoopbackBackend*> by_conn;
  std::set<std::string> unreachable;  // agent names
  uint64_t next = 1;
};

Fabric& GetFabric() {
  static Fabric* fabric = new Fabric();  // never destroyed: backends may outlive statics
  return *fabric;
}

class LoopbackBackend final : public Backend {
 public:
  LoopbackBackend(const BackendOptions& options, BackendListener* listener)
      : name_(options.agent_name), listener_(listener) {
    Fabric& f = GetFabric();
    std::lock_guard<std::recursive_mutex> lock(f.mu);
    conn_ = StrCat("loopback:", f.next++);
    f.by_conn[conn_] = this;
  }
  ~LoopbackBackend() override {
    Fabric& f = GetFabric();
    std::lock_guard<std::recursive_mutex> lock(f.mu);
    f.by_conn.erase(conn_);
  }

  std::string_view name() const override { return "loopback"; }
  std::string ConnectionInfo() const override { return conn_; }
  Result<std::string> RegisterMemory(uint64_t, void*, size_t) override { return std::string(); }
  void DeregisterMemory(uint64_t) override {}

  Result<Transport> Connect(PeerId id, const AgentMetadata& peer, Transport wanted, bool) override {
    Fabric& f = GetFabric();
    std::lock_guard<std::recursive_mutex> lock(f.mu);
    if (f.by_conn.find(peer.conn_info) == f.by_conn.end()) {
      return Status::Unavailable(StrCat("agent '", name_, "': loopback peer '", peer.name,
                                        "' is not in this process (or was destroyed)"));
    }
    peers_[id] = Peer{peer.conn_info, peer.name};
    return wanted == Transport::kAuto ? Transport::kShm : wanted;
  }

  void Disconnect(PeerId id) override {
    std::lock_guard<std::recursive_mutex> lock(GetFabric().mu);
    peers_.erase(id);
  }

  Status Post(PostRequest req) override {
    Fabric& f = GetFabric();
    Status result;
    {
      std::lock_guard<std::recursive_mutex> lock(f.mu);
      LoopbackBackend* target = nullptr;
      EPLBX_RETURN_IF_ERROR(Reach(req.peer, &target));
      for (const Segment& s : req.segments) {
        void* local = reinterpret_cast<void*>(static_cast<uintptr_t>(s.local));
        void* remote = reinterpret_cast<void*>(static_cast<uintptr_t>(s.remote));
        if (req.op == XferOp::kRead) {
          std::memmove(local, remote, s.bytes);
        } else {
          std::memmove(remote, local, s.bytes);
        }
      }
      if (req.notify) target->listener_->OnNotification(name_, std::move(*req.notify));
    }
    listener_->OnTransferDone(req.id, Status::OK());
    return Status::OK();
  }

  Status Notify(PeerId peer, std::string payload) override {
    std::lock_guard<std::recursive_mutex> lock(GetFabric().mu);
    LoopbackBackend* target = nullptr;
    EPLBX_RETURN_IF_ERROR(Reach(peer, &target));
    target->listener_->OnNotification(name_, std::move(payload));
    return Status::OK();
  }

  Status Cancel(TransferId) override { return Status::OK(); }  // transfers finish in Post

 private:
  struct Peer {
    std::string conn;
    std::string name;
  };

  // REQUIRES: fabric lock held.
  Status Reach(PeerId id, LoopbackBackend** target) {
    Fabric& f = GetFabric();
    auto it = peers_.find(id);
    if (it == peers_.end()) return Status::NotFound(StrCat("agent '", name_, "': no peer ", id));
    auto t = f.by_conn.find(it->second.conn);
    if (t == f.by_conn.end() || f.unreachable.count(it->second.name) != 0 ||
        f.unreachable.count(name_) != 0) {
      Status s = Status::Unavailable(StrCat("agent '", name_, "': peer unreachable: '",
                                            it->second.name, "' (loopback peer gone or cut off)"));
      listener_->OnPeerFailed(id, s);
      return s;
    }
    *target = t->second;
    return Status::OK();
  }

  const std::string name_;
  BackendListener* const listener_;
  std::string conn_;
  std::map<PeerId, Peer> peers_;
};

}  // namespace

std::unique_ptr<Backend> CreateLoopbackBackend(const BackendOptions& options,
                                               BackendListener* listener) {
  return std::make_unique<LoopbackBackend>(options, listener);
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
