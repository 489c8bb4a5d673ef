// `eplbx demo`: real rank processes rearranging real weights over real UCX agents, every
// byte verified; and every fault drill ends with a named error, in time, weights intact.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "../unit/etcd_cluster.h"
#include "../unit/joined_store.h"  // Port()
#include "eplbx/bootstrap.h"

namespace {

struct DemoRun {
  int exit_code = -1;
  nlohmann::json report;
  double seconds = 0;
};

DemoRun Demo(const std::string& args, const std::string& env = "") {
  const std::string cmd = env + std::string(EPLBX_CLI) + " demo --json " + args + " 2>/dev/null";
  const auto t0 = std::chrono::steady_clock::now();
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
  const int rc = pclose(p);
  DemoRun r;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.exit_code = WIFEXITED(rc) ? WEXITSTATUS(rc) : 128;
  r.report = nlohmann::json::parse(out, nullptr, false);
  return r;
}

struct Shell {
  int exit_code = -1;
  std::string out;  // stdout (and whatever the command redirects there)
};
// Runs a shell command line and collects its stdout.
Shell RunShell(const std::string& cmd) {
  FILE* p = popen(cmd.c_str(), "r");
  Shell r;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), p)) r.out.append(buf, n);
  const int rc = pclose(p);
  r.exit_code = WIFEXITED(rc) ? WEXITSTATUS(rc) : 128;
  return r;
}

constexpr const char* kSmall =
    "--ranks 3 --layers 3 --experts 16 --slots-per-rank 7 --expert-bytes 100K --steps 2";

TEST(DemoTest, RearrangesAndVerifiesEveryByte) {
  // The weights live in shared memory: auto maps them (shm), tcp goes over UCX, and a
  // list without shm copies them with CMA. Every byte moved is counted on the path used.
  const std::pair<const char*, const char*> runs[] = {
      {"--transport auto", "shm"}, {"--transport tcp", "ucx"}, {"--paths cma", "cma"}};
  for (const auto& [transport, path] : runs) {
    DemoRun r = Demo(std::string(kSmall) + " " + transport);
    ASSERT_FALSE(r.report.is_discarded()) << transport;
    EXPECT_EQ(r.exit_code, 0) << r.report.dump();
    EXPECT_TRUE(r.report["verified"].get<bool>()) << r.report.dump();
    EXPECT_TRUE(r.report["weights_intact"].get<bool>());
    ASSERT_EQ(r.report["steps"].size(), 2u);
    for (const auto& s : r.report["steps"]) {
      EXPECT_GT(s["bytes_moved"].get<uint64_t>(), 0u);
      EXPECT_GE(s["balancedness_after"].get<double>(),
                s["balancedness_before"].get<double>() - 0.01);
      EXPECT_GT(s["gbps"].get<double>(), 0);
      ASSERT_TRUE(s.contains("bytes_by_path")) << s.dump();
      EXPECT_EQ(s["bytes_by_path"].size(), 1u) << transport << ": " << s.dump();
      EXPECT_EQ(s["bytes_by_path"].value(path, uint64_t{0}), s["bytes_moved"].get<uint64_t>())
          << transport << ": " << s.dump();
    }
    EXPECT_FALSE(r.report.contains("error"));
  }
}

TEST(DemoTest, OddSizesAndManyTensors) {
  DemoRun r = Demo(
      "--ranks 2 --layers 2 --experts 8 --slots-per-rank 5 --tensors 5 --expert-bytes 1001 --steps "
      "3");
  EXPECT_EQ(r.exit_code, 0) << r.report.dump();
  EXPECT_TRUE(r.report.value("verified", false)) << r.report.dump();
}

struct Fault {
  const char* inject;
  const char* names;  // the error must contain this
  const char* also;   // and this ("" for nothing more)
};

class DemoFaultTest : public ::testing::TestWithParam<Fault> {};

TEST_P(DemoFaultTest, EndsWithNamedErrorInTimeWeightsIntact) {
  const Fault f = GetParam();
  constexpr double kDeadline = 4;
  DemoRun r = Demo(std::string(kSmall) + " --deadline 4 --inject " + f.inject);
  ASSERT_FALSE(r.report.is_discarded()) << f.inject;
  EXPECT_NE(r.exit_code, 0);
  EXPECT_FALSE(r.report["verified"].get<bool>());
  EXPECT_TRUE(r.report["weights_intact"].get<bool>()) << r.report.dump();
  const std::string error = r.report.value("error", "");
  EXPECT_NE(error.find(f.names), std::string::npos) << error;
  EXPECT_NE(error.find(f.also), std::string::npos) << error;
  // Startup and the children's own checks aside, failing takes at most one deadline.
  EXPECT_LT(r.seconds, kDeadline + 8) << error;
}

INSTANTIATE_TEST_SUITE_P(
    Faults, DemoFaultTest,
    ::testing::Values(
        // during the metadata exchange
        Fault{"stride-mismatch:2", "rank 2", "mismatch"},
        Fault{"missing-tensor:1", "rank 1", "mismatch"},
        Fault{"kill:1@exchange", "rank 1 left", ""},
        Fault{"stall:1@exchange", "rank 1 did not join", ""},
        Fault{"bad-notify:1@exchange", "rank 1", "contribution"},
        // mid-transfer (READY sent, peers reading)
        Fault{"kill:2", "rank 2 unreachable", ""}, Fault{"stall:1", "rank 1 unreachable", ""},
        Fault{"bad-notify:0", "rank 0 sent a malformed notification", ""},
        // during a commit
        Fault{"kill:2@commit", "rank 2 unreachable", ""},
        Fault{"stall:1@commit", "rank 1 unreachable", ""},
        Fault{"bad-notify:0@commit", "rank 0 sent a malformed notification", ""}),
    [](const ::testing::TestParamInfo<Fault>& info) {
      std::string n = info.param.inject;
      for (char& c : n) {
        if (c == '-' || c == ':' || c == '@') c = '_';
      }
      return n;
    });

// GCC says __SANITIZE_ADDRESS__, clang __has_feature(address_sanitizer).
#if defined(__SANITIZE_ADDRESS__)
#define EPLBX_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define EPLBX_TEST_ASAN 1
#endif
#endif
#ifndef EPLBX_TEST_ASAN
#define EPLBX_TEST_ASAN 0
#endif

// Soak, short: memory stays flat after warm-up (the long runs are in docs/reliability.md).
// Heap in use is the sharp check: 300 steps of a leak of even 500 bytes per step (what the
// demo's own per-step JSON once cost) would exceed 128 KiB; measured 29-36 KiB.
TEST(DemoTest, SoakMemoryStaysFlat) {
#if EPLBX_TEST_ASAN
  // ASan's quarantine keeps freed memory resident by design (256 MiB by default): with it
  // cut to 1 MiB, resident growth means a leak again, within a looser bound (ASan's own
  // allocator caches). The heap counter (mallinfo) is not ASan's, so only RSS is checked.
  const char* asan = std::getenv("ASAN_OPTIONS");
  const std::string env = std::string("ASAN_OPTIONS=") + (asan != nullptr ? asan : "") +
                          ":quarantine_size_mb=1:thread_local_quarantine_size_kb=64 ";
  DemoRun r = Demo("--ranks 4 --steps 300 --expert-bytes 64K", env);
#else
  DemoRun r = Demo("--ranks 4 --steps 300 --expert-bytes 64K");
#endif
  EXPECT_EQ(r.exit_code, 0) << r.report.dump();
  EXPECT_TRUE(r.report.value("verified", false));
  ASSERT_EQ(r.report["rss"].size(), 4u);
  ASSERT_EQ(r.report["steps"].size(), 300u);
#if EPLBX_TEST_ASAN
  EXPECT_LT(r.report["rss_growth_mib"].get<double>(), 16.0) << r.report["rss"].dump();
#else
  EXPECT_LT(r.report["rss_growth_mib"].get<double>(), 2.0) << r.report["rss"].dump();
  EXPECT_LT(r.report["heap_growth_kib"].get<double>(), 128.0);
#endif
}

// Every demo/worker flag error: exit 1, one line on stderr naming the flag, the value and
// what was expected, before any rank starts (docs/reliability.md's bad-input table).
// The asynchronous pipeline (Begin, Commit when AwaitCommit says one is due) moves the same
// bytes as the synchronous loop, and every byte verifies.
TEST(DemoTest, PipelineRearrangesAndVerifiesEveryByte) {
  DemoRun sync = Demo(kSmall);
  DemoRun pipe = Demo(std::string(kSmall) + " --pipeline");
  ASSERT_FALSE(pipe.report.is_discarded());
  EXPECT_EQ(pipe.exit_code, 0) << pipe.report.dump();
  EXPECT_TRUE(pipe.report["verified"].get<bool>()) << pipe.report.dump();
  EXPECT_TRUE(pipe.report["pipeline"].get<bool>());
  EXPECT_GT(pipe.report["copy_limit_gbps"].get<double>(), 0);
  ASSERT_EQ(pipe.report["steps"].size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(pipe.report["steps"][i]["bytes_moved"], sync.report["steps"][i]["bytes_moved"]);
    EXPECT_GT(pipe.report["steps"][i]["copy_limit_ratio"].get<double>(), 0);
  }
}

