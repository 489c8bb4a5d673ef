#include "io/load_file.h"

#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/strings.h"
#include "io/npy.h"

namespace eplbx::io {

using internal::StrCat;
using nlohmann::json;

Status CheckJsonText(std::string_view text, std::string_view origin, int max_depth,
                     std::string_view limit_reason) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '\0') {
      return Status::InvalidArgument(
          StrCat(origin, ": not valid JSON (a NUL byte at byte ", i, ")"));
    }
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) {
        return Status::InvalidArgument(StrCat(origin, ": JSON nested more than ", max_depth,
                                              " deep at byte ", i, " (the limit; ", limit_reason,
                                              ")"));
      }
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return Status::OK();
}

namespace {

std::string TypeName(const json& v) { return v.type_name(); }

// Parses text as JSON; the error names the origin and the byte offset.
Result<json> ParseJson(std::string_view text, std::string_view origin) {
  EPLBX_RETURN_IF_ERROR(CheckJsonText(text, origin));
  json doc = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) {
    // Re-parse with a SAX handler that records where the error is.
    struct Locator : nlohmann::json_sax<json> {
      std::string error;
      bool null() override { return true; }
      bool boolean(bool) override { return true; }
      bool number_integer(number_integer_t) override { return true; }
      bool number_unsigned(number_unsigned_t) override { return true; }
      bool number_float(number_float_t, const string_t&) override { return true; }
      bool string(string_t&) override { return true; }
      bool binary(binary_t&) override { return true; }
      bool start_object(std::size_t) override { return true; }
      bool key(string_t&) override { return true; }
      bool end_object() override { return true; }
      bool start_array(std::size_t) override { return true; }
      bool end_array() override { return true; }
      bool parse_error(std::size_t position, const std::string&,
                       const nlohmann::detail::exception& ex) override {
        error = StrCat("byte ", position, ": ", ex.what());
        return false;
      }
    } locator;
    json::sax_parse(text, &locator, json::input_format_t::json, /*strict=*/true);
    return Status::InvalidArgument(StrCat(origin, ": not valid JSON (", locator.error, ")"));
  }
  return doc;
}

// The value under `key` of a JSON object, or the document itself when it is an array.
Result<const json*> ArrayField(const json& doc, std::string_view key, std::string_view origin) {
  if (doc.is_array()) return &doc;
  if (doc.is_object()) {
    auto it = doc.find(key);
    if (it == doc.end()) {
      return Status::InvalidArgument(StrCat(origin, ": JSON object has no key \"", key,
                                            "\" (expected a 2-D array or {\"", key,
                                            "\": [[...], ...]})"));
    }
    if (!it->is_array()) {
      return Status::InvalidArgument(
          StrCat(origin, ": \"", key, "\" is a ", TypeName(*it), " (expected a 2-D array)"));
    }
    return &*it;
  }
  return Status::InvalidArgument(StrCat(origin, ": top level is a ", TypeName(doc),
                                        " (expected a 2-D array or an object with key \"", key,
                                        "\")"));
}

std::string_view Extension(const std::string& path) {
  const size_t dot = path.find_last_of('.');
  const size_t slash = path.find_last_of('/');
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) return {};
  return std::string_view(path).substr(dot);
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r')) {
    s.remove_prefix(1);
  }
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) {
    s.remove_suffix(1);
  }
  return s;
}

}  // namespace

