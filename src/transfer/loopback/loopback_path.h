// Internal: the "loopback" control channel and data path, for agents in one process (unit
// tests of the layers above; never a substitute for real transfers). Data moves with
// memmove inside Post, and notifications are delivered at once.
#ifndef EPLBX_SRC_TRANSFER_LOOPBACK_LOOPBACK_PATH_H_
#define EPLBX_SRC_TRANSFER_LOOPBACK_LOOPBACK_PATH_H_

#include <memory>
#include <string>
#include <string_view>

#include "transfer/backend.h"

namespace eplbx::internal {

std::unique_ptr<ControlChannel> CreateLoopbackControl(const PartOptions& options,
                                                      CoreListener* listener);
std::unique_ptr<DataPath> CreateLoopbackPath(const PartOptions& options, CoreListener* listener);

// Cuts an agent off (or back on): its peers' calls to it fail as unreachable.
void SetLoopbackReachable(std::string_view agent, bool reachable);

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_TRANSFER_LOOPBACK_LOOPBACK_PATH_H_
