// What the step's collective costs on etcd against the built-in store, at several group
// sizes, in the same run; prints JSON.
//   build/bin/eplbx_coord_bench [--etcd etcd://HOST:PORT,...] [--ranks 4,16,64]
//                               [--rounds 200] [--bytes 64]
//
// Without --etcd it starts a 3-member etcd of its own on loopback ports (Debian's etcd-server,
// data in a temporary directory), as the tests do. For each group size N, N ranks (threads of
// this process, each with its own connections, lease and watch, as N processes would have)
// run --rounds all-gathers of --bytes bytes each (the serving step's collective carries a few
// dozen bytes per rank), every result checked:
//   etcd   : EtcdBootstrap (a transaction that writes the contribution and reads the round,
//            then a watch until every contribution is there);
//   store  : the built-in coordinator (TcpStore with membership, SocketBootstrap), what
//            `eplbx worker` runs without --coordination;
//   limit  : one client's put (one Raft commit) and one client's read, back to back: a round
//            needs at least a commit and a read on every rank.
// Per size: the median and p99 round time (of rank 0), requests and waits per rank per round.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "coord/etcd_client.h"
#include "eplbx/bootstrap.h"
#include "eplbx/etcd.h"
#include "etcd_cluster.h"

namespace {

using namespace eplbx;
using Clock = std::chrono::steady_clock;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

struct Rounds {
  std::vector<double> ms;  // rank 0's rounds
  double requests_per_round = 0, waits_per_round = 0;
  std::string error;
};

double Quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))];
}

std::string Contribution(uint32_t rank, uint64_t round, size_t bytes) {
  std::string s = std::to_string(rank) + ":" + std::to_string(round) + ":";
  s.resize(std::max(bytes, s.size()), static_cast<char>('a' + rank % 26));
  return s;
}

