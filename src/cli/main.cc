// The `eplbx` command: a thin layer over the public API. Errors are one line on stderr
// ("eplbx: error: ...") and a non-zero exit: 2 for bad usage, 1 for everything else.
#include <csignal>
#include <exception>
#include <iostream>
#include <new>

#include "cli/commands.h"

int main(int argc, char** argv) {
  // A closed pipe or socket makes a write fail with a one-line error, never kills eplbx
  // silently with SIGPIPE (exit 141; issue 17, item 6).
  std::signal(SIGPIPE, SIG_IGN);
  CLI::App app{"eplbx: expert-parallel load balancing for Mixture-of-Experts inference"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "eplbx 0.1.0");
  eplbx::cli::Action run;
  eplbx::cli::AddPlanCommand(app, run);
  eplbx::cli::AddMigrateCommand(app, run);
  eplbx::cli::AddBenchCommand(app, run);
  eplbx::cli::AddDemoCommand(app, run);
  eplbx::cli::AddWorkerCommand(app, run);
  eplbx::cli::AddSimulateCommands(app, run);
  // Name what is wrong before CLI11 would say only "A subcommand is required": an unknown
  // option in place of the command, or an unknown subcommand of a command that needs one.
  if (argc > 1 && argv[1][0] == '-') {
    const std::string a = argv[1];
    if (a != "-h" && a != "--help" && a != "--version") {
      std::cerr << "eplbx: error: unknown option '" << a
                << "' before a command (expected one of: plan, migrate, bench, demo, worker, "
                   "store, trace, simulate; see eplbx --help)\n";
      return 2;
    }
  }
  {
    const CLI::App* cur = &app;
    std::string path;
    for (int i = 1; i < argc && argv[i][0] != '-'; ++i) {
      const CLI::App* next = nullptr;
      std::string names;
      for (const CLI::App* sub : cur->get_subcommands({})) {
        names += (names.empty() ? "" : ", ") + sub->get_name();
        if (sub->get_name() == argv[i]) next = sub;
      }
      if (next == nullptr) {
        if (cur != &app && cur->get_require_subcommand_min() > 0) {
          std::cerr << "eplbx: error: unknown command '" << path << " " << argv[i]
                    << "' (expected one of: " << names << ")\n";
          return 2;
        }
        break;
      }
      path += (path.empty() ? "" : " ") + next->get_name();
      cur = next;
    }
  }
  if (argc > 1 && argv[1][0] != '-') {
    bool known = false;
    for (const CLI::App* sub : app.get_subcommands({})) known |= sub->get_name() == argv[1];
    if (!known) {
      std::cerr
          << "eplbx: error: unknown command '" << argv[1]
          << "' (expected one of: plan, migrate, bench, demo, worker, store, trace, simulate; see "
             "eplbx --help)\n";
      return 2;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "eplbx: error: " << e.what() << " (see eplbx --help)\n";
    return 2;
  }
  try {
    const eplbx::Status status = run ? run() : eplbx::Status::InvalidArgument("no command");
    if (!status.ok()) {
      std::cerr << "eplbx: error: " << status.message() << "\n";
      return 1;
    }
  } catch (const std::bad_alloc&) {
    std::cerr << "eplbx: error: out of memory (is the input far larger than intended?)\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "eplbx: error: internal: " << e.what() << " (please report this)\n";
    return 1;
  }
  return 0;
}
