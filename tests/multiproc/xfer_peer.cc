// A rank in its own process for the multi-process transfer tests. It registers a buffer
// filled with a known pattern, prints its metadata, then obeys one command per stdin line:
//   CONNECT <hex blob>          -> PEER <id> | ERR <message>
//   HASH <offset> <length>      -> HASH <fnv1a of that range of its buffer>
//   EXPECT <count> <timeout_ms> -> waits for <count> notifications "CHECK <off> <len> <hash>"
//                                  and prints NOTIFY <payload> OK|BAD for each (the bytes
//                                  must be in place when the notification arrives), or
//                                  TIMEOUT
//   SHRINK <bytes>              -> (--memory file) truncates its file to the region's first
//                                  <bytes>, under the registered region: SHRUNK | ERR
//   QUIT
// Output on start: META <hex blob>, BASE <buffer address>, SIZE <bytes>.
// --memory plain (new[]), allocate (Agent::AllocateShared) or file: a MAP_SHARED mapping
// of an unlinked /dev/shm file, registered from an offset that is not page-aligned (what
// torch's share_memory_() gives), with RegisterMemory.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>

#include "eplbx/transfer.h"
#include "multiproc/peer_util.h"

using eplbx::testing::FillPattern;
using eplbx::testing::Fnv1a;

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
  eplbx::AgentConfig config;
  config.peer_timeout = std::chrono::milliseconds(timeout_ms);
  auto agent = eplbx::Agent::Create(name, config);
  if (!agent.ok()) {
    std::cout << "ERR " << agent.status().ToString() << std::endl;
    return 1;
  }
  eplbx::RegisteredRegion region;
  std::unique_ptr<uint8_t[]> owned;
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
    } else if (cmd == "HASH") {
      uint64_t off = 0, len = 0;
      in >> off >> len;
      std::cout << "HASH " << (off + len <= bytes ? Fnv1a(buf + off, len) : 0) << std::endl;
    } else if (cmd == "EXPECT") {
      size_t count = 0;
      int wait_ms = 0;
      in >> count >> wait_ms;
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(wait_ms);
      size_t seen = 0;
      while (seen < count) {
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        if (left.count() <= 0) break;
        for (const auto& n : (*agent)->WaitNotifications(left)) {
          std::istringstream p(n.payload);
          std::string tag;
          uint64_t off = 0, len = 0, hash = 0;
          p >> tag >> off >> len >> hash;
          const bool ok = tag == "CHECK" && off + len <= bytes && Fnv1a(buf + off, len) == hash;
          std::cout << "NOTIFY " << n.peer << " " << (ok ? "OK" : "BAD") << std::endl;
          ++seen;
        }
      }
      if (seen < count) std::cout << "TIMEOUT " << seen << std::endl;
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
