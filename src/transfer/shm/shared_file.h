// Internal: memory that same-host peers can map. A region is mappable when it lies in a
// writable MAP_SHARED mapping of a file (memfd, /dev/shm, any tmpfs or regular file): a peer opens
// the file through /proc/<owner pid>/fd/<fd> and maps the same pages, so its READs and
// WRITEs are plain memcpy instead of process_vm_readv (docs/transfer.md, "Same host").
#ifndef EPLBX_SRC_TRANSFER_SHM_SHARED_FILE_H_
#define EPLBX_SRC_TRANSFER_SHM_SHARED_FILE_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "eplbx/status.h"

namespace eplbx::internal {

// A file that backs a registered region: `fd` is owned by the region, `offset` is the file
// offset of the region's first byte.
struct SharedFile {
  int fd = -1;
  uint64_t offset = 0;
};

// If [p, p + n) lies in writable MAP_SHARED mappings of one file with contiguous offsets, returns a
// new close-on-exec fd of that file (the caller owns it) and the offset of `p`. The fd comes
// from one this process already holds for the file (torch keeps one for tensors moved by
// share_memory_()), else from /proc/self/map_files. nullopt for private or anonymous
// memory, or when no fd can be had.
std::optional<SharedFile> FindSharedFile(const void* p, size_t n);

// The same search on the text of a /proc/<pid>/maps file, for tests: the mapping's file
// identity and the offset of `p`, without opening anything.
struct MappedFileRange {
  uint64_t start = 0;  // of the first mapping line covering p
  uint64_t end = 0;    // of that line
  uint32_t dev_major = 0, dev_minor = 0;
  uint64_t inode = 0;
  uint64_t offset = 0;  // file offset of p
};
std::optional<MappedFileRange> FindInMaps(std::string_view maps, uint64_t p, uint64_t n);

// Maps `bytes` of the owner's file at `offset` (any alignment) for a peer. Returns the
// address of the first byte; *map_base and *map_bytes are what to munmap. Fails when the
// file is shorter than offset + bytes (mapping past its end would fault on access).
Result<uint8_t*> MapPeerFile(int fd, uint64_t offset, uint64_t bytes, void** map_base,
                             size_t* map_bytes);

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_TRANSFER_SHM_SHARED_FILE_H_
