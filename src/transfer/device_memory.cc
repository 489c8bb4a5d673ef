#include "transfer/device_memory.h"

#include <dlfcn.h>

#include <cstdlib>

#if EPLBX_WITH_CUDA
#include <cuda.h>
#endif

namespace eplbx::internal {
namespace {

#if EPLBX_WITH_CUDA
// The function's own type: a call through another type (int for its enums) is undefined,
// and clang's UBSan says so (-fsanitize=function).
using PointerGetAttribute = decltype(&::cuPointerGetAttribute);
constexpr CUpointer_attribute kAttributeMemoryType = CU_POINTER_ATTRIBUTE_MEMORY_TYPE;
constexpr CUpointer_attribute kAttributeIsManaged = CU_POINTER_ATTRIBUTE_IS_MANAGED;
constexpr unsigned kMemoryTypeDevice = CU_MEMORYTYPE_DEVICE;
#else
// Without the toolkit's headers no process of this build has the driver loaded by eplbx;
// the driver API's ABI: CUresult cuPointerGetAttribute(void*, int, CUdeviceptr).
using PointerGetAttribute = int (*)(void* data, int attribute, unsigned long long ptr);
constexpr int kAttributeMemoryType = 2;    // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
constexpr int kAttributeIsManaged = 8;     // CU_POINTER_ATTRIBUTE_IS_MANAGED
constexpr unsigned kMemoryTypeDevice = 2;  // CU_MEMORYTYPE_DEVICE
#endif

PointerGetAttribute LoadedDriver() {
  // Never loads the driver: only finds it when the process already has it.
  void* lib = dlopen(CudaDriverLibrary(), RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) return nullptr;
  auto f = reinterpret_cast<PointerGetAttribute>(dlsym(lib, "cuPointerGetAttribute"));
  dlclose(lib);  // the process keeps its own reference
  return f;
}

}  // namespace

const char* CudaDriverLibrary() {
  const char* env = std::getenv("EPLBX_CUDA_DRIVER");
  return env != nullptr && env[0] != '\0' ? env : "libcuda.so.1";
}

bool CudaDriverLoaded() { return LoadedDriver() != nullptr; }

bool IsCudaDevicePointer(uint64_t p) {
  PointerGetAttribute get = LoadedDriver();
  if (get == nullptr) return false;
  unsigned type = 0;
  // Not initialised, an unknown pointer (plain host memory): not device memory.
  if (get(&type, kAttributeMemoryType, p) != 0 || type != kMemoryTypeDevice) return false;
  unsigned managed = 0;
  return get(&managed, kAttributeIsManaged, p) != 0 || managed == 0;
}

}  // namespace eplbx::internal
