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

// The control channel's connection info (metadata field conn_info): [u32 address bytes]
// [the UCX worker address][the name of its inbox, 0..64 bytes; none: no inbox].
struct UcxConnInfo {
  std::string_view address;
  std::string_view inbox;
};
std::string EncodeUcxConnInfo(std::string_view address, std::string_view inbox);
// Refuses, naming `peer`, an address length the info cannot hold and an inbox name too long.
Result<UcxConnInfo> DecodeUcxConnInfo(std::string_view info, std::string_view agent,
                                      std::string_view peer);

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_TRANSFER_UCX_UCX_PATH_H_
