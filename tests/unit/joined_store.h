// Test helpers: a TcpStore served on a thread with every rank joined (optionally with
// membership and epochs), for tests of ranks as threads; Port() (free_port.h).
#ifndef EPLBX_TESTS_UNIT_JOINED_STORE_H_
#define EPLBX_TESTS_UNIT_JOINED_STORE_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "eplbx/bootstrap.h"
#include "free_port.h"

namespace eplbx {

// A store of `world` members served on a thread with a 300 ms round timeout, every member
// joined; `lost` collects the store's on_lost calls. Stops serving when destroyed.
struct JoinedStore {
  JoinedStore(uint32_t world, bool membership) {
    auto listening = TcpStore::Listen("127.0.0.1", 0, "t", world);  // a port no one can take
    if (!listening.ok()) return;
    store = std::move(*listening);
    port = store->port();
    store->set_membership(membership);
    serve = std::thread([this] {
      (void)store->Serve(
          std::chrono::milliseconds(5000), std::chrono::milliseconds(10000),
          [](uint32_t, std::string) {}, [this] { return done.load(); },
          std::chrono::milliseconds(300),
          [this](uint32_t r) {
            std::lock_guard<std::mutex> lock(mu);
            lost.insert(r);
          });
    });
    m.resize(world);
    std::vector<std::thread> joins;
    for (uint32_t r = 0; r < world; ++r) {
      joins.emplace_back([this, r, world] {
        auto b = JoinTcpStore("127.0.0.1", port, "t", r, world, std::chrono::milliseconds(5000));
        if (b.ok()) m[r] = std::move(*b);
      });
    }
    for (std::thread& t : joins) t.join();
  }
  ~JoinedStore() {
    done = true;
    if (serve.joinable()) serve.join();
  }
  bool joined() const {
    return std::all_of(m.begin(), m.end(), [](const auto& b) { return b != nullptr; });
  }
  std::set<uint32_t> Lost() {
    std::lock_guard<std::mutex> lock(mu);
    return lost;
  }
  uint16_t port = 0;
  std::unique_ptr<TcpStore> store;
  std::thread serve;
  std::atomic<bool> done{false};
  std::mutex mu;
  std::set<uint32_t> lost;
  std::vector<std::unique_ptr<SocketBootstrap>> m;
};

}  // namespace eplbx

#endif  // EPLBX_TESTS_UNIT_JOINED_STORE_H_
