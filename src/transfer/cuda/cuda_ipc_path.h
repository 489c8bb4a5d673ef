// Internal: the "cuda_ipc" data path (docs/transfer.md, "Device memory"): CUDA device memory
// between processes of one host. Regions export a legacy IPC handle (cudaMalloc memory) or
// one POSIX fd per cuMem mapping (PyTorch's expandable segments); peers open them once at
// connect; READ / WRITE are asynchronous copies on the path's own streams, completed by
// CUDA events that the path's poller thread watches, or, for a transfer its caller posted
// alone (PathRequest::alone) when `wait_here`, by the calling thread itself before Post
// returns. Built with EPLBX_WITH_CUDA only.
#ifndef EPLBX_SRC_TRANSFER_CUDA_CUDA_IPC_PATH_H_
#define EPLBX_SRC_TRANSFER_CUDA_CUDA_IPC_PATH_H_

#include <memory>
#include <string>

#include "transfer/backend.h"

namespace eplbx::internal {

// Never fails: without a device the path registers no device memory ("no CUDA device: ...")
// and refuses peers' device regions with that reason.
// `wait_here`: the agent copies on the caller's thread at all (inline_copy_bytes > 0).
std::unique_ptr<DataPath> CreateCudaIpcPath(std::string agent, CoreListener* listener,
                                            bool wait_here);

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_TRANSFER_CUDA_CUDA_IPC_PATH_H_