// Runs `rounds` all-gathers on every member of `group` (one thread each), checking each
// result; rank 0's round times.
Rounds Run(std::vector<std::unique_ptr<Bootstrap>>& group, int rounds, size_t bytes) {
  Rounds out;
  std::vector<std::string> errors(group.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < group.size(); ++r) {
    threads.emplace_back([&, r] {
      for (int k = 0; k < rounds; ++k) {
        const auto t0 = Clock::now();
        auto got = group[r]->AllGather(Contribution(r, k, bytes), std::chrono::seconds(60));
        if (!got.ok()) {
          errors[r] = got.status().ToString();
          return;
        }
        for (size_t p = 0; p < group.size(); ++p) {
          if ((*got)[p] != Contribution(p, k, bytes)) {
            errors[r] = "round " + std::to_string(k) + ": rank " + std::to_string(p) +
                        "'s contribution is wrong";
            return;
          }
        }
        if (r == 0) out.ms.push_back(Ms(Clock::now() - t0));
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (!e.empty() && out.error.empty()) out.error = e;
  }
  return out;
}

Rounds OnEtcd(const std::vector<std::string>& endpoints, uint32_t n, int rounds, size_t bytes) {
  Rounds out;
  std::vector<std::unique_ptr<Bootstrap>> group(n);
  std::vector<std::thread> joins;
  std::vector<std::string> errors(n);
  const std::string name = "bench-" + std::to_string(n) + "-" + std::to_string(getpid()) + "-" +
                           std::to_string(Clock::now().time_since_epoch().count() % 1000000);
  for (uint32_t r = 0; r < n; ++r) {
    joins.emplace_back([&, r] {
      EtcdOptions o;
      o.endpoints = endpoints;
      o.group = name;
      o.token = "bench";
      o.lease = std::chrono::seconds(10);
      auto b = EtcdBootstrap::Join(r, n, o);
      if (b.ok())
        group[r] = std::move(*b);
      else
        errors[r] = b.status().ToString();
    });
  }
  for (auto& t : joins) t.join();
  for (auto& e : errors) {
    if (!e.empty()) {
      out.error = e;
      return out;
    }
  }
  std::vector<EtcdBootstrap::Stats> before;
  for (auto& b : group) before.push_back(static_cast<EtcdBootstrap*>(b.get())->stats());
  out = Run(group, rounds, bytes);
  double requests = 0, waits = 0;
  for (uint32_t r = 0; r < n; ++r) {
    const auto s = static_cast<EtcdBootstrap*>(group[r].get())->stats();
    requests += static_cast<double>(s.requests - before[r].requests);
    waits += static_cast<double>(s.waits - before[r].waits);
  }
  out.requests_per_round = requests / n / rounds;
  out.waits_per_round = waits / n / rounds;
  return out;
}

Rounds OnStore(uint32_t n, int rounds, size_t bytes) {
  Rounds out;
  auto store = TcpStore::Listen("127.0.0.1", 0, "bench", n);
  if (!store.ok()) {
    out.error = store.status().ToString();
    return out;
  }
  const uint16_t port = (*store)->port();
  (*store)->set_membership(true);
  std::thread serve([&] {
    (void)(*store)->Serve(std::chrono::seconds(60), std::chrono::seconds(60),
                          [](uint32_t, std::string) {});
  });
  std::vector<std::unique_ptr<Bootstrap>> group(n);
  std::vector<std::thread> joins;
  std::vector<std::string> errors(n);
  for (uint32_t r = 0; r < n; ++r) {
    joins.emplace_back([&, r] {
      auto b = JoinTcpStore("127.0.0.1", port, "bench", r, n, std::chrono::seconds(30));
      if (b.ok())
        group[r] = std::move(*b);
      else
        errors[r] = b.status().ToString();
    });
  }
  for (auto& t : joins) t.join();
  bool joined = true;
  for (auto& e : errors) {
    if (!e.empty() && joined) {
      out.error = e;
      joined = false;
    }
  }
  if (joined) out = Run(group, rounds, bytes);
  group.clear();  // the members leave: the store's serving ends
  serve.join();
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string url;
  std::vector<uint32_t> sizes = {4, 16, 64};
  int rounds = 200;
  size_t bytes = 64;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--etcd") {
      url = value;
    } else if (flag == "--ranks") {
      sizes.clear();
      for (size_t at = 0; at < value.size();) {
        const size_t comma = std::min(value.find(',', at), value.size());
        sizes.push_back(static_cast<uint32_t>(std::stoul(value.substr(at, comma - at))));
        at = comma + 1;
      }
    } else if (flag == "--rounds") {
      rounds = std::stoi(value);
    } else if (flag == "--bytes") {
      bytes = std::stoul(value);
    } else {
      std::fprintf(stderr,
                   "usage: eplbx_coord_bench [--etcd etcd://H:P,...] [--ranks 4,16,64] "
                   "[--rounds N] [--bytes N]\n");
      return 2;
    }
  }
  std::unique_ptr<testing::EtcdCluster> cluster;
  std::vector<std::string> endpoints;
  if (url.empty()) {
    cluster = std::make_unique<testing::EtcdCluster>(3);
    if (!cluster->ready()) {
      std::fprintf(stderr, "eplbx_coord_bench: %s\n", cluster->why_not().c_str());
      return 1;
    }
    endpoints = cluster->endpoints();
  } else {
    auto e = ParseEtcdUrl(url);
    if (!e.ok()) {
      std::fprintf(stderr, "eplbx_coord_bench: %s\n", e.status().ToString().c_str());
      return 2;
    }
    endpoints = *e;
  }
  // The limit: one put (a Raft commit) and one read, back to back, from one client.
  auto client = coord::EtcdClient::Create(endpoints, std::chrono::seconds(3));
  if (!client.ok()) return 1;
  std::vector<double> put_ms, read_ms;
  for (int k = 0; k < 100; ++k) {
    auto t0 = Clock::now();
    if (!(*client)->Put("/eplbx-bench/limit", std::string(bytes, 'x')).ok()) return 1;
    put_ms.push_back(Ms(Clock::now() - t0));
    t0 = Clock::now();
    if (!(*client)->Range("/eplbx-bench/limit").ok()) return 1;
    read_ms.push_back(Ms(Clock::now() - t0));
  }
  (void)(*client)->Delete("/eplbx-bench/limit");
  nlohmann::json out = {
      {"etcd_members", endpoints.size()},
      {"rounds", rounds},
      {"bytes", bytes},
      {"limit", {{"put_ms_p50", Quantile(put_ms, 0.5)}, {"read_ms_p50", Quantile(read_ms, 0.5)}}},
      {"sizes", nlohmann::json::array()}};
  const double limit = Quantile(put_ms, 0.5) + Quantile(read_ms, 0.5);
  int failed = 0;
  for (const uint32_t n : sizes) {
    const Rounds e = OnEtcd(endpoints, n, rounds, bytes);
    const Rounds s = OnStore(n, rounds, bytes);
    failed += !e.error.empty() || !s.error.empty();
    const double e50 = Quantile(e.ms, 0.5), s50 = Quantile(s.ms, 0.5);
    out["sizes"].push_back(
        {{"ranks", n},
         {"etcd",
          {{"round_ms_p50", e50},
           {"round_ms_p99", Quantile(e.ms, 0.99)},
           {"requests_per_rank_round", e.requests_per_round},
           {"waits_per_rank_round", e.waits_per_round},
           {"error", e.error}}},
         {"store",
          {{"round_ms_p50", s50}, {"round_ms_p99", Quantile(s.ms, 0.99)}, {"error", s.error}}},
         {"etcd_over_store", s50 > 0 ? e50 / s50 : 0.0},
         {"etcd_over_limit", e50 / limit}});
  }
  std::printf("%s\n", out.dump(1).c_str());
  return failed == 0 ? 0 : 1;
}
