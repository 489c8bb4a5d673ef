// Internal: the "cuda_staged" data path (docs/transfer.md, "Device memory across hosts"):
// a peer's CUDA device rows over the UCX worker's endpoints when UCX itself cannot reach
// device memory (Debian's UCX has no CUDA). Both sides stage through pinned host bounce
// buffers: the side holding the rows copies a piece device -> host, sends it as an active
// message (rendezvous for large pieces, so UCX reads it where it lies), the other side
// receives it into a bounce buffer and copies it host -> device (or straight into host
// memory). Pieces of kStageChunk bytes, several in flight per transfer, so the copies and
// the network overlap. The side that receives always asks for the next piece (a pull), so
// a piece never arrives without memory waiting for it. Built with EPLBX_WITH_CUDA only.
#ifndef EPLBX_SRC_TRANSFER_CUDA_CUDA_STAGED_PATH_H_
#define EPLBX_SRC_TRANSFER_CUDA_CUDA_STAGED_PATH_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "transfer/backend.h"

namespace eplbx::internal {
namespace ucx {
class UcxWorker;
}  // namespace ucx

// Bytes per staged piece, and bounce buffers per direction (pinned host memory allocated at
// the first staged transfer that needs them: 2 x kStageSlots x kStageChunk per agent).
inline constexpr uint64_t kStageChunk = 4ull << 20;
inline constexpr int kStageSlots = 4;

// REQUIRES: `worker` outlives the path.
// A cuda_staged message head as a peer sends it (PULL, DATA, REFUSE, WRITE, WRITE_DONE):
// true when `bytes` decode (then *reencoded holds the head encoded again, which must equal
// `bytes`). The fuzz target's entry (fuzz_staged_head).
bool DecodeStagedHeadForTest(std::string_view bytes, std::string* reencoded);

std::unique_ptr<DataPath> CreateCudaStagedPath(ucx::UcxWorker* worker, std::string agent,
                                               CoreListener* listener);

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_TRANSFER_CUDA_CUDA_STAGED_PATH_H_
