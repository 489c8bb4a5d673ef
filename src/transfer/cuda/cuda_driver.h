// Internal: the CUDA driver API, loaded at run time (dlopen "libcuda.so.1"), so that a
// build with CUDA runs on machines without a driver or GPU: there every CUDA feature says
// "no CUDA device: <why>" (docs/transfer.md, "Device memory"). Built only with
// EPLBX_WITH_CUDA (the toolkit's cuda.h gives the types; nothing links libcuda or cudart).
#ifndef EPLBX_SRC_TRANSFER_CUDA_CUDA_DRIVER_H_
#define EPLBX_SRC_TRANSFER_CUDA_CUDA_DRIVER_H_

#include <cuda.h>

#include <chrono>
#include <string>
#include <string_view>

#include "eplbx/status.h"

namespace eplbx::internal::cuda {

// Every driver function eplbx calls (the names cuda.h maps to versioned symbols, such as
// cuMemGetAddressRange -> cuMemGetAddressRange_v2, are resolved under those symbols).
#define EPLBX_CUDA_DRIVER_FUNCTIONS(X)      \
  X(cuInit)                                 \
  X(cuDriverGetVersion)                     \
  X(cuGetErrorName)                         \
  X(cuDeviceGetCount)                       \
  X(cuDeviceGet)                            \
  X(cuDeviceGetUuid)                        \
  X(cuDeviceGetName)                        \
  X(cuDeviceCanAccessPeer)                  \
  X(cuDevicePrimaryCtxRetain)               \
  X(cuDevicePrimaryCtxRelease)              \
  X(cuCtxSetCurrent)                        \
  X(cuPointerGetAttribute)                  \
  X(cuMemGetAddressRange)                   \
  X(cuIpcGetMemHandle)                      \
  X(cuIpcOpenMemHandle)                     \
  X(cuIpcCloseMemHandle)                    \
  X(cuMemRetainAllocationHandle)            \
  X(cuMemGetAllocationPropertiesFromHandle) \
  X(cuMemGetAllocationGranularity)          \
  X(cuMemExportToShareableHandle)           \
  X(cuMemImportFromShareableHandle)         \
  X(cuMemCreate)                            \
  X(cuMemRelease)                           \
  X(cuMemAddressReserve)                    \
  X(cuMemAddressFree)                       \
  X(cuMemMap)                               \
  X(cuMemUnmap)                             \
  X(cuMemSetAccess)                         \
  X(cuMemAlloc)                             \
  X(cuMemFree)                              \
  X(cuMemHostAlloc)                         \
  X(cuMemFreeHost)                          \
  X(cuMemcpyAsync)                          \
  X(cuMemcpyHtoD)                           \
  X(cuMemcpyDtoH)                           \
  X(cuMemsetD8)                             \
  X(cuStreamCreate)                         \
  X(cuStreamDestroy)                        \
  X(cuStreamSynchronize)                    \
  X(cuStreamWaitEvent)                      \
  X(cuEventCreate)                          \
  X(cuEventDestroy)                         \
  X(cuEventRecord)                          \
  X(cuEventQuery)                           \
  X(cuEventSynchronize)                     \
  X(cuEventElapsedTime)

// Functions used when the driver has them (null otherwise): cuMemcpyBatchAsync (CUDA 12.8+,
// resolved under the CUDA 13 symbol), one launch for many rows.
#define EPLBX_CUDA_OPTIONAL_FUNCTIONS(X) X(cuMemcpyBatchAsync)

struct Driver {
#define EPLBX_CUDA_DECLARE(name) decltype(&::name) name = nullptr;
  EPLBX_CUDA_DRIVER_FUNCTIONS(EPLBX_CUDA_DECLARE)
  EPLBX_CUDA_OPTIONAL_FUNCTIONS(EPLBX_CUDA_DECLARE)
#undef EPLBX_CUDA_DECLARE
  int version = 0;       // cuDriverGetVersion, e.g. 13000
  int device_count = 0;  // > 0

  // "cuIpcOpenMemHandle: CUDA_ERROR_INVALID_VALUE" style text for a failed call.
  std::string Error(std::string_view call, CUresult r) const;
};

// The driver, loaded and initialised once per process; "no CUDA device: ..." (kUnavailable)
// when libcuda.so.1 is missing, a function is missing, cuInit fails or no device is visible.
Result<const Driver*> LoadDriver();

// The text of "no CUDA device: ..." for this process, or empty when a device is present.
std::string NoDeviceReason();

// A device's identity across processes (its UUID as 16 raw bytes) and its ordinal here.
Result<std::string> DeviceUuid(const Driver& d, int ordinal);
// The ordinal of the device with `uuid` in this process, or -1 (CUDA_VISIBLE_DEVICES).
int OrdinalOfUuid(const Driver& d, std::string_view uuid);
// "GPU-xxxxxxxx-xxxx-..." as nvidia-smi prints it.
std::string UuidText(std::string_view uuid);

// Makes the primary context of `ordinal` current on this thread (retained once per ordinal,
// kept for the process's life).
Status UseDevice(const Driver& d, int ordinal);

// For the threads that poll copy events between short sleeps: Linux stretches every sleep
// of a thread by its timer slack (50 us by default), which would add ~50 us to each device
// copy a poller waits for (seen on an H200: 16 MiB rows at 0.23 x the device copy rate).
// Sets the calling thread's slack to 1 us.
void UsePreciseSleeps();

// The sleeps of a poller while copies are pending and none completed: 5 us at first, then
// a sixteenth of the time waited so far, at most 200 us. A short copy is seen within
// microseconds, a long one costs a few wakeups (at most ~6 % added to its time) instead of
// one every 5 us, which kept a core busy (a TSan run of the killed-peer test timed out with
// it on a loaded machine).
class PollPacer {
 public:
  void Progress() { since_ = {}; }  // something completed: the next wait starts short
  // Nothing completed: how long to wait before querying again (the caller waits on its
  // condition variable for that long, so new work still wakes it at once).
  std::chrono::steady_clock::duration Next();

 private:
  std::chrono::steady_clock::time_point since_{};
};

}  // namespace eplbx::internal::cuda

#endif  // EPLBX_SRC_TRANSFER_CUDA_CUDA_DRIVER_H_
