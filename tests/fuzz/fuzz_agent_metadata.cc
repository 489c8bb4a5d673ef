// libFuzzer: the agent metadata blob decoder (bytes from peers).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "transfer/metadata.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view in(reinterpret_cast<const char*>(data), size);
  auto m = eplbx::internal::DecodeAgentMetadata(in);
  if (m.ok()) {
    // What decodes must encode back to the same bytes.
    if (eplbx::internal::EncodeAgentMetadata(*m) != in) __builtin_trap();
  }
  size_t used = 0;
  (void)eplbx::internal::DecodeMessageHeader(in, &used);
  return 0;
}
