// The environment eplbx reads: the clock and environment variables, behind one interface
// (LevelDB's Env). Options take an Env*; null means Env::Default(). Tests derive from
// EnvWrapper and override one call: a clock that jumps past a deadline, or variables that
// are not in the process environment.
#ifndef EPLBX_ENV_H_
#define EPLBX_ENV_H_

#include <chrono>
#include <optional>
#include <string>
#include <string_view>

namespace eplbx {

class Env {
 public:
  using Clock = std::chrono::steady_clock;
  virtual ~Env() = default;
  // The process environment and the steady clock. Never destroyed; thread-safe.
  static Env* Default();
  // Monotonic time; deadlines are measured on it.
  virtual Clock::time_point Now() = 0;
  // The variable's value, or nullopt when unset (an empty value is returned as "").
  virtual std::optional<std::string> GetVar(std::string_view name) = 0;
};

// Forwards every call to `target`; override what a test changes.
class EnvWrapper : public Env {
 public:
  explicit EnvWrapper(Env* target) : target_(target) {}
  Env* target() const { return target_; }
  Clock::time_point Now() override { return target_->Now(); }
  std::optional<std::string> GetVar(std::string_view name) override {
    return target_->GetVar(name);
  }

 private:
  Env* const target_;
};

// `env`, or Env::Default() when null.
inline Env* EnvOrDefault(Env* env) { return env != nullptr ? env : Env::Default(); }

}  // namespace eplbx

#endif  // EPLBX_ENV_H_
