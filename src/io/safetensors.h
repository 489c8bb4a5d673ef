// Internal: a strict reader of the safetensors format, for recovering expert rows from the
// checkpoint (issue 20, item 3c; docs/placement.md "After a lost rank").
//
// Format: u64 little-endian header length N, N bytes of JSON (an object: tensor name ->
// {"dtype", "shape", "data_offsets": [begin, end]} relative to the data, plus an optional
// "__metadata__" object of strings), then the data.
#ifndef EPLBX_SRC_IO_SAFETENSORS_H_
#define EPLBX_SRC_IO_SAFETENSORS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "eplbx/layout.h"
#include "eplbx/status.h"

namespace eplbx::io {

struct SafetensorsTensor {
  std::string name;
  std::string dtype;  // as written: "BF16", "F32", "F8_E4M3", ...
  std::vector<int64_t> shape;
  uint64_t offset = 0;  // of the first byte, from the start of the file
  uint64_t bytes = 0;
};

// The layout's name of a safetensors dtype ("BF16" -> "bf16", "F8_E4M3" -> "fp8_e4m3");
// empty for an unknown one.
std::string LayoutDtype(std::string_view safetensors_dtype);

class SafetensorsFile {
 public:
  // Reads and checks the header: the JSON, every dtype known, every size = elements x
  // element size, every tensor inside the file (a truncated file names the tensor and both
  // sizes), no two tensors overlapping. Errors name the file.
  // The file stays open: every read goes through the descriptor that was checked, and each
  // row is handed over only after checking that the file is still the one opened (its size,
  // modification time, and that the path still names its inode); a file changed or replaced
  // since is a named error.
  static Result<SafetensorsFile> Open(const std::string& path);
  // Parses and checks a header's JSON text (the bytes after the length) for a file of
  // `file_bytes`, as Open does: depth (at most 8), no NUL, the tensors. The fuzz target's entry.
  static Result<std::vector<SafetensorsTensor>> ParseHeader(const std::string& path,
                                                            std::string_view text,
                                                            uint64_t file_bytes);

  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  const std::string& path() const { return path_; }

  // Reads the row of `expert` from tensor `name` (shape [experts, ...]) into `dst`
  // (spec.bytes_per_expert bytes), after checking it against `spec`: dtype, the per-expert
  // shape, bytes per expert, and that the expert exists. A mismatch names the file, the
  // tensor, both dtypes, shapes and sizes; nothing is written to `dst` then.
  Status ReadExpertRow(std::string_view name, uint32_t expert, const TensorSpec& spec,
                       uint8_t* dst) const;

 private:
  struct Fd {
    int fd = -1;
    ~Fd();
  };
  Status StillTheSame() const;

  std::string path_;
  std::shared_ptr<Fd> fd_;
  uint64_t size_ = 0;
  uint64_t device_ = 0, inode_ = 0;
  int64_t mtime_ns_ = 0;
  std::vector<SafetensorsTensor> tensors_;
};

}  // namespace eplbx::io

#endif  // EPLBX_SRC_IO_SAFETENSORS_H_
