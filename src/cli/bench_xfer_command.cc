// `eplbx bench xfer`: READ and WRITE throughput and latency between two processes on this
// machine, per transport, block size and batch size, next to the physical limits
// (single-thread memcpy, and two threads copying with streaming stores) and, with
// --perftest, UCX's own ucx_perftest at the same sizes.
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/demo.h"
#include "cli/flags.h"
#include "common/numbers.h"
#include "common/strings.h"
#include "eplbx/env.h"
#include "eplbx/transfer.h"
#include "tools/measure.h"
#include "transfer/backend.h"
#ifdef EPLBX_WITH_CUDA
#include "transfer/cuda/cuda_driver.h"
#endif

namespace eplbx::cli {
namespace {

using internal::StrCat;
using Clock = std::chrono::steady_clock;

constexpr uint64_t kMaxBuffer = 256ull << 20;  // descriptors wrap around inside this

struct XferOptions {
  std::string transport = "auto";
  std::string paths;         // data paths in order: one run with exactly these
  int64_t inline_copy = -1;  // AgentConfig::inline_copy_bytes
  std::string sizes = "4K,64K,256K,1M,4M,16M,64M";
  std::string batches = "1,16";
  std::string ops = "read,write";
  double seconds = 0.4;  // per configuration
  bool json = false;
  bool perftest = false;
  std::string memory = "host";  // host, or cuda: device memory on GPU 0 in both processes
  bool huge_pages = false;      // host buffers asked for transparent huge pages (madvise)
};

// Plain host memory for the bench's buffers (both processes): anonymous pages, with
// --huge-pages asked to be transparent huge pages (madvise, as numpy does for large arrays
// where the kernel's THP mode is `madvise`). CMA pins every page it copies: 2 MiB pages pin
// 512 times fewer. Unmapped when destroyed.
class PlainBuffer {
 public:
  PlainBuffer(uint64_t bytes, bool huge) : bytes_(bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return;
    if (huge) (void)madvise(p, bytes, MADV_HUGEPAGE);
    p_ = static_cast<uint8_t*>(p);
  }
  ~PlainBuffer() {
    if (p_ != nullptr) munmap(p_, bytes_);
  }
  PlainBuffer(const PlainBuffer&) = delete;
  PlainBuffer& operator=(const PlainBuffer&) = delete;
  uint8_t* get() const { return p_; }

