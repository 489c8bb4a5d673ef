#include "eplbx/env.h"

#include <cstdlib>
#include <string>

namespace eplbx {
namespace {

class ProcessEnv final : public Env {
 public:
  Clock::time_point Now() override { return Clock::now(); }
  std::optional<std::string> GetVar(std::string_view name) override {
    const char* v = std::getenv(std::string(name).c_str());
    if (v == nullptr) return std::nullopt;
    return std::string(v);
  }
};

}  // namespace

Env* Env::Default() {
  static Env* env = new ProcessEnv();  // never destroyed: usable from static destructors
  return env;
}

}  // namespace eplbx
