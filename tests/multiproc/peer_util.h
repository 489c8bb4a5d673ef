// Helpers shared by the multi-process transfer tests and their peer program.
#ifndef EPLBX_TESTS_MULTIPROC_PEER_UTIL_H_
#define EPLBX_TESTS_MULTIPROC_PEER_UTIL_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace eplbx::testing {

// The byte a peer seeded with `seed` holds at `offset` of its buffer.
inline uint8_t PatternByte(uint64_t seed, uint64_t offset) {
  uint64_t x = (offset + 1) * 0x9E3779B97F4A7C15ULL ^ (seed * 0xD6E8FEB86659FD93ULL);
  x ^= x >> 29;
  return static_cast<uint8_t>(x ^ (x >> 8));
}

inline void FillPattern(uint8_t* p, size_t n, uint64_t seed, uint64_t base_offset) {
  for (size_t i = 0; i < n; ++i) p[i] = PatternByte(seed, base_offset + i);
}

inline uint64_t Fnv1a(const uint8_t* p, size_t n) {
  uint64_t h = 1469598103934665603ULL;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ULL;
  return h;
}

inline std::string ToHex(std::string_view bytes) {
  static const char* kDigits = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out.push_back(kDigits[c >> 4]);
    out.push_back(kDigits[c & 15]);
  }
  return out;
}

inline std::string FromHex(std::string_view hex) {
  auto nibble = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<char>(nibble(hex[i]) * 16 + nibble(hex[i + 1])));
  }
  return out;
}

}  // namespace eplbx::testing

#endif  // EPLBX_TESTS_MULTIPROC_PEER_UTIL_H_
