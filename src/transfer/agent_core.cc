#include "transfer/agent_core.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <fstream>
#include <iostream>
#include <thread>

#include "common/numbers.h"
#include "common/strings.h"

namespace eplbx::internal {
namespace {

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

std::vector<std::string> SplitList(std::string_view text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    if (comma == std::string_view::npos) comma = text.size();
    out.emplace_back(text.substr(start, comma - start));
    start = comma + 1;
  }
  return out;
}

std::string JoinList(const std::vector<std::string>& items) {
  std::string out;
  for (const std::string& s : items) out += (out.empty() ? "" : ",") + s;
  return out;
}

// The data paths an agent uses, in order; *explicit_list when the user named them.
Result<std::vector<std::string>> ResolvePaths(const AgentConfig& config, Env* env,
                                              bool* explicit_list) {
  *explicit_list = false;
  if (!config.paths.empty()) {
    *explicit_list = true;
    return config.paths;
  }
  Transport transport = config.transport;
  if (transport == Transport::kAuto) {
    if (std::string v = env->GetVar("EPLBX_PATHS").value_or(""); !v.empty()) {
      *explicit_list = true;
      return SplitList(v);
    }
    if (std::string v = env->GetVar("EPLBX_TRANSPORT").value_or(""); !v.empty()) {
      Result<Transport> t = ParseTransport(v);
      if (!t.ok()) return t.status().WithPrefix("environment variable EPLBX_TRANSPORT");
      transport = *t;
    }
  }
  if (config.backend == "loopback" || transport == Transport::kAuto) {
    return DefaultPaths(config.backend);
  }
  if (transport == Transport::kShm) {
    if (CudaPathByDefault()) return std::vector<std::string>{"shm", "cma", "cuda_ipc"};
    return std::vector<std::string>{"shm", "cma"};
  }
  return std::vector<std::string>{"ucx"};
}

}  // namespace

std::string_view OpName(XferOp op) { return op == XferOp::kRead ? "READ" : "WRITE"; }

