#include "transfer/metadata.h"

#include <cstring>

#include "common/bytes.h"
#include "common/strings.h"
#include "eplbx/transfer.h"

namespace eplbx::internal {

std::string EncodeAgentMetadata(const AgentMetadata& m) {
  ByteWriter w;
  w.Raw(std::string_view(kAgentMagic, 4));
  w.U16(kAgentMetadataVersion);
  w.U16(0);  // reserved
  const size_t length_pos = w.size();
  w.U32(0);  // total length, patched below
  w.Str16(m.name);
  w.Str16(m.host_id);
  w.Str16(m.backend);
  w.U32(m.pid);
  w.U64(m.probe_addr);
  w.Str32(m.conn_info);
  w.U32(static_cast<uint32_t>(m.regions.size()));
  for (const RegionInfo& r : m.regions) {
    w.U64(r.addr);
    w.U64(r.bytes);
    w.U32(r.flags);
    w.U32(static_cast<uint32_t>(r.shm_fd));
    w.U64(r.shm_offset);
    w.Str32(r.rkey);
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
  if (reserved != 0) {
    return Status::Corruption(StrCat(kWhat, ": reserved field is ", reserved, ", must be 0"));
  }
  if (version != kAgentMetadataVersion) {
    return Status::NotSupported(StrCat(kWhat, ": version ", version,
                                       " is not supported (this "
                                       "build reads version ",
                                       kAgentMetadataVersion,
                                       "); upgrade eplbx on every rank to the same release"));
  }
  if (length != blob.size()) {
    return Status::Corruption(
        StrCat(kWhat, ": length field says ", length, " bytes, the blob has ", blob.size()));
  }
  AgentMetadata m;
  uint32_t count = 0;
  if (!r.Str16("name", Agent::kMaxNameBytes, &m.name) ||
      !r.Str16("host_id", kMaxHostIdBytes, &m.host_id) ||
      !r.Str16("backend", kMaxBackendNameBytes, &m.backend) || !r.U32("pid", &m.pid) ||
      !r.U64("probe_addr", &m.probe_addr) ||
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
    uint32_t fd = 0;
    if (!r.U64(f + ".addr", &reg.addr) || !r.U64(f + ".bytes", &reg.bytes) ||
        !r.U32(f + ".flags", &reg.flags) || !r.U32(f + ".shm_fd", &fd) ||
        !r.U64(f + ".shm_offset", &reg.shm_offset) ||
        !r.Str32(f + ".rkey", kMaxRkeyBytes, &reg.rkey)) {
      return r.status();
    }
    reg.shm_fd = static_cast<int32_t>(fd);
    if (reg.bytes == 0 || reg.addr + reg.bytes < reg.addr) {
      return Status::Corruption(StrCat(kWhat, ": ", f, " [", reg.addr, ", +", reg.bytes,
                                       ") is empty or wraps around the address space"));
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
  if (kind < 1 || kind > 3)
    return Status::Corruption(StrCat("message header: unknown kind ", +kind));
  h.kind = static_cast<MessageKind>(kind);
  if (!r.Str16("sender", Agent::kMaxNameBytes, &h.sender)) return r.status();
  *consumed = r.pos();
  return h;
}

}  // namespace eplbx::internal
