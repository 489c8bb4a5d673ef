// Internal: the in-process backend. Agents created with backend "loopback" in one process
// reach each other through a process-wide table; READ and WRITE are memcpy on the calling
// thread, so transfers are done when Read()/Write() returns. For unit tests of the layers
// above the transfer engine; never a substitute for the UCX tests.
#ifndef EPLBX_SRC_TRANSFER_LOOPBACK_LOOPBACK_BACKEND_H_
#define EPLBX_SRC_TRANSFER_LOOPBACK_LOOPBACK_BACKEND_H_

#include <memory>
#include <string_view>

#include "transfer/backend.h"

namespace eplbx::internal {

std::unique_ptr<Backend> CreateLoopbackBackend(const BackendOptions& options,
                                               BackendListener* listener);

// Fault injection for tests: while `reachable` is false, the loopback agent named
// `agent` neither serves transfers nor receives notifications, and every agent connected
// to it sees it fail ("peer unreachable") on its next call.
void SetLoopbackReachable(std::string_view agent, bool reachable);

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_TRANSFER_LOOPBACK_LOOPBACK_BACKEND_H_
