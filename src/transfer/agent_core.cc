#include "transfer/agent_core.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <thread>

#include "common/strings.h"

namespace eplbx::internal {
namespace {

// The probe peers read to prove they can reach our memory directly (same-host check).
const volatile uint64_t g_probe = kProbeValue;

std::string ReadLink(const char* path) {
  char buf[256];
  ssize_t n = readlink(path, buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string("?");
}

// Same kernel boot, same network namespace, same pid namespace.
std::string DetectHostId() {
  std::string boot;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::getline(in, boot);
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  return StrCat(host, "/", boot.empty() ? "?" : boot, "/", ReadLink("/proc/self/ns/net"), "/",
                ReadLink("/proc/self/ns/pid"));
}

std::string Hex(uint64_t v) { return StrCat("0x", std::hex, v); }

}  // namespace

std::string_view OpName(XferOp op) { return op == XferOp::kRead ? "READ" : "WRITE"; }

Result<std::shared_ptr<AgentCore>> AgentCore::Create(std::string name, AgentConfig config) {
  if (name.empty() || name.size() > Agent::kMaxNameBytes) {
    return Status::InvalidArgument(
        StrCat("agent name must be 1..", Agent::kMaxNameBytes, " bytes, got ", name.size()));
  }
  if (config.peer_timeout.count() <= 0) {
    return Status::InvalidArgument(StrCat("agent '", name, "': peer_timeout must be positive, got ",
                                          config.peer_timeout.count(), " ms"));
  }
  if (config.transport == Transport::kAuto) {
    if (const char* env = std::getenv("EPLBX_TRANSPORT"); env != nullptr && *env != '\0') {
      Result<Transport> t = ParseTransport(env);
      if (!t.ok()) return t.status().WithPrefix("environment variable EPLBX_TRANSPORT");
      config.transport = *t;
    }
  }
  if (config.copy_threads <= 0) {
    config.copy_threads = static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 2u));
  }
  std::string host = config.host_id;
  if (host.empty()) {
    const char* env = std::getenv("EPLBX_HOST_ID");
    host = (env != nullptr && *env != '\0') ? env : DetectHostId();
  }
  if (host.size() > kMaxHostIdBytes) host.resize(kMaxHostIdBytes);
  std::shared_ptr<AgentCore> core(new AgentCore(std::move(name), config, std::move(host)));
  BackendOptions options;
  options.agent_name = core->name_;
  options.peer_timeout = config.peer_timeout;
  options.copy_threads = config.copy_threads;
  Result<std::unique_ptr<Backend>> backend = CreateBackend(config.backend, options, core.get());
  if (!backend.ok()) return backend.status().WithPrefix(StrCat("agent '", core->name_, "'"));
  core->backend_ = std::move(*backend);
  core->backend_name_ = std::string(core->backend_->name());
  return core;
}

AgentCore::AgentCore(std::string name, AgentConfig config, std::string host_id)
    : name_(std::move(name)), config_(std::move(config)), host_id_(std::move(host_id)) {}

AgentCore::~AgentCore() {
  // The backend stops its threads before the tables it reports into go away.
  backend_.reset();
}

Result<uint64_t> AgentCore::Register(void* ptr, size_t bytes, SharedFile file) {
  const uint64_t addr = reinterpret_cast<uintptr_t>(ptr);
  if (ptr == nullptr || bytes == 0 || addr + bytes < addr) {
    return Status::InvalidArgument(StrCat("agent '", name_, "': cannot register [", Hex(addr),
                                          ", +", bytes, "): null, empty or wrapping"));
  }
  uint64_t id = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto next = regions_.lower_bound(addr);
    auto overlaps = [&](const LocalRegion& r) {
      return r.addr < addr + bytes && addr < r.addr + r.bytes;
    };
    if ((next != regions_.end() && overlaps(next->second)) ||
        (next != regions_.begin() && overlaps(std::prev(next)->second))) {
      const LocalRegion& r = (next != regions_.end() && overlaps(next->second))
                                 ? next->second
                                 : std::prev(next)->second;
      return Status::InvalidArgument(StrCat("agent '", name_, "': region [", Hex(addr), ", +",
                                            bytes, ") overlaps registered region [", Hex(r.addr),
                                            ", +", r.bytes, "); register each byte once"));
    }
    if (regions_.size() >= kMaxRegions) {
      return Status::OutOfRange(StrCat("agent '", name_, "': at most ", kMaxRegions,
                                       " regions; register fewer, larger regions"));
    }
    id = next_region_id_++;
  }
  Result<std::string> rkey = backend_->RegisterMemory(id, ptr, bytes);
  if (!rkey.ok()) return rkey.status();
  std::lock_guard<std::mutex> lock(mu_);
  regions_[addr] = LocalRegion{id, addr, bytes, file, std::move(*rkey)};
  return id;
}

