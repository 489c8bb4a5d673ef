// Internal: the UCX backend. One UCP context and worker per agent, driven only by the
// agent's progress thread (UCX's emulated one-sided operations need the target to
// progress). Per peer: one endpoint from the peer's worker address in error mode PEER,
// which carries notifications and heartbeats (active messages) and, for the tcp transport,
// the data (get/put on rkeys from ucp_mem_map + ucp_rkey_pack, put completed by a flush).
// Same-host peers move data through ShmCopier instead (transfer/shm/copier.h).
#ifndef EPLBX_SRC_TRANSFER_UCX_UCX_BACKEND_H_
#define EPLBX_SRC_TRANSFER_UCX_UCX_BACKEND_H_

#include <memory>

#include "transfer/backend.h"

namespace eplbx::internal {

Result<std::unique_ptr<Backend>> CreateUcxBackend(const BackendOptions& options,
                                                  BackendListener* listener);

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_TRANSFER_UCX_UCX_BACKEND_H_
