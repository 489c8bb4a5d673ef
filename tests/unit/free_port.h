// A free TCP port for a test to hand to a server it starts (a process, etcd) that cannot
// listen on port 0 and say which port it got.
#ifndef EPLBX_TESTS_UNIT_FREE_PORT_H_
#define EPLBX_TESTS_UNIT_FREE_PORT_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <random>

namespace eplbx {

// A port no socket uses now, below the kernel's ephemeral range (ip_local_port_range): a
// port from that range, closed again, is soon handed to an outgoing connection or another
// port-0 bind (UCX, gloo, other tests) before the server meant for it binds it, which failed
// runs with "Address already in use". Drawn at random (tests run in parallel), checked by a
// bind; the kernel's own choice where the range leaves no room below it. (No gtest here:
// bench/coord_bench.cc starts etcd with it too.)
inline uint16_t Port() {
  int low = 32768, high = 60999;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> low >> high;
  constexpr int kFirst = 10000;
  thread_local std::mt19937 rng(std::random_device{}());
  const auto bindable = [](uint16_t port, uint16_t* bound) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(port);
    socklen_t len = sizeof(a);
    const bool ok = fd >= 0 && bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
                    getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
    if (fd >= 0) close(fd);
    *bound = ok ? ntohs(a.sin_port) : 0;
    return ok;
  };
  uint16_t port = 0;
  for (int tries = 0; low - kFirst > 1000 && tries < 100; ++tries) {
    const int candidate = std::uniform_int_distribution<int>(kFirst, low - 1)(rng);
    if (bindable(static_cast<uint16_t>(candidate), &port)) return port;
  }
  bindable(0, &port);
  return port;  // 0 where none is free: the server's bind says so
}

}  // namespace eplbx

#endif  // EPLBX_TESTS_UNIT_FREE_PORT_H_
