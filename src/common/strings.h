// Internal: message building. Not installed.
#ifndef EPLBX_SRC_COMMON_STRINGS_H_
#define EPLBX_SRC_COMMON_STRINGS_H_

#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>
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

// User input quoted for a one-line message: in single quotes, control bytes,
// backslashes and bytes >= 0x80 escaped as \xNN, cut to `max` bytes of input ("..." after).
// "0x1f00": an address as the errors print it.
inline std::string Hex(uint64_t v) { return StrCat("0x", std::hex, v); }

inline std::string Printable(std::string_view text, size_t max = 64) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out = "'";
  for (size_t i = 0; i < text.size() && i < max; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c < 0x20 || c >= 0x7f || c == '\\') {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  out += text.size() > max ? "'..." : "'";
  return out;
}

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_COMMON_STRINGS_H_
