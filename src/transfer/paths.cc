// The one place control channels and data paths are created (no static self-registration).
#include <set>

#include "common/strings.h"
#include "transfer/backend.h"
#include "transfer/cma/cma_path.h"
#include "transfer/device_memory.h"
#include "transfer/loopback/loopback_path.h"
#include "transfer/shm/shm_path.h"
#include "transfer/ucx/ucx_path.h"
#include "transfer/ucx/ucx_worker.h"
#ifdef EPLBX_WITH_CUDA
#include "transfer/cuda/cuda_ipc_path.h"
#include "transfer/cuda/cuda_staged_path.h"
#endif

namespace eplbx::internal {

bool CudaPathBuilt() {
#ifdef EPLBX_WITH_CUDA
  return true;
#else
  return false;
#endif
}

std::string NoCudaPathHint() {
  return CudaPathBuilt()
             ? "; list cuda_ipc (same host) and cuda_staged (other hosts) among the data "
               "paths (EPLBX_PATHS=shm,cma,cuda_ipc,ucx,cuda_staged), "
               "or create the agent after CUDA is in use (it is then listed by "
               "default)"
             : "; this eplbx was built without CUDA (configure it with "
               "-DEPLBX_WITH_CUDA=ON where the CUDA toolkit is installed)";
}

bool CudaPathByDefault() { return CudaPathBuilt() && CudaDriverLoaded(); }

std::vector<std::string> DefaultPaths(std::string_view control) {
  if (control == "loopback") return {"loopback"};
  if (CudaPathByDefault()) return {"shm", "cma", "cuda_ipc", "ucx", "cuda_staged"};
  return {"shm", "cma", "ucx"};
}

Result<AgentParts> CreateParts(std::string_view control, const std::vector<std::string>& paths,
                               const PartOptions& options, CoreListener* listener,
                               const std::vector<CoreListener*>& path_listeners) {
  const std::string who = StrCat("agent '", options.agent_name, "'");
  if (paths.empty()) return Status::InvalidArgument(StrCat(who, ": no data path given"));
  std::set<std::string_view> seen;
  for (const std::string& p : paths) {
    const bool cuda = p == "cuda_ipc" || p == "cuda_staged";
    if (cuda && !CudaPathBuilt()) {
      return Status::InvalidArgument(
          StrCat(who, ": data path '", p, "' is not in this build", NoCudaPathHint()));
    }
    if (p != "shm" && p != "cma" && !cuda && p != "ucx" && p != "loopback") {
      return Status::InvalidArgument(
          StrCat(who, ": unknown data path ", Printable(p),
                 " (expected shm, cma, cuda_ipc, ucx, cuda_staged or loopback)"));
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
      copier = std::make_shared<ShmCopier>(options.copy_threads, options.inline_copy_bytes,
                                           options.inline_when_busy);
    }
    if (p == "shm") {
      parts.paths.push_back(CreateShmPath(copier, options.agent_name, l, options.prefault_bytes));
    } else if (p == "cma") {
      parts.paths.push_back(CreateCmaPath(copier, options.agent_name, l));
    } else if (p == "ucx") {
      parts.paths.push_back(CreateUcxRmaPath(worker, options.agent_name, l));
#ifdef EPLBX_WITH_CUDA
    } else if (p == "cuda_ipc") {
      parts.paths.push_back(
          CreateCudaIpcPath(options.agent_name, l, options.inline_copy_bytes > 0));
    } else if (p == "cuda_staged") {
      parts.paths.push_back(CreateCudaStagedPath(worker, options.agent_name, l));
#endif
    } else {
      parts.paths.push_back(CreateLoopbackPath(options, l));
    }
  }
  return parts;
}

}  // namespace eplbx::internal
