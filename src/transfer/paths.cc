// The one place control channels and data paths are created (no static self-registration).
#include <set>

#include "common/strings.h"
#include "transfer/backend.h"
#include "transfer/cma/cma_path.h"
#include "transfer/loopback/loopback_path.h"
#include "transfer/shm/shm_path.h"
#include "transfer/ucx/ucx_path.h"
#include "transfer/ucx/ucx_worker.h"

namespace eplbx::internal {

std::vector<std::string> DefaultPaths(std::string_view control) {
  if (control == "loopback") return {"loopback"};
  return {"shm", "cma", "ucx"};
}

Result<AgentParts> CreateParts(std::string_view control, const std::vector<std::string>& paths,
                               const PartOptions& options, CoreListener* listener,
                               const std::vector<CoreListener*>& path_listeners) {
  const std::string who = StrCat("agent '", options.agent_name, "'");
  if (paths.empty()) return Status::InvalidArgument(StrCat(who, ": no data path given"));
  std::set<std::string_view> seen;
  for (const std::string& p : paths) {
    if (p != "shm" && p != "cma" && p != "ucx" && p != "loopback") {
      return Status::InvalidArgument(StrCat(who, ": unknown data path ", Printable(p),
                                            " (expected shm, cma, ucx or loopback)"));
    }
    if (!seen.insert(p).second) {
      return Status::InvalidArgument(StrCat(who, ": data path '", p, "' listed twice"));
    }
    if ((p == "loopback") != (control == "loopback")) {
      return Status::InvalidArgument(
          StrCat(who, ": data path '", p, "' does not work with backend '", control, "' (",
                 control == "loopback" ? "the loopback backend has only the loopback path"
                                       : "the loopback path needs the loopback backend",
                 ")"));
    }
  }
  AgentParts parts;
  ucx::UcxWorker* worker = nullptr;
  if (control == "ucx") {
    Result<std::unique_ptr<ucx::UcxWorker>> w = CreateUcxWorker(options, listener);
    if (!w.ok()) return w.status().WithPrefix(who);
    worker = w->get();
    parts.control = std::move(*w);
  } else if (control == "loopback") {
    parts.control = CreateLoopbackControl(options, listener);
  } else {
    return Status::InvalidArgument(
        StrCat("unknown backend ", Printable(control), " (expected ucx or loopback)"));
  }
  std::shared_ptr<ShmCopier> copier;  // one pool of copy threads for shm and cma
  for (size_t i = 0; i < paths.size(); ++i) {
    const std::string& p = paths[i];
    CoreListener* l = path_listeners.at(i);
    if ((p == "shm" || p == "cma") && copier == nullptr) {
      copier = std::make_shared<ShmCopier>(options.copy_threads, options.inline_copy_bytes);
    }
    if (p == "shm") {
      parts.paths.push_back(CreateShmPath(copier, options.agent_name, l));
    } else if (p == "cma") {
      parts.paths.push_back(CreateCmaPath(copier, options.agent_name, l));
    } else if (p == "ucx") {
      parts.paths.push_back(CreateUcxRmaPath(worker, options.agent_name, l));
    } else {
      parts.paths.push_back(CreateLoopbackPath(options, l));
    }
  }
  return parts;
}

}  // namespace eplbx::internal