 private:
  uint64_t bytes_;
  uint8_t* p_ = nullptr;
};

Result<uint64_t> ParseSize(std::string_view s) {
  if (s.empty()) return Status::InvalidArgument("empty size");
  uint64_t mult = 1;
  char last = s.back();
  if (last == 'K' || last == 'k') mult = 1ull << 10;
  if (last == 'M' || last == 'm') mult = 1ull << 20;
  if (last == 'G' || last == 'g') mult = 1ull << 30;
  if (mult != 1) s.remove_suffix(1);
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9')
      return Status::InvalidArgument(StrCat("bad size '", s, "' (examples: 4096, 64K, 16M)"));
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  if (v == 0 || v * mult > (1ull << 30)) {
    return Status::InvalidArgument(StrCat("size ", v * mult, " out of range (1 byte .. 1G)"));
  }
  return v * mult;
}

// A comma-separated list of sizes (batches: plain counts up to 1024).
Result<std::vector<uint64_t>> ParseList(const std::string& csv, bool sizes) {
  std::vector<uint64_t> out;
  std::stringstream in(csv);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (!sizes) {  // plain counts: 0, 2.5 or 1K are not batch sizes
      EPLBX_ASSIGN_OR_RETURN(const uint64_t n,
                             internal::ParseInteger<uint64_t>(item, "batch", 1, 1024));
      out.push_back(n);
      continue;
    }
    Result<uint64_t> v = ParseSize(item);
    if (!v.ok()) return v.status();
    out.push_back(*v);
  }
  if (out.empty()) return Status::InvalidArgument(StrCat("empty list '", csv, "'"));
  return out;
}

// ---- the target process ---------------------------------------------------------------

bool WriteAll(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = write(fd, c, n);
    if (w <= 0) return false;
    c += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool ReadAll(int fd, void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    ssize_t r = read(fd, c, n);
    if (r <= 0) return false;
    c += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// Tells the parent why the target cannot serve: a zero-length blob, then the message.
[[noreturn]] void TargetFails(int fd, const std::string& why) {
  uint64_t header[3] = {0, why.size(), 0};
  WriteAll(fd, header, sizeof(header));
  WriteAll(fd, why.data(), why.size());
  _exit(1);
}

// Registers two buffers (plain memory and AllocateShared; with `cuda`, device memory on GPU
// 0, through the driver loaded only here, after the fork, and plain host memory), sends its
// metadata and their addresses, then serves until the parent closes the socket.
[[noreturn]] void RunTarget(int fd, uint64_t bytes, bool cuda, bool huge) {
  std::unique_ptr<PlainBuffer> plain;
  uint8_t* first = nullptr;
#ifdef EPLBX_WITH_CUDA
  if (cuda) {
    Result<const internal::cuda::Driver*> d = internal::cuda::LoadDriver();
    if (!d.ok()) TargetFails(fd, d.status().message());
    if (Status u = internal::cuda::UseDevice(**d, 0); !u.ok()) TargetFails(fd, u.message());
    CUdeviceptr p = 0;
    if (CUresult r = (*d)->cuMemAlloc(&p, bytes); r != CUDA_SUCCESS) {
      TargetFails(fd, (*d)->Error("cuMemAlloc", r));
    }
    (*d)->cuMemsetD8(p, 7, bytes);
    first = reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(p));
  }
#endif
  if (cuda && first == nullptr)
    TargetFails(fd, StrCat("no CUDA device", internal::NoCudaPathHint()));
  auto agent = Agent::Create("xfer-target", {});
  if (!agent.ok()) TargetFails(fd, agent.status().message());
  if (!cuda) {
    plain = std::make_unique<PlainBuffer>(bytes, huge);
    if (plain->get() == nullptr) TargetFails(fd, StrCat("mmap of ", bytes, " bytes failed"));
    std::memset(plain->get(), 7, bytes);
    first = plain->get();
  }
  auto r1 = (*agent)->RegisterMemory(first, bytes);
  if (!r1.ok()) TargetFails(fd, r1.status().message());
  Result<RegisteredRegion> r2 = Status::NotFound("no second buffer");
  if (!cuda) {
    r2 = (*agent)->AllocateShared(bytes);
    if (!r2.ok()) TargetFails(fd, r2.status().message());
    std::memset(r2->data(), 7, bytes);
  } else {  // host rows too: the link cuda_staged crosses, measured on its own
    plain = std::make_unique<PlainBuffer>(bytes, huge);
    if (plain->get() == nullptr) TargetFails(fd, StrCat("mmap of ", bytes, " bytes failed"));
    std::memset(plain->get(), 7, bytes);
    r2 = (*agent)->RegisterMemory(plain->get(), bytes);
    if (!r2.ok()) TargetFails(fd, r2.status().message());
  }
  std::string blob = (*agent)->Metadata();
  uint64_t header[3] = {blob.size(), r1->addr(), r2.ok() ? r2->addr() : 0};
  if (!WriteAll(fd, header, sizeof(header)) || !WriteAll(fd, blob.data(), blob.size())) _exit(1);
  // Until the bench closes the socket: metadata of agents to connect back to (cuda_staged
  // sends rows to its peer, so the target must be connected to it), answered 1 or 0.
  uint64_t n = 0;
  while (ReadAll(fd, &n, sizeof(n)) && n <= (16u << 20)) {
    std::string peer(n, '\0');
    if (!ReadAll(fd, peer.data(), n)) break;
    const uint64_t ok = (*agent)->Connect(peer).ok() ? 1 : 0;
    if (!WriteAll(fd, &ok, sizeof(ok))) break;
  }
  _exit(0);
}

struct Target {
  pid_t pid = -1;
  int fd = -1;
  std::string blob;
  uint64_t plain = 0;
  uint64_t shared = 0;
  ~Target() {
    if (fd >= 0) close(fd);
    if (pid > 0) waitpid(pid, nullptr, 0);
  }
};

Status StartTarget(Target* t, uint64_t bytes, bool cuda = false, bool huge = false) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    return Status::Unavailable(StrCat("socketpair: ", std::strerror(errno)));
  }
  std::cout.flush();
  t->pid = fork();
  if (t->pid == 0) {
    close(sv[0]);
    RunTarget(sv[1], bytes, cuda, huge);
  }
  close(sv[1]);
  t->fd = sv[0];
  uint64_t header[3];
  if (!ReadAll(t->fd, header, sizeof(header)) || header[0] > (16u << 20)) {
    return Status::Unavailable("bench target process did not start");
  }
  if (header[0] == 0) {
    std::string why(std::min<uint64_t>(header[1], 4096), '\0');
    ReadAll(t->fd, why.data(), why.size());
    return Status::Unavailable(why);
  }
  t->blob.resize(header[0]);
  if (!ReadAll(t->fd, t->blob.data(), t->blob.size()))
    return Status::Unavailable("bench target died");
  t->plain = header[1];
  t->shared = header[2];
  return Status::OK();
}

