// Internal: the agent metadata blob (docs/transfer.md, "Metadata format") and the header of
// every small message agents exchange (notifications and heartbeats).
#ifndef EPLBX_SRC_TRANSFER_METADATA_H_
#define EPLBX_SRC_TRANSFER_METADATA_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "eplbx/status.h"
#include "eplbx/transfer.h"

namespace eplbx::internal {

inline constexpr char kAgentMagic[4] = {'E', 'P', 'X', 'A'};
// Version 3: a neutral header plus one opaque section per data path (docs/transfer.md).
inline constexpr uint16_t kAgentMetadataVersion = 4;
inline constexpr size_t kMaxMetadataBytes = 16u << 20;
inline constexpr size_t kMaxHostIdBytes = 256;
inline constexpr size_t kMaxPartNameBytes = 32;
inline constexpr size_t kMaxConnInfoBytes = 64u << 10;
inline constexpr size_t kMaxRegions = 4096;
inline constexpr size_t kMaxSections = 16;
inline constexpr size_t kMaxSectionBytes = 8u << 20;
inline constexpr size_t kMaxRkeyBytes = 4096;

// What the header says of a region; how to reach it is in the paths' sections.
struct RegionInfo {
  uint64_t addr = 0;
  uint64_t bytes = 0;
  MemoryKind kind = MemoryKind::kHost;
};

// One data path's public bytes, opaque to the core.
struct PathSection {
  std::string path;
  std::string body;
};

struct AgentMetadata {
  std::string name;
  std::string host_id;
  uint32_t pid = 0;
  std::string control;    // the control channel's name ("ucx", "loopback")
  std::string conn_info;  // its connection info (UCX: worker address and inbox name)
  std::vector<RegionInfo> regions;
  std::vector<PathSection> sections;  // distinct path names

  // The section of `path`, or null.
  const PathSection* Section(std::string_view path) const;
};

std::string EncodeAgentMetadata(const AgentMetadata& m);
// Rejects bad magic, another version (naming the peer when its name can be read), a total
// length that disagrees with the blob, truncated and oversized fields, unknown memory kinds,
// duplicate sections and trailing bytes, each with its own message.
Result<AgentMetadata> DecodeAgentMetadata(std::string_view blob);

// Header of an active message between agents.
// kStage: a message of the cuda_staged data path (its head follows the header; its rows, if
// any, travel as the message's data). kNotifyBatch: several notifications to one peer in
// one message (Agent::NotifyMany), delivered one by one in order.
enum class MessageKind : uint8_t {
  kNotify = 1,
  kPing = 2,
  kPong = 3,
  kStage = 4,
  kNotifyBatch = 5
};
inline constexpr char kMessageMagic[4] = {'E', 'P', 'X', 'M'};
inline constexpr uint16_t kMessageVersion = 1;

struct MessageHeader {
  MessageKind kind = MessageKind::kNotify;
  std::string sender;  // agent name
};

std::string EncodeMessageHeader(const MessageHeader& h);
// Decodes the header at the start of `bytes`; *consumed is its length (the payload follows).
Result<MessageHeader> DecodeMessageHeader(std::string_view bytes, size_t* consumed);

// The body of a kNotifyBatch message: a count, then each notification as a 32-bit length
// and its bytes. At most kMaxBatchNotifications of at most Agent::kMaxNotificationBytes
// each; decoding rejects anything else (a zero count, an oversized or truncated entry,
// trailing bytes), naming what is wrong.
inline constexpr size_t kMaxBatchNotifications = 4096;
std::string EncodeNotifyBatch(const std::vector<std::string>& payloads);
Result<std::vector<std::string>> DecodeNotifyBatch(std::string_view body);

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_TRANSFER_METADATA_H_