// --limit-each-step: the copy limit sampled by rank 0 before the first step and after each;
// each step's yardstick is the mean of the two samples around it, the run's their median.
TEST(DemoTest, TheCopyLimitSampledAroundEveryStepIsEachStepsYardstick) {
  DemoRun r = Demo(std::string(kSmall) + " --spare-rows 7 --limit-each-step");
  ASSERT_FALSE(r.report.is_discarded());
  EXPECT_EQ(r.exit_code, 0) << r.report.dump();
  EXPECT_TRUE(r.report["verified"].get<bool>()) << r.report.dump();
  ASSERT_TRUE(r.report.contains("copy_limit_samples_gbps")) << r.report.dump();
  std::vector<double> samples = r.report["copy_limit_samples_gbps"].get<std::vector<double>>();
  ASSERT_EQ(samples.size(), 3u) << r.report.dump();  // 2 steps
  for (double g : samples) EXPECT_GT(g, 0.1);
  ASSERT_EQ(r.report["steps"].size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    const auto& s = r.report["steps"][i];
    const double limit = (samples[i] + samples[i + 1]) / 2;
    EXPECT_DOUBLE_EQ(s["copy_limit_gbps"].get<double>(), limit) << s.dump();
    EXPECT_DOUBLE_EQ(s["copy_limit_ratio"].get<double>(), s["gbps"].get<double>() / limit);
  }
  std::sort(samples.begin(), samples.end());
  EXPECT_DOUBLE_EQ(r.report["copy_limit_gbps"].get<double>(), samples[1]);
  // Without the flag: one sample before the ranks start, the yardstick of every step.
  DemoRun once = Demo(kSmall);
  EXPECT_EQ(once.exit_code, 0) << once.report.dump();
  EXPECT_FALSE(once.report.contains("copy_limit_samples_gbps"));
  for (const auto& s : once.report["steps"])
    EXPECT_EQ(s["copy_limit_gbps"], once.report["copy_limit_gbps"]) << s.dump();
}

// Rows above the 256 KiB copied inline anyway and up to 1 MiB: with as many ranks as cores
// (3 ranks here; CI has 2 cores) the waiting loop copies the READs it posts itself
// (ShmCopier, "busy host"), over shm and over cma, synchronous and pipelined, in place and
// swapped; every byte verifies, and with the rule off (EPLBX_INLINE_WHEN_BUSY=0) the same
// bytes move.
TEST(DemoTest, RowsTheWaitingLoopCopiesOnABusyHostVerify) {
  const std::string base =
      "--ranks 3 --layers 3 --experts 16 --slots-per-rank 7 --expert-bytes 700K --steps 2";
  for (const char* extra :
       {" --paths shm", " --paths cma", " --pipeline --spare-rows 7", " --paths cma --pipeline"}) {
    DemoRun on = Demo(base + extra);
    DemoRun off = Demo(base + extra, "EPLBX_INLINE_WHEN_BUSY=0 ");
    for (const DemoRun* r : {&on, &off}) {
      ASSERT_FALSE(r->report.is_discarded()) << extra;
      EXPECT_EQ(r->exit_code, 0) << extra << ": " << r->report.dump();
      EXPECT_TRUE(r->report.value("verified", false)) << extra << ": " << r->report.dump();
      EXPECT_TRUE(r->report.value("weights_intact", false)) << extra;
    }
    ASSERT_EQ(on.report["steps"].size(), 2u) << extra;
    ASSERT_EQ(off.report["steps"].size(), 2u) << extra;
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_GT(on.report["steps"][i]["bytes_moved"].get<uint64_t>(), 0u) << extra;
      EXPECT_EQ(on.report["steps"][i]["bytes_moved"], off.report["steps"][i]["bytes_moved"])
          << extra;
    }
  }
}

// Swap commit mode (issue 18, item 4): with spare rows the READs land in rows no slot uses and
// the commit swaps row tables; the same bytes move, every slot verifies through its row
// table, and far fewer bytes are copied within the ranks than in place.
TEST(DemoTest, SwapModeMovesEachByteOnceAndVerifiesThroughTheRowTables) {
  DemoRun in_place = Demo(kSmall);
  ASSERT_FALSE(in_place.report.is_discarded());
  EXPECT_EQ(in_place.report["commit_mode"], "in place");
  for (const char* extra : {" --spare-rows 8", " --spare-rows 8 --pipeline", " --spare-rows 1"}) {
    SCOPED_TRACE(extra);
    DemoRun swap = Demo(std::string(kSmall) + extra);
    ASSERT_FALSE(swap.report.is_discarded());
    EXPECT_EQ(swap.exit_code, 0) << swap.report.dump();
    EXPECT_TRUE(swap.report["verified"].get<bool>()) << swap.report.dump();
    EXPECT_EQ(swap.report["commit_mode"], "swap");
    ASSERT_EQ(swap.report["steps"].size(), 2u);
    for (size_t i = 0; i < 2; ++i) {
      const auto& st = swap.report["steps"][i];
      const auto& ip = in_place.report["steps"][i];
      EXPECT_EQ(st["bytes_moved"], ip["bytes_moved"]);
      EXPECT_GT(st["rank_layers_swapped"].get<uint64_t>(), 0u);
      EXPECT_EQ(ip["rank_layers_swapped"].get<uint64_t>(), 0u);
      // In place copies every byte read once more (staging -> weights); swap only what the
      // plan copies within a rank (and with one spare row, the rank-layers that fall back).
      EXPECT_GE(ip["bytes_copied"].get<uint64_t>(), ip["bytes_moved"].get<uint64_t>());
      EXPECT_LT(st["bytes_copied"].get<uint64_t>(), ip["bytes_copied"].get<uint64_t>());
    }
  }
}

// The serving demo (issue 18, item 8): real rank processes serve forward steps with EPLB off,
// synchronous and asynchronous; every row a step used is checked against the map in force,
// every mode verifies its weights at the end, rebalances happen and move bytes over shm, and
// the report has what the comparison needs.
TEST(DemoTest, ServingComparesOffSynchronousAndAsynchronous) {
  const std::string svg = testing::TempDir() + "/serve.svg";
  DemoRun r = Demo(
      "--serve --ranks 3 --layers 3 --experts 16 --slots-per-rank 7 --expert-bytes 64K "
      "--steps 60 --interval 12 --tokens 64 --top-k 4 --work-bytes 1K --plot " +
      svg);
  ASSERT_FALSE(r.report.is_discarded());
  EXPECT_EQ(r.exit_code, 0) << r.report.dump();
  EXPECT_TRUE(r.report["verified"].get<bool>()) << r.report.dump();
  EXPECT_FALSE(r.report.contains("error")) << r.report.dump();
  for (const char* mode : {"off", "sync", "async"}) {
    SCOPED_TRACE(mode);
    const auto& m = r.report["modes"][mode];
    EXPECT_EQ(m["rows_checked"].get<uint64_t>(), 60u * 3 * 7 * 3);  // steps x layers x rows x ranks
    EXPECT_EQ(m["bad_rows"].get<uint64_t>(), 0u);
    EXPECT_EQ(m["step_ms"].size(), 60u);
    EXPECT_GT(m["tokens_per_s"].get<double>(), 0);
    EXPECT_EQ(m["failed_rebalances"].get<int>(), 0);
    if (std::string(mode) == "off") {
      EXPECT_EQ(m["rebalances"].get<int>(), 0);
      EXPECT_EQ(m["bytes_read"].get<uint64_t>(), 0u);
      continue;
    }
    EXPECT_GE(m["rebalances"].get<int>(), 1) << m.dump();
    EXPECT_GT(m["bytes_read"].get<uint64_t>(), 0u);
    EXPECT_GT(m["mean_balancedness"].get<double>(),
              r.report["modes"]["off"]["mean_balancedness"].get<double>());
    ASSERT_FALSE(m["rebalance_log_rank0"].empty());
    const auto& first = m["rebalance_log_rank0"][0];
    EXPECT_TRUE(first["ok"].get<bool>());
    EXPECT_GT(first["window_after"].get<double>(), first["window_before"].get<double>());
    EXPECT_EQ(m["bytes_by_path"].value("shm", uint64_t{0}), m["bytes_read"].get<uint64_t>());
    uint64_t pairs = 0;
    for (size_t src = 0; src < 3; ++src) {
      EXPECT_EQ(m["bytes_by_rank_pair"][src][src].get<uint64_t>(), 0u);  // nobody reads itself
      for (size_t dst = 0; dst < 3; ++dst)
        pairs += m["bytes_by_rank_pair"][src][dst].get<uint64_t>();
    }
    EXPECT_EQ(pairs, m["bytes_read"].get<uint64_t>());
    // One host: one node, every byte within it.
    ASSERT_EQ(m["bytes_by_node_pair"].size(), 1u);
    EXPECT_EQ(m["bytes_by_node_pair"][0][0].get<uint64_t>(), m["bytes_read"].get<uint64_t>());
  }
  EXPECT_EQ(r.report["nodes"].size(), 1u);
  // Every layer's commits land at the same steps in the log of layers committed, and an
  // asynchronous rebalance spans steps while a synchronous one does not.
  const auto& a = r.report["modes"]["async"]["rebalance_log_rank0"][0];
  EXPECT_GT(a["finished_step"].get<int>(), a["step"].get<int>());
  const auto& s = r.report["modes"]["sync"]["rebalance_log_rank0"][0];
  EXPECT_EQ(s["finished_step"].get<int>(), s["step"].get<int>());
  EXPECT_EQ(r.report["commit_mode"], "in place");
  EXPECT_GT(s["rearrange_s"].get<double>(), 0);
  EXPECT_GT(r.report["oracle"]["tokens_per_s"].get<double>(), 0);
  // The hindsight ceiling: each interval balanced on its own load, moved free — never above
  // the oracle (a layer's time is its mean work over a balancedness <= 1); the share of
  // each ceiling's gain over off a mode captured is reported beside it.
  const double hindsight = r.report["hindsight"]["tokens_per_s"].get<double>();
  EXPECT_GT(hindsight, r.report["modes"]["off"]["tokens_per_s"].get<double>() * 0.5);
  EXPECT_LE(hindsight, r.report["oracle"]["tokens_per_s"].get<double>() * (1 + 1e-9));
  for (const char* mode : {"sync", "async"}) {
    const auto& m = r.report["modes"][mode];
    const double off = r.report["modes"]["off"]["tokens_per_s"].get<double>();
    const double oracle = r.report["oracle"]["tokens_per_s"].get<double>();
    EXPECT_NEAR(m["oracle_gain_captured"].get<double>(),
                (m["tokens_per_s"].get<double>() - off) / (oracle - off), 1e-9);
    EXPECT_TRUE(m["hindsight_gain_captured"].is_number());
  }
  FILE* f = std::fopen(svg.c_str(), "r");
  ASSERT_NE(f, nullptr) << svg;
  char head[5] = {};
  EXPECT_EQ(std::fread(head, 1, 4, f), 4u);
  std::fclose(f);
  EXPECT_EQ(std::string(head), "<svg");
}

