#include "io/json_output.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "common/strings.h"

namespace eplbx::io {

using internal::StrCat;
using nlohmann::json;

json PlanToJson(std::string_view policy, const Placement& placement, const Balance& balance,
                double plan_ms) {
  json phy2log = json::array(), log2phy = json::array(), logcnt = json::array();
  for (int l = 0; l < placement.layers(); ++l) {
    json row = json::array();
    for (int s = 0; s < placement.slots(); ++s) row.push_back(placement.phy2log(l, s));
    phy2log.push_back(std::move(row));
    json experts = json::array(), counts = json::array();
    for (int e = 0; e < placement.experts(); ++e) {
      json replicas = json::array();
      for (int k = 0; k < placement.max_replicas(); ++k) {
        replicas.push_back(placement.log2phy(l, e, k));
      }
      experts.push_back(std::move(replicas));
      counts.push_back(placement.logcnt(l, e));
    }
    log2phy.push_back(std::move(experts));
    logcnt.push_back(std::move(counts));
  }
  return json{{"policy", policy},
              {"phy2log", std::move(phy2log)},
              {"log2phy", std::move(log2phy)},
              {"logcnt", std::move(logcnt)},
              {"balancedness", balance.per_layer},
              {"balancedness_total", balance.total},
              {"plan_ms", plan_ms}};
}

Status WriteOutput(const std::string& path, std::string_view text) {
  if (path.empty() || path == "-") {
    std::cout << text;
    std::cout.flush();
    if (!std::cout) return Status::IoError("cannot write to stdout");
    return Status::OK();
  }
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return Status::IoError(StrCat(path, ": cannot open for writing"));
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    out.flush();
    if (!out) {
      std::remove(tmp.c_str());
      return Status::IoError(StrCat(path, ": write failed (disk full?)"));
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::remove(tmp.c_str());
    return Status::IoError(StrCat(path, ": cannot replace the file (", ec.message(), ")"));
  }
  return Status::OK();
}

}  // namespace eplbx::io
