// libFuzzer: what etcd (or anything answering on its port) sends back, as eplbx parses it
// (src/coord): the JSON gateway's range and transaction answers, a watch stream's message,
// the group's view key, and base64. The first byte picks the parser; the rest is the input.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "coord/etcd_client.h"
#include "coord/membership.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const std::string_view in(reinterpret_cast<const char*>(data) + 2, size - 2);
  switch (data[0] % 5) {
    case 0:
      (void)eplbx::coord::ParseRangeResponse(in, "fuzz");
      break;
    case 1:
      (void)eplbx::coord::ParseTxnResponse(in, "fuzz");
      break;
    case 2:
      (void)eplbx::coord::DecodeView(std::string(in), data[1] % 9 + 1, 7);
      break;
    case 4:
      (void)eplbx::coord::ParseWatchMessage(in, "fuzz");
      break;
    default:
      (void)eplbx::coord::Base64Decode(in);
      break;
  }
  return 0;
}