Result<std::shared_ptr<AgentCore>> AgentCore::Create(std::string name, AgentConfig config,
                                                     PartsDecorator decorate) {
  if (name.empty() || name.size() > Agent::kMaxNameBytes) {
    return Status::InvalidArgument(
        StrCat("agent name must be 1..", Agent::kMaxNameBytes, " bytes, got ", name.size()));
  }
  if (config.peer_timeout.count() <= 0) {
    return Status::InvalidArgument(StrCat("agent '", name, "': peer_timeout must be positive, got ",
                                          config.peer_timeout.count(), " ms"));
  }
  if (config.backend != "ucx" && config.backend != "loopback") {
    return Status::InvalidArgument(StrCat("agent '", name, "': unknown backend ",
                                          Printable(config.backend),
                                          " (expected ucx or loopback)"));
  }
  bool explicit_list = false;
  Env* env = EnvOrDefault(config.env);
  Result<std::vector<std::string>> paths = ResolvePaths(config, env, &explicit_list);
  if (!paths.ok()) return paths.status();
  if (paths->size() > kMaxPaths) {
    return Status::InvalidArgument(
        StrCat("agent '", name, "': ", paths->size(), " data paths, at most ", kMaxPaths));
  }
  if (config.copy_threads <= 0) {
    if (std::string v = env->GetVar("EPLBX_COPY_THREADS").value_or(""); !v.empty()) {
      Result<int> n = ParseInteger<int>(v, "EPLBX_COPY_THREADS", 1, 64);
      if (!n.ok()) return n.status().WithPrefix(StrCat("agent '", name, "'"));
      config.copy_threads = *n;
    } else {
      config.copy_threads =
          static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 2u));
    }
  }
  std::string host = config.host_id;
  if (host.empty()) {
    host = env->GetVar("EPLBX_HOST_ID").value_or("");
    if (host.empty()) host = DetectHostId();
  }
  if (host.size() > kMaxHostIdBytes) host.resize(kMaxHostIdBytes);
  std::shared_ptr<AgentCore> core(new AgentCore(std::move(name), config, std::move(host)));
  core->paths_explicit_ = explicit_list;
  PartOptions options;
  options.agent_name = core->name_;
  options.peer_timeout = config.peer_timeout;
  options.copy_threads = config.copy_threads;
  if (config.inline_copy_bytes < -1) {
    return Status::InvalidArgument(StrCat("agent '", core->name_, "': inline_copy_bytes is ",
                                          config.inline_copy_bytes,
                                          "; expected -1 (default) or a byte count"));
  }
  if (config.prefault_bytes < -1) {
    return Status::InvalidArgument(StrCat("agent '", core->name_, "': prefault_bytes is ",
                                          config.prefault_bytes,
                                          "; expected -1 (default) or a byte count"));
  }
  options.prefault_bytes = config.prefault_bytes >= 0 ? static_cast<uint64_t>(config.prefault_bytes)
                                                      : Agent::kDefaultPrefaultBytes;
  options.inline_copy_bytes = Agent::kDefaultInlineCopyBytes;
  if (config.inline_copy_bytes >= 0) {
    options.inline_copy_bytes = static_cast<uint64_t>(config.inline_copy_bytes);
  } else if (std::string v = env->GetVar("EPLBX_INLINE_COPY_BYTES").value_or(""); !v.empty()) {
    Result<uint64_t> n = ParseInteger<uint64_t>(v, "EPLBX_INLINE_COPY_BYTES", 0, uint64_t{1} << 40);
    if (!n.ok()) return n.status().WithPrefix(StrCat("agent '", core->name_, "'"));
    options.inline_copy_bytes = *n;
  }
  // Without it the agent's waits stay on the condition variable (WaitHere needs the fd).
  core->wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  // Switches for measuring (docs/transfer.md, "Notifications on one host"): 0 or 1.
  for (auto [var, flag] :
       {std::pair<const char*, bool*>{"EPLBX_LOCAL_NOTIFY", &options.local_notify},
        {"EPLBX_INLINE_WHEN_BUSY", &options.inline_when_busy},
        {"EPLBX_RECEIVE_HERE", &core->receive_here_}}) {
    if (std::string v = env->GetVar(var).value_or(""); !v.empty()) {
      Result<int> n = ParseInteger<int>(v, var, 0, 1);
      if (!n.ok()) return n.status().WithPrefix(StrCat("agent '", core->name_, "'"));
      *flag = *n == 1;
    }
  }
  core->control_slot_ = std::make_unique<ListenerSlot>(core.get());
  std::vector<CoreListener*> listeners;
  std::vector<ListenerSlot*> slots;
  for (size_t i = 0; i < paths->size(); ++i) {
    core->sinks_.push_back(std::make_unique<PathSink>(core.get(), i));
    core->path_slots_.push_back(std::make_unique<ListenerSlot>(core->sinks_.back().get()));
    slots.push_back(core->path_slots_.back().get());
    listeners.push_back(slots.back());
  }
  Result<AgentParts> parts =
      CreateParts(config.backend, *paths, options, core->control_slot_.get(), listeners);
  if (!parts.ok()) return parts.status();
  if (decorate) EPLBX_RETURN_IF_ERROR(decorate(*parts, core->control_slot_.get(), slots));
  core->parts_ = std::move(*parts);
  core->backend_name_ = std::string(core->parts_.control->name());
  for (auto& p : core->parts_.paths) {
    core->paths_.push_back(p.get());
    core->path_names_.emplace_back(p->name());
    core->totals_.push_back(PathTotals{std::string(p->name()), 0, 0});
  }
  return core;
}

AgentCore::AgentCore(std::string name, AgentConfig config, std::string host_id)
    : name_(std::move(name)), config_(std::move(config)), host_id_(std::move(host_id)) {}

