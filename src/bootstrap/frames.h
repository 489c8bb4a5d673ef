// Internal: the framing shared by the bootstrap's socket transports: [u8 type][u32 length]
// [body], little-endian; frames over 64 MiB are refused.
#ifndef EPLBX_SRC_BOOTSTRAP_FRAMES_H_
#define EPLBX_SRC_BOOTSTRAP_FRAMES_H_

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

#include "eplbx/env.h"

namespace eplbx::internal {

enum FrameType : uint8_t {
  kContributeOld = 1,  // unused since contributions carry an epoch (kContributeAt); reserved
  kMessage = 2,        // member -> coordinator: a report
  kGathered = 3,       // coordinator -> member: every contribution
  kFailed = 4,         // coordinator -> member: why the round or the join failed
  kHello = 5,          // member -> store: rank, world size, token
  kWelcome = 6,        // store -> member: joined
  kContributeAt = 7,   // member -> coordinator: [u64 epoch][contribution]
  kGatheredAt = 8,     // coordinator -> member (membership): [u64 epoch][members][contributions]
  kRefused = 9,        // coordinator -> member (membership): [u64 epoch][members][why]; try again
};

// How long a frame may take to leave when nothing says otherwise: a peer whose link is down
// stops acknowledging, the socket's send buffer fills and a plain send() would block until
// the kernel gives up on the connection (minutes).
inline constexpr std::chrono::milliseconds kWriteWait{5000};

// False on error or when the whole frame did not leave before `deadline` (on env's clock;
// null: Env::Default()); the stream is then unusable (part of a frame may have left).
bool WriteFrame(int fd, uint8_t type, std::string_view body,
                std::chrono::steady_clock::time_point deadline, Env* env = nullptr);
// False on EOF, error, an oversized frame or `deadline` (then *timed_out).
// `deadline` is on env's clock (null: Env::Default()).
bool ReadFrame(int fd, std::chrono::steady_clock::time_point deadline, uint8_t* type,
               std::string* body, bool* timed_out, Env* env = nullptr);

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_BOOTSTRAP_FRAMES_H_
