// Internal: reading loads and placements from files (JSON, CSV, NumPy .npy).
// Every error message starts with the origin (usually the file name) and names the field,
// layer, expert or byte offset, the value found and what was expected.
#ifndef EPLBX_SRC_IO_LOAD_FILE_H_
#define EPLBX_SRC_IO_LOAD_FILE_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "eplbx/placement.h"
#include "eplbx/status.h"

namespace eplbx::io {

// Files larger than this are refused before they are read.
inline constexpr size_t kMaxFileBytes = size_t{1} << 30;

Result<std::string> ReadFile(const std::string& path);

// JSON inputs nest at most this deep (a load is a 2-D array inside an object).
inline constexpr int kMaxJsonDepth = 64;
// Refuses, before any parsing, JSON text that nests deeper than `max_depth` or holds a NUL
// byte (outside strings a parser would stop or wander there); the error names the byte and
// says why the limit is what it is (`limit_reason`).
Status CheckJsonText(std::string_view text, std::string_view origin, int max_depth = kMaxJsonDepth,
                     std::string_view limit_reason = "a load is a 2-D array");

// A JSON 2-D array (layers x experts) or an object whose key "load" holds one.
Result<LoadMatrix> ParseLoadJson(std::string_view text, std::string_view origin);
// One layer per line, values separated by commas; blank lines and lines starting with '#'
// are skipped.
Result<LoadMatrix> ParseLoadCsv(std::string_view text, std::string_view origin);
// A 2-D C-order array of float32, float64, int32 or int64 (either byte order).
Result<LoadMatrix> ParseLoadNpy(std::string_view bytes, std::string_view origin);
// Picks the parser by extension: .json, .csv or .npy.
Result<LoadMatrix> ReadLoadFile(const std::string& path);

// A JSON object with key "phy2log": a 2-D array of integers (layers x slots), -1 for an
// empty slot. `experts` is taken from the key "experts" when present, else from the
// width of "logcnt" when present, else from the largest id + 1; pass min_experts to widen it (for
// comparing two placements).
Result<Placement> ParsePlacementJson(std::string_view text, std::string_view origin,
                                     int min_experts = 0);
Result<Placement> ReadPlacementFile(const std::string& path, int min_experts = 0);

}  // namespace eplbx::io

#endif  // EPLBX_SRC_IO_LOAD_FILE_H_