AgentCore::~AgentCore() {
  // The parts stop their threads before the tables they report into go away: data paths
  // first, then the control channel they may use.
  parts_.paths.clear();
  parts_.control.reset();
  if (wake_fd_ >= 0) close(wake_fd_);
}

void AgentCore::Wake() {
  cv_.notify_all();
  if (waiting_here_.load()) {
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = write(wake_fd_, &one, sizeof(one));
  }
}

std::vector<std::string> AgentCore::path_names() const { return path_names_; }

std::vector<PathTotals> AgentCore::PathBytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return totals_;
}

Result<uint64_t> AgentCore::Register(void* ptr, size_t bytes, SharedFile file, MemoryKind kind) {
  const uint64_t addr = reinterpret_cast<uintptr_t>(ptr);
  if (ptr == nullptr || bytes == 0 || addr + bytes < addr) {
    return Status::InvalidArgument(StrCat("agent '", name_, "': cannot register [", Hex(addr),
                                          ", +", bytes, "): null, empty or wrapping"));
  }
  LocalRegionView view;
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
    view.id = next_region_id_++;
  }
  view.addr = addr;
  view.bytes = bytes;
  view.kind = kind;
  view.file = file;
  if (std::none_of(paths_.begin(), paths_.end(), [&](const DataPath* p) {
        return p->caps().Moves(kind) || p->caps().CopiesLocal(kind);
      })) {
    return Status::InvalidArgument(
        StrCat("agent '", name_, "': [", Hex(addr), ", +", bytes, ") is ", MemoryKindName(kind),
               " memory and none of the data paths [", JoinList(path_names_), "] moves it",
               kind == MemoryKind::kCuda ? NoCudaPathHint() : ""));
  }
  // A path registers what it moves for peers or copies on our side (UCX never maps device
  // memory it cannot reach).
  std::vector<DataPath*> registered;
  for (DataPath* p : paths_) {
    const PathCaps caps = p->caps();
    if (!caps.Moves(kind) && !caps.CopiesLocal(kind)) continue;
    Status s = p->RegisterMemory(view);
    if (!s.ok()) {
      for (DataPath* q : registered) q->DeregisterMemory(view.id);
      return s;
    }
    registered.push_back(p);
  }
  std::lock_guard<std::mutex> lock(mu_);
  regions_[addr] = LocalRegion{view.id, addr, bytes, view.kind, file};
  return view.id;
}

void AgentCore::Deregister(uint64_t id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = std::find_if(regions_.begin(), regions_.end(),
                           [&](const auto& kv) { return kv.second.id == id; });
    if (it == regions_.end()) return;
    regions_.erase(it);
  }
  for (DataPath* p : paths_) p->DeregisterMemory(id);
}

std::vector<LocalRegionView> AgentCore::RegionViews() const {
  std::vector<LocalRegionView> views;
  for (const auto& [addr, r] : regions_) {
    views.push_back(LocalRegionView{r.id, r.addr, r.bytes, r.kind, r.file});
  }
  return views;
}

std::string AgentCore::Metadata() const {
  AgentMetadata m;
  m.name = name_;
  m.host_id = host_id_;
  m.pid = static_cast<uint32_t>(getpid());
  m.control = backend_name_;
  m.conn_info = parts_.control->ConnectionInfo();
  std::vector<LocalRegionView> views;
  {
    std::lock_guard<std::mutex> lock(mu_);
    views = RegionViews();
  }
  for (const LocalRegionView& r : views) m.regions.push_back(RegionInfo{r.addr, r.bytes, r.kind});
  for (DataPath* p : paths_) {
    m.sections.push_back(PathSection{std::string(p->name()), p->Section(views)});
  }
  return EncodeAgentMetadata(m);
}

