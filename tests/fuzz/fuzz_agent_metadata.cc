// libFuzzer: the agent metadata blob decoder, the message header and the notification
// batch decoders (bytes from peers).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "transfer/cma/cma_path.h"
#ifdef EPLBX_WITH_CUDA
#include "transfer/cuda/cuda_section.h"
#endif
#include "transfer/metadata.h"
#include "transfer/shm/shm_path.h"
#include "transfer/ucx/ucx_path.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view in(reinterpret_cast<const char*>(data), size);
  auto m = eplbx::internal::DecodeAgentMetadata(in);
  if (m.ok()) {
    // What decodes must encode back to the same bytes.
    if (eplbx::internal::EncodeAgentMetadata(*m) != in) __builtin_trap();
    // The UCX control channel's connection info (address, inbox), at connect.
    auto info = eplbx::internal::DecodeUcxConnInfo(m->conn_info, "fuzz", m->name);
    if (info.ok() && eplbx::internal::EncodeUcxConnInfo(info->address, info->inbox) != m->conn_info)
      __builtin_trap();
    // Each path's section goes to that path's decoder at connect.
    const size_t regions = m->regions.size();
    if (const auto* s = m->Section("shm"))
      (void)eplbx::internal::DecodeShmSection(s->body, regions, m->name);
    if (const auto* s = m->Section("ucx"))
      (void)eplbx::internal::DecodeUcxSection(s->body, regions, m->name);
    if (const auto* s = m->Section("cma"))
      (void)eplbx::internal::DecodeCmaSection(s->body, m->name);
#ifdef EPLBX_WITH_CUDA
    if (const auto* s = m->Section("cuda_ipc")) {
      auto h = eplbx::internal::cuda::DecodeCudaSection(s->body, m->regions, m->name);
      // What decodes must encode back to the same bytes.
      if (h.ok() && eplbx::internal::cuda::EncodeCudaSection(*h) != s->body) __builtin_trap();
    }
#endif
  }
  size_t used = 0;
  (void)eplbx::internal::DecodeMessageHeader(in, &used);
  // A notification batch (the body of a kNotifyBatch message from a peer).
  auto batch = eplbx::internal::DecodeNotifyBatch(in);
  if (batch.ok() && eplbx::internal::EncodeNotifyBatch(*batch) != in) __builtin_trap();
  return 0;
}
