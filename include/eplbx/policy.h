// Copyright (c) eplbx authors. Placement policies: which expert lives in which slot.
//
// Every policy is a pure, deterministic function of its inputs: the same input gives the
// same placement on every machine (tie rules are in docs/placement.md). Thread safe.
#ifndef EPLBX_POLICY_H_
#define EPLBX_POLICY_H_

#include <string_view>

#include "eplbx/placement.h"
#include "eplbx/status.h"

namespace eplbx {

enum class Policy {
  // DeepSeek's EPLB algorithm, output identical to its reference implementation:
  // hierarchical when groups % nodes == 0, global otherwise.
  kDeepSeek,
};

// "deepseek" -> kDeepSeek. The error lists the known names.
Result<Policy> ParsePolicy(std::string_view name);
std::string_view PolicyName(Policy policy);

struct PlanOptions {
  Policy policy = Policy::kDeepSeek;
};

// True when DeepSeek's hierarchical mode applies (groups % nodes == 0).
bool IsHierarchical(const Topology& topology);

// Plans a placement of load.experts() logical experts into topology.slots slots for every
// layer of `load`. Validates the topology against the load first (see Topology::Validate);
// on error nothing is returned but the Status naming the offending field.
// The result places every expert at least once and fills every slot.
Result<Placement> Plan(const LoadMatrix& load, const Topology& topology,
                       const PlanOptions& options = {});

}  // namespace eplbx

#endif  // EPLBX_POLICY_H_