// Makes the target connect to the agent with metadata `blob`.
Status ConnectBack(Target& t, const std::string& blob) {
  const uint64_t n = blob.size();
  uint64_t ok = 0;
  if (!WriteAll(t.fd, &n, sizeof(n)) || !WriteAll(t.fd, blob.data(), n) ||
      !ReadAll(t.fd, &ok, sizeof(ok)) || ok != 1) {
    return Status::Unavailable("bench target could not connect back");
  }
  return Status::OK();
}

// ---- measurement ----------------------------------------------------------------------

struct Row {
  std::string op, transport, memory;
  std::string path;  // the data path that moved it (shm, cma, ucx)
  uint64_t block = 0, batch = 0;
  double gbps = 0, p50 = 0, p99 = 0;
  int iterations = 0;
};

Result<Row> Measure(Agent& agent, PeerId peer, bool read, uint64_t remote_base, uint8_t* local,
                    uint64_t block, uint64_t batch, double seconds) {
  // Each transfer moves a different window of the 256 MiB buffers (descriptors wrap inside
  // them), so large blocks are not served from the CPU cache the way a reused block would be.
  const uint64_t span = block * batch;
  auto descriptors = [&](int iteration, std::vector<Descriptor>* l, std::vector<Descriptor>* r) {
    l->clear();
    r->clear();
    const uint64_t window = (static_cast<uint64_t>(iteration) * span) % kMaxBuffer;
    for (uint64_t i = 0; i < batch; ++i) {
      uint64_t at = (window + i * block) % kMaxBuffer;
      if (at + block > kMaxBuffer) at = 0;
      l->push_back(Descriptor::Of(local + at, block));
      r->push_back({remote_base + at, block});
    }
  };
  std::vector<Descriptor> l, r;
  std::vector<double> lat;
  const auto start = Env::Default()->Now();
  double busy = 0;
  for (int it = 0;; ++it) {
    descriptors(it, &l, &r);
    auto t0 = Env::Default()->Now();
    auto id = read ? agent.Read(peer, l, r) : agent.Write(peer, l, r);
    if (!id.ok()) return id.status();
    TransferStatus s = agent.Wait(*id, std::chrono::seconds(60));
    if (s.state != TransferState::kDone) {
      return s.state == TransferState::kError ? s.error
                                              : Status::Timeout("transfer did not finish in 60 s");
    }
    (void)agent.Release(*id);
    const double us = std::chrono::duration<double, std::micro>(Env::Default()->Now() - t0).count();
    if (it >= 2) {  // two warm-up transfers
      lat.push_back(us);
      busy += us;
    }
    const double elapsed = std::chrono::duration<double>(Env::Default()->Now() - start).count();
    if (lat.size() >= 3 && (elapsed > seconds || lat.size() >= 20000)) break;
  }
  std::sort(lat.begin(), lat.end());
  Row row;
  row.block = block;
  row.batch = batch;
  row.iterations = static_cast<int>(lat.size());
  row.gbps = static_cast<double>(block * batch) * lat.size() / (busy * 1e-6) / 1e9;
  row.p50 = lat[lat.size() / 2];
  row.p99 = lat[std::min(lat.size() - 1, lat.size() * 99 / 100)];
  return row;
}

