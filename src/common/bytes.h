// Internal: little-endian encoding of what crosses a process boundary (metadata blobs,
// notification headers, protocol records). Readers never read past the end: each read
// names its field, and the first failure sticks with a message saying which field was
// truncated or too long and by how much.
#ifndef EPLBX_SRC_COMMON_BYTES_H_
#define EPLBX_SRC_COMMON_BYTES_H_

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/strings.h"
#include "eplbx/status.h"

namespace eplbx::internal {

class ByteWriter {
 public:
  void U8(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void U16(uint16_t v) { Int(v, 2); }
  void U32(uint32_t v) { Int(v, 4); }
  void U64(uint64_t v) { Int(v, 8); }
  void Raw(std::string_view s) { out_.append(s); }
  // Length-prefixed bytes; the caller has checked the length fits the prefix.
  void Str16(std::string_view s) {
    U16(static_cast<uint16_t>(s.size()));
    Raw(s);
  }
  void Str32(std::string_view s) {
    U32(static_cast<uint32_t>(s.size()));
    Raw(s);
  }
  // Each value as U32 would write it, in one piece (maps of thousands of entries).
  void U32s(std::span<const int32_t> v) {
    const size_t at = out_.size();
    out_.resize(at + 4 * v.size());
    char* p = out_.data() + at;
    if constexpr (std::endian::native == std::endian::little) {
      if (!v.empty()) std::memcpy(p, v.data(), 4 * v.size());
    } else {
      for (size_t i = 0; i < v.size(); ++i) {
        const auto x = static_cast<uint32_t>(v[i]);
        for (int b = 0; b < 4; ++b) p[4 * i + b] = static_cast<char>((x >> (8 * b)) & 0xff);
      }
    }
  }
  void Reserve(size_t n) { out_.reserve(n); }
  // Overwrites 4 bytes at `pos` (for a total-length field written up front).
  void PatchU32(size_t pos, uint32_t v) {
    for (int i = 0; i < 4; ++i) out_[pos + i] = static_cast<char>((v >> (8 * i)) & 0xff);
  }
  size_t size() const { return out_.size(); }
  std::string Take() { return std::move(out_); }

 private:
  void Int(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  std::string out_;
};

class ByteReader {
 public:
  // `what` names the record in messages ("agent metadata").
  ByteReader(std::string_view in, std::string_view what) : in_(in), what_(what) {}

  bool U8(std::string_view field, uint8_t* v) {
    uint64_t x = 0;
    if (!Int(field, 1, &x)) return false;
    *v = static_cast<uint8_t>(x);
    return true;
  }
  bool U16(std::string_view field, uint16_t* v) {
    uint64_t x = 0;
    if (!Int(field, 2, &x)) return false;
    *v = static_cast<uint16_t>(x);
    return true;
  }
  bool U32(std::string_view field, uint32_t* v) {
    uint64_t x = 0;
    if (!Int(field, 4, &x)) return false;
    *v = static_cast<uint32_t>(x);
    return true;
  }
  bool U64(std::string_view field, uint64_t* v) { return Int(field, 8, v); }
  // `n` values as U32 reads them one by one, into `v` (resized to `n`).
  bool U32s(std::string_view field, size_t n, std::vector<int32_t>* v) {
    if (n > remaining() / 4) {  // fails, naming the field (a count too large for size_t: all of it)
      return Need(field, n > SIZE_MAX / 4 ? SIZE_MAX : 4 * n);
    }
    v->resize(n);
    const char* p = in_.data() + pos_;
    if constexpr (std::endian::native == std::endian::little) {
      if (n != 0) std::memcpy(v->data(), p, 4 * n);
    } else {
      for (size_t i = 0; i < n; ++i) {
        uint32_t x = 0;
        for (int b = 0; b < 4; ++b)
          x |= static_cast<uint32_t>(static_cast<uint8_t>(p[4 * i + b])) << (8 * b);
        (*v)[i] = static_cast<int32_t>(x);
      }
    }
    pos_ += 4 * n;
    return true;
  }
  bool Raw(std::string_view field, size_t n, std::string* v) {
    if (!Need(field, n)) return false;
    v->assign(in_.substr(pos_, n));
    pos_ += n;
    return true;
  }
  // Length-prefixed bytes of at most `max` bytes.
  bool Str16(std::string_view field, size_t max, std::string* v) {
    uint16_t n = 0;
    if (!U16(field, &n)) return false;
    return Bounded(field, n, max) && Raw(field, n, v);
  }
  bool Str32(std::string_view field, size_t max, std::string* v) {
    uint32_t n = 0;
    if (!U32(field, &n)) return false;
    return Bounded(field, n, max) && Raw(field, n, v);
  }
  bool Fail(Status s) {
    if (status_.ok()) status_ = std::move(s);
    return false;
  }

  size_t pos() const { return pos_; }
  size_t remaining() const { return in_.size() - pos_; }
  const Status& status() const { return status_; }
  std::string_view what() const { return what_; }

 private:
  bool Need(std::string_view field, size_t n) {
    if (!status_.ok()) return false;
    if (remaining() >= n) return true;
    return Fail(Status::Corruption(StrCat(what_, " truncated at field '", field, "' (offset ", pos_,
                                          "): needs ", n, " bytes, ", remaining(), " left")));
  }
  bool Bounded(std::string_view field, size_t n, size_t max) {
    if (n <= max) return true;
    return Fail(Status::Corruption(
        StrCat(what_, " field '", field, "' is ", n, " bytes, the limit is ", max)));
  }
  bool Int(std::string_view field, int n, uint64_t* v) {
    if (!Need(field, n)) return false;
    uint64_t x = 0;
    for (int i = 0; i < n; ++i)
      x |= static_cast<uint64_t>(static_cast<uint8_t>(in_[pos_ + i])) << (8 * i);
    pos_ += n;
    *v = x;
    return true;
  }

  std::string_view in_;
  std::string_view what_;
  size_t pos_ = 0;
  Status status_;
};

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_COMMON_BYTES_H_