// Outside a drill the serving steps send nothing through the coordinator, which ends a group
// silent for the deadline + 10 s as hung: rank 0 says how far it got at least every quarter
// of the deadline, not only every 100 steps. A healthy run on a busy host took 40 s for 100
// steps and was ended as hung (2026-12-07). Here 150 steps (about 30 ms each here, idle)
// against a deadline of 4 s: a progress line every second and the one at step 100; without
// the rule, that one alone. (`--modes off` keeps no step collective, so the ranks drift
// apart and meet at the end within the coordinator's round timeout, 0.8 x the deadline: a
// shorter deadline failed that meeting here beside a CI run.)
TEST(DemoTest, ServingSaysHowFarItGotWithinAQuarterOfTheDeadline) {
  const Shell r = RunShell(std::string(EPLBX_CLI) +
                           " demo --serve --modes off --layers 4 --expert-bytes 64K --steps 150 "
                           "--deadline 4 2>&1 >/dev/null");
  EXPECT_EQ(r.exit_code, 0) << r.out;
  size_t lines = 0;
  for (size_t at = r.out.find(" served in every mode"); at != std::string::npos;
       at = r.out.find(" served in every mode", at + 1)) {
    ++lines;
  }
  EXPECT_GE(lines, 3u) << r.out;
  EXPECT_NE(r.out.find("step 100/150 served in every mode"), std::string::npos) << r.out;
}

// The serving demo in swap mode: the forward pass reads every slot through the row table the
// last commit handed out, and checks it.
TEST(DemoTest, ServingInSwapModeChecksEveryRowThroughTheRowTables) {
  DemoRun r = Demo(
      "--serve --modes sync,async --spare-rows 7 --ranks 3 --layers 3 --experts 16 "
      "--slots-per-rank 7 --expert-bytes 64K --steps 40 --interval 12 --tokens 64 --top-k 4 "
      "--work-bytes 1K");
  ASSERT_FALSE(r.report.is_discarded());
  EXPECT_EQ(r.exit_code, 0) << r.report.dump();
  EXPECT_TRUE(r.report["verified"].get<bool>()) << r.report.dump();
  EXPECT_EQ(r.report["commit_mode"], "swap");
  for (const char* mode : {"sync", "async"}) {
    SCOPED_TRACE(mode);
    const auto& m = r.report["modes"][mode];
    EXPECT_EQ(m["rows_checked"].get<uint64_t>(), 40u * 3 * 7 * 3);
    EXPECT_EQ(m["bad_rows"].get<uint64_t>(), 0u);
    EXPECT_GE(m["rebalances"].get<int>(), 1) << m.dump();
    EXPECT_GT(m["bytes_read"].get<uint64_t>(), 0u);
    EXPECT_LT(m["bytes_copied"].get<uint64_t>(), m["bytes_read"].get<uint64_t>());
    ASSERT_FALSE(m["rebalance_log_rank0"].empty());
    EXPECT_GT(m["rebalance_log_rank0"][0]["layers_swapped"].get<uint32_t>(), 0u);
  }
}

// A rank lost while serving (issue 20, item 5): killed, or stopped with SIGSTOP, at the start
// of a step. The survivors learn it from the step's collective (a new epoch), end the
// rebalance in flight, agree on what each holds, re-place over themselves, move among
// themselves, restore the experts only the lost rank held from the host backup, rebuild the
// Balancer over the members and serve on, every row every step used checked; the report has
// the recovery time and tokens/s before, during and after.
// A serving drill at small sizes: 4 ranks, 3 layers x 16 experts, 6 slots each, 50 steps.
DemoRun ServeDrill(const std::string& flags, int steps = 50) {
  return Demo(
      "--serve --ranks 4 --layers 3 --experts 16 --slots-per-rank 6 --expert-bytes 64K "
      "--steps " +
      std::to_string(steps) + " --interval 10 --tokens 64 --top-k 4 --work-bytes 1K " + flags);
}

// Ranks 0..3 but `gone`.
std::vector<int> MembersWithout(int gone) {
  std::vector<int> out;
  for (int k = 0; k < 4; ++k) {
    if (k != gone) out.push_back(k);
  }
  return out;
}

TEST(DemoTest, ServingGoesOnAfterARankIsKilledOrStopped) {
  struct Drill {
    const char* inject;
    const char* extra;
    int lost, step;
  };
  const Drill drills[] = {
      {"kill:1@25", "--modes async --deadline 3", 1, 25},  // rebalances around then
      {"stop:2@17", "--modes sync --deadline 2", 2, 17},   // found by the round timeout
      {"kill:0@31", "--modes async --deadline 3 --spare-rows 6", 0, 31},  // swap mode, rank 0
  };
  for (const Drill& d : drills) {
    SCOPED_TRACE(d.inject);
    DemoRun r = ServeDrill(std::string("--inject ") + d.inject + " " + d.extra);
    ASSERT_FALSE(r.report.is_discarded());
    EXPECT_EQ(r.exit_code, 0) << r.report.dump();
    EXPECT_TRUE(r.report["verified"].get<bool>()) << r.report.dump();
    EXPECT_FALSE(r.report.contains("error")) << r.report.dump();
    const auto& drill = r.report["drill"];
    EXPECT_EQ(drill["rank"].get<int>(), d.lost);
    EXPECT_EQ(drill["detected_step"].get<int>(), d.step) << drill.dump();
    EXPECT_EQ(drill["epoch"].get<int>(), 2);
    EXPECT_EQ(drill["members"].get<std::vector<int>>(), MembersWithout(d.lost));
    // 16 experts over 24 slots: the lost rank held some experts nobody else did.
    EXPECT_GT(drill["experts_recovered"].get<int>(), 0) << drill.dump();
    EXPECT_GE(drill["rows_recovered"].get<int>(), drill["experts_recovered"].get<int>());
    EXPECT_GT(drill["backup_bytes"].get<double>(), 0);
    EXPECT_GT(drill["recovery_s"].get<double>(), 0);
    // Every row of every survivor at every step, and none wrong.
    EXPECT_EQ(r.report["rows_checked"].get<uint64_t>(), 50u * 3 * 6 * 3);
    EXPECT_EQ(r.report["bad_rows"].get<uint64_t>(), 0u);
    for (const char* when : {"before", "during", "after"})
      EXPECT_GT(r.report["tokens_per_s"][when].get<double>(), 0) << when;
  }
}