// Runs ucx_perftest (server + client on localhost) for one test and size; GB/s or error.
Result<double> Perftest(const std::string& test, const std::string& tls, uint64_t block) {
  static int port = 13500 + static_cast<int>(getpid() % 2000);
  ++port;
  const std::string env = StrCat("UCX_TLS=", tls, " ");
  const std::string server =
      StrCat(env, "timeout 120 ucx_perftest -p ", port, " >/dev/null 2>&1 &");
  if (std::system(server.c_str()) != 0) return Status::Unavailable("cannot start ucx_perftest");
  usleep(500000);
  const uint64_t iters = std::max<uint64_t>(20, std::min<uint64_t>(2000, (2ull << 30) / block));
  const std::string client = StrCat(env, "timeout 120 ucx_perftest 127.0.0.1 -p ", port, " -t ",
                                    test, " -s ", block, " -n ", iters, " 2>&1");
  FILE* p = popen(client.c_str(), "r");
  if (p == nullptr) return Status::Unavailable("cannot run ucx_perftest");
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
  pclose(p);
  // "Final: iters p50 avg overall bw_avg bw_overall rate_avg rate_overall", bandwidth in MB/s
  // (2^20).
  auto at = out.find("Final:");
  if (at == std::string::npos) {
    return Status::Unavailable(
        StrCat("ucx_perftest gave no result (is ucx-utils installed?): ", out.substr(0, 300)));
  }
  std::istringstream line(out.substr(at + 6));
  double v[7] = {};
  for (double& x : v) line >> x;
  if (!(v[5] > 0))
    return Status::Unavailable(StrCat("ucx_perftest result unreadable: ", out.substr(at, 200)));
  return v[5] * (1 << 20) / 1e9;
}

// ---- device memory (--memory cuda) ------------------------------------------------------

#ifdef EPLBX_WITH_CUDA
// Copies of `batch` rows of `block` per iteration with cuMemcpyAsync on one stream, from the
// same windows Measure uses: device to device in this process (the limit cuda_ipc READs are
// compared with), or pinned host <-> device (what the cuda_staged path is bound by). GB/s.
Result<double> MeasureCopies(const internal::cuda::Driver& d, CUstream stream, uint64_t dst,
                             uint64_t src, uint64_t block, uint64_t batch, double seconds) {
  const uint64_t span = block * batch;
  double busy = 0;
  int timed = 0;
  const auto start = Env::Default()->Now();
  for (int it = 0;; ++it) {
    const uint64_t window = (static_cast<uint64_t>(it) * span) % kMaxBuffer;
    const auto t0 = Env::Default()->Now();
    for (uint64_t i = 0; i < batch; ++i) {
      uint64_t at = (window + i * block) % kMaxBuffer;
      if (at + block > kMaxBuffer) at = 0;
      if (CUresult r = d.cuMemcpyAsync(dst + at, src + at, block, stream); r != CUDA_SUCCESS) {
        return Status::Internal(d.Error("cuMemcpyAsync", r));
      }
    }
    if (CUresult r = d.cuStreamSynchronize(stream); r != CUDA_SUCCESS) {
      return Status::Internal(d.Error("cuStreamSynchronize", r));
    }
    const double us = std::chrono::duration<double, std::micro>(Env::Default()->Now() - t0).count();
    if (it >= 2) {
      busy += us;
      ++timed;
    }
    const double elapsed = std::chrono::duration<double>(Env::Default()->Now() - start).count();
    if (timed >= 3 && (elapsed > seconds || timed >= 20000)) break;
  }
  return static_cast<double>(span) * timed / (busy * 1e-6) / 1e9;
}

