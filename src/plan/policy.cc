#include "eplbx/policy.h"

#include <vector>

#include "common/strings.h"
#include "plan/deepseek_internal.h"

namespace eplbx {

Result<Policy> ParsePolicy(std::string_view name) {
  if (name == "deepseek") return Policy::kDeepSeek;
  return Status::InvalidArgument(
      internal::StrCat("unknown policy '", name, "' (expected one of: deepseek)"));
}

std::string_view PolicyName(Policy policy) {
  switch (policy) {
    case Policy::kDeepSeek:
      return "deepseek";
  }
  return "unknown";
}

bool IsHierarchical(const Topology& topology) { return topology.groups % topology.nodes == 0; }

namespace {

Result<Placement> PlanDeepSeek(const LoadMatrix& load, const Topology& topology) {
  const bool hierarchical = IsHierarchical(topology);
  const int groups = hierarchical ? topology.groups : 1;
  const int nodes = hierarchical ? topology.nodes : 1;
  const size_t experts = static_cast<size_t>(load.experts());
  const size_t slots = static_cast<size_t>(topology.slots);
  std::vector<int32_t> phy2log(static_cast<size_t>(load.layers()) * slots);
  std::vector<int32_t> logcnt(experts);
  std::vector<float> weight(experts);
  for (int l = 0; l < load.layers(); ++l) {
    const double* row = load.row(l);
    for (size_t e = 0; e < experts; ++e) weight[e] = static_cast<float>(row[e]);
    internal::DeepSeekLayer(weight, topology.slots, groups, nodes, topology.ranks,
                            std::span<int32_t>(phy2log).subspan(l * slots, slots), logcnt);
  }
  return Placement::FromPhy2Log(load.layers(), topology.slots, load.experts(), std::move(phy2log));
}

}  // namespace

Result<Placement> Plan(const LoadMatrix& load, const Topology& topology,
                       const PlanOptions& options) {
  if (load.layers() < 1 || load.experts() < 1) {
    return Status::InvalidArgument("load is empty; expected at least one layer of one expert");
  }
  EPLBX_RETURN_IF_ERROR(topology.Validate(load.experts()));
  switch (options.policy) {
    case Policy::kDeepSeek:
      return PlanDeepSeek(load, topology);
  }
  return Status::InvalidArgument("unknown policy");
}

}  // namespace eplbx
