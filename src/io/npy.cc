#include "io/npy.h"

#include <algorithm>
#include <bit>
#include <cctype>
#include <cstring>
#include <limits>

#include "common/strings.h"

namespace eplbx::io {

using internal::StrCat;

namespace {

constexpr std::string_view kMagic = "\x93NUMPY";
constexpr int64_t kMaxElements = int64_t{1} << 32;

// Finds `'key':` in the header dict and returns the text after it, trimmed on the left.
Result<std::string_view> ValueOf(std::string_view header, std::string_view key) {
  for (char quote : {'\'', '"'}) {
    const std::string pattern = StrCat(quote, key, quote);
    size_t at = header.find(pattern);
    if (at == std::string_view::npos) continue;
    at += pattern.size();
    while (at < header.size() && std::isspace(static_cast<unsigned char>(header[at]))) ++at;
    if (at >= header.size() || header[at] != ':') break;
    ++at;
    while (at < header.size() && std::isspace(static_cast<unsigned char>(header[at]))) ++at;
    return header.substr(at);
  }
  return Status::Corruption(StrCat("header has no '", key, "' entry: ", header));
}

Result<std::string> ParseDescr(std::string_view header) {
  Result<std::string_view> v = ValueOf(header, "descr");
  if (!v.ok()) return v.status();
  std::string_view s = *v;
  if (s.empty() || (s[0] != '\'' && s[0] != '"')) {
    return Status::Corruption("header 'descr' is not a quoted string");
  }
  const size_t end = s.find(s[0], 1);
  if (end == std::string_view::npos) return Status::Corruption("header 'descr' is unterminated");
  return std::string(s.substr(1, end - 1));
}

Result<bool> ParseFortranOrder(std::string_view header) {
  Result<std::string_view> v = ValueOf(header, "fortran_order");
  if (!v.ok()) return v.status();
  if (v->starts_with("False")) return false;
  if (v->starts_with("True")) return true;
  return Status::Corruption("header 'fortran_order' is neither True nor False");
}

Result<std::vector<int64_t>> ParseShape(std::string_view header) {
  Result<std::string_view> v = ValueOf(header, "shape");
  if (!v.ok()) return v.status();
  std::string_view s = *v;
  if (s.empty() || s[0] != '(') return Status::Corruption("header 'shape' is not a tuple");
  const size_t close = s.find(')');
  if (close == std::string_view::npos) return Status::Corruption("header 'shape' is unterminated");
  std::vector<int64_t> shape;
  size_t i = 1;
  while (i < close) {
    while (i < close && (std::isspace(static_cast<unsigned char>(s[i])) || s[i] == ',')) ++i;
    if (i >= close) break;
    int64_t dim = 0;
    size_t digits = 0;
    while (i < close && std::isdigit(static_cast<unsigned char>(s[i]))) {
      if (dim > (std::numeric_limits<int64_t>::max() - 9) / 10) {
        return Status::Corruption("header 'shape' has a dimension too large");
      }
      dim = dim * 10 + (s[i] - '0');
      ++i;
      ++digits;
    }
    while (i < close && (s[i] == 'L' || std::isspace(static_cast<unsigned char>(s[i])))) ++i;
    if (digits == 0 || (i < close && s[i] != ',')) {
      return Status::Corruption(
          StrCat("header 'shape' is not a tuple of integers: ", s.substr(0, close + 1)));
    }
    shape.push_back(dim);
  }
  return shape;
}

template <typename T>
T Load(const char* p, bool swap) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  if (swap) {
    unsigned char b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));
    for (size_t k = 0; k < sizeof(T) / 2; ++k) std::swap(b[k], b[sizeof(T) - 1 - k]);
    std::memcpy(&v, b, sizeof(T));
  }
  return v;
}

}  // namespace

