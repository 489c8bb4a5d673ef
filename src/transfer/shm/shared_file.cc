#include "transfer/shm/shared_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "common/strings.h"

namespace eplbx::internal {
namespace {

struct MapsLine {
  uint64_t start = 0, end = 0, offset = 0, inode = 0;
  uint32_t major = 0, minor = 0;
  bool shared = false;    // MAP_SHARED
  bool writable = false;  // PROT_WRITE
};

bool ParseMapsLine(std::string_view text, MapsLine* out) {
  const std::string line(text);
  char perms[5] = {};
  unsigned major = 0, minor = 0;
  unsigned long long start = 0, end = 0, offset = 0, inode = 0;
  if (std::sscanf(line.c_str(), "%llx-%llx %4s %llx %x:%x %llu", &start, &end, perms, &offset,
                  &major, &minor, &inode) != 7) {
    return false;
  }
  *out = MapsLine{start, end, offset, inode, major, minor, perms[3] == 's', perms[1] == 'w'};
  return true;
}

// An fd this process holds for the file (dev, inode), duplicated; -1 if none.
int DupHeldFd(uint32_t major, uint32_t minor, uint64_t inode) {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int found = -1;
  const int skip = dirfd(dir);
  while (dirent* e = readdir(dir)) {
    char* rest = nullptr;
    const long fd = std::strtol(e->d_name, &rest, 10);
    if (rest == e->d_name || *rest != '\0' || fd == skip) continue;
    struct stat st;
    if (fstat(static_cast<int>(fd), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    if (st.st_ino == inode && ::major(st.st_dev) == major && ::minor(st.st_dev) == minor) {
      found = fcntl(static_cast<int>(fd), F_DUPFD_CLOEXEC, 0);
      break;
    }
  }
  closedir(dir);
  return found;
}

}  // namespace

std::optional<MappedFileRange> FindInMaps(std::string_view maps, uint64_t p, uint64_t n) {
  std::optional<MappedFileRange> found;
  uint64_t covered_to = 0, next_offset = 0;  // while extending over consecutive lines
  while (!maps.empty()) {
    const size_t eol = maps.find('\n');
    const std::string_view text = maps.substr(0, eol);
    maps = eol == std::string_view::npos ? std::string_view() : maps.substr(eol + 1);
    MapsLine l;
    if (!ParseMapsLine(text, &l)) continue;
    if (!found) {
      if (p < l.start || p >= l.end) continue;
      // Read-only shared mappings (a model file mapped for reading, say) stay private to
      // CMA: a peer's WRITE through a mapping of its own would reach the file.
      if (!l.shared || !l.writable || l.inode == 0) return std::nullopt;
      found = MappedFileRange{l.start, l.end, l.major, l.minor, l.inode, l.offset + (p - l.start)};
      covered_to = l.end;
      next_offset = l.offset + (l.end - l.start);
    } else {
      // A later line continues the range only if it is the same file, contiguous in both
      // address and offset (one mmap split by mprotect, for example).
      if (l.start != covered_to || !l.shared || !l.writable || l.inode != found->inode ||
          l.major != found->dev_major || l.minor != found->dev_minor || l.offset != next_offset) {
        break;
      }
      covered_to = l.end;
      next_offset = l.offset + (l.end - l.start);
    }
    if (covered_to >= p + n) return found;
  }
  return std::nullopt;
}

std::optional<SharedFile> FindSharedFile(const void* p, size_t n) {
  std::ifstream in("/proc/self/maps");
  if (!in) return std::nullopt;
  std::stringstream text;
  text << in.rdbuf();
  const std::string maps = text.str();
  const uint64_t addr = reinterpret_cast<uintptr_t>(p);
  std::optional<MappedFileRange> m = FindInMaps(maps, addr, n);
  if (!m) return std::nullopt;
  int fd = DupHeldFd(m->dev_major, m->dev_minor, m->inode);
  if (fd < 0) {
    char path[96];
    std::snprintf(path, sizeof(path), "/proc/self/map_files/%" PRIx64 "-%" PRIx64, m->start,
                  m->end);
    fd = open(path, O_RDWR | O_CLOEXEC);
  }
  if (fd < 0) return std::nullopt;
  return SharedFile{fd, m->offset};
}

Result<uint8_t*> MapPeerFile(int fd, uint64_t offset, uint64_t bytes, void** map_base,
                             size_t* map_bytes) {
  struct stat st;
  if (fstat(fd, &st) != 0) return Status::IoError(StrCat("fstat: ", std::strerror(errno)));
  if (static_cast<uint64_t>(st.st_size) < offset || st.st_size - offset < bytes) {
    return Status::OutOfRange(StrCat("shared file has ", st.st_size, " bytes, the region needs [",
                                     offset, ", +", bytes, ")"));
  }
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t lead = offset % page;
  void* m = mmap(nullptr, bytes + lead, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                 static_cast<off_t>(offset - lead));
  if (m == MAP_FAILED) return Status::IoError(StrCat("mmap: ", std::strerror(errno)));
  *map_base = m;
  *map_bytes = bytes + lead;
  return static_cast<uint8_t*>(m) + lead;
}

}  // namespace eplbx::internal
