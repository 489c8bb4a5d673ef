// Internal: a strict reader of NumPy's .npy format (versions 1.0, 2.0 and 3.0).
#ifndef EPLBX_SRC_IO_NPY_H_
#define EPLBX_SRC_IO_NPY_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "eplbx/status.h"

namespace eplbx::io {

struct NpyArray {
  std::string descr;           // as written, e.g. "<f4"
  std::vector<int64_t> shape;  // as written
  std::vector<double> values;  // every element converted to double, C order
};

// Supported element types: float32, float64, int32, int64 in little or big endian.
// Rejects a bad magic, an unknown version, a header that is not the dict NumPy writes,
// Fortran order, an unsupported dtype, and data shorter or longer than the shape says.
Result<NpyArray> ParseNpy(std::string_view bytes);

// Encodes a 2-D float64 array (little endian, version 1.0). Used by tests and tools.
std::string EncodeNpyF64(int64_t rows, int64_t cols, const std::vector<double>& values);

}  // namespace eplbx::io

#endif  // EPLBX_SRC_IO_NPY_H_
