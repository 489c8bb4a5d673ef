// A stand-in for the CUDA driver (libcuda.so.1) for the tests of the cuda_ipc path on machines
// without a GPU: the layer above the driver (registration, handle export and import across
// processes, address translation, streams, events, the poller, Disconnect) runs for real,
// only the "device" is host memory. Loaded instead of the driver with
// EPLBX_CUDA_DRIVER=<path of this library>; never instead of the real thing where a GPU is
// (scripts/test-gpu.sh runs the same tests on the real driver).
//
// Model, per process: "device memory" is a MAP_SHARED mapping of a memfd, so another process
// opens it through /proc/<pid>/fd/<fd> (legacy IPC handles) or through an exported fd (cuMem
// handles). Copies are memmove, done at once; an event is NOT_READY at its first query and
// complete afterwards (so callers' polling is exercised). One device, ordinal 0.
#include <cuda.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

namespace {

constexpr size_t kGranularity = 2u << 20;

struct Allocation {  // cuMemAlloc memory or an opened IPC handle
  size_t bytes = 0;
  int fd = -1;  // -1 for opened handles
  bool legacy = true;
};
struct Handle {  // a cuMemCreate / imported allocation
  size_t bytes = 0;
  int fd = -1;
  int refs = 1;
  bool exportable = true;  // created with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
};
struct Mapping {  // a cuMemMap'ed handle
  size_t bytes = 0;
  uint64_t handle = 0;
};
struct IpcPayload {
  uint32_t magic;
  int32_t pid;
  int32_t fd;
  uint64_t bytes;
};

std::mutex mu;
std::map<uint64_t, Allocation> allocations;  // by base
std::map<uint64_t, Handle> handles;          // by id
std::map<uint64_t, Mapping> mappings;        // by address
std::map<uint64_t, size_t> reserved;         // by address
std::map<void*, int> events;                 // queries left before complete
uint64_t next_handle = 1;
int initialised = 0;

template <typename Map>
typename Map::iterator Containing(Map& m, uint64_t p) {
  auto it = m.upper_bound(p);
  if (it == m.begin()) return m.end();
  --it;
  return p < it->first + it->second.bytes ? it : m.end();
}

int NewMemfd(size_t bytes) {
  const int fd = memfd_create("fake-cuda", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(bytes)) != 0) return -1;
  return fd;
}

void ReleaseHandle(uint64_t id) {
  auto it = handles.find(id);
  if (it == handles.end() || --it->second.refs > 0) return;
  close(it->second.fd);
  handles.erase(it);
}

}  // namespace

