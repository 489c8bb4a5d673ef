// libFuzzer: the head of a cuda_staged message (PULL, DATA, REFUSE, WRITE, WRITE_DONE), what
// a peer sends over UCX's active messages; what decodes must re-encode to the same bytes.
// Built where the CUDA data path is (EPLBX_WITH_CUDA).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "transfer/cuda/cuda_staged_path.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  std::string again;
  if (eplbx::internal::DecodeStagedHeadForTest(in, &again) && again != in) std::abort();
  return 0;
}
