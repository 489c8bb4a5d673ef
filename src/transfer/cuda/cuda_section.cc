#include "transfer/cuda/cuda_section.h"

#include "common/bytes.h"
#include "common/strings.h"

namespace eplbx::internal::cuda {

std::string EncodeCudaSection(const std::vector<RegionHandle>& handles) {
  ByteWriter w;
  w.U32(static_cast<uint32_t>(handles.size()));
  for (const RegionHandle& h : handles) {
    w.U8(static_cast<uint8_t>(h.kind));
    if (h.kind == HandleKind::kNone) continue;
    w.Raw(h.device_uuid);
    w.U64(h.base);
    w.U64(h.bytes);
    if (h.kind == HandleKind::kLegacy) {
      w.Raw(h.ipc_handle);
    } else {
      w.U32(static_cast<uint32_t>(h.chunks.size()));
      for (const Chunk& c : h.chunks) {
        w.U64(c.offset);
        w.U64(c.bytes);
        w.U32(c.fd);
      }
    }
  }
  return w.Take();
}

Result<std::vector<RegionHandle>> DecodeCudaSection(std::string_view section,
                                                    const std::vector<RegionInfo>& regions,
                                                    std::string_view peer) {
  const std::string what = StrCat("cuda_ipc section of peer '", peer, "'");
  ByteReader r(section, what);
  uint32_t count = 0;
  if (!r.U32("region_count", &count)) return r.status();
  if (count != regions.size()) {
    return Status::Corruption(
        StrCat(what, ": handles for ", count, " regions, the header lists ", regions.size()));
  }
  std::vector<RegionHandle> out(count);
  for (uint32_t i = 0; i < count; ++i) {
    RegionHandle& h = out[i];
    const RegionInfo& reg = regions[i];
    const std::string f = StrCat("region[", i, "]");
    uint8_t kind = 0;
    if (!r.U8(StrCat(f, ".handle_kind"), &kind)) return r.status();
    if (kind > static_cast<uint8_t>(HandleKind::kVmm)) {
      return Status::Corruption(
          StrCat(what, ": ", f, ".handle_kind is ", +kind, " (known: 0 none, 1 ipc, 2 vmm)"));
    }
    h.kind = static_cast<HandleKind>(kind);
    const bool device = reg.kind == MemoryKind::kCuda;
    if (device != (h.kind != HandleKind::kNone)) {
      return Status::Corruption(StrCat(what, ": ", f, " is ", MemoryKindName(reg.kind),
                                       " memory but its handle kind is ", +kind));
    }
    if (h.kind == HandleKind::kNone) continue;
    if (!r.Raw(StrCat(f, ".device_uuid"), kUuidBytes, &h.device_uuid) ||
        !r.U64(StrCat(f, ".base"), &h.base) || !r.U64(StrCat(f, ".bytes"), &h.bytes)) {
      return r.status();
    }
    if (h.base + h.bytes < h.base || reg.addr < h.base || reg.bytes > h.bytes ||
        reg.addr - h.base > h.bytes - reg.bytes) {
      return Status::Corruption(StrCat(what, ": ", f, " [", Hex(reg.addr), ", +", reg.bytes,
                                       ") is not inside its allocation [", Hex(h.base), ", +",
                                       h.bytes, ")"));
    }
    if (h.kind == HandleKind::kLegacy) {
      if (!r.Raw(StrCat(f, ".ipc_handle"), kIpcHandleBytes, &h.ipc_handle)) return r.status();
      continue;
    }
    uint32_t chunks = 0;
    if (!r.U32(StrCat(f, ".chunk_count"), &chunks)) return r.status();
    if (chunks == 0 || chunks > kMaxChunks) {
      return Status::Corruption(
          StrCat(what, ": ", f, " has ", chunks, " chunks (1 to ", kMaxChunks, ")"));
    }
    uint64_t next = 0;
    for (uint32_t c = 0; c < chunks; ++c) {
      Chunk k;
      const std::string cf = StrCat(f, ".chunk[", c, "]");
      if (!r.U64(StrCat(cf, ".offset"), &k.offset) || !r.U64(StrCat(cf, ".bytes"), &k.bytes) ||
          !r.U32(StrCat(cf, ".fd"), &k.fd)) {
        return r.status();
      }
      if (k.offset != next || k.bytes == 0 || k.bytes > h.bytes - next) {
        return Status::Corruption(StrCat(what, ": ", cf, " [+", k.offset, ", ", k.bytes,
                                         " bytes) does not continue at +", next, " inside the ",
                                         h.bytes, "-byte allocation"));
      }
      next += k.bytes;
      h.chunks.push_back(k);
    }
    if (next != h.bytes) {
      return Status::Corruption(
          StrCat(what, ": ", f, " chunks cover ", next, " of its ", h.bytes, " bytes"));
    }
  }
  if (r.remaining() != 0) {
    return Status::Corruption(StrCat(what, ": ", r.remaining(), " trailing bytes"));
  }
  return out;
}

}  // namespace eplbx::internal::cuda
