// Internal: strict parsing of numbers given by users (flags, environment variables, sweep
// values): the whole text must be the number, and one that is negative where unsigned,
// fractional where integral, out of range or not finite is an error naming `what`, the
// text and the range, never a wrap, a cut or a cast.
#ifndef EPLBX_SRC_COMMON_NUMBERS_H_
#define EPLBX_SRC_COMMON_NUMBERS_H_

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <string>
#include <string_view>
#include <type_traits>

#include "common/strings.h"
#include "eplbx/status.h"

namespace eplbx::internal {

template <class T>
Result<T> ParseInteger(std::string_view text, std::string_view what, T lo, T hi) {
  static_assert(std::is_integral_v<T>);
  T v{};
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, v);
  if (ec == std::errc() && ptr == end && v >= lo && v <= hi) return v;
  std::string why = "expected an integer";
  if (ec == std::errc::result_out_of_range || (ec == std::errc() && ptr == end)) {
    why = "out of range";
  } else if (ec == std::errc() && *ptr == '.') {
    why = "not an integer";
  } else if (std::is_unsigned_v<T> && !text.empty() && text[0] == '-') {
    why = "negative";
  }
  return Status::InvalidArgument(
      StrCat(what, " is ", Printable(text), ": ", why, " (expected ", +lo, " .. ", +hi, ")"));
}

inline Result<double> ParseReal(std::string_view text, std::string_view what, double lo,
                                double hi) {
  const std::string s(text);
  char* end = nullptr;
  errno = 0;
  const double v = s.empty() ? 0 : std::strtod(s.c_str(), &end);
  std::string why;
  if (s.empty() || end != s.c_str() + s.size() || std::isspace(static_cast<unsigned char>(s[0]))) {
    why = "not a number";
  } else if (!std::isfinite(v) || (errno == ERANGE && std::fabs(v) > 1)) {
    why = std::isnan(v) ? "not a number (NaN)" : "not finite";
  } else if (!(v >= lo && v <= hi)) {
    why = "out of range";
  } else {
    return v;
  }
  return Status::InvalidArgument(
      StrCat(what, " is ", Printable(text), ": ", why, " (expected ", lo, " .. ", hi, ")"));
}

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_COMMON_NUMBERS_H_