// cuda_ipc READ / WRITE of device rows between this process and the target on GPU 0, beside
// device-to-device copies in one process and pinned host <-> device copies, same run.
Status RunCudaRows(const XferOptions& o, const std::vector<uint64_t>& sizes,
                   const std::vector<uint64_t>& batches, const std::vector<bool>& ops,
                   Target& target, nlohmann::json& out) {
  Result<const internal::cuda::Driver*> dr = internal::cuda::LoadDriver();
  if (!dr.ok()) return dr.status();
  const internal::cuda::Driver& d = **dr;
  EPLBX_RETURN_IF_ERROR(internal::cuda::UseDevice(d, 0));
  CUdeviceptr local = 0, other = 0;
  void* pinned = nullptr;
  CUstream stream = nullptr;
  if (CUresult r = d.cuMemAlloc(&local, kMaxBuffer); r != CUDA_SUCCESS) {
    return Status::Unavailable(d.Error("cuMemAlloc", r));
  }
  if (CUresult r = d.cuMemAlloc(&other, kMaxBuffer); r != CUDA_SUCCESS) {
    return Status::Unavailable(d.Error("cuMemAlloc", r));
  }
  if (CUresult r = d.cuMemHostAlloc(&pinned, kMaxBuffer, 0); r != CUDA_SUCCESS) {
    return Status::Unavailable(d.Error("cuMemHostAlloc", r));
  }
  if (CUresult r = d.cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING); r != CUDA_SUCCESS) {
    return Status::Unavailable(d.Error("cuStreamCreate", r));
  }
  char name[256] = {};
  CUdevice dev = 0;
  d.cuDeviceGet(&dev, 0);
  d.cuDeviceGetName(name, sizeof(name) - 1, dev);
  out["device"] = name;
  out["cuda_driver_version"] = d.version;
  AgentConfig config;  // CUDA is in use now: cuda_ipc is among the default paths
  config.paths = SplitPaths(o.paths);
  auto agent = Agent::Create("xfer-cuda", config);
  if (!agent.ok()) return agent.status();
  auto region = (*agent)->RegisterMemory(reinterpret_cast<void*>(local), kMaxBuffer);
  if (!region.ok()) return region.status();
  auto peer = (*agent)->Connect(target.blob);
  if (!peer.ok()) return peer.status();
  Result<PeerInfo> info = (*agent)->Peer(*peer);
  if (!info.ok()) return info.status();
  std::string path = "?";  // the path of the device rows (the target has host rows too)
  for (const PathChoice& c : info->paths) {
    if (c.kind != MemoryKind::kHost) path = c.path;
  }
  auto* local_rows = reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(local));
  for (bool read : ops) {
    for (uint64_t size : sizes) {
      for (uint64_t batch : batches) {
        Result<Row> row =
            Measure(**agent, *peer, read, target.plain, local_rows, size, batch, o.seconds);
        if (!row.ok()) return row.status();
        Result<double> d2d = MeasureCopies(d, stream, other, local, size, batch, o.seconds);
        if (!d2d.ok()) return d2d.status();
        nlohmann::json j = {{"op", read ? "read" : "write"},
                            {"memory", "cuda"},
                            {"path", path},
                            {"block_bytes", size},
                            {"batch", batch},
                            {"gbps", row->gbps},
                            {"p50_us", row->p50},
                            {"p99_us", row->p99},
                            {"iterations", row->iterations},
                            {"device_copy_gbps", *d2d},
                            {"ratio_to_device_copy", row->gbps / *d2d}};
        if (!o.json) {
          std::printf(
              "%-5s cuda %-8s block %9llu batch %3llu: %8.2f GB/s  p50 %9.1f us  "
              "(device-to-device copy here: %8.2f GB/s, ratio %.2f)\n",
              read ? "read" : "write", path.c_str(), static_cast<unsigned long long>(size),
              static_cast<unsigned long long>(batch), row->gbps, row->p50, *d2d, row->gbps / *d2d);
          std::fflush(stdout);
        }
        out["results"].push_back(j);
      }
    }
  }
  const auto host = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(pinned));
  std::map<uint64_t, double> staged_limit;  // per block: the slower of the two pinned copies
  for (uint64_t size : sizes) {
    Result<double> h2d = MeasureCopies(d, stream, local, host, size, 1, o.seconds);
    Result<double> d2h = MeasureCopies(d, stream, host, local, size, 1, o.seconds);
    if (!h2d.ok()) return h2d.status();
    if (!d2h.ok()) return d2h.status();
    staged_limit[size] = std::min(*h2d, *d2h);
    out["pinned_host_copy"].push_back(
        {{"block_bytes", size}, {"host_to_device_gbps", *h2d}, {"device_to_host_gbps", *d2h}});
    if (!o.json) {
      std::printf(
          "pinned host copy   block %9llu: host->device %8.2f GB/s, device->host %8.2f GB/s\n",
          static_cast<unsigned long long>(size), *h2d, *d2h);
    }
  }
  // The same rows as if the target were on another host (EPLBX_HOST_ID differs): they
  // travel by cuda_staged (device -> pinned host -> UCX -> pinned host -> device). Its bound
  // is the slower of the pinned host <-> device copy and the link: host rows between the
  // same two agents over the same UCX (the path a host-memory peer on another host uses),
  // measured here too.
  AgentConfig other_host = config;
  other_host.host_id = "bench-xfer-other-host";
  auto staged = Agent::Create("xfer-staged", other_host);
  if (!staged.ok()) return staged.status();
  auto staged_region = (*staged)->RegisterMemory(reinterpret_cast<void*>(local), kMaxBuffer);
  if (!staged_region.ok()) return staged_region.status();
  auto staged_peer = (*staged)->Connect(target.blob);
  if (!staged_peer.ok()) return staged_peer.status();
  EPLBX_RETURN_IF_ERROR(ConnectBack(target, (*staged)->Metadata()));
  Result<PeerInfo> staged_info = (*staged)->Peer(*staged_peer);
  if (!staged_info.ok()) return staged_info.status();
  std::string staged_path = "?", link_path = "?";
  for (const PathChoice& c : staged_info->paths) {
    (c.kind == MemoryKind::kHost ? link_path : staged_path) = c.path;
  }
  auto staged_host = (*staged)->RegisterMemory(pinned, kMaxBuffer);
  if (!staged_host.ok()) return staged_host.status();
  auto* host_rows = static_cast<uint8_t*>(pinned);
  for (bool read : ops) {
    for (uint64_t size : sizes) {
      Result<Row> row =
          Measure(**staged, *staged_peer, read, target.plain, local_rows, size, 1, o.seconds);
      if (!row.ok()) return row.status();
      Result<Row> link =
          Measure(**staged, *staged_peer, read, target.shared, host_rows, size, 1, o.seconds);
      if (!link.ok()) return link.status();
      const double copy = staged_limit[size];
      const double bound = std::min(copy, link->gbps);
      out["staged"].push_back({{"op", read ? "read" : "write"},
                               {"memory", "cuda"},
                               {"path", staged_path},
                               {"block_bytes", size},
                               {"batch", 1},
                               {"gbps", row->gbps},
                               {"p50_us", row->p50},
                               {"pinned_host_copy_gbps", copy},
                               {"ratio_to_pinned_host_copy", row->gbps / copy},
                               {"link_path", link_path},
                               {"link_host_rows_gbps", link->gbps},
                               {"ratio_to_bound", row->gbps / bound}});
      if (!o.json) {
        std::printf(
            "%-5s cuda %-11s block %9llu batch   1: %8.2f GB/s  p50 %9.1f us  "
            "(pinned host copy here: %8.2f GB/s, ratio %.2f; host rows over %s: %8.2f GB/s; "
            "ratio to the slower %.2f)\n",
            read ? "read" : "write", staged_path.c_str(), static_cast<unsigned long long>(size),
            row->gbps, row->p50, copy, row->gbps / copy, link_path.c_str(), link->gbps,
            row->gbps / bound);
        std::fflush(stdout);
      }
    }
  }
  d.cuStreamDestroy(stream);
  d.cuMemFreeHost(pinned);
  d.cuMemFree(other);  // `local` stays registered until the agent goes; the process ends then
  return Status::OK();
}
#endif