Status AgentCore::ChoosePaths(PeerId id, bool same_host, PeerRecord* rec) {
  // Connect every path; a refusal is kept as the path's reason.
  std::vector<std::string> why(paths_.size());
  for (size_t i = 0; i < paths_.size(); ++i) {
    const PathCaps caps = paths_[i]->caps();
    if (same_host ? !caps.same_host : !caps.other_hosts) {
      why[i] = same_host ? "moves data only between hosts"
                         : StrCat("the peer is on another host ('", rec->meta.host_id,
                                  "'; this agent is on '", host_id_, "')");
      continue;
    }
    PeerView view;
    view.id = id;
    view.name = rec->meta.name;
    view.pid = rec->meta.pid;
    view.same_host = same_host;
    view.regions = &rec->meta.regions;
    if (const PathSection* s = rec->meta.Section(paths_[i]->name()); s != nullptr) {
      view.section = s->body;
      view.has_section = true;
    }
    Status s = paths_[i]->Connect(view);
    if (s.ok()) {
      rec->connected_paths |= 1u << i;
    } else {
      why[i] = s.message();
    }
  }
  // Per region, the first connected path that moves its kind and reaches it.
  std::vector<bool> refused(paths_.size(), false);
  auto refuse = [&](size_t i, std::string reason) {
    if (refused[i]) return;
    refused[i] = true;
    rec->refused.push_back(StrCat(paths_[i]->name(), ": ", reason));
  };
  bool any_connected = rec->connected_paths != 0;
  rec->region_path.assign(rec->meta.regions.size(), 0);
  for (uint32_t r = 0; r < rec->meta.regions.size(); ++r) {
    const MemoryKind kind = rec->meta.regions[r].kind;
    bool chosen = false;
    std::vector<std::string> reasons;
    for (size_t i = 0; i < paths_.size() && !chosen; ++i) {
      std::string reason;
      if ((rec->connected_paths & (1u << i)) == 0) {
        reason = why[i];
      } else if (!paths_[i]->caps().Moves(kind)) {
        // The path may say it better ("region 3 is not in a shared file").
        if (paths_[i]->Reaches(id, r, &reason) || reason.empty()) {
          reason = StrCat("moves no ", MemoryKindName(kind), " memory");
        }
      } else if (!paths_[i]->Reaches(id, r, &reason)) {
      } else {
        chosen = true;
        rec->region_path[r] = static_cast<uint8_t>(i);
        const std::string name(paths_[i]->name());
        if (std::none_of(rec->choices.begin(), rec->choices.end(),
                         [&](const PathChoice& c) { return c.kind == kind && c.path == name; })) {
          rec->choices.push_back(PathChoice{kind, name});
        }
        break;
      }
      reasons.push_back(StrCat(paths_[i]->name(), ": ", reason));
      refuse(i, reason);
    }
    if (!chosen) {
      std::string all;
      for (const std::string& s : reasons) all += (all.empty() ? "" : "; ") + s;
      return Status::Unavailable(StrCat(
          "agent '", name_, "': no data path of [", JoinList(path_names_), "] reaches region ", r,
          " (", MemoryKindName(kind), ") of peer '", rec->meta.name, "': ", all));
    }
  }
  if (!any_connected) {
    std::string all;
    for (size_t i = 0; i < paths_.size(); ++i) {
      all += StrCat(all.empty() ? "" : "; ", paths_[i]->name(), ": ", why[i]);
    }
    return Status::Unavailable(StrCat("agent '", name_, "': no data path of [",
                                      JoinList(path_names_), "] accepts peer '", rec->meta.name,
                                      "': ", all));
  }
  // Connected paths before the chosen ones that refused the whole peer are reported too.
  for (size_t i = 0; i < paths_.size(); ++i) {
    if ((rec->connected_paths & (1u << i)) != 0 || refused[i]) continue;
    bool before_a_choice = false;
    for (uint8_t p : rec->region_path) before_a_choice |= p > i;
    if (before_a_choice || rec->meta.regions.empty()) refuse(i, why[i]);
  }
  // Same-host paths only: the peer's bytes never cross the network stack.
  bool local = true;
  for (const PathChoice& c : rec->choices) local &= c.path != "ucx";
  if (rec->meta.regions.empty()) {
    local = false;
    for (size_t i = 0; i < paths_.size(); ++i) {
      if ((rec->connected_paths & (1u << i)) != 0) {
        local = paths_[i]->name() != "ucx";
        break;
      }
    }
  }
  rec->transport = local ? Transport::kShm : Transport::kTcp;
  return Status::OK();
}

