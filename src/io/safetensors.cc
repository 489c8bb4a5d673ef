#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <nlohmann/json.hpp>

#include "common/strings.h"
#include "io/load_file.h"

namespace eplbx::io {

using internal::StrCat;

namespace {

constexpr uint64_t kMaxHeaderBytes = 100u << 20;  // the format's own limit

struct DtypeInfo {
  const char* name;
  const char* layout;
  uint64_t bytes;
};
constexpr DtypeInfo kDtypes[] = {
    {"BOOL", "bool", 1},        {"U8", "u8", 1},   {"I8", "i8", 1},   {"F8_E4M3", "fp8_e4m3", 1},
    {"F8_E5M2", "fp8_e5m2", 1}, {"I16", "i16", 2}, {"U16", "u16", 2}, {"F16", "f16", 2},
    {"BF16", "bf16", 2},        {"I32", "i32", 4}, {"U32", "u32", 4}, {"F32", "f32", 4},
    {"I64", "i64", 8},          {"U64", "u64", 8}, {"F64", "f64", 8},
};

const DtypeInfo* FindDtype(std::string_view name) {
  for (const DtypeInfo& d : kDtypes) {
    if (name == d.name) return &d;
  }
  return nullptr;
}

std::string Shape(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += StrCat(i ? ", " : "", s[i]);
  return out + "]";
}

constexpr int kMaxDepth = 8;  // {name: {"shape": [...]}} needs 3

// Reads exactly `n` bytes at `offset` of the open file `fd` (`path` names it in errors).
Status ReadAt(int fd, const std::string& path, uint64_t offset, uint8_t* dst, uint64_t n) {
  uint64_t done = 0;
  while (done < n) {
    const ssize_t got = ::pread(fd, dst + done, n - done, static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      return Status::Corruption(StrCat("checkpoint '", path, "': ", n, " bytes at byte ", offset,
                                       " could not be read (",
                                       got < 0 ? std::strerror(errno) : "end of file", ")"));
    }
    done += static_cast<uint64_t>(got);
  }
  return Status::OK();
}

int64_t MtimeNs(const struct stat& st) {
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

}  // namespace

std::string LayoutDtype(std::string_view safetensors_dtype) {
  const DtypeInfo* d = FindDtype(safetensors_dtype);
  return d ? d->layout : "";
}

SafetensorsFile::Fd::~Fd() {
  if (fd >= 0) ::close(fd);
}

Result<std::vector<SafetensorsTensor>> SafetensorsFile::ParseHeader(const std::string& path,
                                                                    std::string_view text,
                                                                    uint64_t file_bytes) {
  auto bad = [&](const std::string& why) {
    return Status::Corruption(
        StrCat("checkpoint '", path, "' is not a valid safetensors file: ", why));
  };
  if (file_bytes < 8 + text.size()) {
    return bad(StrCat("a header of ", text.size(), " bytes in a file of ", file_bytes));
  }
  // Depth and NUL first: a header nested 200,000 deep would exhaust the stack of whatever
  // walks the parsed value, and a NUL would end the text a parser reads.
  if (Status st = CheckJsonText(text, StrCat("checkpoint '", path, "' header"), kMaxDepth,
                                "a safetensors header nests 3 deep");
      !st.ok()) {
    return Status::Corruption(st.message());
  }
  std::vector<SafetensorsTensor> tensors;
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return bad("the header is not a JSON object");
  const uint64_t data = 8 + text.size(), data_bytes = file_bytes - data;
  for (const auto& [name, t] : j.items()) {
    if (name == "__metadata__") continue;
    const std::string what = StrCat("tensor ", internal::Printable(name));
    if (!t.is_object() || !t.contains("dtype") || !t["dtype"].is_string() || !t.contains("shape") ||
        !t["shape"].is_array() || !t.contains("data_offsets") || !t["data_offsets"].is_array() ||
        t["data_offsets"].size() != 2) {
      return bad(StrCat(what, " needs \"dtype\", \"shape\" and two \"data_offsets\""));
    }
    SafetensorsTensor x;
    x.name = name;
    x.dtype = t["dtype"].get<std::string>();
    const DtypeInfo* d = FindDtype(x.dtype);
    if (d == nullptr)
      return bad(StrCat(what, " has an unknown dtype ", internal::Printable(x.dtype)));
    uint64_t elements = 1;
    for (const auto& dim : t["shape"]) {
      if (!dim.is_number_unsigned() || dim.get<uint64_t>() > (uint64_t{1} << 40))
        return bad(StrCat(what, " has a shape entry that is not a size: ", dim.dump()));
      x.shape.push_back(static_cast<int64_t>(dim.get<uint64_t>()));
      elements = x.shape.back() == 0 ? 0 : elements;
      if (elements != 0 && elements > (uint64_t{1} << 50) / static_cast<uint64_t>(x.shape.back()))
        return bad(StrCat(what, " has more elements than a file can hold"));
      elements *= static_cast<uint64_t>(x.shape.back());
    }
    const auto& off = t["data_offsets"];
    if (!off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      return bad(StrCat(what, " has data offsets that are not sizes"));
    const uint64_t b = off[0].get<uint64_t>(), e = off[1].get<uint64_t>();
    if (b > e) return bad(StrCat(what, " starts at byte ", b, " after its end ", e));
    if (e - b != elements * d->bytes) {
      return bad(StrCat(what, " is ", x.dtype, " ", Shape(x.shape), ": ", elements * d->bytes,
                        " bytes, but its data offsets span ", e - b));
    }
    if (e > data_bytes) {
      return Status::Corruption(StrCat(
          "checkpoint '", path, "': tensor ", internal::Printable(name), " ends at data byte ", e,
          " but the file holds ", data_bytes, " bytes of data (truncated?)"));
    }
    x.offset = data + b;
    x.bytes = e - b;
    tensors.push_back(std::move(x));
  }
  std::vector<const SafetensorsTensor*> by_offset;
  for (const SafetensorsTensor& x : tensors) by_offset.push_back(&x);
  std::sort(by_offset.begin(), by_offset.end(),
            [](auto* a, auto* b) { return a->offset < b->offset; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const SafetensorsTensor& p = *by_offset[i - 1];
    if (p.offset + p.bytes > by_offset[i]->offset) {
      return bad(StrCat("tensors ", internal::Printable(p.name), " and ",
                        internal::Printable(by_offset[i]->name), " overlap"));
    }
  }
  return tensors;
}

Result<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  SafetensorsFile f;
  f.path_ = path;
  f.fd_ = std::make_shared<Fd>();
  f.fd_->fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd_->fd < 0) {
    return Status::IoError(StrCat("checkpoint '", path, "': ", std::strerror(errno)));
  }
  struct stat st {};
  if (::fstat(f.fd_->fd, &st) != 0) {
    return Status::IoError(StrCat("checkpoint '", path, "': ", std::strerror(errno)));
  }
  auto bad = [&](const std::string& why) {
    return Status::Corruption(
        StrCat("checkpoint '", path, "' is not a valid safetensors file: ", why));
  };
  if (!S_ISREG(st.st_mode)) return bad("it is not a regular file");
  f.size_ = static_cast<uint64_t>(st.st_size);
  f.device_ = static_cast<uint64_t>(st.st_dev);
  f.inode_ = static_cast<uint64_t>(st.st_ino);
  f.mtime_ns_ = MtimeNs(st);
  if (f.size_ < 8) return bad(StrCat("it is ", f.size_, " bytes (the header length alone is 8)"));
  const int fd = f.fd_->fd;
  uint8_t len_bytes[8];
  EPLBX_RETURN_IF_ERROR(ReadAt(fd, path, 0, len_bytes, 8));
  uint64_t header = 0;
  for (int i = 7; i >= 0; --i) header = header << 8 | len_bytes[i];
  if (header > kMaxHeaderBytes || header > f.size_ - 8) {
    return bad(StrCat("the header claims ", header, " bytes; the file has ", f.size_ - 8,
                      " after the length (truncated?)"));
  }
  std::string text(header, '\0');
  EPLBX_RETURN_IF_ERROR(ReadAt(fd, path, 8, reinterpret_cast<uint8_t*>(text.data()), header));
  EPLBX_ASSIGN_OR_RETURN(f.tensors_, ParseHeader(path, text, f.size_));
  return f;
}

Status SafetensorsFile::ReadExpertRow(std::string_view name, uint32_t expert,
                                      const TensorSpec& spec, uint8_t* dst) const {
  const SafetensorsTensor* t = nullptr;
  for (const SafetensorsTensor& x : tensors_) {
    if (x.name == name) t = &x;
  }
  if (t == nullptr) {
    std::string some;
    for (size_t i = 0; i < tensors_.size() && i < 3; ++i)
      some += StrCat(i ? ", " : " (e.g. ", internal::Printable(tensors_[i].name));
    return Status::NotFound(StrCat("checkpoint '", path_, "' has no tensor ",
                                   internal::Printable(name), " (it has ", tensors_.size(),
                                   " tensors", some, tensors_.empty() ? "" : ")", ")"));
  }
  const uint64_t rows = t->shape.empty() ? 0 : static_cast<uint64_t>(t->shape[0]);
  const std::vector<int64_t> row_shape =
      t->shape.empty() ? std::vector<int64_t>{}
                       : std::vector<int64_t>(t->shape.begin() + 1, t->shape.end());
  const uint64_t row_bytes = rows == 0 ? 0 : t->bytes / rows;
  const std::string dtype = LayoutDtype(t->dtype);
  if ((!spec.dtype.empty() && dtype != spec.dtype) ||
      (!spec.expert_shape.empty() && row_shape != spec.expert_shape) ||
      row_bytes != spec.bytes_per_expert) {
    return Status::Mismatch(
        StrCat("checkpoint '", path_, "': tensor ", internal::Printable(name), " is ", t->dtype,
               " ", Shape(t->shape), " (", dtype, " ", Shape(row_shape), ", ", row_bytes,
               " bytes per expert); the layout's '", spec.name, "' is ", spec.dtype, " ",
               Shape(spec.expert_shape), ", ", spec.bytes_per_expert,
               " bytes per expert (another quantization or model revision?)"));
  }
  if (expert >= rows) {
    return Status::InvalidArgument(StrCat("checkpoint '", path_, "': tensor ",
                                          internal::Printable(name), " has ", rows,
                                          " experts; expert ", expert, " is not among them"));
  }
  std::vector<uint8_t> row(row_bytes);  // dst is written only with a whole row
  const Status read = ReadAt(fd_->fd, path_, t->offset + expert * row_bytes, row.data(), row_bytes);
  // Checked once the row is in (a file changed before or while it was read is named: also
  // the cause of a short read), so `dst` gets only rows of the file Open checked.
  EPLBX_RETURN_IF_ERROR(StillTheSame());
  EPLBX_RETURN_IF_ERROR(read);
  std::memcpy(dst, row.data(), row_bytes);
  return Status::OK();
}

Status SafetensorsFile::StillTheSame() const {
  struct stat now {
  }, named{};
  if (::fstat(fd_->fd, &now) != 0) {
    return Status::IoError(StrCat("checkpoint '", path_, "': ", std::strerror(errno)));
  }
  std::string what;
  if (static_cast<uint64_t>(now.st_size) != size_) {
    what = StrCat("its size went from ", size_, " to ", now.st_size, " bytes");
  } else if (MtimeNs(now) != mtime_ns_) {
    what = "it was modified";
  } else if (::stat(path_.c_str(), &named) != 0) {
    what = StrCat("its name is gone (", std::strerror(errno), ")");
  } else if (static_cast<uint64_t>(named.st_dev) != device_ ||
             static_cast<uint64_t>(named.st_ino) != inode_) {
    what = "the name now names another file";
  }
  if (what.empty()) return Status::OK();
  return Status::Corruption(StrCat("checkpoint '", path_, "' changed since it was opened (", what,
                                   "): its rows are not read; open the checkpoint again"));
}

}  // namespace eplbx::io
