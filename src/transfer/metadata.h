// Internal: the agent metadata blob (docs/transfer.md, "Metadata format") and the header of
// every small message agents exchange (notifications and heartbeats).
#ifndef EPLBX_SRC_TRANSFER_METADATA_H_
#define EPLBX_SRC_TRANSFER_METADATA_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "eplbx/status.h"

namespace eplbx::internal {

inline constexpr char kAgentMagic[4] = {'E', 'P', 'X', 'A'};
inline constexpr uint16_t kAgentMetadataVersion = 2;
inline constexpr size_t kMaxMetadataBytes = 16u << 20;
inline constexpr size_t kMaxHostIdBytes = 256;
inline constexpr size_t kMaxBackendNameBytes = 32;
inline constexpr size_t kMaxConnInfoBytes = 64u << 10;
inline constexpr size_t kMaxRegions = 4096;
inline constexpr size_t kMaxRkeyBytes = 4096;

inline constexpr uint32_t kRegionShared = 1;  // region flag: backed by a shared file, mappable

struct RegionInfo {
  uint64_t addr = 0;
  uint64_t bytes = 0;
  uint32_t flags = 0;
  int32_t shm_fd = -1;      // the owner's fd of the file, when kRegionShared
  uint64_t shm_offset = 0;  // the file offset of `addr`, when kRegionShared
  std::string rkey;         // backend remote-access key
};

struct AgentMetadata {
  std::string name;
  std::string host_id;
  std::string backend;
  uint32_t pid = 0;
  uint64_t probe_addr = 0;  // 8 readable bytes holding kProbeValue (same-host check)
  std::string conn_info;    // backend connection info (UCX worker address)
  std::vector<RegionInfo> regions;
};

inline constexpr uint64_t kProbeValue = 0x6570'6c62'7850'524fULL;

std::string EncodeAgentMetadata(const AgentMetadata& m);
// Rejects bad magic, unsupported version, a total length that disagrees with the blob,
// truncated and oversized fields, and trailing bytes, each with its own message.
Result<AgentMetadata> DecodeAgentMetadata(std::string_view blob);

// Header of an active message between agents.
enum class MessageKind : uint8_t { kNotify = 1, kPing = 2, kPong = 3 };
inline constexpr char kMessageMagic[4] = {'E', 'P', 'X', 'M'};
inline constexpr uint16_t kMessageVersion = 1;

struct MessageHeader {
  MessageKind kind = MessageKind::kNotify;
  std::string sender;  // agent name
};

std::string EncodeMessageHeader(const MessageHeader& h);
// Decodes the header at the start of `bytes`; *consumed is its length (the payload follows).
Result<MessageHeader> DecodeMessageHeader(std::string_view bytes, size_t* consumed);

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_TRANSFER_METADATA_H_
