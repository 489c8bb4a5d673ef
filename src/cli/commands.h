// Internal: the subcommands of the `eplbx` CLI. Each Add*Command registers its flags on
// `app` and sets `run` to the action to execute when that subcommand is chosen. An action
// returns a Status; main prints a non-OK one as a single line on stderr.
#ifndef EPLBX_SRC_CLI_COMMANDS_H_
#define EPLBX_SRC_CLI_COMMANDS_H_

#include <CLI/CLI.hpp>
#include <functional>

#include "eplbx/status.h"

namespace eplbx::cli {

using Action = std::function<Status()>;

void AddPlanCommand(CLI::App& app, Action& run);
void AddMigrateCommand(CLI::App& app, Action& run);
void AddBenchCommand(CLI::App& app, Action& run);
void AddDemoCommand(CLI::App& app, Action& run);
void AddWorkerCommand(CLI::App& app, Action& run);     // also `eplbx store`
void AddSimulateCommands(CLI::App& app, Action& run);  // `eplbx trace synth`, `eplbx simulate`

}  // namespace eplbx::cli

#endif  // EPLBX_SRC_CLI_COMMANDS_H_
