// libFuzzer: the safetensors header reader (the checkpoint as a backup source): the JSON text
// after the length, for a file with room for every tensor and one without.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  (void)eplbx::io::SafetensorsFile::ParseHeader("fuzz", text, 8 + size + (1u << 20));
  (void)eplbx::io::SafetensorsFile::ParseHeader("fuzz", text, 8 + size);
  return 0;
}
