// A rank in its own process for the multi-process transfer tests. It registers a buffer
// filled with a known pattern, prints its metadata, then obeys one command per stdin line:
//   CONNECT <hex blob>          -> PEER <id> | ERR <message>
//   HASH <offset> <length>      -> HASH <fnv1a of that range of its buffer>
//   ECHO <count> <timeout_ms>   -> prints GOT <peer> <size> <first word> for each of the next
//                                  <count> notifications
//   EXPECT <count> <timeout_ms> -> waits for <count> notifications "CHECK <off> <len> <hash>"
//                                  and prints NOTIFY <payload> OK|BAD for each (the bytes
//                                  must be in place when the notification arrives), or
//                                  TIMEOUT
//   NOTIFY <peer id> <count> <address> -> sends <count> notifications "last<i>" to that
//                                  peer, then READs 64 bytes at its <address> with the
//                                  notification "last<count>" and waits: SENT ok | SENT failed
//   SHRINK <bytes>              -> (--memory file) truncates its file to the region's first
//                                  <bytes>, under the registered region: SHRUNK | ERR
//   QUIT
// Output on start: META <hex blob>, BASE <buffer address>, SIZE <bytes>.
// --memory plain (new[]), allocate (Agent::AllocateShared) or file: a MAP_SHARED mapping
// of an unlinked /dev/shm file, registered from an offset that is not page-aligned (what
// torch's share_memory_() gives), with RegisterMemory. In a build with CUDA also cuda
// (cuMemAlloc) and cuda-vmm (two cuMemCreate allocations back to back) on device 0: HASH
// and the checks of EXPECT then copy the range to the host first.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>

#include "eplbx/transfer.h"
#include "multiproc/peer_util.h"
#ifdef EPLBX_WITH_CUDA
#include "multiproc/device_buffer.h"
#endif

using eplbx::testing::FillPattern;
using eplbx::testing::Fnv1a;

// Hands each of the next `count` notifications to `each` as they arrive, waiting at most
// `wait_ms` in all; prints TIMEOUT <seen> when fewer came.
static void ForNotifications(eplbx::Agent& agent, size_t count, int wait_ms,
                             const std::function<void(const eplbx::Notification&)>& each) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(wait_ms);
  size_t seen = 0;
  while (seen < count) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    for (const auto& n : agent.WaitNotifications(left)) {
      each(n);
      ++seen;
    }
  }
  if (seen < count) std::cout << "TIMEOUT " << seen << std::endl;
}

int main(int argc, char** argv) {
  std::string name = "peer";
  size_t bytes = 1 << 20;
  uint64_t seed = 1;
  std::string memory = "plain";
  int timeout_ms = 2000;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&] { return std::string(i + 1 < argc ? argv[++i] : ""); };
    if (a == "--name")
      name = next();
    else if (a == "--bytes")
      bytes = std::stoull(next());
    else if (a == "--seed")
      seed = std::stoull(next());
    else if (a == "--memory")
      memory = next();
    else if (a == "--timeout-ms")
      timeout_ms = std::stoi(next());
  }
#ifdef EPLBX_WITH_CUDA
  // As an engine would: CUDA is in use before the agent exists, so cuda_ipc is a default path.
  if (memory.rfind("cuda", 0) == 0) {
    if (auto d = eplbx::internal::cuda::LoadDriver(); !d.ok()) {
      std::cout << "ERR " << d.status().ToString() << std::endl;
      return 1;
    }
  }
#endif
  eplbx::AgentConfig config;
  config.peer_timeout = std::chrono::milliseconds(timeout_ms);
  auto agent = eplbx::Agent::Create(name, config);
  if (!agent.ok()) {
    std::cout << "ERR " << agent.status().ToString() << std::endl;
    return 1;
  }
  std::unique_ptr<uint8_t[]> owned;
#ifdef EPLBX_WITH_CUDA
  std::unique_ptr<eplbx::testing::DeviceBuffer> device;  // outlives the region
#endif
  eplbx::RegisteredRegion region;
  int file_fd = -1;
  constexpr size_t kLead = 4096 + 100;  // --memory file: file offset of the region
  eplbx::Result<eplbx::RegisteredRegion> r = eplbx::Status::InvalidArgument("--memory " + memory);
  if (memory == "allocate") {
    r = (*agent)->AllocateShared(bytes);
  } else if (memory == "file") {
    const std::string path = "/eplbx-xfer-peer-" + std::to_string(getpid());
    const int fd = shm_open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0 || shm_unlink(path.c_str()) != 0 ||
        ftruncate(fd, static_cast<off_t>(kLead + bytes)) != 0) {
      std::cout << "ERR shm file: " << std::strerror(errno) << std::endl;
      return 1;
    }
    void* m = mmap(nullptr, bytes + 100, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 4096);
    if (m == MAP_FAILED) {
      std::cout << "ERR mmap: " << std::strerror(errno) << std::endl;
      return 1;
    }
    r = (*agent)->RegisterMemory(static_cast<uint8_t*>(m) + 100, bytes);  // fd stays open
    file_fd = fd;
    if (r.ok() && !r->shared()) r = eplbx::Status::Internal("file memory not seen as shared");
