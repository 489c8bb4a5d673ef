// Internal: the rearrangement protocol's wire records (docs/protocol.md). Every record is
// magic "EPXR", version, kind, generation, epoch, layer, expert, source rank, reader rank and a
// variable part (ABORT: the reason; MAPS: the layer's slot count and a chunk of its maps),
// with an exact length; decoding rejects anything else.
#ifndef EPLBX_SRC_PROTOCOL_RECORDS_H_
#define EPLBX_SRC_PROTOCOL_RECORDS_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "eplbx/status.h"

namespace eplbx::protocol {

enum class RecordKind : uint8_t {
  kReady = 1,  // source -> reader: the expert's rows are stable, READ them
  // 2 was READ_DONE (reader -> source, once a READ completed), retired in version 6: DONE
  // from every rank already says every READ completed.
  kDone = 3,   // rank -> every rank: my READs are complete
  kAbort = 4,  // rank -> every rank: the generation failed; reason attached
  kMaps = 5,   // rank -> every rank: a chunk of the layer's old (and new) map, first
  // rank -> every rank, once per step of an asynchronous rearrangement: `generation` is the
  // rearrangement, `layer` the step, `expert` how many leading layers are ready here,
  // `reader` 1 when this rank failed (then `reason` says why).
  kVote = 6,
};
std::string_view KindName(RecordKind kind);

inline constexpr size_t kRecordFixedBytes = 42;
inline constexpr size_t kMaxReasonBytes = 1024;
// Map entries one MAPS record carries (old and new entries together): 16 KiB.
inline constexpr size_t kMaxMapEntries = 4096;
// (A MAPS record's entries and slot count go in one 16-bit length.)
static_assert(4 + 4 * kMaxMapEntries <= 0xffff);

struct Record {
  RecordKind kind = RecordKind::kReady;
  uint64_t generation = 0;
  uint32_t layer = 0;
  uint32_t expert = 0;
  uint32_t source = 0;  // the serving rank (READY) or the sender (DONE, ABORT, MAPS, VOTE)
  uint32_t reader = 0;
  std::string reason;  // ABORT, VOTE
  // MAPS only: `expert` is the chunk's first slot, `reader` the number of maps (1: old
  // only, 2: old and new); `map_slots` the layer's slots; `maps` the chunk's old entries
  // followed by the same slots' new entries.
  uint32_t map_slots = 0;
  std::vector<int32_t> maps;
  // The membership epoch the sender acts in (the store's, docs/deploy.md "Membership and
  // epochs"; 0 without membership). A record of another epoch is refused by name.
  uint64_t epoch = 0;
};

std::string EncodeRecord(const Record& r);
Result<Record> DecodeRecord(std::string_view bytes);

}  // namespace eplbx::protocol

#endif  // EPLBX_SRC_PROTOCOL_RECORDS_H_