void AgentCore::Deregister(uint64_t id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = std::find_if(regions_.begin(), regions_.end(),
                           [&](const auto& kv) { return kv.second.id == id; });
    if (it == regions_.end()) return;
    regions_.erase(it);
  }
  backend_->DeregisterMemory(id);
}

std::string AgentCore::Metadata() const {
  AgentMetadata m;
  m.name = name_;
  m.host_id = host_id_;
  m.backend = backend_name_;
  m.pid = static_cast<uint32_t>(getpid());
  m.probe_addr = reinterpret_cast<uintptr_t>(&g_probe);
  m.conn_info = backend_->ConnectionInfo();
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [addr, r] : regions_) {
    m.regions.push_back(RegionInfo{r.addr, r.bytes, r.file.fd >= 0 ? kRegionShared : 0u, r.file.fd,
                                   r.file.offset, r.rkey});
  }
  return EncodeAgentMetadata(m);
}

Result<PeerId> AgentCore::Connect(std::string_view blob) {
  Result<AgentMetadata> meta = DecodeAgentMetadata(blob);
  if (!meta.ok()) return meta.status().WithPrefix(StrCat("agent '", name_, "': connect"));
  const std::string& peer = meta->name;
  if (meta->backend != backend_name_) {
    return Status::Mismatch(StrCat("agent '", name_, "': peer '", peer, "' uses backend '",
                                   meta->backend, "', this agent uses '", backend_name_,
                                   "'; configure every rank with the same backend"));
  }
  if (peer == name_) {
    return Status::InvalidArgument(
        StrCat("agent '", name_, "': blob is this agent's own metadata"));
  }
  PeerId id = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [pid, rec] : peers_) {
      if (rec.meta.name == peer) {
        return Status::InvalidArgument(
            StrCat("agent '", name_, "': an agent named '", peer, "' is already connected (peer ",
                   pid, "); agent names must be unique — disconnect it first"));
      }
    }
    id = next_peer_++;
  }
  const bool same_host = meta->host_id == host_id_;
  if (config_.transport == Transport::kShm && !same_host) {
    return Status::InvalidArgument(
        StrCat("agent '", name_, "': transport shm is forced but peer '", peer, "' is on host '",
               meta->host_id, "', this agent on '", host_id_, "'; use transport auto or tcp"));
  }
  Result<Transport> transport = backend_->Connect(id, *meta, config_.transport, same_host);
  if (!transport.ok()) return transport.status();
  PeerRecord rec;
  rec.transport = *transport;
  rec.meta = std::move(*meta);
  rec.by_addr.resize(rec.meta.regions.size());
  for (uint32_t i = 0; i < rec.by_addr.size(); ++i) rec.by_addr[i] = i;
  std::sort(rec.by_addr.begin(), rec.by_addr.end(), [&](uint32_t a, uint32_t b) {
    return rec.meta.regions[a].addr < rec.meta.regions[b].addr;
  });
  std::lock_guard<std::mutex> lock(mu_);
  peers_[id] = std::move(rec);
  return id;
}

Status AgentCore::Disconnect(PeerId peer) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (peers_.erase(peer) == 0) {
      return Status::NotFound(StrCat("agent '", name_, "': no peer ", peer));
    }
  }
  backend_->Disconnect(peer);
  return Status::OK();
}

Result<PeerInfo> AgentCore::Peer(PeerId peer) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = peers_.find(peer);
  if (it == peers_.end()) return Status::NotFound(StrCat("agent '", name_, "': no peer ", peer));
  const PeerRecord& p = it->second;
  return PeerInfo{p.meta.name, p.meta.host_id, p.transport, p.reachable, p.failure};
}

