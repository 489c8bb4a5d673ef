#include "io/json_output.h"

#include <fcntl.h>
#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
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

json MovesToJson(const Moves& moves) {
  auto one = [](const LayerMoves& m) {
    return json{{"remote_copies", m.remote_copies},
                {"local_copies", m.local_copies},
                {"unchanged_slots", m.unchanged_slots}};
  };
  json out = one(moves.total);
  json per_layer = json::array();
  for (const LayerMoves& m : moves.per_layer) per_layer.push_back(one(m));
  out["per_layer"] = std::move(per_layer);
  return out;
}

json MigrationToJson(const MigrationPlan& plan, const MigrationOptions& options) {
  json layers = json::array();
  for (const LayerMigration& m : plan.layers) {
    json transfers = json::array(), copies = json::array();
    for (const RemoteRead& t : m.transfers) {
      transfers.push_back({{"src", t.src},
                           {"src_row", t.src_row},
                           {"dst", t.dst},
                           {"dst_row", t.dst_row},
                           {"expert", t.expert},
                           {"round", t.round}});
    }
    for (const LocalCopy& c : m.local_copies) {
      copies.push_back({{"rank", c.rank},
                        {"src_row", c.src_row},
                        {"dst_row", c.dst_row},
                        {"expert", c.expert},
                        {"source", c.source == CopySource::kOld ? "old" : "new"}});
    }
    layers.push_back({{"layer", m.layer},
                      {"transfers", std::move(transfers)},
                      {"local_copies", std::move(copies)},
                      {"rounds", m.rounds},
                      {"rounds_lower_bound", m.rounds_lower_bound},
                      {"bytes_moved", m.bytes_remote},
                      {"cross_node_bytes", m.bytes_cross_node},
                      {"max_bytes_in", m.max_bytes_in},
                      {"max_bytes_out", m.max_bytes_out}});
  }
  const MigrationSummary& s = plan.summary;
  json summary = {{"layers", plan.layers.size()},
                  {"remote_transfers", s.remote_transfers},
                  {"local_copies", s.local_copies},
                  {"bytes_per_expert", options.bytes_per_expert},
                  {"bytes_moved", s.bytes_moved},
                  {"local_copy_bytes", s.local_copy_bytes},
                  {"cross_node_bytes", s.cross_node_bytes},
                  {"rounds", s.rounds},
                  {"rounds_lower_bound", s.rounds_lower_bound},
                  {"max_rounds_per_layer", s.max_rounds_per_layer},
                  {"max_bytes_in", s.max_bytes_in},
                  {"max_bytes_out", s.max_bytes_out},
                  {"link_gbps", options.link_gbps},
                  {"time_lower_bound_s", s.time_lower_bound_s}};
  return json{{"layers", std::move(layers)}, {"summary", std::move(summary)}};
}

namespace {

// Writes all of `text` to `fd`; false (errno set) on failure.
bool WriteAll(int fd, std::string_view text) {
  while (!text.empty()) {
    const ssize_t n = ::write(fd, text.data(), text.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    text.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

std::string Errno() { return std::strerror(errno); }

// A FIFO, a device (/dev/null, /dev/stdout) or a socket: written in place, never replaced.
Status WriteInPlace(const std::string& path, std::string_view text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_NOCTTY | O_CLOEXEC);
  if (fd < 0) return Status::IoError(StrCat(path, ": cannot open for writing (", Errno(), ")"));
  const bool ok = WriteAll(fd, text);
  const std::string why = ok ? std::string() : Errno();
  ::close(fd);
  if (!ok) return Status::IoError(StrCat(path, ": write failed (", why, ")"));
  return Status::OK();
}

// A regular file (or none yet): a fresh temporary beside it, created exclusively and
// without following links, renamed over it once complete.
Status ReplaceRegular(const std::string& path, std::string_view text, const struct stat* old) {
  const std::filesystem::path target(path);
  const std::filesystem::path dir =
      target.has_parent_path() ? target.parent_path() : std::filesystem::path(".");
  std::string name = ".";  // built by appends: GCC 12 warns (-Wrestrict) on "." + string
  name += target.filename().string();
  name += ".XXXXXX";
  std::string tmpl = (dir / name).string();
  const int fd = ::mkostemp(tmpl.data(), O_CLOEXEC);  // O_CREAT | O_EXCL: never follows a link
  if (fd < 0)
    return Status::IoError(
        StrCat(path, ": cannot open for writing (", Errno(), ", creating a file beside it)"));
  // mkostemp creates 0600; keep the old file's mode, else what a new file would get.
  mode_t mode = 0;
  if (old != nullptr) {
    mode = old->st_mode & 07777;
  } else {
    const mode_t mask = ::umask(0);
    ::umask(mask);
    mode = 0666 & ~mask;
  }
  bool ok = ::fchmod(fd, mode) == 0 && WriteAll(fd, text);
  std::string why = ok ? std::string() : Errno();
  if (::close(fd) != 0 && ok) {
    ok = false;
    why = Errno();
  }
  if (!ok) {
    ::unlink(tmpl.c_str());
    return Status::IoError(StrCat(path, ": write failed (", why, "; disk full?)"));
  }
  if (::rename(tmpl.c_str(), path.c_str()) != 0) {
    why = Errno();
    ::unlink(tmpl.c_str());
    return Status::IoError(StrCat(path, ": cannot replace the file (", why, ")"));
  }
  return Status::OK();
}

}  // namespace

Status WriteOutput(const std::string& path, std::string_view text) {
  if (path.empty() || path == "-") {
    std::cout << text;
    std::cout.flush();
    if (!std::cout) return Status::IoError("cannot write to stdout");
    return Status::OK();
  }
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno != ENOENT) return Status::IoError(StrCat(path, ": ", Errno()));
    return ReplaceRegular(path, text, nullptr);
  }
  if (S_ISDIR(st.st_mode)) return Status::IoError(StrCat(path, ": is a directory"));
  if (S_ISLNK(st.st_mode)) {
    // A link stays a link: what it points to gets the output.
    char resolved[PATH_MAX];
    if (::realpath(path.c_str(), resolved) == nullptr) {
      return Status::IoError(
          StrCat(path, ": is a symbolic link that cannot be followed (", Errno(), ")"));
    }
    return WriteOutput(resolved, text);
  }
  if (!S_ISREG(st.st_mode)) return WriteInPlace(path, text);
  return ReplaceRegular(path, text, &st);
}

}  // namespace eplbx::io