// A rank removed gracefully while serving (issue 20, item 4): at the step every rank ends the
// rebalance in flight and drains it (PlanResize: its experts to the others, it a source
// only), then it reports and leaves; the others learn the new member set from the next round,
// rebuild the Rearranger and the Balancer over the members and serve on, every row checked.
// A second rank lost while the survivors recover from the first (as their move begins): the
// move ends by name, the next round says who is left, and the survivors place again from what
// each one's slots hold, restoring both ranks' only experts from the host backup.
TEST(DemoTest, ServingSurvivesASecondLossDuringRecovery) {
  struct Drill {
    const char* inject;
    const char* extra;
    std::vector<int> members;
  };
  const Drill drills[] = {
      {"kill:1@20,kill:3@recovery", "--modes async", {0, 2, 4}},
      {"kill:0@15,stop:2@recovery", "--modes sync --spare-rows 6", {1, 3, 4}},
  };
  for (const Drill& d : drills) {
    SCOPED_TRACE(d.inject);
    DemoRun r = Demo(std::string("--serve --ranks 5 --layers 3 --experts 16 --slots-per-rank 6 "
                                 "--expert-bytes 64K --steps 50 --interval 10 --tokens 64 "
                                 "--top-k 4 --work-bytes 1K --deadline 3 --inject ") +
                     d.inject + " " + d.extra);
    ASSERT_FALSE(r.report.is_discarded());
    EXPECT_EQ(r.exit_code, 0) << r.report.dump();
    EXPECT_TRUE(r.report["verified"].get<bool>()) << r.report.dump();
    EXPECT_FALSE(r.report.contains("error")) << r.report.dump();
    const auto& drill = r.report["drill"];
    EXPECT_EQ(drill["epoch"].get<int>(), 3);
    EXPECT_EQ(drill["members"].get<std::vector<int>>(), d.members);
    EXPECT_EQ(drill["placements"].get<int>(), 2) << drill.dump();
    ASSERT_EQ(drill["restarts"].size(), 1u) << drill.dump();
    EXPECT_NE(drill["restarts"][0].get<std::string>().find("epoch 2 -> 3"), std::string::npos)
        << drill.dump();
    EXPECT_GT(drill["experts_recovered"].get<int>(), 0);
    // Every row of the three survivors at every step, none wrong.
    EXPECT_EQ(r.report["rows_checked"].get<uint64_t>(), 50u * 3 * 6 * 3);
    EXPECT_EQ(r.report["bad_rows"].get<uint64_t>(), 0u);
  }
}

TEST(DemoTest, ServingDrainsARankThatLeaves) {
  struct Case {
    const char* resize;
    const char* extra;
    int rank;
  };
  const Case cases[] = {{"remove:1@25", "--modes async", 1},
                        {"remove:0@12", "--modes sync --spare-rows 6", 0},
                        {"remove:2@7", "--modes off", 2}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.resize);
    DemoRun r = ServeDrill(std::string("--deadline 3 --resize ") + c.resize + " " + c.extra);
    ASSERT_FALSE(r.report.is_discarded());
    EXPECT_EQ(r.exit_code, 0) << r.report.dump();
    EXPECT_TRUE(r.report["verified"].get<bool>()) << r.report.dump();
    const auto& drill = r.report["drill"];
    EXPECT_EQ(drill["fault"], "remove");
    EXPECT_EQ(drill["epoch"].get<int>(), 2);
    EXPECT_EQ(drill["members"].get<std::vector<int>>(), MembersWithout(c.rank));
    EXPECT_EQ(drill["experts_recovered"].get<int>(), 0);  // drained, nothing lost
    EXPECT_GT(drill["bytes_moved_among_survivors"].get<uint64_t>(), 0u);
    EXPECT_EQ(r.report["rows_checked"].get<uint64_t>(), 50u * 3 * 6 * 3);
    EXPECT_EQ(r.report["bad_rows"].get<uint64_t>(), 0u);
  }
}

// `--resize add:RANK@STEP`: RANK serves from the start of nothing; at STEP a member asks for
// it, its process starts and joins while the others serve on; then every member re-places
// over the four and the new rank serves its share, every row it uses checked.
TEST(DemoTest, ServingTakesInARankThatJoins) {
  struct Case {
    const char* resize;
    const char* extra;
    int rank, step;
  };
  const Case cases[] = {{"add:3@5", "--modes async", 3, 5},
                        {"add:0@8", "--modes sync --spare-rows 6", 0, 8},
                        {"add:2@4", "--modes off", 2, 4}};
  constexpr int kSteps = 300;  // the members serve on while the new process starts
  for (const Case& c : cases) {
    SCOPED_TRACE(c.resize);
    DemoRun r =
        ServeDrill(std::string("--deadline 3 --resize ") + c.resize + " " + c.extra, kSteps);
    ASSERT_FALSE(r.report.is_discarded());
    EXPECT_EQ(r.exit_code, 0) << r.report.dump();
    EXPECT_TRUE(r.report["verified"].get<bool>()) << r.report.dump();
    EXPECT_FALSE(r.report.contains("error")) << r.report.dump();
    const auto& drill = r.report["drill"];
    EXPECT_EQ(drill["fault"], "add");
    EXPECT_EQ(drill["rank"].get<int>(), c.rank);
    EXPECT_EQ(drill["epoch"].get<int>(), 2);
    EXPECT_EQ(drill["members"].get<std::vector<int>>(), (std::vector<int>{0, 1, 2, 3}));
    EXPECT_EQ(drill["experts_recovered"].get<int>(), 0);  // nothing lost: no backup used
    EXPECT_EQ(drill["backup_bytes"].get<double>(), 0);
    // Its share: its 3 layers x 6 slots filled from the others.
    EXPECT_GE(drill["bytes_moved_among_survivors"].get<uint64_t>(), 3u * 6 * (64u << 10));
    const int joined = drill["detected_step"].get<int>();
    EXPECT_GE(joined, c.step);
    ASSERT_LT(joined, kSteps - 1) << "the new rank never served";
    // The three members every step, the new rank from the step after it joined: every row.
    EXPECT_EQ(r.report["rows_checked"].get<uint64_t>(),
              3u * kSteps * 3 * 6 + static_cast<uint64_t>(kSteps - joined - 1) * 3 * 6);
    EXPECT_EQ(r.report["bad_rows"].get<uint64_t>(), 0u);
    // Rebalancing goes on with the new rank in it (its asynchronous rearrangements' ids
    // continue from the members').
    if (std::string(c.extra).find("off") == std::string::npos) {
      EXPECT_GT(drill["rebalances_after"].get<int>(), 0) << drill.dump();
    }
  }
}

// Issue 35: any sequence of membership events in one run (the failover protocol is the
// library's ServingGroup): rank 1 killed at step 20, rank 3 stopped at step 40 (a second,
// separate loss), a new process for rank 1 at step 60 (the lost rank comes back and joins),
// rank 4 killed at step 220 (a loss after the join: the joined process keeps a backup of its
// own, since an expert counts as recoverable only where every member's backups hold it).
// The members settle each in turn and serve on, every row every step used checked.
// The members serve on while the new process starts (as an engine's would): it joined 25-27
// steps after it was asked for under ASan on an idle host (2026-12-07), and once, under ctest
// -j2 beside other tests, more than 60 (the kill, then at step 120, came first and the two
// changes settled as one). The kill is 160 steps after the ask, six times that.
TEST(DemoTest, ServingGoesOnThroughLossesAndALostRankComingBack) {
  constexpr int kSteps = 300;
  DemoRun r = Demo(
      "--serve --modes async --ranks 5 --layers 3 --experts 16 --slots-per-rank 6 "
      "--expert-bytes 64K --steps 300 --interval 10 --tokens 64 --top-k 4 --work-bytes 1K "
      "--deadline 3 --inject kill:1@20,stop:3@40,kill:4@220 --resize add:1@60");
  ASSERT_FALSE(r.report.is_discarded());
  EXPECT_EQ(r.exit_code, 0) << r.report.dump();
  EXPECT_TRUE(r.report["verified"].get<bool>()) << r.report.dump();
  const auto& drill = r.report["drill"];
  EXPECT_EQ(drill["detected_step"].get<int>(), 20);
  EXPECT_EQ(drill["epoch"].get<int>(), 5);
  EXPECT_EQ(drill["members"].get<std::vector<int>>(), (std::vector<int>{0, 1, 2}));
  const auto& events = drill["events"];
  ASSERT_EQ(events.size(), 4u) << drill.dump();
  const std::vector<std::vector<int>> members = {{0, 2, 3, 4}, {0, 2, 4}, {0, 1, 2, 4}, {0, 1, 2}};
  const char* kinds[] = {"loss", "loss", "join", "loss"};
  for (size_t k = 0; k < 4; ++k) {
    EXPECT_EQ(events[k]["kind"], kinds[k]) << events.dump();
    EXPECT_EQ(events[k]["epoch"].get<int>(), static_cast<int>(k) + 2);
    EXPECT_EQ(events[k]["members"].get<std::vector<int>>(), members[k]);
  }
  EXPECT_EQ(events[0]["step"].get<int>(), 20);
  EXPECT_GE(events[1]["step"].get<int>(), 40);
  EXPECT_GE(events[2]["step"].get<int>(), 60);
  EXPECT_EQ(events[3]["step"].get<int>(), 220);
  // Rank 1's and rank 3's only experts came from the backup, and after the join rank 4's
  // (6-11 in runs of 2026-12-05: the joined process's own backup holds them too).
  EXPECT_GT(events[0]["experts_recovered"].get<int>() + events[1]["experts_recovered"].get<int>(),
            0);
  EXPECT_GT(events[3]["experts_recovered"].get<int>(), 0) << events.dump();
  EXPECT_EQ(r.report["bad_rows"].get<uint64_t>(), 0u);
  EXPECT_GT(r.report["rows_checked"].get<uint64_t>(), 3u * kSteps * 3 * 6 / 2);
}