Status AgentCore::CheckLocal(XferOp op, const PeerRecord& p, size_t i, const Descriptor& d,
                             uint64_t* region) const {
  auto it = regions_.upper_bound(d.addr);
  if (it != regions_.begin()) {
    const LocalRegion& r = std::prev(it)->second;
    if (d.addr >= r.addr && d.bytes <= r.bytes && d.addr - r.addr <= r.bytes - d.bytes) {
      *region = r.id;
      return Status::OK();
    }
  }
  return Status::OutOfRange(StrCat("agent '", name_, "': ", OpName(op), " with '", p.meta.name,
                                   "': local descriptor ", i, " [", Hex(d.addr), ", +", d.bytes,
                                   ") is not inside any region this agent registered; nothing "
                                   "was sent"));
}

Status AgentCore::CheckRemote(XferOp op, const PeerRecord& p, size_t i, const Descriptor& d,
                              uint32_t* region) const {
  const auto& regs = p.meta.regions;
  auto it = std::upper_bound(p.by_addr.begin(), p.by_addr.end(), d.addr,
                             [&](uint64_t a, uint32_t r) { return a < regs[r].addr; });
  if (it != p.by_addr.begin()) {
    const RegionInfo& r = regs[*std::prev(it)];
    if (d.addr >= r.addr && d.bytes <= r.bytes && d.addr - r.addr <= r.bytes - d.bytes) {
      *region = *std::prev(it);
      return Status::OK();
    }
  }
  return Status::OutOfRange(StrCat("agent '", name_, "': ", OpName(op), " with '", p.meta.name,
                                   "': remote descriptor ", i, " [", Hex(d.addr), ", +", d.bytes,
                                   ") is not inside any of the ", regs.size(), " regions '",
                                   p.meta.name,
                                   "' registered; nothing was sent (stale metadata? "
                                   "reconnect with the peer's current blob)"));
}

Result<TransferId> AgentCore::Post(XferOp op, PeerId peer, std::span<const Descriptor> local,
                                   std::span<const Descriptor> remote,
                                   std::optional<std::string> notify) {
  PostRequest req;
  req.op = op;
  req.peer = peer;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(peer);
    if (it == peers_.end()) return Status::NotFound(StrCat("agent '", name_, "': no peer ", peer));
    const PeerRecord& p = it->second;
    req.peer_name = p.meta.name;
    if (!p.reachable) {
      return Status::Unavailable(
          StrCat("agent '", name_, "': peer unreachable: '", p.meta.name, "' (", p.failure, ")"));
    }
    if (local.size() != remote.size()) {
      return Status::InvalidArgument(StrCat("agent '", name_, "': ", OpName(op), " with '",
                                            p.meta.name, "': ", local.size(),
                                            " local descriptors but ", remote.size(), " remote"));
    }
    if (notify && notify->size() > Agent::kMaxNotificationBytes) {
      return Status::InvalidArgument(StrCat("agent '", name_, "': notification of ", notify->size(),
                                            " bytes, the limit is ", Agent::kMaxNotificationBytes));
    }
    req.segments.reserve(local.size());
    for (size_t i = 0; i < local.size(); ++i) {
      if (local[i].bytes != remote[i].bytes) {
        return Status::InvalidArgument(
            StrCat("agent '", name_, "': ", OpName(op), " with '", p.meta.name, "': descriptor ", i,
                   " has ", local[i].bytes, " local bytes but ", remote[i].bytes, " remote"));
      }
      if (local[i].bytes == 0) continue;
      uint32_t region = 0;
      uint64_t local_region = 0;
      EPLBX_RETURN_IF_ERROR(CheckLocal(op, p, i, local[i], &local_region));
      EPLBX_RETURN_IF_ERROR(CheckRemote(op, p, i, remote[i], &region));
      req.segments.push_back(
          Segment{local[i].addr, remote[i].addr, local[i].bytes, region, local_region});
    }
    req.id = next_transfer_++;
    transfers_[req.id] = TransferStatus{};
  }
  const TransferId id = req.id;
  req.notify = std::move(notify);
  Status posted = backend_->Post(std::move(req));
  if (!posted.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    transfers_.erase(id);
    return posted;
  }
  return id;
}