Result<NpyArray> ParseNpy(std::string_view bytes) {
  if (bytes.size() < 10 || bytes.substr(0, 6) != kMagic) {
    return Status::Corruption("not a .npy file (missing the \\x93NUMPY magic)");
  }
  const int major = static_cast<unsigned char>(bytes[6]);
  size_t header_len = 0, offset = 0;
  if (major == 1) {
    header_len = static_cast<unsigned char>(bytes[8]) |
                 (static_cast<size_t>(static_cast<unsigned char>(bytes[9])) << 8);
    offset = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) return Status::Corruption("truncated .npy header");
    for (int k = 3; k >= 0; --k) {
      header_len = (header_len << 8) | static_cast<unsigned char>(bytes[8 + k]);
    }
    offset = 12;
  } else {
    return Status::Corruption(StrCat(".npy version ", major, ".",
                                     static_cast<int>(static_cast<unsigned char>(bytes[7])),
                                     " is not supported (expected 1.0, 2.0 or 3.0)"));
  }
  if (header_len > bytes.size() - offset) {
    return Status::Corruption(StrCat("truncated .npy header: it declares ", header_len,
                                     " bytes but the file has ", bytes.size() - offset,
                                     " after the preamble"));
  }
  const std::string_view header = bytes.substr(offset, header_len);
  const std::string_view data = bytes.substr(offset + header_len);

  NpyArray out;
  Result<std::string> descr = ParseDescr(header);
  if (!descr.ok()) return descr.status();
  Result<bool> fortran = ParseFortranOrder(header);
  if (!fortran.ok()) return fortran.status();
  Result<std::vector<int64_t>> shape = ParseShape(header);
  if (!shape.ok()) return shape.status();
  out.descr = *descr;
  out.shape = *shape;
  if (*fortran) {
    return Status::InvalidArgument(
        "array is in Fortran order; save it in C order (numpy.ascontiguousarray)");
  }
  const std::string& d = out.descr;
  if (d.size() != 3 || (d[0] != '<' && d[0] != '>' && d[0] != '=' && d[0] != '|') ||
      !((d[1] == 'f' && (d[2] == '4' || d[2] == '8')) ||
        (d[1] == 'i' && (d[2] == '4' || d[2] == '8')))) {
    return Status::InvalidArgument(StrCat("dtype '", d,
                                          "' is not supported (expected float32, float64, "
                                          "int32 or int64: '<f4', '<f8', '<i4', '<i8')"));
  }
  const bool big = d[0] == '>';
  const bool swap = big != (std::endian::native == std::endian::big);
  const size_t item = static_cast<size_t>(d[2] - '0');
  int64_t count = 1;
  for (int64_t dim : out.shape) {
    if (dim != 0 && count > kMaxElements / dim) {
      return Status::InvalidArgument("array has more than 2^32 elements");
    }
    count *= dim;
  }
  const size_t need = static_cast<size_t>(count) * item;
  if (data.size() != need) {
    return Status::Corruption(
        StrCat("data is ", data.size(), " bytes but shape and dtype '", d, "' need ", need,
               data.size() < need ? " (truncated file)" : " (trailing bytes)"));
  }
  out.values.resize(static_cast<size_t>(count));
  for (size_t i = 0; i < out.values.size(); ++i) {
    const char* p = data.data() + i * item;
    if (d[1] == 'f') {
      out.values[i] = item == 4 ? Load<float>(p, swap) : Load<double>(p, swap);
    } else {
      out.values[i] = item == 4 ? static_cast<double>(Load<int32_t>(p, swap))
                                : static_cast<double>(Load<int64_t>(p, swap));
    }
  }
  return out;
}

std::string EncodeNpyF64(int64_t rows, int64_t cols, const std::vector<double>& values) {
  std::string header =
      StrCat("{'descr': '<f8', 'fortran_order': False, 'shape': (", rows, ", ", cols, "), }");
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::string out(kMagic);
  out += '\x01';
  out += '\x00';
  out += static_cast<char>(header.size() & 0xff);
  out += static_cast<char>((header.size() >> 8) & 0xff);
  out += header;
  for (double v : values) {
    char b[8];
    std::memcpy(b, &v, 8);
    if constexpr (std::endian::native == std::endian::big) std::reverse(b, b + 8);
    out.append(b, 8);
  }
  return out;
}

}  // namespace eplbx::io
