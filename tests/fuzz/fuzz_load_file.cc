// libFuzzer: the load and placement file parsers (JSON, CSV, .npy).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "io/load_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view in(reinterpret_cast<const char*>(data), size);
  (void)eplbx::io::ParseLoadJson(in, "fuzz.json");
  (void)eplbx::io::ParseLoadCsv(in, "fuzz.csv");
  (void)eplbx::io::ParseLoadNpy(in, "fuzz.npy");
  (void)eplbx::io::ParsePlacementJson(in, "fuzz.json");
  return 0;
}
