// Internal: the UCX parts of an agent. One worker (context, worker, progress thread) is the
// control channel and carries the "ucx" data path (docs/transfer.md, "Data paths").
#ifndef EPLBX_SRC_TRANSFER_UCX_UCX_PATH_H_
#define EPLBX_SRC_TRANSFER_UCX_UCX_PATH_H_

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "transfer/backend.h"

namespace eplbx::internal {
namespace ucx {
class UcxWorker;
}  // namespace ucx

// The control channel: starts UCX and its progress thread.
Result<std::unique_ptr<ucx::UcxWorker>> CreateUcxWorker(const PartOptions& options,
                                                        CoreListener* listener);
// The RMA data path over `worker`'s endpoints. REQUIRES: `worker` outlives the path.
std::unique_ptr<DataPath> CreateUcxRmaPath(ucx::UcxWorker* worker, std::string agent,
                                           CoreListener* listener);
// The path's metadata section: one packed rkey per region of the header.
Result<std::vector<std::string>> DecodeUcxSection(std::string_view section, size_t regions,
                                                  std::string_view peer);

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_TRANSFER_UCX_UCX_PATH_H_
