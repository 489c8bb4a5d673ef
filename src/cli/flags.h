// Internal: CLI11 validators over common/numbers.h, so every numeric flag is parsed
// strictly (no wrap of -1 into 2^64-1, no cut of 2.7 into 2, no inf or NaN) and its range
// is written once, beside the flag. A failed check is a usage error (exit 2).
#ifndef EPLBX_SRC_CLI_FLAGS_H_
#define EPLBX_SRC_CLI_FLAGS_H_

#include <CLI/CLI.hpp>
#include <string>

#include "common/numbers.h"

namespace eplbx::cli {

template <class T>
CLI::Validator IntIn(T lo, T hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        auto v = internal::ParseInteger<T>(text, "the value", lo, hi);
        return v.ok() ? std::string() : v.status().message();
      },
      internal::StrCat("INT in ", +lo, "..", +hi));
}

inline CLI::Validator RealIn(double lo, double hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        auto v = internal::ParseReal(text, "the value", lo, hi);
        return v.ok() ? std::string() : v.status().message();
      },
      internal::StrCat("NUMBER in ", lo, "..", hi));
}

}  // namespace eplbx::cli

#endif  // EPLBX_SRC_CLI_FLAGS_H_
