// Internal: message building. Not installed.
#ifndef EPLBX_SRC_COMMON_STRINGS_H_
#define EPLBX_SRC_COMMON_STRINGS_H_

#include <sstream>
#include <string>
#include <utility>

namespace eplbx::internal {

// Concatenates anything with an operator<<; doubles keep up to 10 significant digits.
template <typename... Args>
std::string StrCat(Args&&... args) {
  std::ostringstream out;
  out.precision(10);
  (out << ... << std::forward<Args>(args));
  return out.str();
}

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_COMMON_STRINGS_H_