Status RunXferCuda(const XferOptions& o, const std::vector<uint64_t>& sizes,
                   const std::vector<uint64_t>& batches, const std::vector<bool>& ops) {
  nlohmann::json out;
  Target target;
  // The target starts CUDA after the fork (CUDA does not survive one); it says if it cannot.
  Status started = StartTarget(&target, kMaxBuffer, /*cuda=*/true);
  Status s = started;
#ifdef EPLBX_WITH_CUDA
  if (started.ok()) s = RunCudaRows(o, sizes, batches, ops, target, out);
#else
  (void)batches;
  (void)ops;
  (void)sizes;
#endif
  if (!s.ok() && s.message().rfind("no CUDA device", 0) == 0) {
    // Nothing to measure on this machine: say why and succeed (the benchmark needs a GPU).
    if (o.json) {
      std::cout << nlohmann::json({{"memory", "cuda"}, {"skipped", s.message()}}).dump(1) << "\n";
    } else {
      std::cout << "bench xfer --memory cuda: " << s.message() << "; nothing measured\n";
    }
    return Status::OK();
  }
  EPLBX_RETURN_IF_ERROR(s);
  if (o.json) std::cout << out.dump(1) << "\n";
  return Status::OK();
}

Status RunXfer(const XferOptions& o) {
  Result<std::vector<uint64_t>> sizes = ParseList(o.sizes, true);
  if (!sizes.ok()) return sizes.status().WithPrefix("--sizes");
  Result<std::vector<uint64_t>> batches = ParseList(o.batches, false);
  if (!batches.ok()) return batches.status().WithPrefix("--batches");
  Result<Transport> forced = ParseTransport(o.transport);
  if (!forced.ok()) return forced.status().WithPrefix("--transport");
  std::vector<Transport> transports;
  if (*forced == Transport::kAuto || *forced == Transport::kShm)
    transports.push_back(Transport::kShm);
  if (*forced == Transport::kAuto || *forced == Transport::kTcp)
    transports.push_back(Transport::kTcp);
  std::vector<bool> ops;
  if (o.ops.find("read") != std::string::npos) ops.push_back(true);
  if (o.ops.find("write") != std::string::npos) ops.push_back(false);
  if (ops.empty())
    return Status::InvalidArgument(
        StrCat("--ops '", o.ops, "': expected read, write or read,write"));
  if (o.memory == "cuda") return RunXferCuda(o, *sizes, *batches, ops);

  nlohmann::json out;
  out["memcpy_gbps"] = internal::MeasureMemcpyGbps();
  // Same-host READs copy with two threads and streaming stores: their own limit.
  out["copy_limit_gbps"] = internal::MeasureCopyLimitGbps(2);
  Target target;
  EPLBX_RETURN_IF_ERROR(StartTarget(&target, kMaxBuffer, /*cuda=*/false, o.huge_pages));
  PlainBuffer local(kMaxBuffer, o.huge_pages);
  if (local.get() == nullptr) return Status::Internal("mmap of the bench's buffer failed");
  std::memset(local.get(), 1, kMaxBuffer);
  out["huge_pages"] = o.huge_pages;
  std::vector<Row> rows;
  std::map<std::string, uint64_t> bytes_by_path;  // over all agents of the run
  // One agent per transport, or one with the data paths given.
  std::vector<std::pair<std::string, AgentConfig>> runs;
  if (!o.paths.empty()) {
    AgentConfig config;
    config.paths = SplitPaths(o.paths);
    config.inline_copy_bytes = o.inline_copy;
    runs.push_back({"paths", config});
  } else {
    for (Transport t : transports) {
      AgentConfig config;
      config.transport = t;
      config.inline_copy_bytes = o.inline_copy;
      runs.push_back({std::string(TransportName(t)), config});
    }
  }
  for (const auto& [label, config] : runs) {
    auto agent = Agent::Create(StrCat("xfer-", label), config);
    if (!agent.ok()) return agent.status();
    auto region = (*agent)->RegisterMemory(local.get(), kMaxBuffer);
    if (!region.ok()) return region.status();
    auto peer = (*agent)->Connect(target.blob);
    if (!peer.ok()) return peer.status();
    Result<PeerInfo> info = (*agent)->Peer(*peer);
    if (!info.ok()) return info.status();
    auto path_of = [&](MemoryKind kind) {
      for (const PathChoice& c : info->paths) {
        if (c.kind == kind) return c.path;
      }
      return std::string("?");
    };
    std::vector<std::pair<std::string, uint64_t>> memories = {{"plain", target.plain}};
    if (label != "tcp") memories.push_back({"shared", target.shared});
    for (const auto& [memory, base] : memories) {
      for (bool read : ops) {
        for (uint64_t size : *sizes) {
          for (uint64_t batch : *batches) {
            Result<Row> row =
                Measure(**agent, *peer, read, base, local.get(), size, batch, o.seconds);
            if (!row.ok()) return row.status();
            row->op = read ? "read" : "write";
            row->transport = label;
            row->memory = memory;
            row->path = path_of(memory == "shared" ? MemoryKind::kHostFile : MemoryKind::kHost);
            if (!o.json) {
              std::printf(
                  "%-5s %-3s %-6s %-3s block %9llu batch %3llu: %7.2f GB/s  p50 %9.1f us  p99 "
                  "%9.1f us\n",
                  row->op.c_str(), row->transport.c_str(), memory.c_str(), row->path.c_str(),
                  static_cast<unsigned long long>(size), static_cast<unsigned long long>(batch),
                  row->gbps, row->p50, row->p99);
              std::fflush(stdout);
            }
            rows.push_back(*row);
          }
        }
      }
    }
    for (const PathTotals& p : (*agent)->PathBytes()) {
      uint64_t& bytes = bytes_by_path[p.path];
      bytes += p.bytes;
    }
  }
  for (const auto& [path, bytes] : bytes_by_path) out["bytes_by_path"][path] = bytes;
  for (const Row& r : rows) {
    out["results"].push_back({{"op", r.op},
                              {"transport", r.transport},
                              {"memory", r.memory},
                              {"path", r.path},
                              {"block_bytes", r.block},
                              {"batch", r.batch},
                              {"gbps", r.gbps},
                              {"p50_us", r.p50},
                              {"p99_us", r.p99},
                              {"iterations", r.iterations}});
  }
  if (o.perftest) {
    for (Transport t : transports) {
      const std::string tls = t == Transport::kTcp ? "tcp" : "posix,sysv,cma,self";
      for (uint64_t size : *sizes) {
        for (const char* test : {"ucp_get", "ucp_put_bw"}) {
          Result<double> g = Perftest(test, tls, size);
          nlohmann::json j = {{"test", test},
                              {"ucx_tls", tls},
                              {"transport", TransportName(t)},
                              {"block_bytes", size}};
          if (g.ok()) {
            j["gbps"] = *g;
          } else {
            j["error"] = g.status().message();
          }
          if (!o.json)
            std::printf("ucx_perftest %-10s UCX_TLS=%-20s block %9llu: %s\n", test, tls.c_str(),
                        static_cast<unsigned long long>(size),
                        g.ok() ? StrCat(*g, " GB/s").c_str() : g.status().message().c_str());
          out["ucx_perftest"].push_back(j);
        }
      }
    }
  }
  if (o.json) {
    std::cout << out.dump(1) << "\n";
  } else {
    std::printf("memcpy (one thread, 64 MiB): %.2f GB/s\n", out["memcpy_gbps"].get<double>());
    std::printf("copy limit (two threads, streaming stores): %.2f GB/s\n",
                out["copy_limit_gbps"].get<double>());
  }
  return Status::OK();
}

}  // namespace