#ifdef EPLBX_WITH_CUDA
  } else if (memory == "cuda" || memory == "cuda-vmm") {
    auto dev = eplbx::testing::DeviceBuffer::Create(bytes, memory == "cuda-vmm");
    if (!dev.ok()) {
      std::cout << "ERR " << dev.status().ToString() << std::endl;
      return 1;
    }
    device = std::move(*dev);
    std::vector<uint8_t> pattern(bytes);
    FillPattern(pattern.data(), bytes, seed, 0);
    eplbx::Status up = device->Upload(pattern.data(), 0, bytes);
    r = up.ok() ? (*agent)->RegisterMemory(device->data(), bytes) : up;
#endif
  } else if (memory == "plain") {
    owned.reset(new uint8_t[bytes]);
    r = (*agent)->RegisterMemory(owned.get(), bytes);
  }
  if (!r.ok()) {
    std::cout << "ERR " << r.status().ToString() << std::endl;
    return 1;
  }
  region = std::move(*r);
  auto* buf = static_cast<uint8_t*>(region.data());
  // The hash of [off, off + len) of the buffer, wherever it lives (0 when out of range).
  auto hash = [&](uint64_t off, uint64_t len) -> uint64_t {
    if (off > bytes || len > bytes - off) return 0;
#ifdef EPLBX_WITH_CUDA
    if (device != nullptr) {
      auto host = device->Download(off, len);
      return host.ok() ? Fnv1a(host->data(), len) : 0;
    }
#endif
    return Fnv1a(buf + off, len);
  };
  if (owned != nullptr || memory == "allocate" || memory == "file")
    FillPattern(buf, bytes, seed, 0);
  std::cout << "META " << eplbx::testing::ToHex((*agent)->Metadata()) << "\n"
            << "BASE " << region.addr() << "\n"
            << "SIZE " << bytes << std::endl;
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    if (cmd == "CONNECT") {
      std::string hex;
      in >> hex;
      auto peer = (*agent)->Connect(eplbx::testing::FromHex(hex));
      if (peer.ok()) {
        std::cout << "PEER " << *peer << std::endl;
      } else {
        std::cout << "ERR " << peer.status().ToString() << std::endl;
      }
    } else if (cmd == "NOTIFY") {
      // NOTIFY <peer id> <count> <address>: "last0" .. "last<count-1>", then a 64-byte READ
      // of that peer's <address> with the notification "last<count>", waited for: once it
      // completed, its notification and every one before it left this process.
      uint64_t peer = 0, count = 0, addr = 0;
      in >> peer >> count >> addr;
      bool ok = true;
      for (uint64_t i = 0; i < count && ok; ++i)
        ok = (*agent)->Notify(peer, "last" + std::to_string(i)).ok();
      const eplbx::Descriptor l = eplbx::Descriptor::Of(buf, 64), r{addr, 64};
      auto id = (*agent)->Read(peer, {&l, 1}, {&r, 1}, "last" + std::to_string(count));
      ok = ok && id.ok() &&
           (*agent)->Wait(*id, std::chrono::seconds(30)).state == eplbx::TransferState::kDone;
      std::cout << (ok ? "SENT ok" : "SENT failed") << std::endl;
    } else if (cmd == "HASH") {
      uint64_t off = 0, len = 0;
      in >> off >> len;
      std::cout << "HASH " << hash(off, len) << std::endl;
    } else if (cmd == "EXPECT") {
      size_t count = 0;
      int wait_ms = 0;
      in >> count >> wait_ms;
      ForNotifications(**agent, count, wait_ms, [&](const eplbx::Notification& n) {
        std::istringstream p(n.payload);
        std::string tag;
        uint64_t off = 0, len = 0, want = 0;
        p >> tag >> off >> len >> want;
        const bool ok = tag == "CHECK" && off + len <= bytes && hash(off, len) == want;
        std::cout << "NOTIFY " << n.peer << " " << (ok ? "OK" : "BAD") << std::endl;
      });
    } else if (cmd == "ECHO") {
      // ECHO <count> <timeout_ms>: prints GOT <peer> <size> <first word> for each of the next
      // <count> notifications, in the order they arrive.
      size_t count = 0;
      int wait_ms = 0;
      in >> count >> wait_ms;
      ForNotifications(**agent, count, wait_ms, [](const eplbx::Notification& n) {
        std::istringstream p(n.payload);
        std::string word;
        p >> word;
        std::cout << "GOT " << n.peer << " " << n.payload.size() << " " << word << std::endl;
      });
    } else if (cmd == "SHRINK") {
      uint64_t keep = 0;
      in >> keep;
      if (file_fd >= 0 && ftruncate(file_fd, static_cast<off_t>(kLead + keep)) == 0) {
        std::cout << "SHRUNK" << std::endl;
      } else {
        std::cout << "ERR shrink: " << (file_fd < 0 ? "not --memory file" : std::strerror(errno))
                  << std::endl;
      }
    } else if (cmd == "QUIT") {
      break;
    }
  }
  return 0;
}
