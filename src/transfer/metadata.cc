#include "transfer/metadata.h"

#include <charconv>
#include <cstring>

#include "common/bytes.h"
#include "common/strings.h"
#include "eplbx/transfer.h"

namespace eplbx::internal {

const PathSection* AgentMetadata::Section(std::string_view path) const {
  for (const PathSection& s : sections) {
    if (s.path == path) return &s;
  }
  return nullptr;
}

std::string EncodeAgentMetadata(const AgentMetadata& m) {
  ByteWriter w;
  w.Raw(std::string_view(kAgentMagic, 4));
  w.U16(kAgentMetadataVersion);
  w.U16(0);  // reserved
  const size_t length_pos = w.size();
  w.U32(0);  // total length, patched below
  w.Str16(m.name);
  w.Str16(m.host_id);
  w.U32(m.pid);
  w.Str16(m.control);
  w.Str32(m.conn_info);
  w.U32(static_cast<uint32_t>(m.regions.size()));
  for (const RegionInfo& r : m.regions) {
    w.U64(r.addr);
    w.U64(r.bytes);
    w.U8(static_cast<uint8_t>(r.kind));
    w.U8(0);
    w.U16(0);
  }
  w.U16(static_cast<uint16_t>(m.sections.size()));
  for (const PathSection& s : m.sections) {
    w.Str16(s.path);
    w.Str32(s.body);
  }
  w.PatchU32(length_pos, static_cast<uint32_t>(w.size()));
  return w.Take();
}

Result<AgentMetadata> DecodeAgentMetadata(std::string_view blob) {
  constexpr std::string_view kWhat = "agent metadata";
  if (blob.size() > kMaxMetadataBytes) {
    return Status::Corruption(
        StrCat(kWhat, " is ", blob.size(), " bytes, the limit is ", kMaxMetadataBytes));
  }
  ByteReader r(blob, kWhat);
  std::string magic;
  if (!r.Raw("magic", 4, &magic)) return r.status();
  if (std::memcmp(magic.data(), kAgentMagic, 4) != 0) {
    return Status::Corruption(StrCat(kWhat,
                                     ": bad magic (not an eplbx agent blob; expected "
                                     "'EPXA')"));
  }
  uint16_t version = 0, reserved = 0;
  uint32_t length = 0;
  if (!r.U16("version", &version) || !r.U16("reserved", &reserved) || !r.U32("length", &length)) {
    return r.status();
  }
  if (version != kAgentMetadataVersion) {
    // Every version so far starts with the name right after the length: name the peer.
    std::string peer;
    const std::string who = r.Str16("name", Agent::kMaxNameBytes, &peer) && !peer.empty()
                                ? StrCat("peer ", Printable(peer))
                                : std::string("the peer");
    return Status::NotSupported(StrCat(kWhat, " of ", who, " is version ", version,
                                       ", this build reads version ", kAgentMetadataVersion,
                                       ": both sides need the same eplbx version (upgrade "
                                       "eplbx on every rank to the same release)"));
  }
  if (reserved != 0) {
    return Status::Corruption(StrCat(kWhat, ": reserved field is ", reserved, ", must be 0"));
  }
  if (length != blob.size()) {
    return Status::Corruption(
        StrCat(kWhat, ": length field says ", length, " bytes, the blob has ", blob.size()));
  }
  AgentMetadata m;
  uint32_t count = 0;
  if (!r.Str16("name", Agent::kMaxNameBytes, &m.name) ||
      !r.Str16("host_id", kMaxHostIdBytes, &m.host_id) || !r.U32("pid", &m.pid) ||
      !r.Str16("control", kMaxPartNameBytes, &m.control) ||
      !r.Str32("conn_info", kMaxConnInfoBytes, &m.conn_info) || !r.U32("region_count", &count)) {
    return r.status();
  }
  if (m.name.empty()) return Status::Corruption(StrCat(kWhat, ": empty agent name"));
  if (count > kMaxRegions) {
    return Status::Corruption(StrCat(kWhat, ": ", count, " regions, the limit is ", kMaxRegions));
  }
  m.regions.resize(count);
  for (uint32_t i = 0; i < count; ++i) {
    RegionInfo& reg = m.regions[i];
    const std::string f = StrCat("regions[", i, "]");
    uint8_t kind = 0, pad8 = 0;
    uint16_t pad16 = 0;
    if (!r.U64(f + ".addr", &reg.addr) || !r.U64(f + ".bytes", &reg.bytes) ||
        !r.U8(f + ".kind", &kind) || !r.U8(f + ".reserved", &pad8) ||
        !r.U16(f + ".reserved", &pad16)) {
      return r.status();
    }
    if (kind > static_cast<uint8_t>(MemoryKind::kCuda)) {
      return Status::Corruption(
          StrCat(kWhat, ": ", f, ".kind is ", +kind, " (known: 0 host, 1 host_file, 2 cuda)"));
    }
    if (pad8 != 0 || pad16 != 0) {
      return Status::Corruption(StrCat(kWhat, ": ", f, ".reserved is not 0"));
    }
    reg.kind = static_cast<MemoryKind>(kind);
    if (reg.bytes == 0 || reg.addr + reg.bytes < reg.addr) {
      return Status::Corruption(StrCat(kWhat, ": ", f, " [", reg.addr, ", +", reg.bytes,
                                       ") is empty or wraps around the address space"));
    }
  }
  uint16_t sections = 0;
  if (!r.U16("section_count", &sections)) return r.status();
  if (sections > kMaxSections) {
    return Status::Corruption(
        StrCat(kWhat, ": ", sections, " path sections, the limit is ", kMaxSections));
  }
  m.sections.resize(sections);
  for (uint16_t i = 0; i < sections; ++i) {
    PathSection& s = m.sections[i];
    const std::string f = StrCat("sections[", i, "]");
    if (!r.Str16(f + ".path", kMaxPartNameBytes, &s.path) ||
        !r.Str32(f + ".body", kMaxSectionBytes, &s.body)) {
      return r.status();
    }
    if (s.path.empty()) return Status::Corruption(StrCat(kWhat, ": ", f, " has no path name"));
    for (uint16_t j = 0; j < i; ++j) {
      if (m.sections[j].path == s.path) {
        return Status::Corruption(StrCat(kWhat, ": two sections for path ", Printable(s.path)));
      }
    }
  }
  if (r.remaining() != 0) {
    return Status::Corruption(StrCat(kWhat, ": ", r.remaining(), " trailing bytes"));
  }
  return m;
}

std::string EncodeMessageHeader(const MessageHeader& h) {
  ByteWriter w;
  w.Raw(std::string_view(kMessageMagic, 4));
  w.U16(kMessageVersion);
  w.U8(static_cast<uint8_t>(h.kind));
  w.U8(0);
  w.Str16(h.sender);
  return w.Take();
}

Result<MessageHeader> DecodeMessageHeader(std::string_view bytes, size_t* consumed) {
  ByteReader r(bytes, "message header");
  std::string magic;
  if (!r.Raw("magic", 4, &magic)) return r.status();
  if (std::memcmp(magic.data(), kMessageMagic, 4) != 0) {
    return Status::Corruption("message header: bad magic");
  }
  uint16_t version = 0;
  uint8_t kind = 0, reserved = 0;
  MessageHeader h;
  if (!r.U16("version", &version) || !r.U8("kind", &kind) || !r.U8("reserved", &reserved)) {
    return r.status();
  }
  if (reserved != 0) return Status::Corruption("message header: reserved byte is not 0");
  if (version != kMessageVersion) {
    return Status::NotSupported(StrCat("message header: version ", version, " not supported"));
  }
  if (kind < 1 || kind > static_cast<uint8_t>(MessageKind::kNotifyBatch))
    return Status::Corruption(StrCat("message header: unknown kind ", +kind));
  h.kind = static_cast<MessageKind>(kind);
  if (!r.Str16("sender", Agent::kMaxNameBytes, &h.sender)) return r.status();
  *consumed = r.pos();
  return h;
}

std::string EncodeNotifyBatch(const std::vector<std::string>& payloads) {
  ByteWriter w;
  w.U32(static_cast<uint32_t>(payloads.size()));
  for (const std::string& p : payloads) w.Str32(p);
  return w.Take();
}

Result<std::vector<std::string>> DecodeNotifyBatch(std::string_view body) {
  ByteReader r(body, "notification batch");
  uint32_t count = 0;
  if (!r.U32("count", &count)) return r.status();
  if (count == 0 || count > kMaxBatchNotifications) {
    return Status::Corruption(StrCat("notification batch: ", count, " notifications (expected 1..",
                                     kMaxBatchNotifications, ")"));
  }
  std::vector<std::string> out;
  out.reserve(std::min<size_t>(count, r.remaining() / 4));
  // Each field's name ("notification 7", for a message) on the stack: a batch arrives with
  // every notification, and an ostringstream per name was work on each.
  char field[32] = "notification ";
  constexpr size_t kPrefix = sizeof("notification ") - 1;
  for (uint32_t i = 0; i < count; ++i) {
    const size_t n =
        static_cast<size_t>(std::to_chars(field + kPrefix, field + sizeof(field), i).ptr - field);
    std::string payload;
    if (!r.Str32(std::string_view(field, n), Agent::kMaxNotificationBytes, &payload))
      return r.status();
    out.push_back(std::move(payload));
  }
  if (r.remaining() != 0) {
    return Status::Corruption(StrCat("notification batch: ", r.remaining(), " trailing bytes"));
  }
  return out;
}

}  // namespace eplbx::internal
