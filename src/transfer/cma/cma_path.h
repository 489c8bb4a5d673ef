// Internal: the "cma" data path. Same host only: any host memory of the peer process, read
// with process_vm_readv and written with process_vm_writev on the copy threads (shared with
// the shm path). Needs ptrace permission over the peer (fine as root or with
// ptrace_scope 0; often forbidden in containers): Connect proves it by reading the peer's
// probe word, whose address is the path's metadata section.
#ifndef EPLBX_SRC_TRANSFER_CMA_CMA_PATH_H_
#define EPLBX_SRC_TRANSFER_CMA_CMA_PATH_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "transfer/backend.h"
#include "transfer/shm/copier.h"

namespace eplbx::internal {

std::unique_ptr<DataPath> CreateCmaPath(std::shared_ptr<ShmCopier> copier, std::string agent,
                                        CoreListener* listener);

// The section: the address of 8 bytes holding kProbeValue.
Result<uint64_t> DecodeCmaSection(std::string_view section, std::string_view peer);
inline constexpr uint64_t kProbeValue = 0x6570'6c62'7850'524fULL;

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_TRANSFER_CMA_CMA_PATH_H_
