// libFuzzer: the host backup's fixed part and header (a file another process of the node
// wrote), checked as HostBackup::Open checks them, for the file's own size and a larger one.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "eplbx/backup.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view head(reinterpret_cast<const char*>(data), size);
  (void)eplbx::HostBackup::CheckHead(head, size);
  (void)eplbx::HostBackup::CheckHead(head, uint64_t{size} + (1u << 16));
  return 0;
}