TEST(DemoTest, BadFlagsAreRejectedBeforeAnythingStarts) {
  const std::pair<const char*, const char*> cases[] = {
      {"--inject explode:1", "--inject 'explode:1': expected KIND:RANK with KIND one of"},
      {"--inject kill:9", "--inject kill:9: the rank is '9': out of range (expected 0 .. 3)"},
      // Issue 17, items 12, 13 and 16: no wraps, no silent defaults.
      {"--inject kill:abc", "the rank is 'abc': expected an integer (expected 0 .. 3)"},
      {"--expert-bytes 18014398509481985K", "--expert-bytes '18014398509481985K': expected bytes"},
      {"--expert-bytes 300M", "(at most 256M)"},
      {"--deadline 0.01", "--deadline 0.01: expected at least 0.1 seconds"},
      {"--inject kill:1@never", "the phase after @ must be exchange, transfer or commit"},
      {"--ranks 2 --slots-per-rank 4 --experts 64",
       "--ranks 2 x --slots-per-rank 4 slots cannot hold --experts 64"},
      {"--ranks 1", "--ranks 1: expected 2..64"},
      {"--layers 0", "--layers 0: expected 1..4096"},
      {"--tensors 0", "--tensors 0: expected 1..16"},
      {"--steps 0", "--steps 0: expected at least 1"},
      {"--deadline 0", "--deadline 0: expected > 0 seconds"},
      {"--expert-bytes 12Q", "--expert-bytes '12Q': expected bytes like 4096, 64K, 1M"},
      {"--transport ib", "--transport: unknown transport 'ib' (expected auto, shm or tcp)"},
      {"--paths shm,rdma", "--paths: unknown data path 'rdma' (expected shm, cma or ucx)"},
      {"--paths cma,cma", "--paths: 'cma' listed twice"},
      {"--serve --modes off,turbo", "--modes: unknown mode 'turbo' (expected off, sync, async)"},
      {"--serve --modes sync,sync", "--modes: 'sync' listed twice"},
      {"--serve --limit-each-step",
       "--limit-each-step measures the rearrangement demo's steps (without --serve)"},
      {"--serve --interval 0", "--interval 0: expected 1..--steps (300)"},
      {"--serve --steps 10 --interval 20", "--interval 20: expected 1..--steps (10)"},
      {"--serve --top-k 65", "--tokens 512 and --top-k 65: expected >= 1, and top-k <= --experts"},
      {"--serve --policy greedy", "--policy"},
      {"--serve --work-bytes 4", "--work-bytes 4: expected at least 8"},
      {"--serve --modes async --inject kill:1",
       "--inject 'kill:1': with --serve expected kill:RANK@STEP or stop:RANK@STEP"},
      {"--serve --modes async --inject stall:1@5", "with --serve expected kill:RANK@STEP"},
      {"--serve --modes async --inject kill:1@300",
       "the step is '300': out of range (expected 1 .. 299)"},
      {"--serve --modes async --inject kill:4@30",
       "the rank is '4': out of range (expected 0 .. 3)"},
      {"--serve --inject kill:1@30", "with --serve drills one mode: pass --modes sync"},
      {"--serve --modes async --ranks 2 --slots-per-rank 40 --inject kill:1@30",
       "needs at least 3 ranks (two go on)"},
      {"--serve --modes async --inject kill:1@30",
       "--inject kill:1@30: after kill:1@30 the 3 members would have 54 slots for --experts 64"},
      {"--serve --modes async --ranks 5 --inject kill:1@30,kill:1@recovery",
       "kill:1@recovery must strike a member other than the one of kill:1@30"},
      {"--serve --modes async --ranks 5 --inject kill:2@recovery,kill:1@30",
       "kill:2@recovery strikes during the recovery from the fault listed before it"},
      {"--serve --modes async --ranks 5 --inject kill:1@30,kill:2@30",
       "two events at step 30; one membership event per step"},
      {"--serve --modes async --ranks 6 --inject kill:1@30,kill:1@40",
       "kill:1@40: rank 1 is no member then (lost or removed earlier, not added back)"},
      {"--serve --modes async --ranks 6 --resize add:2@30,add:2@40",
       "add:2@40: rank 2 is a member then"},
      {"--serve --modes async --ranks 5 --inject kill:1@30,kill:2@recovery --slots-per-rank 18",
       "after kill:1@30 the 3 members would have 54 slots for --experts 64"},
      {"--serve --modes async --resize grow:1@30",
       "--resize 'grow:1@30': expected remove:RANK@STEP (the rank is drained at that step, then "
       "leaves) or add:RANK@STEP"},
      {"--serve --modes async --ranks 3 --experts 40 --resize add:1@30",
       "--resize add:1@30: the 2 members at the start would have 36 slots for --experts 40"},
      {"--resize remove:1@2", "--resize drills the serving demo (--serve)"},
      {"--serve --modes async --ranks 5 --resize remove:1@30 --inject kill:2@recovery",
       "strikes during the recovery from the fault listed before it"},
  };
  // Numbers that are not numbers of the flag's kind: usage errors (exit 2), before anything.
  const std::pair<const char*, const char*> usage[] = {
      {"--deadline inf", "--deadline: the value is 'inf': not finite"},
      {"--deadline nan", "not a number (NaN)"},
      {"--deadline -1", "out of range (expected 0 .. 86400)"},
      {"--layers 2.7", "--layers: the value is '2.7': not an integer"},
      {"--steps 4294967298", "--steps: the value is '4294967298': out of range"},
      {"--seed -1", "--seed: the value is '-1': negative"},
      {"--spare-rows -1", "--spare-rows: the value is '-1': out of range (expected 0 .. 65536)"},
      {"--spare-rows 1.5", "--spare-rows: the value is '1.5': not an integer"},
  };
  for (int exit_code : {2, 1}) {
    using Cases = std::span<const std::pair<const char*, const char*>>;
    for (const auto& [args, needle] : exit_code == 2 ? Cases(usage) : Cases(cases)) {
      const Shell r = RunShell(std::string(EPLBX_CLI) + " demo " + args + " 2>&1 >/dev/null");
      const std::string& err = r.out;
      EXPECT_EQ(r.exit_code, exit_code) << args;
      EXPECT_EQ(err.rfind("eplbx: error: ", 0), 0u) << args << ": " << err;
      EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << args << ": " << err;
      EXPECT_NE(err.find(needle), std::string::npos) << args << ": " << err;
    }
  }
}

