#include "transfer/cuda/cuda_driver.h"

#include <dlfcn.h>
#include <sys/prctl.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <mutex>

#include "common/strings.h"
#include "transfer/device_memory.h"

namespace eplbx::internal::cuda {
namespace {

#define EPLBX_STR2(x) #x
#define EPLBX_STR(x) EPLBX_STR2(x)  // the versioned symbol cuda.h maps a name to

struct Loaded {
  Driver driver;
  std::string failure;  // empty when loaded
};

Loaded Load() {
  Loaded out;
  Driver& d = out.driver;
  const std::string library = CudaDriverLibrary();
  void* lib = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    out.failure =
        library == "libcuda.so.1"
            ? "libcuda.so.1 not found (no NVIDIA driver on this machine)"
            : StrCat("EPLBX_CUDA_DRIVER=", library, " cannot be loaded (", dlerror(), ")");
    return out;
  }
#define EPLBX_CUDA_RESOLVE(name)                                                        \
  d.name = reinterpret_cast<decltype(&::name)>(dlsym(lib, EPLBX_STR(name)));            \
  if (d.name == nullptr) {                                                              \
    out.failure = StrCat("the driver ", library, " has no ", EPLBX_STR(name),           \
                         " (driver older than this build's CUDA ", CUDA_VERSION / 1000, \
                         "; update the driver)");                                       \
    return out;                                                                         \
  }
  EPLBX_CUDA_DRIVER_FUNCTIONS(EPLBX_CUDA_RESOLVE)
#undef EPLBX_CUDA_RESOLVE
#define EPLBX_CUDA_RESOLVE_OPTIONAL(name) \
  d.name = reinterpret_cast<decltype(&::name)>(dlsym(lib, EPLBX_STR(name)));
  EPLBX_CUDA_OPTIONAL_FUNCTIONS(EPLBX_CUDA_RESOLVE_OPTIONAL)
#undef EPLBX_CUDA_RESOLVE_OPTIONAL
  // The library stays loaded for the process's life.
  if (CUresult r = d.cuInit(0); r != CUDA_SUCCESS) {
    out.failure = d.Error("cuInit", r);
    return out;
  }
  d.cuDriverGetVersion(&d.version);
  if (CUresult r = d.cuDeviceGetCount(&d.device_count); r != CUDA_SUCCESS) {
    out.failure = d.Error("cuDeviceGetCount", r);
    return out;
  }
  if (d.device_count <= 0) out.failure = "the driver sees no device (CUDA_VISIBLE_DEVICES?)";
  return out;
}

const Loaded& Once() {
  static const Loaded* loaded = new Loaded(Load());
  return *loaded;
}

}  // namespace

std::string Driver::Error(std::string_view call, CUresult r) const {
  const char* name = nullptr;
  if (cuGetErrorName == nullptr || cuGetErrorName(r, &name) != CUDA_SUCCESS || name == nullptr) {
    return StrCat(call, ": CUDA error ", static_cast<int>(r));
  }
  return StrCat(call, ": ", name);
}

Result<const Driver*> LoadDriver() {
  const Loaded& l = Once();
  if (!l.failure.empty()) return Status::Unavailable(StrCat("no CUDA device: ", l.failure));
  return &l.driver;
}

std::string NoDeviceReason() {
  const Loaded& l = Once();
  return l.failure.empty() ? std::string() : StrCat("no CUDA device: ", l.failure);
}

Result<std::string> DeviceUuid(const Driver& d, int ordinal) {
  CUdevice dev = 0;
  if (CUresult r = d.cuDeviceGet(&dev, ordinal); r != CUDA_SUCCESS) {
    return Status::Unavailable(d.Error(StrCat("cuDeviceGet(", ordinal, ")"), r));
  }
  CUuuid uuid{};
  if (CUresult r = d.cuDeviceGetUuid(&uuid, dev); r != CUDA_SUCCESS) {
    return Status::Unavailable(d.Error("cuDeviceGetUuid", r));
  }
  return std::string(uuid.bytes, sizeof(uuid.bytes));
}

int OrdinalOfUuid(const Driver& d, std::string_view uuid) {
  for (int i = 0; i < d.device_count; ++i) {
    Result<std::string> u = DeviceUuid(d, i);
    if (u.ok() && *u == uuid) return i;
  }
  return -1;
}

std::string UuidText(std::string_view uuid) {
  std::string out = "GPU-";
  for (size_t i = 0; i < uuid.size(); ++i) {
    char hex[3];
    std::snprintf(hex, sizeof(hex), "%02x", static_cast<unsigned char>(uuid[i]));
    out += hex;
    if (i == 3 || i == 5 || i == 7 || i == 9) out += '-';
  }
  return out;
}

void UsePreciseSleeps() { static_cast<void>(prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0)); }

std::chrono::steady_clock::duration PollPacer::Next() {
  using namespace std::chrono;
  const auto now = steady_clock::now();
  if (since_ == steady_clock::time_point{}) since_ = now;
  return std::clamp<steady_clock::duration>((now - since_) / 16, microseconds(5),
                                            microseconds(200));
}

Status UseDevice(const Driver& d, int ordinal) {
  static std::mutex mu;
  static std::map<int, CUcontext>* contexts = new std::map<int, CUcontext>();
  CUcontext ctx = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = contexts->find(ordinal);
    if (it == contexts->end()) {
      CUdevice dev = 0;
      if (CUresult r = d.cuDeviceGet(&dev, ordinal); r != CUDA_SUCCESS) {
        return Status::Unavailable(d.Error(StrCat("cuDeviceGet(", ordinal, ")"), r));
      }
      if (CUresult r = d.cuDevicePrimaryCtxRetain(&ctx, dev); r != CUDA_SUCCESS) {
        return Status::Unavailable(d.Error("cuDevicePrimaryCtxRetain", r));
      }
      (*contexts)[ordinal] = ctx;
    } else {
      ctx = it->second;
    }
  }
  if (CUresult r = d.cuCtxSetCurrent(ctx); r != CUDA_SUCCESS) {
    return Status::Unavailable(d.Error("cuCtxSetCurrent", r));
  }
  return Status::OK();
}

}  // namespace eplbx::internal::cuda
