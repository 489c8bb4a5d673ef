// Internal: the JSON documents the CLI writes.
#ifndef EPLBX_SRC_IO_JSON_OUTPUT_H_
#define EPLBX_SRC_IO_JSON_OUTPUT_H_

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "eplbx/migration.h"
#include "eplbx/placement.h"
#include "eplbx/policy.h"
#include "eplbx/status.h"

namespace eplbx::io {

// {"policy", "phy2log", "log2phy", "logcnt", "balancedness", "balancedness_total", "plan_ms"}
nlohmann::json PlanToJson(std::string_view policy, const Placement& placement,
                          const Balance& balance, double plan_ms);

// {"remote_copies", "local_copies", "unchanged_slots", "per_layer": [{...}, ...]}
nlohmann::json MovesToJson(const Moves& moves);

// {"layers": [{"layer", "transfers": [...], "local_copies": [...], per-layer figures}],
//  "summary": {...}} (docs/cli.md).
nlohmann::json MigrationToJson(const MigrationPlan& plan, const MigrationOptions& options);

// Writes `text` to `path`. A regular file (or a new one) is replaced through a fresh
// temporary in the same directory (created exclusively, never through a link) and a
// rename, so a failed write never leaves a half-written file and keeps the file's mode; a
// FIFO, device or socket (/dev/null, /dev/stdout) is written in place, never replaced; a
// symbolic link stays a link and its target gets the output. "-" means stdout.
Status WriteOutput(const std::string& path, std::string_view text);

}  // namespace eplbx::io

#endif  // EPLBX_SRC_IO_JSON_OUTPUT_H_
