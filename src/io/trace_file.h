// Internal: load traces as JSON lines, one step per line:
//   {"step": 0, "load": [[tokens per logical expert] per layer]}
// Steps are numbered 0, 1, 2, ... in order; every line has the same layers x experts;
// blank lines are skipped. Errors name the file, the line, the field and what was expected.
#ifndef EPLBX_SRC_IO_TRACE_FILE_H_
#define EPLBX_SRC_IO_TRACE_FILE_H_

#include <ostream>
#include <string>
#include <string_view>

#include "eplbx/simulate.h"
#include "eplbx/status.h"

namespace eplbx::io {

Result<LoadTrace> ParseTrace(std::string_view text, std::string_view origin);
Result<LoadTrace> ReadTraceFile(const std::string& path);
void WriteTrace(const LoadTrace& trace, std::ostream& out);

}  // namespace eplbx::io

#endif  // EPLBX_SRC_IO_TRACE_FILE_H_
