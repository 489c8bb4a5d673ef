// The one place backends are registered (ARCHITECTURE.md: no static self-registration).
#include "common/strings.h"
#include "transfer/backend.h"
#include "transfer/loopback/loopback_backend.h"
#include "transfer/ucx/ucx_backend.h"

namespace eplbx::internal {

Result<std::unique_ptr<Backend>> CreateBackend(std::string_view name, const BackendOptions& options,
                                               BackendListener* listener) {
  if (name == "ucx") return CreateUcxBackend(options, listener);
  if (name == "loopback") return CreateLoopbackBackend(options, listener);
  return Status::InvalidArgument(StrCat("unknown backend '", name, "' (expected ucx or loopback)"));
}

}  // namespace eplbx::internal