void AddBenchCommand(CLI::App& app, Action& run) {
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks of eplbx against the physical limit");
  bench->require_subcommand(1);
  auto o = std::make_shared<XferOptions>();
  CLI::App* xfer = bench->add_subcommand(
      "xfer", "READ/WRITE between two processes on this machine, per transport, vs memcpy");
  xfer->add_option("--transport", o->transport, "auto (shm and tcp), shm or tcp")
      ->capture_default_str();
  xfer->add_option("--paths", o->paths,
                   "data paths in order, e.g. cma or shm,cma,ucx: one run with exactly these "
                   "(instead of --transport)");
  xfer->add_option("--inline-copy", o->inline_copy,
                   "same-host transfers up to this many bytes are copied on the calling thread "
                   "(-1: the agent's default, 0: never)")
      ->check(IntIn<int64_t>(-1, int64_t{1} << 40));
  xfer->add_option("--sizes", o->sizes, "block sizes, comma-separated (K, M, G suffixes)")
      ->capture_default_str();
  xfer->add_option("--batches", o->batches, "descriptors per transfer, comma-separated")
      ->capture_default_str();
  xfer->add_option("--ops", o->ops, "read, write or read,write")->capture_default_str();
  xfer->add_option("--seconds", o->seconds, "time per configuration")
      ->capture_default_str()
      ->check(RealIn(0.001, 3600));
  xfer->add_option("--memory", o->memory,
                   "host, or cuda: device rows on GPU 0 between two processes (cuda_ipc) beside "
                   "device-to-device and pinned host copies; without a GPU it says so and exits 0")
      ->check(CLI::IsMember({"host", "cuda"}))
      ->capture_default_str();
  xfer->add_flag("--json", o->json, "print one JSON document");
  xfer->add_flag("--huge-pages", o->huge_pages,
                 "host buffers (both processes) asked for transparent huge pages (madvise)");
  xfer->add_flag("--perftest", o->perftest,
                 "also run ucx_perftest (ucp_get, ucp_put_bw) at the same sizes");
  xfer->callback([&run, o] { run = [o] { return RunXfer(*o); }; });
}

}  // namespace eplbx::cli