// A bad EPLBX_TRANSPORT: before, half the runs lost the ranks' error ("rank 0 exited without
// a report": its report was read after its exit was counted) and the others said "weights
// intact: NO" though no rank had created weights (issue 17, item 14). Now it is refused
// before any rank starts, and a failure before the weights exist says so.
TEST(DemoTest, ABadTransportVariableIsOneErrorBeforeAnyRankStarts) {
  for (int run = 0; run < 5; ++run) {
    const std::string cmd = std::string("EPLBX_TRANSPORT=ib ") + EPLBX_CLI +
                            " demo --ranks 2 --layers 1 --experts 4 --slots-per-rank 2 "
                            "--expert-bytes 4K --steps 1 2>&1";
    FILE* p = popen(cmd.c_str(), "r");
    std::string out;
    char buf[4096];
    while (size_t n = fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
    const int rc = pclose(p);
    EXPECT_EQ(WIFEXITED(rc) ? WEXITSTATUS(rc) : 128, 1) << out;
    EXPECT_EQ(out,
              "eplbx: error: environment variable EPLBX_TRANSPORT: unknown transport 'ib' "
              "(expected auto, shm or tcp)\n");
  }
}

// `world` worker processes on this machine, each its own node (EPLBX_NODE=n<rank>, backups
// in a fresh directory of their own), meeting at rank 0's store on `port`, all with `flags`;
// returns rank 0's output (stdout), every rank's exit code (rank 0's at [0]) and the names
// left in the backup directory.
struct Workers {
  Shell zero;
  std::vector<int> codes;
  std::vector<std::string> err;   // each rank's stderr (rank 0's: empty)
  std::vector<std::string> left;  // names in the backup directory after all exited
};
// The variables of worker `rank` of `world` meeting at rank 0's store on `port`, a node of its
// own (EPLBX_NODE=n<rank>), its backups in `dir`.
std::string WorkerEnv(int port, int world, int rank, const std::string& dir) {
  return "EPLBX_MASTER_ADDR=127.0.0.1 EPLBX_MASTER_PORT=" + std::to_string(port) +
         " EPLBX_RANK=" + std::to_string(rank) + " EPLBX_WORLD_SIZE=" + std::to_string(world) +
         " EPLBX_TOKEN=t EPLBX_NODE=n" + std::to_string(rank) + " EPLBX_BACKUP_DIR=" + dir + " ";
}

// Waits (up to `seconds`) until `file` holds `text`.
bool FileSays(const std::string& file, const std::string& text, int seconds) {
  for (int i = 0; i < seconds * 20; ++i) {
    if (RunShell("cat " + file).out.find(text) != std::string::npos) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

// Waits (up to 30 s) until rank 0's stderr, in `err_file`, says it served step `step`
// (rank 0 prints progress every 100 steps in text mode).
bool ZeroReached(const std::string& err_file, int step) {
  return FileSays(err_file, "step " + std::to_string(step) + "/", 30);
}

// `env_of` adds variables to one rank's environment ("VAR=value ", by rank). A `standby` rank
// (`--resize add:RANK@STEP`; -1: none) starts with rank 0, before the others, and they start
// once it says it is ready to join: a pre-warmed standby, as an operator would start one (the
// members do not wait for it; started with them, it may still be setting up when they end).
Workers RunWorkers(int world, int port, const std::string& flags,
                   const std::map<int, std::string>& env_of = {}, int standby = -1) {
  std::string dir = testing::TempDir() + "/workers-XXXXXX";
  EXPECT_NE(mkdtemp(dir.data()), nullptr);
  std::string standby_err = testing::TempDir() + "/standby-err-XXXXXX";
  const int standby_fd = mkstemp(standby_err.data());
  EXPECT_GE(standby_fd, 0);
  close(standby_fd);
  auto env = [&](int rank) {
    return WorkerEnv(port, world, rank, dir) +
           (env_of.count(rank) ? env_of.at(rank) : std::string());
  };
  Workers w;
  w.codes.assign(world, -1);
  w.err.assign(world, "");
  std::vector<std::thread> running;
  auto start = [&](int r) {
    running.emplace_back([&, r] {
      if (r == 0) {
        w.zero = RunShell(env(0) + EPLBX_CLI + " worker" + flags + " 2>/dev/null");
        return;
      }
      const std::string out =
          r == standby ? " 2>" + standby_err + " >/dev/null" : std::string(" 2>&1 >/dev/null");
      const Shell s = RunShell(env(r) + EPLBX_CLI + " worker" + flags + out);
      w.codes[r] = s.exit_code;
      w.err[r] = r == standby ? RunShell("cat " + standby_err).out : s.out;
    });
  };
  if (standby > 0) {
    start(0);
    start(standby);
    EXPECT_TRUE(
        FileSays(standby_err, "eplbx: rank " + std::to_string(standby) + ": ready to join", 60))
        << "the standby rank " << standby << " never said it was ready";
  }
  for (int r = 1; r < world; ++r) {
    if (r != standby) start(r);
  }
  if (standby <= 0) start(0);
  for (std::thread& t : running) t.join();
  w.codes[0] = w.zero.exit_code;
  std::filesystem::remove(standby_err);
  for (const auto& entry : std::filesystem::directory_iterator(dir))
    w.left.push_back(entry.path().filename().string());
  std::filesystem::remove_all(dir);
  return w;
}

// UCX prints its messages on stdout unless told otherwise; eplbx sends them to stderr (unless
// UCX_LOG_FILE is set), so a worker's --json stays one JSON document with UCX talking (here
// at info level; a UCX warning at a failed run's teardown once broke a report this way).
TEST(DemoTest, UcxMessagesGoToStderrAndTheJsonStaysClean) {
  const std::string flags =
      " --json --layers 2 --experts 8 --slots-per-rank 5 --expert-bytes 4K --steps 1 "
      "--paths ucx --deadline 10";
  Workers w =
      RunWorkers(2, eplbx::Port(), flags, {{0, "UCX_LOG_LEVEL=info "}, {1, "UCX_LOG_LEVEL=info "}});
  EXPECT_EQ(w.codes, (std::vector<int>{0, 0})) << w.err[1];
  const nlohmann::json report = nlohmann::json::parse(w.zero.out, nullptr, false);
  ASSERT_FALSE(report.is_discarded()) << "rank 0's stdout is not one JSON document:\n"
                                      << w.zero.out.substr(0, 300);
  EXPECT_TRUE(report.value("verified", false));
  EXPECT_NE(w.err[1].find("eplbx: UCX INFO"), std::string::npos) << w.err[1].substr(0, 300);
}

// Issue 33, item 6: a serving worker other than rank 0 that fails says why (it said only
// `rank 1: failed (rank 0 prints the whole report while it runs)`). Rank 1's node's backup
// cannot be made: rank 1 names the directory and the reason.
TEST(DemoTest, AServingWorkerThatFailsSaysWhy) {
  Workers w = RunWorkers(3, eplbx::Port(),
                         " --serve --modes async --layers 2 --experts 16 --slots-per-rank 8 "
                         "--expert-bytes 4K --steps 30 --interval 10 --tokens 64 --top-k 4 "
                         "--work-bytes 1K --deadline 3 --json",
                         {{1, "EPLBX_BACKUP_DIR=/nonexistent/eplbx-backups "}});
  EXPECT_NE(w.codes[1], 0);
  EXPECT_NE(w.err[1].find("eplbx: error: rank 1: host backup '/nonexistent/eplbx-backups/"
                          "eplbx-backup-"),
            std::string::npos)
      << w.err[1];
  EXPECT_NE(w.err[1].find("': creating it: No such file or directory"), std::string::npos)
      << w.err[1];
  EXPECT_EQ(w.err[1].find("rank 1: failed"), std::string::npos) << w.err[1];
  EXPECT_NE(w.codes[0], 0) << w.zero.out;  // the group cannot serve without rank 1
}

// Issue 33, item 6: rank 0 (the store) stopped while three workers serve: the others notice
// within 2 x --deadline of the step they wait in and say so (it took 4 x: a final barrier
// waited again for the coordinator that could not answer).
TEST(DemoTest, WorkersNoticeAStoppedRankZeroWithinTwiceTheDeadline) {
  const int port = eplbx::Port();
  std::string dir = testing::TempDir() + "/stopped0-XXXXXX";
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  const std::string flags =
      " --serve --modes async --layers 2 --experts 16 --slots-per-rank 8 --expert-bytes 4K "
      "--steps 1000000 --interval 50 --tokens 64 --top-k 4 --work-bytes 1K --deadline 2";
  auto env = [&](int rank) { return WorkerEnv(port, 3, rank, dir); };
  const Shell zero = RunShell(env(0) + EPLBX_CLI + " worker" + flags + " >/dev/null 2>" + dir +
                              "/zero.err & echo $!");
  const pid_t pid = static_cast<pid_t>(std::stol(zero.out));
  Shell one, two;
  std::chrono::steady_clock::time_point one_done, two_done;
  std::thread t1([&] {
    one = RunShell(env(1) + EPLBX_CLI + " worker" + flags + " 2>&1 >/dev/null");
    one_done = std::chrono::steady_clock::now();
  });
  std::thread t2([&] {
    two = RunShell(env(2) + EPLBX_CLI + " worker" + flags + " 2>&1 >/dev/null");
    two_done = std::chrono::steady_clock::now();
  });
  const bool serving = ZeroReached(dir + "/zero.err", 200);
  const auto stopped = std::chrono::steady_clock::now();
  kill(pid, SIGSTOP);
  t1.join();
  t2.join();
  kill(pid, SIGKILL);
  kill(pid, SIGCONT);
  const std::string zero_err = RunShell("cat " + dir + "/zero.err").out;
  std::filesystem::remove_all(dir);
  // (With what every worker said: a CI run once saw rank 0 short of step 200 after 30 s
  // where it takes about 4.)
  ASSERT_TRUE(serving) << "the workers never served 200 steps; rank 0 said:\n"
                       << zero_err << "\nrank 1:\n"
                       << one.out << "\nrank 2:\n"
                       << two.out;
  for (const auto& [out, done] : {std::pair{one, one_done}, std::pair{two, two_done}}) {
    EXPECT_NE(out.exit_code, 0);
    EXPECT_NE(out.out.find("the coordinator (rank 0's store) did not answer the step's collective "
                           "within 4 s (2 x --deadline): rank 0 stopped, hung or unreachable"),
              std::string::npos)
        << out.out;
    const double took = std::chrono::duration<double>(done - stopped).count();
    EXPECT_LT(took, 6.5) << "2 x --deadline is 4 s; 4 x would be 8 s";
  }
}

// Issue 33, item 6: a serving run that fails after a recovered loss reports what happened up
// to the failure (it said "no rank was lost", tokens/s 0, rebalances 0). Four workers; rank 3
// is killed after step 200 (the others recover), rank 2 after step 600.
TEST(DemoTest, AFailedServingRunReportsWhatHappenedUpToTheFailure) {
  const int port = eplbx::Port();
  std::string dir = testing::TempDir() + "/failedrun-XXXXXX";
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  const std::string flags =
      " --serve --modes async --layers 2 --experts 16 --slots-per-rank 6 --expert-bytes 4K "
      "--steps 100000 --interval 50 --tokens 64 --top-k 4 --work-bytes 1K --deadline 2";
  auto env = [&](int rank) { return WorkerEnv(port, 4, rank, dir); };
  Shell zero;
  std::thread t0(
      [&] { zero = RunShell(env(0) + EPLBX_CLI + " worker" + flags + " 2>" + dir + "/zero.err"); });
  std::vector<pid_t> pids(4, -1);
  for (int r = 1; r < 4; ++r) {
    const Shell bg =
        RunShell(env(r) + EPLBX_CLI + " worker" + flags + " >/dev/null 2>&1 & echo $!");
    pids[r] = static_cast<pid_t>(std::stol(bg.out));
  }
  const bool first = ZeroReached(dir + "/zero.err", 200);
  kill(pids[3], SIGKILL);
  const bool second = first && ZeroReached(dir + "/zero.err", 600);
  kill(pids[2], SIGKILL);
  t0.join();
  kill(pids[1], SIGKILL);  // if it still runs
  const std::string err = RunShell("cat " + dir + "/zero.err").out;
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(first && second) << zero.out << err;
  // After the second loss two ranks' 12 slots cannot hold 16 experts: the run fails, by name.
  EXPECT_NE(zero.exit_code, 0) << zero.out;
  EXPECT_NE(err.find("eplbx: error: "), std::string::npos) << err;
  // The text report (rank 0 prints progress only in text mode).
  const std::string& out = zero.out;
  EXPECT_NE(out.find("serving on 4 ranks (async mode): lost [3] at step "), std::string::npos)
      << out;
  EXPECT_EQ(out.find("no rank was lost"), std::string::npos) << out;
  const size_t at = out.find("tokens/s before ");
  ASSERT_NE(at, std::string::npos) << out;
  EXPECT_GT(std::stod(out.substr(at + 16)), 0) << out;
  EXPECT_NE(out.find("every row a step used checked against its map: yes"), std::string::npos)
      << out;
}

// `eplbx worker --serve`: three worker processes meet through rank 0's store; rank 2 is
// killed while they serve; ranks 0 and 1 go on over themselves with rank 2's only experts
// from their nodes' backups (each worker a node of its own), every row checked.
TEST(DemoTest, WorkersServingGoOnAfterAWorkerIsKilled) {
  const int port = eplbx::Port();
  Workers w = RunWorkers(3, port,
                         " --serve --modes async --layers 3 --experts 16 --slots-per-rank 8 "
                         "--expert-bytes 64K --steps 60 --interval 10 --tokens 64 --top-k 4 "
                         "--work-bytes 1K --deadline 3 --inject kill:2@25 --json");
  // No backup file is left behind, not even the killed worker's node's (issue 33, item 1:
  // the names are removed once every rank of the node opened them).
  EXPECT_TRUE(w.left.empty()) << w.left.front();
  const Shell& zero = w.zero;
  EXPECT_EQ(w.codes[0], 0) << zero.out;
  EXPECT_EQ(w.codes[1], 0);
  EXPECT_NE(w.codes[2], 0);  // killed
  const nlohmann::json report = nlohmann::json::parse(zero.out, nullptr, false);
  ASSERT_FALSE(report.is_discarded()) << zero.out;
  EXPECT_TRUE(report["verified"].get<bool>()) << report.dump();
  const auto& drill = report["drill"];
  EXPECT_EQ(drill["detected_step"].get<int>(), 25);
  EXPECT_EQ(drill["members"].get<std::vector<int>>(), (std::vector<int>{0, 1}));
  EXPECT_GT(drill["experts_recovered"].get<int>(), 0) << drill.dump();
  // Each node's backup holds every expert: 3 layers x 16 experts x 64 KiB.
  EXPECT_EQ(drill["backup_bytes"].get<double>(), 3.0 * 16 * 65536);
  EXPECT_EQ(report["rows_checked"].get<uint64_t>(), 2u * 60 * 3 * 8);
  EXPECT_EQ(report["bad_rows"].get<uint64_t>(), 0u);
}

// Issue 31: coordination on etcd, across processes. Three etcd members on loopback; four
// `eplbx worker --serve --coordination etcd://...` processes, no store, no coordinator. Rank 0
// kills itself at step 60 (SIGKILL: its lease runs out); while its loss is being detected and
// settled, the etcd leader is killed, and later another etcd member. Rank 2 stops itself at
// step 500 (SIGSTOP, as a hung host) and stays stopped past its lease. Ranks 1 and 3 serve to
// step 1000 over themselves, every row checked, exit 0, in one epoch with one placement.
TEST(DemoTest, WorkersOnEtcdServeOnWhenRankZeroAndEtcdMembersAreKilled) {
  eplbx::testing::EtcdCluster cluster(3);
  if (!cluster.ready()) GTEST_SKIP() << "SKIPPED: " << cluster.why_not();
  std::string dir = testing::TempDir() + "/etcdworkers-XXXXXX";
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  std::string url;
  for (const std::string& e : cluster.endpoints()) {
    url += url.empty() ? "etcd://" : ",";
    url += e;
  }
  const std::string flags =
      " --serve --modes async --layers 3 --experts 16 --slots-per-rank 8 --expert-bytes 64K "
      "--steps 1000 --interval 10 --tokens 64 --top-k 4 --work-bytes 1K --deadline 2 --json "
      "--group drill --coordination " +
      url + " --inject kill:0@60,stop:2@500";
  std::vector<Shell> out(4);
  std::vector<std::thread> workers;
  for (int r = 0; r < 4; ++r) {
    workers.emplace_back([&, r] {
      const std::string n = std::to_string(r);
      // In the background with its pid written down (a stopped process never exits itself).
      out[r] = RunShell("EPLBX_RANK=" + n + " EPLBX_WORLD_SIZE=4 EPLBX_TOKEN=t EPLBX_NODE=n" + n +
                        " EPLBX_BACKUP_DIR=" + dir + " " + EPLBX_CLI + " worker" + flags + " 2>" +
                        dir + "/err" + n + " & echo $! >" + dir + "/pid" + n + "; wait $!");
    });
  }
  // Rank 0's process ends at step 60 (killed); a second later, while its lease (2 s) runs
  // out and the others settle, the etcd leader goes; later a follower too.
  workers[0].join();
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  const int leader = cluster.Leader();
  EXPECT_GE(leader, 0) << "no etcd leader found";
  if (leader >= 0) {
    cluster.Kill(leader);
    std::this_thread::sleep_for(std::chrono::milliseconds(3000));
    cluster.Restart(leader);
    std::this_thread::sleep_for(std::chrono::milliseconds(1000));
    cluster.Kill(leader == 0 ? 1 : 0);
  }
  for (int r : {1, 3}) workers[r].join();
  const std::string stopped = RunShell("cat " + dir + "/pid2").out;
  RunShell("kill -9 " + stopped);  // rank 2, stopped since step 500
  workers[2].join();
  std::string errs;
  for (int r = 0; r < 4; ++r) errs += RunShell("cat " + dir + "/err" + std::to_string(r)).out;
  std::filesystem::remove_all(dir);
  EXPECT_NE(out[0].exit_code, 0);  // killed
  EXPECT_NE(out[2].exit_code, 0);  // stopped, then killed
  std::string digest;
  for (int r : {1, 3}) {
    SCOPED_TRACE("rank " + std::to_string(r) + ": " + out[r].out + errs);
    EXPECT_EQ(out[r].exit_code, 0);
    const nlohmann::json rep = nlohmann::json::parse(out[r].out, nullptr, false);
    ASSERT_FALSE(rep.is_discarded());
    EXPECT_TRUE(rep["verified"].get<bool>());
    EXPECT_EQ(rep["drill"]["members"].get<std::vector<int>>(), (std::vector<int>{1, 3}));
    EXPECT_EQ(rep["coordination"]["epoch"].get<int>(), 3);  // two losses
    EXPECT_EQ(rep["drill"]["detected_step"].get<int>(), 60);
    ASSERT_EQ(rep["drill"]["events"].size(), 2u);
    EXPECT_EQ(rep["drill"]["events"][1]["step"].get<int>(), 500);
    if (digest.empty()) digest = rep["placement_digest"].get<std::string>();
    EXPECT_EQ(rep["placement_digest"].get<std::string>(), digest);
  }
}

// Issue 35: a worker restarted for a lost rank (what systemd or Kubernetes does) rejoins the
// group as a new member: four workers serve; worker 2 is killed after step 200 and started
// again with the same command; the store welcomes it as a joiner, the members take it back
// in and all four serve to the end, every row checked. (It killed the group: "rank 2 joined:
// epoch 3 ...".)
TEST(DemoTest, AWorkerRestartedForALostRankRejoinsTheGroup) {
  const int port = eplbx::Port();
  std::string dir = testing::TempDir() + "/restart-XXXXXX";
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  const std::string flags =
      " --serve --modes async --layers 2 --experts 16 --slots-per-rank 6 --expert-bytes 4K "
      "--steps 3000 --interval 50 --tokens 64 --top-k 4 --work-bytes 1K --deadline 2";
  auto env = [&](int rank) { return WorkerEnv(port, 4, rank, dir); };
  Shell zero;
  std::thread t0(
      [&] { zero = RunShell(env(0) + EPLBX_CLI + " worker" + flags + " 2>" + dir + "/zero.err"); });
  std::vector<Shell> out(4);
  std::vector<std::thread> others;
  pid_t two = -1;
  for (int r : {1, 3}) {
    others.emplace_back(
        [&, r] { out[r] = RunShell(env(r) + EPLBX_CLI + " worker" + flags + " 2>&1 >/dev/null"); });
  }
  const Shell bg = RunShell(env(2) + EPLBX_CLI + " worker" + flags + " >/dev/null 2>&1 & echo $!");
  two = static_cast<pid_t>(std::stol(bg.out));
  const bool serving = ZeroReached(dir + "/zero.err", 200);
  kill(two, SIGKILL);
  // Started again, the same command line.
  others.emplace_back(
      [&] { out[2] = RunShell(env(2) + EPLBX_CLI + " worker" + flags + " 2>&1 >/dev/null"); });
  t0.join();
  for (std::thread& t : others) t.join();
  const std::string err = RunShell("cat " + dir + "/zero.err").out;
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(serving) << zero.out << err;
  EXPECT_EQ(zero.exit_code, 0) << zero.out << err;
  for (int r : {1, 2, 3}) EXPECT_EQ(out[r].exit_code, 0) << "rank " << r << ": " << out[r].out;
  const std::string& text = zero.out;
  EXPECT_NE(text.find("lost [2] at step "), std::string::npos) << text;
  EXPECT_NE(text.find("membership events:"), std::string::npos) << text;
  EXPECT_NE(text.find(": loss, epoch 2, members [0,1,3]"), std::string::npos) << text;
  EXPECT_NE(text.find(": join, epoch 3, members [0,1,2,3]"), std::string::npos) << text;
  EXPECT_NE(text.find("every row a step used checked against its map: yes"), std::string::npos)
      << text;
}

// `eplbx worker --serve --resize add:3@20`: workers 0-2 serve; worker 3, started with them as
// a standby, is held by the store until a member asks for it at step 20, then joins under
// a new epoch and takes its share; every row of all four checked.
TEST(DemoTest, WorkersServingTakeInAStandbyWorker) {
  constexpr int kSteps = 200;
  Workers w = RunWorkers(4, eplbx::Port(),
                         " --serve --modes async --layers 3 --experts 16 --slots-per-rank 6 "
                         "--expert-bytes 64K --steps 200 --interval 10 --tokens 64 --top-k 4 "
                         "--work-bytes 1K --deadline 10 --resize add:3@20 --json",
                         {}, /*standby=*/3);
  const Shell& zero = w.zero;
  EXPECT_EQ(w.codes, (std::vector<int>{0, 0, 0, 0})) << zero.out;
  const nlohmann::json report = nlohmann::json::parse(zero.out, nullptr, false);
  ASSERT_FALSE(report.is_discarded()) << zero.out;
  EXPECT_TRUE(report["verified"].get<bool>()) << report.dump();
  const auto& drill = report["drill"];
  EXPECT_EQ(drill["fault"], "add");
  EXPECT_EQ(drill["members"].get<std::vector<int>>(), (std::vector<int>{0, 1, 2, 3}));
  const int joined = drill["detected_step"].get<int>();
  EXPECT_GE(joined, 20);
  ASSERT_LT(joined, kSteps - 1);
  EXPECT_GE(drill["bytes_moved_among_survivors"].get<uint64_t>(), 3u * 6 * (64u << 10));
  EXPECT_EQ(report["rows_checked"].get<uint64_t>(),
            3u * kSteps * 3 * 6 + static_cast<uint64_t>(kSteps - joined - 1) * 3 * 6);
  EXPECT_EQ(report["bad_rows"].get<uint64_t>(), 0u);
}

// `eplbx worker --serve --resize remove:2@20`: worker 2 is drained at step 20 and leaves
// (exit 0); workers 0 and 1 serve on over themselves; nothing restored.
TEST(DemoTest, WorkersServingDrainAWorkerThatLeaves) {
  Workers w = RunWorkers(3, eplbx::Port(),
                         " --serve --modes sync --layers 3 --experts 16 --slots-per-rank 8 "
                         "--expert-bytes 64K --steps 60 --interval 10 --tokens 64 --top-k 4 "
                         "--work-bytes 1K --deadline 3 --resize remove:2@20 --json");
  EXPECT_EQ(w.codes, (std::vector<int>{0, 0, 0})) << w.zero.out;
  const nlohmann::json report = nlohmann::json::parse(w.zero.out, nullptr, false);
  ASSERT_FALSE(report.is_discarded()) << w.zero.out;
  EXPECT_TRUE(report["verified"].get<bool>()) << report.dump();
  const auto& drill = report["drill"];
  EXPECT_EQ(drill["fault"], "remove");
  EXPECT_EQ(drill["detected_step"].get<int>(), 20);
  EXPECT_EQ(drill["members"].get<std::vector<int>>(), (std::vector<int>{0, 1}));
  EXPECT_EQ(drill["experts_recovered"].get<int>(), 0);
  EXPECT_GT(drill["bytes_moved_among_survivors"].get<uint64_t>(), 0u);
  EXPECT_EQ(report["rows_checked"].get<uint64_t>(), 2u * 60 * 3 * 8);
  EXPECT_EQ(report["bad_rows"].get<uint64_t>(), 0u);
}

// Flags `eplbx worker --serve` refuses before anything starts.
TEST(DemoTest, WorkerServingRefusesWhatItCannotDo) {
  const std::string env =
      "EPLBX_MASTER_ADDR=127.0.0.1 EPLBX_MASTER_PORT=1 EPLBX_RANK=1 EPLBX_WORLD_SIZE=3 "
      "EPLBX_TOKEN=t ";
  const std::pair<const char*, const char*> cases[] = {
      {"--serve", "eplbx worker --serve runs one mode"},
      {"--serve --modes async --plot x.svg", "--plot draws the demo's comparison of modes"},
      {"--serve --modes async --inject kill:0@5",
       "rank 0 serves the rendezvous store, so it cannot be the rank lost or removed"},
  };
  for (const auto& [flags, want] : cases) {
    Shell r = RunShell(env + EPLBX_CLI + " worker --layers 3 --experts 16 --slots-per-rank 8 " +
                       flags + " 2>&1");
    EXPECT_EQ(r.exit_code, 1) << flags << ": " << r.out;
    EXPECT_NE(r.out.find(want), std::string::npos) << flags << ": " << r.out;
  }
}

// A member that sends malformed messages ({"progress": 5}, a report whose fields have the
// wrong types) to rank 0's embedded store. Before: rank 0 aborted (std::terminate, exit 134;
// issue 17, item 9). Now every field from a peer is type-checked: rank 0 ends with a
// one-line error naming rank 1 and the field, exit 1.
TEST(DemoTest, AMalformedReportFromAMemberIsANamedError) {
  const int port = eplbx::Port();  // (below the ephemeral range: 32000 + pid % 1000 was in it)
  const std::string env = "EPLBX_MASTER_ADDR=127.0.0.1 EPLBX_MASTER_PORT=" + std::to_string(port) +
                          " EPLBX_RANK=0 EPLBX_WORLD_SIZE=2 EPLBX_TOKEN=t ";
  const std::string cmd = env + EPLBX_CLI +
                          " worker --layers 1 --experts 4 --slots-per-rank 2 --expert-bytes 4K "
                          "--deadline 3 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  auto member = eplbx::JoinTcpStore("127.0.0.1", static_cast<uint16_t>(port), "t", 1, 2,
                                    std::chrono::milliseconds(10000));
  ASSERT_TRUE(member.ok()) << member.status().ToString();
  EXPECT_TRUE((*member)->SendMessage(R"({"progress": 5})").ok());
  EXPECT_TRUE(
      (*member)->SendMessage(R"({"verified": "yes", "steps": [{"seconds": "fast"}]})").ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  member->reset();  // and leave
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
  const int rc = pclose(p);
  ASSERT_TRUE(WIFEXITED(rc)) << out;
  EXPECT_EQ(WEXITSTATUS(rc), 1) << out;
  EXPECT_NE(out.find("rank 1 sent a malformed report: 'verified' is a string (expected true or "
                     "false)"),
            std::string::npos)
      << out;
  EXPECT_EQ(out.find("terminate"), std::string::npos) << out;
}

}  // namespace