TransferStatus AgentCore::GetStatus(TransferId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = transfers_.find(id);
  if (it == transfers_.end()) {
    return {TransferState::kError,
            Status::NotFound(StrCat("agent '", name_, "': no transfer ", id, " (released?)"))};
  }
  return it->second;
}

TransferStatus AgentCore::Wait(TransferId id, std::chrono::milliseconds timeout) const {
  std::unique_lock<std::mutex> lock(mu_);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    auto it = transfers_.find(id);
    if (it == transfers_.end()) {
      return {TransferState::kError,
              Status::NotFound(StrCat("agent '", name_, "': no transfer ", id, " (released?)"))};
    }
    if (it->second.state != TransferState::kInProgress) return it->second;
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout) {
      auto again = transfers_.find(id);
      if (again == transfers_.end()) continue;
      return again->second;
    }
  }
}

Status AgentCore::Cancel(TransferId id) {
  TransferStatus s = GetStatus(id);
  if (s.state != TransferState::kInProgress) {
    return s.state == TransferState::kError && s.error.code() == Code::kNotFound ? s.error
                                                                                 : Status::OK();
  }
  EPLBX_RETURN_IF_ERROR(backend_->Cancel(id));
  // The backend ends the transfer once nothing can move; its failure deadline bounds this.
  s = Wait(id, config_.peer_timeout + std::chrono::seconds(5));
  if (s.state == TransferState::kInProgress) {
    return Status::Timeout(StrCat("agent '", name_, "': transfer ", id, " did not stop within ",
                                  (config_.peer_timeout.count() + 5000), " ms"));
  }
  return Status::OK();
}

Status AgentCore::Release(TransferId id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = transfers_.find(id);
  if (it == transfers_.end())
    return Status::NotFound(StrCat("agent '", name_, "': no transfer ", id));
  if (it->second.state == TransferState::kInProgress) {
    return Status::InvalidArgument(StrCat("agent '", name_, "': transfer ", id,
                                          " is in progress; wait or cancel it before releasing"));
  }
  transfers_.erase(it);
  return Status::OK();
}

Status AgentCore::Notify(PeerId peer, std::string_view payload) {
  if (payload.size() > Agent::kMaxNotificationBytes) {
    return Status::InvalidArgument(StrCat("agent '", name_, "': notification of ", payload.size(),
                                          " bytes, the limit is ", Agent::kMaxNotificationBytes));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(peer);
    if (it == peers_.end()) return Status::NotFound(StrCat("agent '", name_, "': no peer ", peer));
    if (!it->second.reachable) {
      return Status::Unavailable(StrCat("agent '", name_, "': peer unreachable: '",
                                        it->second.meta.name, "' (", it->second.failure, ")"));
    }
  }
  return backend_->Notify(peer, std::string(payload));
}

std::vector<Notification> AgentCore::PollNotifications(std::chrono::milliseconds timeout,
                                                       bool or_completion) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, timeout, [&] {
    return !notifications_.empty() || (or_completion && events_ != events_seen_);
  });
  if (or_completion) events_seen_ = events_;
  std::vector<Notification> out(std::make_move_iterator(notifications_.begin()),
                                std::make_move_iterator(notifications_.end()));
  notifications_.clear();
  return out;
}

void AgentCore::OnTransferDone(TransferId id, Status status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = transfers_.find(id);
    if (it == transfers_.end() || it->second.state != TransferState::kInProgress) return;
    it->second = status.ok() ? TransferStatus{TransferState::kDone, Status::OK()}
                             : TransferStatus{TransferState::kError, std::move(status)};
    ++events_;
  }
  cv_.notify_all();
}

void AgentCore::OnNotification(std::string sender, std::string payload) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    notifications_.push_back(Notification{std::move(sender), std::move(payload)});
  }
  cv_.notify_all();
}

void AgentCore::OnPeerFailed(PeerId peer, Status reason) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(peer);
    if (it == peers_.end() || !it->second.reachable) return;
    it->second.reachable = false;
    it->second.failure = reason.message();
    ++events_;  // wakes WaitEvents: the caller's loop checks Peer()
  }
  cv_.notify_all();
}

}  // namespace eplbx::internal
