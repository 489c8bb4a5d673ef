// libFuzzer: the load-trace parser (JSON lines). Whatever parses must survive a round trip
// through the writer unchanged.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string_view>

#include "io/trace_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view in(reinterpret_cast<const char*>(data), size);
  eplbx::Result<eplbx::LoadTrace> trace = eplbx::io::ParseTrace(in, "fuzz.jsonl");
  if (!trace.ok()) return 0;
  std::ostringstream out;
  eplbx::io::WriteTrace(*trace, out);
  eplbx::Result<eplbx::LoadTrace> again = eplbx::io::ParseTrace(out.str(), "again.jsonl");
  if (!again.ok() || again->values != trace->values || again->layers != trace->layers ||
      again->experts != trace->experts) {
    std::abort();  // the writer's output must parse back to the same trace
  }
  return 0;
}
