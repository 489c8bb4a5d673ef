// Internal: which memory kind a pointer is, without linking CUDA (docs/transfer.md,
// "Device memory"). Device memory exists in a process only once it loaded the CUDA driver,
// so the probe asks the driver only when libcuda.so.1 is already loaded (dlopen with
// RTLD_NOLOAD): a host-only process never loads or initialises CUDA.
#ifndef EPLBX_SRC_TRANSFER_DEVICE_MEMORY_H_
#define EPLBX_SRC_TRANSFER_DEVICE_MEMORY_H_

#include <cstdint>

namespace eplbx::internal {

// True when [p, p + 1) is CUDA device memory (cudaMalloc, cuMemMap, PyTorch's caching
// allocator); false for host memory, including pinned host memory and managed memory
// (which host code can touch), and whenever the driver is not loaded or not initialised.
bool IsCudaDevicePointer(uint64_t p);

// True when this process has loaded the CUDA driver (libcuda.so.1); never loads it.
bool CudaDriverLoaded();

// The driver library eplbx loads: EPLBX_CUDA_DRIVER if set (a path or name, e.g. a driver
// outside the loader's path, or the tests' stand-in), else "libcuda.so.1".
const char* CudaDriverLibrary();

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_TRANSFER_DEVICE_MEMORY_H_
