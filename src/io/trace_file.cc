#include "io/trace_file.h"

#include <charconv>
#include <cmath>
#include <nlohmann/json.hpp>

#include "common/strings.h"
#include "io/load_file.h"

namespace eplbx::io {

using internal::StrCat;
using nlohmann::json;

Result<LoadTrace> ParseTrace(std::string_view text, std::string_view origin) {
  LoadTrace trace;
  int64_t line_no = 0, step = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t end = std::min(text.find('\n', pos), text.size());
    const std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    const std::string where = StrCat(origin, ":", line_no);
    EPLBX_RETURN_IF_ERROR(CheckJsonText(line, where));
    const json doc = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (doc.is_discarded() || !doc.is_object()) {
      return Status::InvalidArgument(
          StrCat(where, ": not a JSON object (expected {\"step\": N, \"load\": [[...], ...]})"));
    }
    const auto it = doc.find("step");
    if (it == doc.end() || !it->is_number_integer() || it->get<int64_t>() != step) {
      return Status::InvalidArgument(
          StrCat(where, ": \"step\" is ", it == doc.end() ? std::string("missing") : it->dump(),
                 " (expected ", step, ": steps are numbered from 0 without gaps)"));
    }
    Result<LoadMatrix> load = ParseLoadJson(line, where);
    if (!load.ok()) return load.status();
    if (step == 0) {
      trace.layers = load->layers();
      trace.experts = load->experts();
    } else if (load->layers() != trace.layers || load->experts() != trace.experts) {
      return Status::Mismatch(StrCat(where, ": load is ", load->layers(), " layers x ",
                                     load->experts(), " experts; earlier steps are ", trace.layers,
                                     " x ", trace.experts));
    }
    trace.values.insert(trace.values.end(), load->values().begin(), load->values().end());
    ++step;
  }
  if (step == 0) {
    return Status::InvalidArgument(
        StrCat(origin, ": no steps (expected one JSON object per line)"));
  }
  return trace;
}

Result<LoadTrace> ReadTraceFile(const std::string& path) {
  Result<std::string> data = ReadFile(path);
  if (!data.ok()) return data.status();
  return ParseTrace(*data, path);
}

void WriteTrace(const LoadTrace& trace, std::ostream& out) {
  std::string line;
  for (int64_t s = 0; s < trace.steps(); ++s) {
    const auto v = trace.step(s);
    line = StrCat("{\"step\": ", s, ", \"load\": [");
    for (int l = 0; l < trace.layers; ++l) {
      line += l ? ", [" : "[";
      for (int e = 0; e < trace.experts; ++e) {
        if (e) line += ", ";
        const double x = v[static_cast<size_t>(l) * trace.experts + e];
        char buf[32];
        const auto r = x == std::floor(x) && std::fabs(x) < 1e15
                           ? std::to_chars(buf, buf + sizeof buf, static_cast<int64_t>(x))
                           : std::to_chars(buf, buf + sizeof buf, x);  // shortest round trip
        line.append(buf, r.ptr);
      }
      line += "]";
    }
    line += "]}\n";
    out << line;
  }
}

}  // namespace eplbx::io