Result<PeerId> AgentCore::Connect(std::string_view blob) {
  Result<AgentMetadata> meta = DecodeAgentMetadata(blob);
  if (!meta.ok()) return meta.status().WithPrefix(StrCat("agent '", name_, "': connect"));
  const std::string peer = meta->name;
  if (meta->control != backend_name_) {
    return Status::Mismatch(StrCat("agent '", name_, "': peer '", peer, "' uses backend '",
                                   meta->control, "', this agent uses '", backend_name_,
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
  EPLBX_RETURN_IF_ERROR(parts_.control->Connect(id, peer, meta->conn_info));
  PeerRecord rec;
  rec.meta = std::move(*meta);
  Status chosen = ChoosePaths(id, same_host, &rec);
  if (!chosen.ok()) {
    for (size_t i = 0; i < paths_.size(); ++i) {
      if ((rec.connected_paths & (1u << i)) != 0) paths_[i]->Disconnect(id);
    }
    parts_.control->Disconnect(id);
    return chosen;
  }
  // Never a silent fallback: a path the user listed, or a same-host peer that ends up on
  // the network path, is reported once per peer.
  const bool network_for_local =
      same_host && rec.transport == Transport::kTcp &&
      std::find(path_names_.begin(), path_names_.end(), "cma") != path_names_.end();
  if (!rec.refused.empty() && (paths_explicit_ || network_for_local)) {
    std::string line = StrCat("eplbx: agent '", name_, "': peer '", peer, "' uses");
    for (const PathChoice& c : rec.choices) {
      line += StrCat(" ", c.path, " for ", MemoryKindName(c.kind), ";");
    }
    line += " refused:";
    for (const std::string& r : rec.refused) line += " [" + r + "]";
    std::cerr << line << "\n";
  }
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
  uint32_t connected = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(peer);
    if (it == peers_.end()) return Status::NotFound(StrCat("agent '", name_, "': no peer ", peer));
    connected = it->second.connected_paths;
    peers_.erase(it);
  }
  for (size_t i = 0; i < paths_.size(); ++i) {
    if ((connected & (1u << i)) != 0) paths_[i]->Disconnect(peer);
  }
  parts_.control->Disconnect(peer);
  return Status::OK();
}

Result<PeerInfo> AgentCore::Peer(PeerId peer) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = peers_.find(peer);
  if (it == peers_.end()) return Status::NotFound(StrCat("agent '", name_, "': no peer ", peer));
  const PeerRecord& p = it->second;
  return PeerInfo{p.meta.name, p.meta.host_id, p.transport, p.reachable,
                  p.failure,   p.choices,      p.refused};
}

Status AgentCore::CheckLocal(XferOp op, const PeerRecord& p, size_t i, const Descriptor& d,
                             uint64_t* region, MemoryKind* kind) const {
  auto it = regions_.upper_bound(d.addr);
  if (it != regions_.begin()) {
    const LocalRegion& r = std::prev(it)->second;
    if (d.addr >= r.addr && d.bytes <= r.bytes && d.addr - r.addr <= r.bytes - d.bytes) {
      *region = r.id;
      *kind = r.kind;
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
                                   std::optional<std::string> notify, bool may_help,
                                   bool caller_waits) {
  std::array<PathRequest, kMaxPaths> parts;
  TransferId id = 0;
  uint32_t mask = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(peer);
    if (it == peers_.end()) return Status::NotFound(StrCat("agent '", name_, "': no peer ", peer));
    const PeerRecord& p = it->second;
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
    for (size_t i = 0; i < local.size(); ++i) {
      if (local[i].bytes != remote[i].bytes) {
        return Status::InvalidArgument(
            StrCat("agent '", name_, "': ", OpName(op), " with '", p.meta.name, "': descriptor ", i,
                   " has ", local[i].bytes, " local bytes but ", remote[i].bytes, " remote"));
      }
      if (local[i].bytes == 0) continue;
      uint32_t region = 0;
      uint64_t local_region = 0;
      MemoryKind local_kind = MemoryKind::kHost;
      EPLBX_RETURN_IF_ERROR(CheckLocal(op, p, i, local[i], &local_region, &local_kind));
      EPLBX_RETURN_IF_ERROR(CheckRemote(op, p, i, remote[i], &region));
      const uint8_t path = p.region_path[region];
      const PathCaps caps = paths_[path]->caps();
      if (!caps.CopiesLocal(local_kind)) {
        return Status::InvalidArgument(
            StrCat("agent '", name_, "': ", OpName(op), " with '", p.meta.name,
                   "': local descriptor ", i, " lies in ", MemoryKindName(local_kind),
                   " memory, which data path '", paths_[path]->name(), "' (chosen for the peer's ",
                   MemoryKindName(p.meta.regions[region].kind), " region ", region,
                   ") cannot copy; nothing was sent (keep both sides of a transfer in "
                   "the same kind of memory)"));
      }
      if (op == XferOp::kRead ? !caps.read : !caps.write) {
        return Status::NotSupported(StrCat("agent '", name_, "': ", OpName(op), " with '",
                                           p.meta.name, "': data path '", paths_[path]->name(),
                                           "' cannot ", OpName(op)));
      }
      parts[path].segments.push_back(
          Segment{local[i].addr, remote[i].addr, local[i].bytes, region, local_region});
      mask |= 1u << path;
    }
    const bool alone = may_help && transfers_.empty();
    id = next_transfer_++;
    Xfer& x = transfers_[id];
    x.peer = peer;
    x.parts = mask;
    x.notify = std::move(notify);
    for (size_t i = 0; i < paths_.size(); ++i) {
      if ((mask & (1u << i)) == 0) continue;
      parts[i].id = id;
      parts[i].peer = peer;
      parts[i].peer_name = p.meta.name;
      parts[i].op = op;
      parts[i].alone = alone && std::popcount(mask) == 1;
      parts[i].caller_waits = caller_waits;
      for (const Segment& s : parts[i].segments) x.part_bytes[i] += s.bytes;
    }
  }
  if (mask == 0) {  // nothing to move: only the notification
    FinishParts(id);
    return id;
  }
  bool posted_any = false;
  for (size_t i = 0; i < paths_.size(); ++i) {
    if ((mask & (1u << i)) == 0) continue;
    Status posted = paths_[i]->Post(std::move(parts[i]));
    if (posted.ok()) {
      posted_any = true;
      continue;
    }
    if (!posted_any) {
      // Nothing moves yet: fail the call, as if nothing had been asked. A part done
      // synchronously before this one cannot exist: it would have been posted.
      std::lock_guard<std::mutex> lock(mu_);
      transfers_.erase(id);
      return posted;
    }
    OnPartDone(i, id, std::move(posted));
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
  return it->second.status;
}

TransferStatus AgentCore::Wait(TransferId id, std::chrono::milliseconds timeout) const {
  std::unique_lock<std::mutex> lock(mu_);
  // A blocking wait on the condition variable's own clock (not the Env's: it only paces).
  cv_.wait_for(lock, timeout, [&] {
    auto it = transfers_.find(id);
    return it == transfers_.end() || it->second.status.state != TransferState::kInProgress;
  });
  auto it = transfers_.find(id);
  if (it == transfers_.end()) {
    return {TransferState::kError,
            Status::NotFound(StrCat("agent '", name_, "': no transfer ", id, " (released?)"))};
  }
  return it->second.status;
}

Status AgentCore::Cancel(TransferId id) {
  uint32_t parts = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = transfers_.find(id);
    if (it == transfers_.end()) {
      return Status::NotFound(StrCat("agent '", name_, "': no transfer ", id, " (released?)"));
    }
    if (it->second.status.state != TransferState::kInProgress) return Status::OK();
    parts = it->second.parts;
  }
  for (size_t i = 0; i < paths_.size(); ++i) {
    if ((parts & (1u << i)) != 0) EPLBX_RETURN_IF_ERROR(paths_[i]->Cancel(id));
  }
  // The paths end the transfer once nothing can move; their failure deadline bounds this.
  TransferStatus s = Wait(id, config_.peer_timeout + std::chrono::seconds(5));
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
  if (it->second.status.state == TransferState::kInProgress) {
    return Status::InvalidArgument(StrCat("agent '", name_, "': transfer ", id,
                                          " is in progress; wait or cancel it before releasing"));
  }
  transfers_.erase(it);
  return Status::OK();
}

Status AgentCore::CheckNotify(PeerId peer, size_t bytes) const {
  if (bytes > Agent::kMaxNotificationBytes) {
    return Status::InvalidArgument(StrCat("agent '", name_, "': notification of ", bytes,
                                          " bytes, the limit is ", Agent::kMaxNotificationBytes));
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto it = peers_.find(peer);
  if (it == peers_.end()) return Status::NotFound(StrCat("agent '", name_, "': no peer ", peer));
  if (!it->second.reachable) {
    return Status::Unavailable(StrCat("agent '", name_, "': peer unreachable: '",
                                      it->second.meta.name, "' (", it->second.failure, ")"));
  }
  return Status::OK();
}

Status AgentCore::Notify(PeerId peer, std::string_view payload) {
  EPLBX_RETURN_IF_ERROR(CheckNotify(peer, payload.size()));
  return parts_.control->Notify(peer, std::string(payload));
}

std::vector<Status> AgentCore::NotifyMany(PeerId peer, std::vector<std::string> payloads) {
  // A payload refused here is left out (its status says why); the rest go, in order.
  std::vector<Status> out(payloads.size());
  std::vector<std::string> sent;
  std::vector<size_t> index;
  for (size_t i = 0; i < payloads.size(); ++i) {
    out[i] = CheckNotify(peer, payloads[i].size());
    if (!out[i].ok()) continue;
    sent.push_back(std::move(payloads[i]));
    index.push_back(i);
  }
  if (sent.empty()) return out;
  std::vector<Status> result = parts_.control->NotifyMany(peer, std::move(sent));
  for (size_t k = 0; k < index.size() && k < result.size(); ++k) out[index[k]] = result[k];
  return out;
}

std::vector<Notification> AgentCore::PollNotifications(std::chrono::milliseconds timeout,
                                                       bool or_completion) {
  std::unique_lock<std::mutex> lock(mu_);
  // No wait at all for a poll: a zero wait_for still makes a futex call (a third of a
  // pipeline's Poll() on a busy host).
  const auto ready = [&] {
    return !notifications_.empty() || (or_completion && events_ != events_seen_);
  };
  if (timeout.count() > 0 && !ready()) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    // One waiter at a time receives the control channel's messages itself (WaitHere): a
    // message wakes it instead of the channel's thread, which would then wake it. Every
    // change a waiter looks for is made under mu_ and then Wake()s, which writes wake_fd_
    // while waiting_here_: set under mu_ before the last look, it cannot miss one.
    while (wake_fd_ >= 0 && !waiting_here_.load() && receive_here_) {
      waiting_here_.store(true);
      lock.unlock();
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      const bool waited = left.count() > 0 && parts_.control->WaitHere(left, wake_fd_);
      uint64_t drained = 0;
      [[maybe_unused]] ssize_t n = read(wake_fd_, &drained, sizeof(drained));
      lock.lock();
      waiting_here_.store(false);
      if (!waited || ready() || std::chrono::steady_clock::now() >= deadline) break;
    }
    // The rest of the time (none once WaitHere waited it out), or all of it.
    cv_.wait_until(lock, deadline, ready);
  }
  if (or_completion) events_seen_ = events_;
  std::vector<Notification> out(std::make_move_iterator(notifications_.begin()),
                                std::make_move_iterator(notifications_.end()));
  notifications_.clear();
  return out;
}

void AgentCore::OnDataDone(TransferId, Status) {
  // Data paths report through their PathSink; nothing else moves data.
}

void AgentCore::OnPartDone(size_t path, TransferId id, Status status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = transfers_.find(id);
    if (it == transfers_.end()) return;
    Xfer& x = it->second;
    if (x.status.state != TransferState::kInProgress || (x.parts & (1u << path)) == 0) {
      return;  // a duplicate completion
    }
    x.parts &= ~(1u << path);
    if (status.ok()) {
      totals_[path].bytes += x.part_bytes[path];
      totals_[path].transfers += 1;
    } else if (x.error.ok()) {
      x.error = std::move(status);
    }
    if (x.parts != 0) return;
  }
  FinishParts(id);
}

void AgentCore::FinishParts(TransferId id) {
  Status error;
  PeerId peer = 0;
  std::optional<std::string> notify;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = transfers_.find(id);
    if (it == transfers_.end()) return;
    Xfer& x = it->second;
    error = x.error;
    peer = x.peer;
    auto p = peers_.find(peer);
    if (error.ok() && p == peers_.end()) {
      error = Status::Aborted(StrCat("agent '", name_, "': peer ", peer, " was disconnected"));
    } else if (error.ok() && !p->second.reachable) {
      error = Status::Unavailable(StrCat("agent '", name_, "': peer unreachable: '",
                                         p->second.meta.name, "' (", p->second.failure, ")"));
    }
    if (error.ok()) notify = std::move(x.notify);
  }
  if (!error.ok() || !notify) {
    Complete(id, std::move(error));
    return;
  }
  // The data landed: now the notification may go; the transfer is done once it left.
  Status sent = parts_.control->Notify(peer, std::move(*notify),
                                       [this, id](Status s) { Complete(id, std::move(s)); });
  if (!sent.ok()) Complete(id, std::move(sent));
}

void AgentCore::Complete(TransferId id, Status status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = transfers_.find(id);
    if (it == transfers_.end() || it->second.status.state != TransferState::kInProgress) return;
    it->second.status = status.ok() ? TransferStatus{TransferState::kDone, Status::OK()}
                                    : TransferStatus{TransferState::kError, std::move(status)};
    it->second.notify.reset();
    ++events_;
  }
  Wake();
}

void AgentCore::OnNotification(std::string sender, std::string payload) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    notifications_.push_back(Notification{std::move(sender), std::move(payload)});
  }
  Wake();
}

void AgentCore::OnNotifications(std::string sender, std::vector<std::string> payloads) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (std::string& p : payloads) notifications_.push_back(Notification{sender, std::move(p)});
  }
  Wake();
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
  Wake();
}

Result<std::unique_ptr<Agent>> AgentFactory::Create(std::string name, AgentConfig config,
                                                    PartsDecorator decorate) {
  Result<std::shared_ptr<AgentCore>> core =
      AgentCore::Create(std::move(name), std::move(config), std::move(decorate));
  if (!core.ok()) return core.status();
  return std::unique_ptr<Agent>(new Agent(std::move(*core)));
}

}  // namespace eplbx::internal
