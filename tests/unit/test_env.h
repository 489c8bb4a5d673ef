// Test Envs (eplbx/env.h): variables from a map instead of the process environment, and a
// clock that can be moved forward.
#ifndef EPLBX_TESTS_UNIT_TEST_ENV_H_
#define EPLBX_TESTS_UNIT_TEST_ENV_H_

#include <atomic>
#include <map>
#include <mutex>
#include <string>

#include "eplbx/env.h"

namespace eplbx {

// Variables only from Set(); the real clock.
class MapEnv final : public EnvWrapper {
 public:
  MapEnv() : EnvWrapper(Env::Default()) {}
  void Set(const std::string& name, const std::string& value) {
    std::lock_guard<std::mutex> lock(mu_);
    vars_[name] = value;
  }
  void Unset(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    vars_.erase(name);
  }
  std::optional<std::string> GetVar(std::string_view name) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = vars_.find(std::string(name));
    if (it == vars_.end()) return std::nullopt;
    return it->second;
  }

 private:
  std::mutex mu_;
  std::map<std::string, std::string> vars_;
};

// The real clock plus an offset that Advance() moves forward.
class SkewedClockEnv final : public EnvWrapper {
 public:
  SkewedClockEnv() : EnvWrapper(Env::Default()) {}
  void Advance(std::chrono::milliseconds by) { skew_ms_ += by.count(); }
  Clock::time_point Now() override {
    return target()->Now() + std::chrono::milliseconds(skew_ms_.load());
  }

 private:
  std::atomic<int64_t> skew_ms_{0};
};

}  // namespace eplbx

#endif  // EPLBX_TESTS_UNIT_TEST_ENV_H_