Result<std::string> ReadFile(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    return Status::NotFound(StrCat(path, ": no such file"));
  }
  if (std::filesystem::is_directory(path, ec)) {
    return Status::InvalidArgument(StrCat(path, ": is a directory (expected a file)"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::IoError(StrCat(path, ": cannot open for reading"));
  std::string data;
  char buf[1 << 16];
  while (in.read(buf, sizeof(buf)) || in.gcount() > 0) {
    data.append(buf, static_cast<size_t>(in.gcount()));
    if (data.size() > kMaxFileBytes) {
      return Status::InvalidArgument(StrCat(path, ": larger than ", kMaxFileBytes, " bytes"));
    }
  }
  if (in.bad()) return Status::IoError(StrCat(path, ": read failed"));
  return data;
}

Result<LoadMatrix> ParseLoadJson(std::string_view text, std::string_view origin) {
  Result<json> doc = ParseJson(text, origin);
  if (!doc.ok()) return doc.status();
  Result<const json*> arr = ArrayField(*doc, "load", origin);
  if (!arr.ok()) return arr.status();
  const json& rows = **arr;
  std::vector<std::vector<double>> values;
  values.reserve(rows.size());
  for (size_t l = 0; l < rows.size(); ++l) {
    const json& row = rows[l];
    if (!row.is_array()) {
      return Status::InvalidArgument(StrCat(origin, ": layer ", l, " is a ", TypeName(row),
                                            " (expected an array of numbers, one per expert)"));
    }
    std::vector<double>& out = values.emplace_back();
    out.reserve(row.size());
    for (size_t e = 0; e < row.size(); ++e) {
      if (!row[e].is_number()) {
        return Status::InvalidArgument(StrCat(origin, ": layer ", l, ", expert ", e, ": ",
                                              TypeName(row[e]), " ", row[e].dump(),
                                              " is not a number"));
      }
      out.push_back(row[e].get<double>());
    }
  }
  Result<LoadMatrix> m = LoadMatrix::FromRows(values);
  if (!m.ok()) return m.status().WithPrefix(origin);
  return m;
}

Result<LoadMatrix> ParseLoadCsv(std::string_view text, std::string_view origin) {
  std::vector<std::vector<double>> rows;
  size_t line_no = 0;
  while (!text.empty()) {
    const size_t nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view() : text.substr(nl + 1);
    ++line_no;
    line = Trim(line);
    if (line.empty() || line.front() == '#') continue;
    std::vector<double>& row = rows.emplace_back();
    size_t column = 0;
    while (true) {
      const size_t comma = line.find(',');
      const std::string_view cell = Trim(line.substr(0, comma));
      ++column;
      double v = 0;
      const char* end = cell.data() + cell.size();
      auto [ptr, ec] = std::from_chars(cell.data(), end, v);
      if (ec == std::errc::result_out_of_range && ptr == end) {
        // from_chars leaves v unset: tell overflow (1e999) from underflow (1e-400, read as 0).
        const std::string text(cell);
        const double d = std::strtod(text.c_str(), nullptr);
        if (std::isinf(d)) {
          return Status::InvalidArgument(StrCat(origin, ": line ", line_no, ", column ", column,
                                                ": ", internal::Printable(cell),
                                                " is beyond a double's range"));
        }
        v = 0;
        ec = std::errc();
      }
      if (cell.empty() || ec != std::errc() || ptr != end) {
        return Status::InvalidArgument(
            StrCat(origin, ": line ", line_no, ", column ", column, ": ", internal::Printable(cell),
                   " is not a number (expected one layer per line, loads separated by commas)"));
      }
      row.push_back(v);
      if (comma == std::string_view::npos) break;
      line = line.substr(comma + 1);
    }
  }
  if (rows.empty()) {
    return Status::InvalidArgument(StrCat(origin, ": no data (expected one layer per line)"));
  }
  Result<LoadMatrix> m = LoadMatrix::FromRows(rows);
  if (!m.ok()) return m.status().WithPrefix(origin);
  return m;
}

Result<LoadMatrix> ParseLoadNpy(std::string_view bytes, std::string_view origin) {
  Result<NpyArray> arr = ParseNpy(bytes);
  if (!arr.ok()) return arr.status().WithPrefix(origin);
  if (arr->shape.size() != 2) {
    std::string shape = "(";
    for (int64_t d : arr->shape) shape += StrCat(d, ",");
    shape += ")";
    return Status::InvalidArgument(
        StrCat(origin, ": array has shape ", shape, " (expected 2-D: layers x experts)"));
  }
  if (arr->shape[0] > (1 << 20) || arr->shape[1] > (1 << 20)) {
    return Status::InvalidArgument(
        StrCat(origin, ": array shape (", arr->shape[0], ", ", arr->shape[1], ") is too large"));
  }
  Result<LoadMatrix> m = LoadMatrix::Create(
      static_cast<int>(arr->shape[0]), static_cast<int>(arr->shape[1]), std::move(arr->values));
  if (!m.ok()) return m.status().WithPrefix(origin);
  return m;
}

Result<LoadMatrix> ReadLoadFile(const std::string& path) {
  const std::string_view ext = Extension(path);
  if (ext != ".json" && ext != ".csv" && ext != ".npy") {
    return Status::InvalidArgument(
        StrCat(path, ": unknown extension '", ext, "' (expected .json, .csv or .npy)"));
  }
  Result<std::string> data = ReadFile(path);
  if (!data.ok()) return data.status();
  if (ext == ".json") return ParseLoadJson(*data, path);
  if (ext == ".csv") return ParseLoadCsv(*data, path);
  return ParseLoadNpy(*data, path);
}

Result<Placement> ParsePlacementJson(std::string_view text, std::string_view origin,
                                     int min_experts) {
  Result<json> doc = ParseJson(text, origin);
  if (!doc.ok()) return doc.status();
  if (!doc->is_object()) {
    return Status::InvalidArgument(StrCat(origin, ": top level is a ", TypeName(*doc),
                                          " (expected an object with key \"phy2log\")"));
  }
  Result<const json*> arr = ArrayField(*doc, "phy2log", origin);
  if (!arr.ok()) return arr.status();
  const json& rows = **arr;
  if (rows.empty() || !rows[0].is_array() || rows[0].empty()) {
    return Status::InvalidArgument(
        StrCat(origin, ": \"phy2log\" is empty (expected layers x slots expert ids)"));
  }
  const size_t slots = rows[0].size();
  std::vector<int32_t> flat;
  int experts = min_experts;
  for (size_t l = 0; l < rows.size(); ++l) {
    if (!rows[l].is_array() || rows[l].size() != slots) {
      return Status::InvalidArgument(StrCat(origin, ": phy2log layer ", l, " has ",
                                            rows[l].is_array() ? rows[l].size() : 0,
                                            " slots but layer 0 has ", slots));
    }
    for (size_t s = 0; s < slots; ++s) {
      const json& v = rows[l][s];
      // Unsigned first: 18446744073709551615 read as int64 is -1, an empty slot.
      const bool id = v.is_number_unsigned() ? v.get<uint64_t>() < uint64_t{Topology::kMaxSlots}
                                             : v.is_number_integer() && v.get<int64_t>() >= -1 &&
                                                   v.get<int64_t>() < Topology::kMaxSlots;
      if (!id) {
        return Status::InvalidArgument(
            StrCat(origin, ": phy2log layer ", l, ", slot ", s, ": ", v.dump(),
                   " is not an expert id (expected an integer in [0, ", Topology::kMaxSlots - 1,
                   "], or -1 for an empty slot)"));
      }
      flat.push_back(static_cast<int32_t>(v.get<int64_t>()));
      experts = std::max(experts, flat.back() + 1);
    }
  }
  // The width of "logcnt" (as `eplbx plan` writes it) counts experts that have no replica.
  if (auto it = doc->find("logcnt");
      it != doc->end() && it->is_array() && !it->empty() && (*it)[0].is_array()) {
    experts = std::max(experts, static_cast<int>(std::min<size_t>((*it)[0].size(), 1 << 20)));
  }
  if (auto it = doc->find("experts"); it != doc->end()) {
    if (!it->is_number_integer() || it->get<int64_t>() < experts ||
        it->get<int64_t>() > (1 << 20)) {
      return Status::InvalidArgument(StrCat(origin, ": \"experts\" is ", it->dump(),
                                            " (expected an integer >= ", experts, ")"));
    }
    experts = static_cast<int>(it->get<int64_t>());
  }
  if (experts < 1) {
    return Status::InvalidArgument(StrCat(origin, ": phy2log has only empty slots"));
  }
  Result<Placement> p = Placement::FromPhy2Log(static_cast<int>(rows.size()),
                                               static_cast<int>(slots), experts, std::move(flat));
  if (!p.ok()) return p.status().WithPrefix(origin);
  return p;
}

Result<Placement> ReadPlacementFile(const std::string& path, int min_experts) {
  Result<std::string> data = ReadFile(path);
  if (!data.ok()) return data.status();
  return ParsePlacementJson(*data, path, min_experts);
}

}  // namespace eplbx::io
