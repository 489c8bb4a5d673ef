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

// The header is a Python dict literal: {'descr': '<f4', 'fortran_order': False,
// 'shape': (3, 4), } padded with spaces and a newline. Parsed as such: exactly these three
// keys, each once, with a value of its kind; anything else is an error naming the header.
struct Header {
  std::string descr;
  bool fortran = false;
  std::vector<int64_t> shape;
};

class HeaderParser {
 public:
  explicit HeaderParser(std::string_view h) : h_(h) {}

  Result<Header> Parse() {
    Header out;
    bool seen[3] = {false, false, false};
    Space();
    if (!Eat('{')) return Bad("is not a dict");
    while (true) {
      Space();
      if (Eat('}')) break;
      std::string key;
      if (!String(&key)) return Bad("has a key that is not a quoted string");
      Space();
      if (!Eat(':')) return Bad(StrCat("has no ':' after '", key, "'"));
      Space();
      int k = key == "descr" ? 0 : key == "fortran_order" ? 1 : key == "shape" ? 2 : -1;
      if (k < 0) return Bad(StrCat("has an unknown key ", internal::Printable(key)));
      if (seen[k]) return Bad(StrCat("has '", key, "' twice"));
      seen[k] = true;
      if (k == 0 && !String(&out.descr)) return Bad("has a 'descr' that is not a quoted string");
      if (k == 1 && !Bool(&out.fortran)) return Bad("has a 'fortran_order' that is not True/False");
      if (k == 2 && !Tuple(&out.shape)) return Bad("has a 'shape' that is not a tuple of integers");
      Space();
      if (Eat(',')) continue;
      Space();
      if (Eat('}')) break;
      return Bad(StrCat("has no ',' or '}' after '", key, "'"));
    }
    Space();
    if (at_ != h_.size()) return Bad("has text after the dict");
    for (int k = 0; k < 3; ++k) {
      if (!seen[k]) {
        static const char* kKeys[] = {"descr", "fortran_order", "shape"};
        return Bad(StrCat("has no '", kKeys[k], "' entry"));
      }
    }
    return out;
  }

 private:
  Status Bad(const std::string& why) const {
    return Status::Corruption(StrCat("header ", why, ": ", internal::Printable(h_, 80)));
  }
  void Space() {
    while (at_ < h_.size() && std::isspace(static_cast<unsigned char>(h_[at_]))) ++at_;
  }
  bool Eat(char c) {
    if (at_ < h_.size() && h_[at_] == c) {
      ++at_;
      return true;
    }
    return false;
  }
  bool String(std::string* out) {
    if (at_ >= h_.size() || (h_[at_] != '\'' && h_[at_] != '"')) return false;
    const char q = h_[at_];
    const size_t end = h_.find(q, at_ + 1);
    if (end == std::string_view::npos) return false;
    *out = std::string(h_.substr(at_ + 1, end - at_ - 1));
    at_ = end + 1;
    return out->find('\\') == std::string::npos;
  }
  bool Bool(bool* out) {
    for (const auto& [word, v] :
         {std::pair<std::string_view, bool>{"True", true}, {"False", false}}) {
      if (h_.substr(at_, word.size()) == word) {
        at_ += word.size();
        *out = v;
        return true;
      }
    }
    return false;
  }
  bool Tuple(std::vector<int64_t>* out) {
    if (!Eat('(')) return false;
    while (true) {
      Space();
      if (Eat(')')) return true;
      int64_t dim = 0;
      size_t digits = 0;
      while (at_ < h_.size() && std::isdigit(static_cast<unsigned char>(h_[at_]))) {
        if (dim > (std::numeric_limits<int64_t>::max() - 9) / 10) return false;
        dim = dim * 10 + (h_[at_++] - '0');
        ++digits;
      }
      if (digits == 0) return false;
      out->push_back(dim);
      Space();
      if (Eat(',')) continue;
      Space();
      if (Eat(')')) return true;
      return false;
    }
  }

  std::string_view h_;
  size_t at_ = 0;
};

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
  EPLBX_ASSIGN_OR_RETURN(Header parsed, HeaderParser(header).Parse());
  out.descr = parsed.descr;
  out.shape = parsed.shape;
  if (parsed.fortran) {
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
