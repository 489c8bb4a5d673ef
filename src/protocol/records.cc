#include "protocol/records.h"

#include <algorithm>
#include <cstring>

#include "common/bytes.h"
#include "common/strings.h"

namespace eplbx::protocol {

using internal::StrCat;

namespace {
constexpr char kMagic[4] = {'E', 'P', 'X', 'R'};
// 2: MAPS records (map agreement before any READ). 3: VOTE records (asynchronous commits).
// 4: MAPS may carry the row tables (swap commit mode) as a third map. 5: the membership
// epoch after the generation. 6: no READ_DONE (kind 2); DONE says this rank's READs completed.
constexpr uint16_t kVersion = 6;
}  // namespace

std::string_view KindName(RecordKind kind) {
  switch (kind) {
    case RecordKind::kReady:
      return "READY";
    case RecordKind::kDone:
      return "DONE";
    case RecordKind::kAbort:
      return "ABORT";
    case RecordKind::kMaps:
      return "MAPS";
    case RecordKind::kVote:
      return "VOTE";
  }
  return "?";
}

std::string EncodeRecord(const Record& r) {
  internal::ByteWriter w;
  w.Raw(std::string_view(kMagic, 4));
  w.U16(kVersion);
  w.U8(static_cast<uint8_t>(r.kind));
  w.U8(0);
  w.U64(r.generation);
  w.U64(r.epoch);
  w.U32(r.layer);
  w.U32(r.expert);
  w.U32(r.source);
  w.U32(r.reader);
  if (r.kind == RecordKind::kMaps) {
    const size_t n = std::min(r.maps.size(), kMaxMapEntries);
    w.Reserve(kRecordFixedBytes + 4 + 4 * n);
    w.U16(static_cast<uint16_t>(4 + 4 * n));
    w.U32(r.map_slots);
    w.U32s(std::span<const int32_t>(r.maps.data(), n));
  } else {
    w.Str16(r.reason.substr(0, kMaxReasonBytes));
  }
  return w.Take();
}

Result<Record> DecodeRecord(std::string_view bytes) {
  if (bytes.size() < kRecordFixedBytes) {
    return Status::Corruption(StrCat("protocol record of ", bytes.size(), " bytes; at least ",
                                     kRecordFixedBytes, " expected"));
  }
  internal::ByteReader in(bytes, "protocol record");
  std::string magic;
  uint16_t version = 0;
  uint8_t kind = 0, reserved = 0;
  Record r;
  uint16_t reason_len = 0;
  (void)in.Raw("magic", 4, &magic);
  if (std::memcmp(magic.data(), kMagic, 4) != 0) {
    return Status::Corruption("protocol record: bad magic (expected 'EPXR')");
  }
  (void)(in.U16("version", &version) && in.U8("kind", &kind) && in.U8("reserved", &reserved) &&
         in.U64("generation", &r.generation) && in.U64("epoch", &r.epoch) &&
         in.U32("layer", &r.layer) && in.U32("expert", &r.expert) && in.U32("source", &r.source) &&
         in.U32("reader", &r.reader) && in.U16("reason_length", &reason_len));
  if (version != kVersion) {
    return Status::NotSupported(
        StrCat("protocol record: version ", version, " (this build speaks ", kVersion, ")"));
  }
  if (kind < 1 || kind > 6 || kind == 2)
    return Status::Corruption(StrCat("protocol record: unknown kind ", +kind));
  r.kind = static_cast<RecordKind>(kind);
  if (reserved != 0) return Status::Corruption("protocol record: reserved byte is not 0");
  const size_t limit = kind == 5 ? 4 + 4 * kMaxMapEntries : kMaxReasonBytes;
  if (reason_len > limit) {
    return Status::Corruption(
        StrCat("protocol record: variable part of ", reason_len, " bytes (limit ", limit, ")"));
  }
  if (bytes.size() != kRecordFixedBytes + reason_len) {
    return Status::Corruption(StrCat("protocol record: ", bytes.size(), " bytes, the header says ",
                                     kRecordFixedBytes + reason_len));
  }
  if (r.kind == RecordKind::kMaps) {
    if (reason_len < 4 || reason_len % 4 != 0) {
      return Status::Corruption(StrCat("protocol record: MAPS part of ", reason_len,
                                       " bytes (4 + 4 per entry expected)"));
    }
    if (r.reader < 1 || r.reader > 3) {
      return Status::Corruption(
          StrCat("protocol record: MAPS of ", r.reader, " maps (1 to 3 expected)"));
    }
    (void)in.U32("map_slots", &r.map_slots);
    const size_t n = (reason_len - 4u) / 4u;
    if (n % r.reader != 0) {
      return Status::Corruption(
          StrCat("protocol record: MAPS of ", r.reader, " maps with ", n, " entries"));
    }
    (void)in.U32s("map entries", n, &r.maps);
    return r;
  }
  if (r.kind != RecordKind::kAbort && r.kind != RecordKind::kVote && reason_len != 0) {
    return Status::Corruption(StrCat("protocol record: ", KindName(r.kind), " carries a reason"));
  }
  (void)in.Raw("reason", reason_len, &r.reason);
  return r;
}

}  // namespace eplbx::protocol