CUresult CUDAAPI cuInit(unsigned int) {
  initialised = 1;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDriverGetVersion(int* v) {
  *v = 13000;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuGetErrorName(CUresult error, const char** str) {
  static char text[64];
  std::snprintf(text, sizeof(text), "FAKE_CUDA_ERROR_%d", static_cast<int>(error));
  *str = text;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDeviceGetCount(int* count) {
  *count = 1;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDeviceGet(CUdevice* device, int ordinal) {
  if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
  *device = 0;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDeviceGetUuid(CUuuid* uuid, CUdevice) {
  std::memcpy(uuid->bytes, "fake-cuda-gpu-00", 16);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDeviceGetName(char* name, int len, CUdevice) {
  std::snprintf(name, static_cast<size_t>(len), "fake CUDA device (host memory)");
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDeviceCanAccessPeer(int* can, CUdevice, CUdevice) {
  *can = 1;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice) {
  static int context;
  *ctx = reinterpret_cast<CUcontext>(&context);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuCtxSetCurrent(CUcontext) { return CUDA_SUCCESS; }

CUresult CUDAAPI cuPointerGetAttribute(void* data, CUpointer_attribute attribute, CUdeviceptr p) {
  std::lock_guard<std::mutex> lock(mu);
  if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
  auto a = Containing(allocations, p);
  auto m = Containing(mappings, p);
  if (a == allocations.end() && m == mappings.end()) return CUDA_ERROR_INVALID_VALUE;
  switch (attribute) {
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
      *static_cast<unsigned*>(data) = CU_MEMORYTYPE_DEVICE;
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED:
      *static_cast<unsigned*>(data) = 0;
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
      *static_cast<int*>(data) = 0;
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE:
      *static_cast<int*>(data) = a != allocations.end() && a->second.legacy ? 1 : 0;
      return CUDA_SUCCESS;
    default:
      return CUDA_ERROR_NOT_SUPPORTED;
  }
}

CUresult CUDAAPI cuMemGetAddressRange(CUdeviceptr* base, size_t* size, CUdeviceptr p) {
  std::lock_guard<std::mutex> lock(mu);
  if (auto a = Containing(allocations, p); a != allocations.end()) {
    *base = a->first;
    *size = a->second.bytes;
    return CUDA_SUCCESS;
  }
  if (auto m = Containing(mappings, p); m != mappings.end()) {
    *base = m->first;
    *size = m->second.bytes;
    return CUDA_SUCCESS;
  }
  return CUDA_ERROR_NOT_FOUND;
}

CUresult CUDAAPI cuMemAlloc(CUdeviceptr* p, size_t bytes) {
  std::lock_guard<std::mutex> lock(mu);
  const int fd = NewMemfd(bytes);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  void* m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) {
    close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  *p = reinterpret_cast<uintptr_t>(m);
  allocations[*p] = Allocation{bytes, fd, true};
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemFree(CUdeviceptr p) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = allocations.find(p);
  if (it == allocations.end() || it->second.fd < 0) return CUDA_ERROR_INVALID_VALUE;
  munmap(reinterpret_cast<void*>(p), it->second.bytes);
  close(it->second.fd);
  allocations.erase(it);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuIpcGetMemHandle(CUipcMemHandle* h, CUdeviceptr p) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = allocations.find(p);
  if (it == allocations.end() || it->second.fd < 0) return CUDA_ERROR_INVALID_VALUE;
  IpcPayload pl{0xfa4ecda, getpid(), it->second.fd, it->second.bytes};
  std::memset(h->reserved, 0, sizeof(h->reserved));
  std::memcpy(h->reserved, &pl, sizeof(pl));
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuIpcOpenMemHandle(CUdeviceptr* p, CUipcMemHandle h, unsigned int) {
  IpcPayload pl;
  std::memcpy(&pl, h.reserved, sizeof(pl));
  if (pl.magic != 0xfa4ecda) return CUDA_ERROR_INVALID_HANDLE;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/fd/%d", pl.pid, pl.fd);
  const int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) return CUDA_ERROR_INVALID_HANDLE;
  void* m = mmap(nullptr, pl.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (m == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  std::lock_guard<std::mutex> lock(mu);
  *p = reinterpret_cast<uintptr_t>(m);
  allocations[*p] = Allocation{pl.bytes, -1, false};
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuIpcCloseMemHandle(CUdeviceptr p) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = allocations.find(p);
  if (it == allocations.end() || it->second.fd >= 0) return CUDA_ERROR_INVALID_VALUE;
  munmap(reinterpret_cast<void*>(p), it->second.bytes);
  allocations.erase(it);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemGetAllocationGranularity(size_t* g, const CUmemAllocationProp*,
                                               CUmemAllocationGranularity_flags) {
  *g = kGranularity;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle* h, size_t size,
                             const CUmemAllocationProp* prop, unsigned long long) {
  if (size % kGranularity != 0) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> lock(mu);
  const int fd = NewMemfd(size);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  *h = next_handle++;
  handles[*h] =
      Handle{size, fd, 1, prop->requestedHandleTypes == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR};
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle h) {
  std::lock_guard<std::mutex> lock(mu);
  if (handles.count(h) == 0) return CUDA_ERROR_INVALID_VALUE;
  ReleaseHandle(h);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemRetainAllocationHandle(CUmemGenericAllocationHandle* h, void* addr) {
  std::lock_guard<std::mutex> lock(mu);
  auto m = Containing(mappings, reinterpret_cast<uintptr_t>(addr));
  if (m == mappings.end()) return CUDA_ERROR_INVALID_VALUE;
  *h = m->second.handle;
  ++handles[*h].refs;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp* prop,
                                                        CUmemGenericAllocationHandle h) {
  std::lock_guard<std::mutex> lock(mu);
  if (handles.count(h) == 0) return CUDA_ERROR_INVALID_VALUE;
  *prop = CUmemAllocationProp{};
  prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop->requestedHandleTypes =
      handles[h].exportable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemExportToShareableHandle(void* out, CUmemGenericAllocationHandle h,
                                              CUmemAllocationHandleType type, unsigned long long) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = handles.find(h);
  if (it == handles.end() || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR ||
      !it->second.exportable) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  *static_cast<int*>(out) = fcntl(it->second.fd, F_DUPFD_CLOEXEC, 0);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemImportFromShareableHandle(CUmemGenericAllocationHandle* h, void* os,
                                                CUmemAllocationHandleType type) {
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_INVALID_VALUE;
  const int fd = fcntl(static_cast<int>(reinterpret_cast<uintptr_t>(os)), F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return CUDA_ERROR_INVALID_HANDLE;
  struct stat st {};
  fstat(fd, &st);
  std::lock_guard<std::mutex> lock(mu);
  *h = next_handle++;
  handles[*h] = Handle{static_cast<size_t>(st.st_size), fd, 1};
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemAddressReserve(CUdeviceptr* p, size_t size, size_t, CUdeviceptr,
                                     unsigned long long) {
  void* m = mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  std::lock_guard<std::mutex> lock(mu);
  *p = reinterpret_cast<uintptr_t>(m);
  reserved[*p] = size;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemAddressFree(CUdeviceptr p, size_t size) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = reserved.find(p);
  if (it == reserved.end() || it->second != size) return CUDA_ERROR_INVALID_VALUE;
  munmap(reinterpret_cast<void*>(p), size);
  reserved.erase(it);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemMap(CUdeviceptr p, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                          unsigned long long) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = handles.find(h);
  if (it == handles.end() || offset != 0 || size != it->second.bytes) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  void* m = mmap(reinterpret_cast<void*>(p), size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                 it->second.fd, 0);
  if (m == MAP_FAILED) return CUDA_ERROR_INVALID_VALUE;
  ++it->second.refs;  // the mapping holds the allocation
  mappings[p] = Mapping{size, h};
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemUnmap(CUdeviceptr p, size_t size) {
  std::lock_guard<std::mutex> lock(mu);
  for (auto it = mappings.lower_bound(p); it != mappings.end() && it->first < p + size;) {
    mmap(reinterpret_cast<void*>(it->first), it->second.bytes, PROT_NONE,
         MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    ReleaseHandle(it->second.handle);
    it = mappings.erase(it);
  }
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemSetAccess(CUdeviceptr p, size_t size, const CUmemAccessDesc*, size_t) {
  std::lock_guard<std::mutex> lock(mu);
  for (uint64_t at = p; at < p + size;) {  // every byte must be mapped
    auto m = Containing(mappings, at);
    if (m == mappings.end()) return CUDA_ERROR_INVALID_VALUE;
    at = m->first + m->second.bytes;
  }
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemHostAlloc(void** p, size_t bytes, unsigned int) {
  *p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
  return *p != nullptr ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}
CUresult CUDAAPI cuMemFreeHost(void* p) {
  std::free(p);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream) {
  std::memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemcpyBatchAsync(CUdeviceptr* dsts, CUdeviceptr* srcs, size_t* sizes,
                                    size_t count, CUmemcpyAttributes*, size_t*, size_t numAttrs,
                                    CUstream) {
  if (numAttrs != 1) return CUDA_ERROR_INVALID_VALUE;
  for (size_t i = 0; i < count; ++i) {
    std::memmove(reinterpret_cast<void*>(dsts[i]), reinterpret_cast<const void*>(srcs[i]),
                 sizes[i]);
  }
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemcpyHtoD(CUdeviceptr dst, const void* src, size_t n) {
  std::memcpy(reinterpret_cast<void*>(dst), src, n);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemcpyDtoH(void* dst, CUdeviceptr src, size_t n) {
  std::memcpy(dst, reinterpret_cast<const void*>(src), n);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemsetD8(CUdeviceptr p, unsigned char v, size_t n) {
  std::memset(reinterpret_cast<void*>(p), v, n);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamCreate(CUstream* s, unsigned int) {
  *s = reinterpret_cast<CUstream>(new int(0));
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuStreamDestroy(CUstream s) {
  delete reinterpret_cast<int*>(s);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuStreamSynchronize(CUstream) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuStreamWaitEvent(CUstream, CUevent, unsigned int) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuEventCreate(CUevent* e, unsigned int) {
  std::lock_guard<std::mutex> lock(mu);
  *e = reinterpret_cast<CUevent>(new int(0));
  events[*e] = 0;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuEventDestroy(CUevent e) {
  std::lock_guard<std::mutex> lock(mu);
  if (events.erase(e) == 0) return CUDA_ERROR_INVALID_HANDLE;
  delete reinterpret_cast<int*>(e);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuEventRecord(CUevent e, CUstream) {
  std::lock_guard<std::mutex> lock(mu);
  if (events.count(e) == 0) return CUDA_ERROR_INVALID_HANDLE;
  events[e] = 1;  // one NOT_READY before it completes
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuEventQuery(CUevent e) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = events.find(e);
  if (it == events.end()) return CUDA_ERROR_INVALID_HANDLE;
  if (it->second > 0) {
    --it->second;
    return CUDA_ERROR_NOT_READY;
  }
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuEventSynchronize(CUevent e) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = events.find(e);
  if (it == events.end()) return CUDA_ERROR_INVALID_HANDLE;
  it->second = 0;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuEventElapsedTime(float* ms, CUevent, CUevent) {
  *ms = 0;
  return CUDA_SUCCESS;
}
