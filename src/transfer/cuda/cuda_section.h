// Internal: the cuda_ipc data path's metadata section (docs/transfer.md, "Metadata format"):
// per region of the header, how a same-host peer opens it. Pure bytes, tested without a GPU.
#ifndef EPLBX_SRC_TRANSFER_CUDA_CUDA_SECTION_H_
#define EPLBX_SRC_TRANSFER_CUDA_CUDA_SECTION_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "eplbx/status.h"
#include "transfer/metadata.h"

namespace eplbx::internal::cuda {

inline constexpr size_t kIpcHandleBytes = 64;  // CU_IPC_HANDLE_SIZE
inline constexpr size_t kUuidBytes = 16;
inline constexpr uint32_t kMaxChunks = 1u << 16;

enum class HandleKind : uint8_t {
  kNone = 0,    // not device memory (host regions)
  kLegacy = 1,  // cudaMalloc memory: one cuIpcGetMemHandle of the whole allocation
  kVmm = 2,     // cuMem* memory (PyTorch's expandable segments): one POSIX fd per mapping
};

// One cuMemMap'ed piece of a kVmm allocation: [base + offset, + bytes), shared as `fd`, a
// descriptor number in the owner's process (peers take it with pidfd_getfd).
struct Chunk {
  uint64_t offset = 0;
  uint64_t bytes = 0;
  uint32_t fd = 0;
};

struct RegionHandle {
  HandleKind kind = HandleKind::kNone;
  std::string device_uuid;    // kUuidBytes raw
  uint64_t base = 0;          // the owner's address of the allocation (first chunk)
  uint64_t bytes = 0;         // the allocation's size (all chunks)
  std::string ipc_handle;     // kLegacy: kIpcHandleBytes raw
  std::vector<Chunk> chunks;  // kVmm: contiguous from offset 0, covering `bytes`
};

std::string EncodeCudaSection(const std::vector<RegionHandle>& handles);
// Checks the count against the header's regions, every handle against its region's kind
// (a cuda region without a handle, a host region with one), that each region lies inside its
// allocation, and that chunks are contiguous and cover it; each error names the peer and
// region.
Result<std::vector<RegionHandle>> DecodeCudaSection(std::string_view section,
                                                    const std::vector<RegionInfo>& regions,
                                                    std::string_view peer);

}  // namespace eplbx::internal::cuda

#endif  // EPLBX_SRC_TRANSFER_CUDA_CUDA_SECTION_H_
