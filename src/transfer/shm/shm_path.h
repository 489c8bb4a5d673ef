// Internal: the "shm" data path. Same host only: a peer region that lies in a shared file
// (kHostFile) is mapped here at connect and copied with streaming stores (copier.h); the
// path's metadata section gives, per region, the owner's fd of the file and the file offset.
#ifndef EPLBX_SRC_TRANSFER_SHM_SHM_PATH_H_
#define EPLBX_SRC_TRANSFER_SHM_SHM_PATH_H_

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "transfer/backend.h"
#include "transfer/shm/copier.h"

namespace eplbx::internal {

// `copier` is shared with the cma path (one pool of copy threads per agent). A peer's
// regions get their page tables at connect while their bytes add up to at most
// `prefault_bytes` (AgentConfig::prefault_bytes).
std::unique_ptr<DataPath> CreateShmPath(std::shared_ptr<ShmCopier> copier, std::string agent,
                                        CoreListener* listener, uint64_t prefault_bytes);

// The section: per region of the header, the owner's fd (-1: not in a shared file) and the
// file offset of the region's first byte.
Result<std::vector<SharedFile>> DecodeShmSection(std::string_view section, size_t regions,
                                                 std::string_view peer);

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_TRANSFER_SHM_SHM_PATH_H_
