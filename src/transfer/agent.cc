// The public Agent: a thin owner of an AgentCore, plus RegisteredRegion.
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <optional>

#include "common/strings.h"
#include "eplbx/transfer.h"
#include "transfer/agent_core.h"
#include "transfer/device_memory.h"
#include "transfer/shm/copier.h"

namespace eplbx {

using internal::StrCat;

std::string_view TransportName(Transport transport) {
  switch (transport) {
    case Transport::kAuto:
      return "auto";
    case Transport::kShm:
      return "shm";
    case Transport::kTcp:
      return "tcp";
  }
  return "?";
}

Result<Transport> ParseTransport(std::string_view name) {
  if (name == "auto") return Transport::kAuto;
  if (name == "shm") return Transport::kShm;
  if (name == "tcp") return Transport::kTcp;
  return Status::InvalidArgument(
      StrCat("unknown transport '", name, "' (expected auto, shm or tcp)"));
}

std::string_view MemoryKindName(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kHost:
      return "host";
    case MemoryKind::kHostFile:
      return "host_file";
    case MemoryKind::kCuda:
      return "cuda";
  }
  return "?";
}

RegisteredRegion::RegisteredRegion(RegisteredRegion&& other) noexcept { *this = std::move(other); }

RegisteredRegion& RegisteredRegion::operator=(RegisteredRegion&& other) noexcept {
  if (this != &other) {
    Reset();
    core_ = std::move(other.core_);
    id_ = std::exchange(other.id_, 0);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    owns_mapping_ = std::exchange(other.owns_mapping_, false);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

RegisteredRegion::~RegisteredRegion() { Reset(); }

void RegisteredRegion::Reset() {
  if (id_ != 0) {
    if (auto core = core_.lock()) core->Deregister(id_);
  }
  if (owns_mapping_ && data_ != nullptr) munmap(data_, size_);
  if (fd_ >= 0) close(fd_);
  core_.reset();
  id_ = 0;
  data_ = nullptr;
  size_ = 0;
  owns_mapping_ = false;
  fd_ = -1;
}

Agent::Agent(std::shared_ptr<internal::AgentCore> core) : core_(std::move(core)) {}
Agent::~Agent() = default;

Result<std::unique_ptr<Agent>> Agent::Create(std::string name, AgentConfig config) {
  Result<std::shared_ptr<internal::AgentCore>> core =
      internal::AgentCore::Create(std::move(name), std::move(config));
  if (!core.ok()) return core.status();
  return std::unique_ptr<Agent>(new Agent(std::move(*core)));
}

const std::string& Agent::name() const { return core_->name(); }
const std::string& Agent::backend() const { return core_->backend_name(); }
const std::string& Agent::host_id() const { return core_->host_id(); }
std::vector<std::string> Agent::paths() const { return core_->path_names(); }
std::vector<PathTotals> Agent::PathBytes() const { return core_->PathBytes(); }

Result<RegisteredRegion> Agent::RegisterMemory(void* ptr, size_t bytes) {
  // Device memory first (its addresses may appear in /proc/self/maps as driver mappings).
  const bool device = ptr != nullptr && bytes > 0 &&
                      internal::IsCudaDevicePointer(reinterpret_cast<uintptr_t>(ptr));
  // Memory in a writable shared file mapping (memfd, /dev/shm: torch's share_memory_()) is
  // published as mappable, so same-host peers copy it with memcpy instead of process_vm_readv.
  std::optional<internal::SharedFile> file =
      ptr != nullptr && bytes > 0 && !device ? internal::FindSharedFile(ptr, bytes) : std::nullopt;
  RegisteredRegion r;
  r.data_ = ptr;
  r.size_ = bytes;
  if (file) r.fd_ = file->fd;  // r's destructor closes it, also on failure below
  const MemoryKind kind =
      device ? MemoryKind::kCuda : (file ? MemoryKind::kHostFile : MemoryKind::kHost);
  Result<uint64_t> id = core_->Register(ptr, bytes, file.value_or(internal::SharedFile{}), kind);
  if (!id.ok()) return id.status();
  r.core_ = core_;
  r.id_ = *id;
  return r;
}

Result<RegisteredRegion> Agent::AllocateShared(size_t bytes) {
  if (bytes == 0)
    return Status::InvalidArgument(StrCat("agent '", name(), "': cannot allocate 0 bytes"));
  int fd = memfd_create(StrCat("eplbx-", name()).c_str(), MFD_CLOEXEC);
  if (fd < 0)
    return Status::Unavailable(
        StrCat("agent '", name(), "': memfd_create: ", std::strerror(errno)));
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    Status s = Status::Unavailable(StrCat("agent '", name(), "': cannot size shared memory to ",
                                          bytes, " bytes: ", std::strerror(errno)));
    close(fd);
    return s;
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    Status s = Status::Unavailable(
        StrCat("agent '", name(), "': mmap of ", bytes, " shared bytes: ", std::strerror(errno)));
    close(fd);
    return s;
  }
  internal::TouchPagesForWrite(p, bytes);  // zeroed, and no first-touch cost in transfers
  RegisteredRegion r;
  r.data_ = p;
  r.size_ = bytes;
  r.owns_mapping_ = true;
  r.fd_ = fd;
  Result<uint64_t> id =
      core_->Register(p, bytes, internal::SharedFile{fd, 0}, MemoryKind::kHostFile);
  if (!id.ok()) return id.status();  // r's destructor unmaps and closes
  r.core_ = core_;
  r.id_ = *id;
  return r;
}

std::string Agent::Metadata() const { return core_->Metadata(); }
Result<PeerId> Agent::Connect(std::string_view blob) { return core_->Connect(blob); }
Status Agent::Disconnect(PeerId peer) { return core_->Disconnect(peer); }
Result<PeerInfo> Agent::Peer(PeerId peer) const { return core_->Peer(peer); }

Result<TransferId> Agent::Read(PeerId peer, std::span<const Descriptor> local,
                               std::span<const Descriptor> remote,
                               std::optional<std::string> notify) {
  return core_->Post(internal::XferOp::kRead, peer, local, remote, std::move(notify));
}

std::vector<Result<TransferId>> Agent::ReadMany(std::span<const ReadRequest> requests,
                                                bool caller_waits) {
  std::vector<Result<TransferId>> out;
  out.reserve(requests.size());
  for (const ReadRequest& r : requests) {
    out.push_back(core_->Post(internal::XferOp::kRead, r.peer, r.local, r.remote, r.notify,
                              /*may_help=*/false, caller_waits));
  }
  return out;
}

Result<TransferId> Agent::Write(PeerId peer, std::span<const Descriptor> local,
                                std::span<const Descriptor> remote,
                                std::optional<std::string> notify) {
  return core_->Post(internal::XferOp::kWrite, peer, local, remote, std::move(notify));
}

TransferStatus Agent::GetStatus(TransferId id) const { return core_->GetStatus(id); }
TransferStatus Agent::Wait(TransferId id, std::chrono::milliseconds timeout) const {
  return core_->Wait(id, timeout);
}
Status Agent::Cancel(TransferId id) { return core_->Cancel(id); }
Status Agent::Release(TransferId id) { return core_->Release(id); }
Status Agent::Notify(PeerId peer, std::string_view payload) { return core_->Notify(peer, payload); }
std::vector<Status> Agent::NotifyMany(PeerId peer, std::vector<std::string> payloads) {
  return core_->NotifyMany(peer, std::move(payloads));
}
std::vector<Notification> Agent::PollNotifications() {
  return core_->PollNotifications(std::chrono::milliseconds(0));
}
std::vector<Notification> Agent::WaitNotifications(std::chrono::milliseconds timeout) {
  return core_->PollNotifications(timeout);
}
std::vector<Notification> Agent::WaitEvents(std::chrono::milliseconds timeout) {
  return core_->PollNotifications(timeout, /*or_completion=*/true);
}

}  // namespace eplbx
