// Internal: the rearrangement protocol's wire records (docs/protocol.md). Every record is
// magic "EPXR", version, kind, generation, layer, expert, source rank, reader rank and a
// reason (ABORT only), with an exact length; decoding rejects anything else.
#ifndef EPLBX_SRC_PROTOCOL_RECORDS_H_
#define EPLBX_SRC_PROTOCOL_RECORDS_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "eplbx/status.h"

namespace eplbx::protocol {

enum class RecordKind : uint8_t {
  kReady = 1,     // source -> reader: the expert's rows are stable, READ them
  kReadDone = 2,  // reader -> source (attached to the READ): the data landed
  kDone = 3,      // rank -> every rank: my reads and my readers' reads are complete
  kAbort = 4,     // rank -> every rank: the generation failed; reason attached
};
std::string_view KindName(RecordKind kind);

inline constexpr size_t kRecordFixedBytes = 34;
inline constexpr size_t kMaxReasonBytes = 1024;

struct Record {
  RecordKind kind = RecordKind::kReady;
  uint64_t generation = 0;
  uint32_t layer = 0;
  uint32_t expert = 0;
  uint32_t source = 0;  // the serving rank (READY, READ_DONE) or the sender (DONE, ABORT)
  uint32_t reader = 0;
  std::string reason;  // ABORT only
};

std::string EncodeRecord(const Record& r);
Result<Record> DecodeRecord(std::string_view bytes);

}  // namespace eplbx::protocol

#endif  // EPLBX_SRC_PROTOCOL_RECORDS_H_
