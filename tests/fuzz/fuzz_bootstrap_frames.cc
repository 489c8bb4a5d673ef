// libFuzzer: what a member reads from the rendezvous coordinator (a peer on the network): the
// bytes of a round's answer (frames: [u8 type][u32 length][body]; kGathered, kGatheredAt,
// kRefused, kFailed), fed over a socket to SocketBootstrap::AllGather as the coordinator's
// side would send them; then the socket closes. Also every prefix of a round's answer that
// a dying coordinator could leave.
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "eplbx/bootstrap.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 60000) return 0;  // fits in a socket's buffer: the write never blocks
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return 0;
  const int one = 1 << 18;
  setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &one, sizeof(one));
  if (size > 0 && write(sv[0], data, size) != static_cast<ssize_t>(size)) {
    close(sv[0]);
    close(sv[1]);
    return 0;
  }
  shutdown(sv[0], SHUT_WR);
  {
    eplbx::SocketBootstrap member(sv[1], /*rank=*/1, /*size=*/4);
    for (int round = 0; round < 3; ++round) {  // what is left after the first answer
      auto r = member.AllGather("mine", std::chrono::milliseconds(50));
      if (!r.ok() && r.status().code() != eplbx::Code::kAborted) break;
    }
  }
  close(sv[0]);
  return 0;
}
