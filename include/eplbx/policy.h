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
  // Replica counts and packing chosen together, then local search; never worse than
  // kDeepSeek on any layer. Hierarchical mode keeps each group on one node and chooses
  // which node well (docs/placement.md).
  kBalanced,
  // Starts from PlanOptions::previous and moves as few expert copies as possible while
  // every layer stays within `tolerance` of kBalanced's balancedness.
  kIncremental,
};

// "deepseek", "balanced", "incremental". The error lists the known names.
Result<Policy> ParsePolicy(std::string_view name);
std::string_view PolicyName(Policy policy);

struct PlanOptions {
  Policy policy = Policy::kDeepSeek;
  // The placement in force (same layers and slots). With any policy, an expert that stays
  // on a rank keeps its old row, so unchanged rows never move. Required by kIncremental.
  // Not owned; must outlive the call.
  const Placement* previous = nullptr;
  // kIncremental: allowed balancedness loss per layer against kBalanced.
  double tolerance = 0.002;
  // kBalanced and kIncremental: layers are planned independently, on this many threads (0:
  // one per core, at most one per layer, and only the calling thread for a plan of fewer
  // than 4,096 layer-slots; 1: the calling thread). The result is the same whatever the
  // number. kDeepSeek always runs on the calling thread (about a millisecond).
  int threads = 0;
};

// What a new placement costs to reach from the previous one.
struct LayerMoves {
  int64_t remote_copies = 0;    // (rank, expert) pairs in the new placement absent before
  int64_t local_copies = 0;     // changed rows whose expert the rank already held
  int64_t unchanged_slots = 0;  // rows holding the same expert as before
};
struct Moves {
  std::vector<LayerMoves> per_layer;
  LayerMoves total;
};

// REQUIRES nothing: shapes are checked (same layers and slots, ranks divides slots).
Result<Moves> CountMoves(const Placement& previous, const Placement& next, int ranks);

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
