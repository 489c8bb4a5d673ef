// Runs the real `eplbx` binary as a user would and checks stdout, stderr and the exit code.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "io/npy.h"

namespace {

namespace fs = std::filesystem;

struct CliRun {
  int exit_code;
  std::string out, err;
};

std::string Slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("eplbx_cli_test_" +
            std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string PlanFromDsv3InForce(std::string* load, std::string* shape);

  CliRun Eplbx(const std::string& args) {
    const fs::path out = dir_ / "stdout", err = dir_ / "stderr";
    const std::string cmd =
        std::string(EPLBX_CLI) + " " + args + " >" + out.string() + " 2>" + err.string();
    const int rc = std::system(cmd.c_str());
    return {WIFEXITED(rc) ? WEXITSTATUS(rc) : 128 + WTERMSIG(rc), Slurp(out), Slurp(err)};
  }

  std::string Write(const std::string& name, const std::string& text) {
    const fs::path p = dir_ / name;
    std::ofstream(p, std::ios::binary) << text;
    return p.string();
  }

  // Exactly one line on stderr, starting "eplbx: error: ", containing `needle`.
  void ExpectOneLineError(const CliRun& r, const std::string& needle) {
    EXPECT_NE(r.exit_code, 0);
    EXPECT_TRUE(r.out.empty()) << r.out;
    EXPECT_EQ(r.err.rfind("eplbx: error: ", 0), 0u) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
  }

  fs::path dir_;
};

const char* kReadme =
    "[[90,132,40,61,104,165,39,4,73,56,183,86],[20,107,104,64,19,197,187,157,172,86,16,27]]";

TEST_F(CliTest, PlanReadmeVectorAsJson) {
  const std::string load = Write("load.json", kReadme);
  CliRun r = Eplbx("plan --load " + load + " --slots 16 --ranks 8 --nodes 2 --groups 4");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(r.err.empty()) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["policy"], "deepseek");
  EXPECT_EQ(j["phy2log"][0], nlohmann::json::parse("[5,6,5,7,8,4,3,4,10,9,10,2,0,1,11,1]"));
  EXPECT_EQ(j["phy2log"][1], nlohmann::json::parse("[7,10,6,8,6,11,8,9,2,4,5,1,5,0,3,1]"));
  EXPECT_EQ(j["logcnt"][0], nlohmann::json::parse("[1,2,1,1,2,2,1,1,1,1,2,1]"));
  EXPECT_EQ(j["log2phy"][0][5], nlohmann::json::parse("[0,2]"));
  EXPECT_EQ(j["log2phy"][0][0], nlohmann::json::parse("[12,-1]"));
  EXPECT_EQ(j["balancedness"].size(), 2u);
  EXPECT_TRUE(j["balancedness_total"].is_number_float());
  EXPECT_TRUE(j["plan_ms"].is_number_float());
  EXPECT_GE(j["plan_ms"].get<double>(), 0.0);
}

TEST_F(CliTest, SameAnswerFromEveryFileFormat) {
  const std::string json = Write("l.json", std::string("{\"load\": ") + kReadme + "}");
  const std::string csv = Write("l.csv",
                                "90,132,40,61,104,165,39,4,73,56,183,86\n"
                                "20,107,104,64,19,197,187,157,172,86,16,27\n");
  const std::string npy = Write(
      "l.npy",
      eplbx::io::EncodeNpyF64(2, 12, {90, 132, 40,  61, 104, 165, 39,  4,   73,  56, 183, 86,
                                      20, 107, 104, 64, 19,  197, 187, 157, 172, 86, 16,  27}));
  nlohmann::json first;
  for (const std::string& f : {json, csv, npy}) {
    CliRun r = Eplbx("plan --load " + f + " --slots 16 --ranks 8 --nodes 2 --groups 4");
    ASSERT_EQ(r.exit_code, 0) << f << ": " << r.err;
    nlohmann::json j = nlohmann::json::parse(r.out);
    if (first.is_null()) first = j["phy2log"];
    EXPECT_EQ(j["phy2log"], first) << f;
  }
}

TEST_F(CliTest, OutFileAndTableFormat) {
  const std::string load = Write("load.json", kReadme);
  const std::string out = (dir_ / "plan.json").string();
  CliRun r =
      Eplbx("plan --load " + load + " --slots 16 --ranks 8 --nodes 2 --groups 4 --out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(r.out.empty());
  EXPECT_EQ(nlohmann::json::parse(Slurp(out))["phy2log"].size(), 2u);
  CliRun t = Eplbx("plan --load " + load + " --slots 16 --ranks 8 --format table-full");
  ASSERT_EQ(t.exit_code, 0) << t.err;
  EXPECT_NE(t.out.find("layer 1  balancedness"), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("rank loads:"), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("replicated (expert x replicas): 1x2"), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("balancedness_total"), std::string::npos) << t.out;
}

// The table a person reads (issue 17, item 18): a summary and one layer's rank loads as
// bars, not every slot id of every rank; a DeepSeek-V3-sized plan fits on a screen.
TEST_F(CliTest, TableIsASummaryAtAGlance) {
  CliRun t = Eplbx(std::string("plan --load ") + EPLBX_EXAMPLES +
                   "/dsv3_load.json --slots 288 --ranks 32 --nodes 4 --groups 8 --format table");
  ASSERT_EQ(t.exit_code, 0) << t.err;
  EXPECT_NE(t.out.find("balancedness (mean / max rank load, 1 = perfect): total 0."),
            std::string::npos)
      << t.out;
  EXPECT_NE(t.out.find("replicated experts per layer: "), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("(the least balanced; bar = load / max"), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("  rank 31 #"), std::string::npos) << t.out;
  EXPECT_EQ(t.out.find("slots by rank"), std::string::npos) << t.out;
  EXPECT_LE(std::count(t.out.begin(), t.out.end(), '\n'), 45) << t.out;
  for (size_t at = 0, next; at < t.out.size(); at = next + 1) {
    next = t.out.find('\n', at);
    if (next == std::string::npos) next = t.out.size();
    EXPECT_LE(next - at, 120u) << t.out.substr(at, next - at);
  }
  // Bars scale with load: the heaviest rank's bar is full.
  EXPECT_NE(t.out.find("########################################"), std::string::npos);
}

// --out never replaces what is at the path with a regular file (issue 17, item 4): a FIFO
// and a device are written in place, a link stays a link, a planted PATH.tmp (or a link
// there) is left alone, and a replaced file keeps its mode.
TEST_F(CliTest, OutWritesThroughWhatIsThere) {
  const std::string load = Write("load.json", kReadme);
  const std::string plan = "plan --load " + load + " --slots 16 --ranks 8 --out ";
  struct stat st {};
  // FIFO: a reader gets the JSON; the FIFO is still a FIFO. The reader end is opened here
  // first (non-blocking), so the writer never waits and the test never hangs.
  const fs::path fifo = dir_ / "fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const int rd = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK);
  ASSERT_GE(rd, 0);
  CliRun r = Eplbx(plan + fifo.string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::string got(1 << 16, '\0');
  const ssize_t n = ::read(rd, got.data(), got.size());
  ::close(rd);
  got.resize(n > 0 ? static_cast<size_t>(n) : 0);
  ASSERT_FALSE(got.empty()) << "nothing arrived through the FIFO";
  EXPECT_EQ(nlohmann::json::parse(got)["phy2log"].size(), 2u);
  ASSERT_EQ(::lstat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
  // A character device (a private copy of /dev/null where we may make one).
  const fs::path null = dir_ / "null";
  if (::mknod(null.c_str(), S_IFCHR | 0666, makedev(1, 3)) == 0) {
    r = Eplbx(plan + null.string());
    ASSERT_EQ(r.exit_code, 0) << r.err;
    ASSERT_EQ(::lstat(null.c_str(), &st), 0);
    EXPECT_TRUE(S_ISCHR(st.st_mode)) << "the device became a regular file";
  } else {
    std::printf("[ note ] mknod not permitted here: the device case ran on /dev/null\n");
    r = Eplbx(plan + "/dev/null");
    ASSERT_EQ(r.exit_code, 0) << r.err;
    ASSERT_EQ(::lstat("/dev/null", &st), 0);
    EXPECT_TRUE(S_ISCHR(st.st_mode));
  }
  // A symbolic link stays a link; its target gets the plan.
  const fs::path target = dir_ / "target.json", link = dir_ / "link.json";
  Write("target.json", "old");
  fs::create_symlink(target, link);
  r = Eplbx(plan + link.string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(fs::is_symlink(link));
  EXPECT_EQ(nlohmann::json::parse(Slurp(target))["phy2log"].size(), 2u);
  // A planted PATH.tmp, and a link planted there, are neither destroyed nor followed.
  const fs::path out = dir_ / "plan.json", victim = dir_ / "victim";
  Write("victim", "precious");
  fs::create_symlink(victim, dir_ / "plan.json.tmp");
  Write("plan.json", "{}");
  ASSERT_EQ(::chmod(out.c_str(), 0640), 0);
  r = Eplbx(plan + out.string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(Slurp(victim), "precious");
  EXPECT_TRUE(fs::is_symlink(dir_ / "plan.json.tmp"));
  EXPECT_EQ(nlohmann::json::parse(Slurp(out))["phy2log"].size(), 2u);
  ASSERT_EQ(::stat(out.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0640u);
  // Nothing else was left in the directory (no temporaries).
  int entries = 0;
  for (const auto& e : fs::directory_iterator(dir_))
    entries += e.path().filename().string()[0] == '.';
  EXPECT_EQ(entries, 0);
}

TEST_F(CliTest, ShippedExampleWorks) {
  CliRun r = Eplbx(std::string("plan --load ") + EPLBX_EXAMPLES +
                   "/dsv3_load.json --slots 288 --ranks 32 --nodes 4 --groups 8");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["phy2log"].size(), 58u);
  EXPECT_EQ(j["phy2log"][0].size(), 288u);
}

TEST_F(CliTest, EveryBadInputIsOneClearLine) {
  const std::string load = Write("load.json", kReadme);
  const std::string base = "plan --load " + load + " ";
  ExpectOneLineError(Eplbx(base + "--slots 15 --ranks 8"),
                     "slots (15) is not a multiple of ranks (8)");
  ExpectOneLineError(Eplbx(base + "--slots 16 --ranks 8 --nodes 3"),
                     "ranks (8) is not a multiple of nodes (3)");
  ExpectOneLineError(Eplbx(base + "--slots 16 --ranks 8 --groups 5"),
                     "experts (12) is not a multiple of groups (5)");
  ExpectOneLineError(Eplbx(base + "--slots 8 --ranks 8"), "slots (8) is less than experts (12)");
  ExpectOneLineError(Eplbx(base + "--slots 16 --ranks 0"), "ranks is 0");
  ExpectOneLineError(Eplbx(base + "--slots 16 --ranks 8 --policy magic"),
                     "--policy: unknown policy 'magic'");
  ExpectOneLineError(Eplbx(base + "--slots 16 --ranks 8 --format xml"), "--format is 'xml'");
  ExpectOneLineError(Eplbx(base + "--slots abc --ranks 8"), "--slots");
  ExpectOneLineError(Eplbx("plan --slots 16 --ranks 8"), "--load is required");
  ExpectOneLineError(Eplbx("plan --load /nonexistent/x.json --slots 16 --ranks 8"),
                     "/nonexistent/x.json: no such file");
  ExpectOneLineError(Eplbx("frobnicate"), "frobnicate");
  ExpectOneLineError(Eplbx(""), "subcommand");
  ExpectOneLineError(
      Eplbx("plan --load " + Write("bad.json", "[[1,2],[3]]") + " --slots 4 --ranks 2"),
      "bad.json: layer 1 has 1 experts but layer 0 has 2");
  ExpectOneLineError(
      Eplbx("plan --load " + Write("neg.csv", "1,2\n3,-4\n") + " --slots 4 --ranks 2"),
      "neg.csv: layer 1, expert 1: load is -4");
  ExpectOneLineError(
      Eplbx("plan --load " + Write("junk.npy", "not numpy at all") + " --slots 4 --ranks 2"),
      "junk.npy: not a .npy file");
  ExpectOneLineError(Eplbx("plan --load " + Write("x.yaml", "a: 1") + " --slots 4 --ranks 2"),
                     "unknown extension '.yaml'");
  ExpectOneLineError(Eplbx(base + "--slots 16 --ranks 8 --out " + (dir_ / "no/dir/x").string()),
                     "cannot open for writing");
}

TEST_F(CliTest, MigrateBetweenTwoPlans) {
  // vLLM's example through files, then a plan's own output as input.
  const std::string from = Write("old.json", R"({"phy2log": [[0, 0, 1, 1, 1]]})");
  const std::string to = Write("new.json", R"({"phy2log": [[0, 0, 0, 0, 0]]})");
  CliRun r = Eplbx("migrate --old " + from + " --new " + to +
                   " --ranks 5 --bytes-per-expert 1048576 --link-gbps 8");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  const nlohmann::json& layer = j["layers"][0];
  EXPECT_EQ(layer["layer"], 0);
  ASSERT_EQ(layer["transfers"].size(), 3u);
  for (const auto& t : layer["transfers"]) {
    EXPECT_EQ(t["expert"], 0);
    EXPECT_TRUE(t.contains("src_row") && t.contains("dst_row") && t.contains("round"));
  }
  EXPECT_EQ(j["summary"]["remote_transfers"], 3);
  EXPECT_EQ(j["summary"]["bytes_moved"], 3 * 1048576);
  EXPECT_EQ(j["summary"]["rounds"], 2);
  EXPECT_EQ(j["summary"]["rounds_lower_bound"], 2);
  EXPECT_EQ(j["summary"]["max_bytes_out"], 2 * 1048576);
  EXPECT_DOUBLE_EQ(j["summary"]["time_lower_bound_s"].get<double>(), 2 * 1048576 / 1e9);

  const std::string load = Write("load.json", kReadme);
  const std::string a = (dir_ / "a.json").string(), b = (dir_ / "b.json").string();
  ASSERT_EQ(Eplbx("plan --load " + load + " --slots 16 --ranks 8 --out " + a).exit_code, 0);
  ASSERT_EQ(Eplbx("plan --load " + load + " --slots 16 --ranks 8 --nodes 2 --groups 4 --out " + b)
                .exit_code,
            0);
  CliRun t = Eplbx("migrate --old " + a + " --new " + b + " --ranks 8 --nodes 2 --format table");
  ASSERT_EQ(t.exit_code, 0) << t.err;
  EXPECT_NE(t.out.find("layer 1: "), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("total: "), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("round 0:"), std::string::npos) << t.out;
}

TEST_F(CliTest, MigrateErrors) {
  const std::string a = Write("a.json", R"({"phy2log": [[0, 1, 2, 3]]})");
  const std::string b = Write("b.json", R"({"phy2log": [[0, 1, 2, 4]]})");
  const std::string c = Write("c.json", R"({"phy2log": [[0, 1]]})");
  ExpectOneLineError(Eplbx("migrate --old " + a + " --new " + b + " --ranks 2"),
                     "layer 0: expert 4 is placed on rank 1 (row 1) in the new placement but no "
                     "rank holds it in the old placement");
  ExpectOneLineError(Eplbx("migrate --old " + a + " --new " + c + " --ranks 2"),
                     "old placement is 1 layers x 4 slots but new placement is 1 layers x 2 slots");
  ExpectOneLineError(Eplbx("migrate --old " + a + " --new " + a + " --ranks 3"),
                     "slots (4) is not a multiple of ranks (3)");
  ExpectOneLineError(
      Eplbx("migrate --old " + Write("x.json", "{\"load\": []}") + " --new " + a + " --ranks 2"),
      "x.json: JSON object has no key \"phy2log\"");
  ExpectOneLineError(
      Eplbx("migrate --old " + a + " --new " + a + " --ranks 2 --bytes-per-expert 0"),
      "bytes per expert is 0");
}

TEST_F(CliTest, BalancedAndIncrementalWithMoves) {
  const std::string load = std::string(EPLBX_EXAMPLES) + "/dsv3_load.json";
  const std::string shape = " --slots 288 --ranks 32 --nodes 4 --groups 8";
  const std::string prev = (dir_ / "prev.json").string();
  ASSERT_EQ(Eplbx("plan --load " + load + shape + " --out " + prev).exit_code, 0);
  CliRun b = Eplbx("plan --load " + load + shape + " --policy balanced --previous " + prev);
  ASSERT_EQ(b.exit_code, 0) << b.err;
  const nlohmann::json jb = nlohmann::json::parse(b.out);
  const nlohmann::json jd = nlohmann::json::parse(Slurp(prev));
  EXPECT_EQ(jb["policy"], "balanced");
  EXPECT_GE(jb["balancedness_total"].get<double>(), jd["balancedness_total"].get<double>());
  ASSERT_TRUE(jb.contains("moves"));
  EXPECT_EQ(jb["moves"]["per_layer"].size(), 58u);
  EXPECT_GE(jb["moves"]["unchanged_slots"].get<int>(), 0);
  CliRun i = Eplbx("plan --load " + load + shape + " --policy incremental --previous " + prev +
                   " --tolerance 0.01");
  ASSERT_EQ(i.exit_code, 0) << i.err;
  const nlohmann::json ji = nlohmann::json::parse(i.out);
  EXPECT_EQ(ji["policy"], "incremental");
  EXPECT_LT(ji["moves"]["remote_copies"].get<int>(), jb["moves"]["remote_copies"].get<int>());
  ExpectOneLineError(Eplbx("plan --load " + load + shape + " --policy incremental"),
                     "--policy incremental needs --previous FILE");
  ExpectOneLineError(Eplbx("plan --load " + load + " --slots 256 --ranks 32 --previous " + prev),
                     "previous placement is 58 layers x 288 slots but this plan is 58 layers x "
                     "256 slots");
}

// After a lost rank (issue 20, item 2): `plan --previous P --lost R` re-places over the
// survivors; experts only lost ranks held need a backup (named otherwise).
// `plan` of the DeepSeek-V3 example (32 ranks, 4 nodes, 288 slots) from a placement planned
// for it, written to prev.json in the test's folder.
std::string CliTest::PlanFromDsv3InForce(std::string* load, std::string* shape) {
  *load = std::string(EPLBX_EXAMPLES) + "/dsv3_load.json";
  *shape = " --slots 288 --ranks 32 --nodes 4 --groups 8";
  const std::string prev = (dir_ / "prev.json").string();
  EXPECT_EQ(Eplbx("plan --load " + *load + *shape + " --out " + prev).exit_code, 0);
  return "plan --load " + *load + *shape + " --previous " + prev;
}

TEST_F(CliTest, PlanOverTheSurvivorsOfLostRanks) {
  std::string load, shape;
  const std::string base = PlanFromDsv3InForce(&load, &shape);
  // DeepSeek's plan gives most experts one replica: rank 5 held the only copy of some.
  ExpectOneLineError(Eplbx(base + " --lost 5"), "rank 5 was lost with the only replicas of ");
  ExpectOneLineError(Eplbx(base + " --lost 5"), "register a host backup or the checkpoint");
  CliRun r = Eplbx(base + " --lost 5,6 --backup all");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["policy"], "incremental");
  EXPECT_EQ(j["survivors"]["lost_ranks"], (std::vector<int>{5, 6}));
  EXPECT_GT(j["survivors"]["experts_recovered"].get<int>(), 0);
  EXPECT_GT(j["survivors"]["migration"]["remote_transfers"].get<int>(), 0);
  EXPECT_GE(j["survivors"]["recovered_slots"].size(),
            j["survivors"]["experts_recovered"].get<size_t>());
  ASSERT_EQ(j["phy2log"].size(), 58u);
  for (const auto& layer : j["phy2log"]) {
    for (int s = 5 * 9; s < 7 * 9; ++s) ASSERT_EQ(layer[s].get<int>(), -1) << s;  // lost ranks
  }
  for (const auto& slot : j["survivors"]["recovered_slots"]) {
    const int rank = slot["slot"].get<int>() / 9;
    EXPECT_TRUE(rank != 5 && rank != 6) << slot.dump();
  }
  CliRun t = Eplbx(base + " --lost 5,6 --backup all --format table");
  ASSERT_EQ(t.exit_code, 0) << t.err;
  EXPECT_NE(t.out.find("lost ranks 5, 6: their slots are empty; "), std::string::npos) << t.out;
  ExpectOneLineError(Eplbx(base + " --lost 32"),
                     "--lost: '32' is not a rank (expected 0..31, comma-separated)");
  ExpectOneLineError(Eplbx(base + " --lost 5,x"), "--lost: 'x' is not a rank");
  ExpectOneLineError(Eplbx(base + " --lost 5,5"), "--lost: rank 5 listed twice");
  ExpectOneLineError(Eplbx(base + " --lost 5,"), "--lost: '' is not a rank");
  ExpectOneLineError(Eplbx(base + " --lost 5 --backup some"),
                     "--backup is 'some' (expected none or all)");
  ExpectOneLineError(Eplbx("plan --load " + load + shape + " --lost 5"),
                     "--lost needs --previous FILE");
}

// Elastic resize (issue 20, item 4): a whole node joins (nodes kept), two ranks leave
// (planned as one node), bad requests named.
TEST_F(CliTest, PlanAnElasticResize) {
  std::string load, shape;
  const std::string base = PlanFromDsv3InForce(&load, &shape);
  CliRun r = Eplbx(base + " --add-ranks 8");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["policy"], "incremental");
  EXPECT_EQ(j["resize"]["added_ranks"], (std::vector<int>{32, 33, 34, 35, 36, 37, 38, 39}));
  EXPECT_EQ(j["resize"]["ranks"], 40);
  EXPECT_EQ(j["resize"]["nodes"], 5);
  EXPECT_GT(j["resize"]["migration"]["remote_transfers"].get<int>(), 0);
  ASSERT_EQ(j["phy2log"].size(), 58u);
  for (const auto& layer : j["phy2log"]) {
    ASSERT_EQ(layer.size(), 360u);
    for (int s = 32 * 9; s < 40 * 9; ++s)
      ASSERT_GE(layer[s].get<int>(), 0) << s;  // new ranks serve
  }
  r = Eplbx(base + " --remove-ranks 31,30");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["resize"]["removed_ranks"], (std::vector<int>{30, 31}));
  EXPECT_EQ(j["resize"]["ranks"], 30);
  EXPECT_EQ(j["resize"]["nodes"], 1);
  EXPECT_EQ(j["phy2log"][0].size(), 270u);
  CliRun t = Eplbx(base + " --add-ranks 8 --format table");
  ASSERT_EQ(t.exit_code, 0) << t.err;
  EXPECT_NE(t.out.find("resize: 8 ranks added, 0 removed (drained first); 40 ranks after, on 5 "
                       "nodes; "),
            std::string::npos)
      << t.out;
  ExpectOneLineError(Eplbx(base + " --remove-ranks 24,25,26,27,28,29,30,31"),
                     "24 ranks after the resize have 216 slots (9 each) for 256 experts");
  ExpectOneLineError(Eplbx(base + " --remove-ranks 32"),
                     "--remove-ranks: '32' is not a rank (expected 0..31, comma-separated)");
  ExpectOneLineError(Eplbx(base + " --remove-ranks 3,3"), "--remove-ranks: rank 3 listed twice");
  ExpectOneLineError(Eplbx(base + " --add-ranks 1 --lost 2"), "one at a time");
  ExpectOneLineError(Eplbx("plan --load " + load + shape + " --add-ranks 8"),
                     "--add-ranks / --remove-ranks need --previous FILE");
}

TEST_F(CliTest, TraceSynthAndSimulate) {
  const std::string trace = (dir_ / "t.jsonl").string();
  ASSERT_EQ(
      Eplbx("trace synth --layers 2 --experts 16 --steps 120 --seed 3 --out " + trace).exit_code,
      0);
  const CliRun again = Eplbx("trace synth --layers 2 --experts 16 --steps 120 --seed 3");
  EXPECT_EQ(again.out, Slurp(trace));  // same seed, same trace
  const CliRun r =
      Eplbx("simulate --trace " + trace + " --slots 20 --ranks 4 --window 40 --interval 30 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  for (const char* key : {"mean_balancedness", "p5_balancedness", "rebalances", "bytes_moved",
                          "stall_seconds_est", "copies"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_EQ(j["series"]["balancedness"].size(), 120u);
  EXPECT_EQ(j["rebalances"].get<int>(), static_cast<int>(j["series"]["rebalance_events"].size()));
  // A sweep: one row per combination (2 x 2), and a plot with every run.
  const std::string png = (dir_ / "sweep.png").string();
  const CliRun sweep = Eplbx("simulate --trace " + trace +
                             " --slots 20 --ranks 4 --sweep window=20,60,policy=deepseek,balanced"
                             " --plot " +
                             png);
  ASSERT_EQ(sweep.exit_code, 0) << sweep.err;
  EXPECT_EQ(std::count(sweep.out.begin(), sweep.out.end(), '\n'), 5) << sweep.out;
  EXPECT_EQ(Slurp(png).substr(1, 3), "PNG");
  const std::string base = "simulate --trace " + trace + " --slots 20 --ranks 4 ";
  ExpectOneLineError(Eplbx(base + "--sweep speed=1,2"), "--sweep: unknown setting 'speed'");
  ExpectOneLineError(Eplbx(base + "--sweep 5,window=1"), "comes before any setting");
  ExpectOneLineError(Eplbx(base + "--sweep window=x"),
                     "--sweep: window is 'x': expected an integer");
  // Issue 17, item 12: window=1e10 wrapped to -2147483648 and window=2.7 ran as 2.
  ExpectOneLineError(Eplbx(base + "--sweep window=1e10"), "--sweep: window is '1e10'");
  ExpectOneLineError(Eplbx(base + "--sweep window=2.7"), "window is '2.7': not an integer");
  ExpectOneLineError(Eplbx(base + "--sweep min_gain=nan"), "min_gain is 'nan': not a number");
  ExpectOneLineError(Eplbx(base + "--plot out.gif"), "expected a .png or .svg");
  ExpectOneLineError(Eplbx(base + "--window 0"), "window (0) and interval (1000) must be >= 1");
  ExpectOneLineError(Eplbx("simulate --trace " + trace + " --slots 10 --ranks 2"),
                     "slots (10) is less than experts (16)");
  ExpectOneLineError(
      Eplbx("simulate --slots 20 --ranks 4 --trace " +
            Write("gap.jsonl",
                  "{\"step\": 0, \"load\": [[1, 2]]}\n{\"step\": 5, \"load\": [[1, 2]]}\n")),
      "gap.jsonl:2: \"step\" is 5 (expected 1");
  ExpectOneLineError(Eplbx("trace synth --layers 0 --experts 4 --steps 5"),
                     "needs --layers, --experts and --steps >= 1");
}

// JSON nested 100,000 deep crashed every JSON reader (SIGSEGV); JSON followed by a NUL and
// garbage was accepted (issue 17, items 8 and 16). Now a one-line error naming the byte.
TEST_F(CliTest, DeepOrGarbageJsonIsRefusedByEveryReader) {
  const std::string deep = Write("deep.json", std::string(100000, '[') + std::string(100000, ']'));
  const std::string nul = Write("nul.json", std::string(kReadme) + std::string(1, '\0') + "junk");
  const std::string load = Write("load.json", kReadme);
  const std::string plan = (dir_ / "plan.json").string();
  ASSERT_EQ(Eplbx("plan --load " + load + " --slots 16 --ranks 8 --out " + plan).exit_code, 0);
  const std::string trace =
      Write("deep.jsonl",
            "{\"step\": 0, \"load\": " + std::string(1000, '[') + std::string(1000, ']') + "}\n");
  for (const std::string& args :
       {"plan --slots 16 --ranks 8 --load " + deep,
        "plan --slots 16 --ranks 8 --load " + load + " --policy incremental --previous " + deep,
        "migrate --ranks 8 --old " + deep + " --new " + plan,
        "migrate --ranks 8 --old " + plan + " --new " + deep}) {
    ExpectOneLineError(Eplbx(args), "JSON nested more than 64 deep at byte 64");
  }
  ExpectOneLineError(Eplbx("simulate --slots 16 --ranks 8 --trace " + trace),
                     "deep.jsonl:1: JSON nested more than 64 deep");
  ExpectOneLineError(Eplbx("plan --slots 16 --ranks 8 --load " + nul),
                     "a NUL byte at byte " + std::to_string(std::strlen(kReadme)));
}

// Numbers that do not fit, are negative, fractional or not finite are usage errors naming
// the flag and the range, never wraps (issue 17, item 12: --bytes-per-expert -1 was read as
// 2^64-1 and reported as bytes_moved 18446744073709551612; items 13, 15).
TEST_F(CliTest, NumbersThatDoNotFitAreErrorsNotWraps) {
  const std::string load = Write("load.json", kReadme);
  const std::string plan = (dir_ / "plan.json").string();
  ASSERT_EQ(Eplbx("plan --load " + load + " --slots 16 --ranks 8 --out " + plan).exit_code, 0);
  const std::string trace = (dir_ / "t.jsonl").string();
  ASSERT_EQ(Eplbx("trace synth --layers 2 --experts 12 --steps 20 --out " + trace).exit_code, 0);
  const std::string migrate = "migrate --old " + plan + " --new " + plan + " --ranks 8 ";
  const std::string sim = "simulate --trace " + trace + " --slots 16 --ranks 8 ";
  const std::pair<std::string, std::string> cases[] = {
      {migrate + "--bytes-per-expert -1", "--bytes-per-expert: the value is '-1': negative"},
      {migrate + "--bytes-per-expert 18446744073709551616", "out of range"},
      {migrate + "--link-gbps nan", "--link-gbps: the value is 'nan': not a number"},
      {migrate + "--link-gbps inf", "not finite"},
      {"plan --load " + load + " --slots 16.5 --ranks 8", "--slots: the value is '16.5'"},
      {"plan --load " + load + " --slots 16 --ranks 4294967304", "--ranks: the value is"},
      {"plan --load " + load + " --slots 16 --ranks 8 --tolerance -0.1", "--tolerance"},
      {sim + "--min-gain nan", "--min-gain: the value is 'nan': not a number (NaN)"},
      {sim + "--skip-above nan", "--skip-above"},
      {sim + "--window 1e10", "--window: the value is '1e10'"},
      {sim + "--window 2.7", "not an integer"},
      {"trace synth --layers 1 --experts 4 --steps 3 --drift 50", "--drift: the value is '50'"},
      {"trace synth --layers 1 --experts 4 --steps 3 --zipf nan", "--zipf"},
      {"trace synth --layers 1 --experts 4 --steps -3", "--steps: the value is '-3'"},
      {"bench xfer --seconds -1", "--seconds: the value is '-1': out of range"},
      {"bench xfer --seconds nan", "--seconds"},
      {"store --timeout inf", "--timeout: the value is 'inf': not finite"},
  };
  // Expert ids in a placement file: 2^64-1 was read as -1, an empty slot.
  const std::string huge = Write("huge.json", "{\"phy2log\": [[0, 1, 18446744073709551615, 2]]}");
  ExpectOneLineError(Eplbx("migrate --ranks 2 --old " + huge + " --new " + huge),
                     "slot 2: 18446744073709551615 is not an expert id");
  for (const auto& [args, needle] : cases) {
    CliRun r = Eplbx(args);
    EXPECT_EQ(r.exit_code, 2) << args << ": " << r.err;
    ExpectOneLineError(r, needle);
  }
}

// Issue 19: the device benchmark needs a GPU; without one it says why and succeeds, with one
// it measures cuda_ipc READs beside device-to-device copies in the same run.
TEST_F(CliTest, BenchXferOnDeviceMemorySaysWhyWithoutAGpu) {
  CliRun r =
      Eplbx("bench xfer --memory cuda --json --ops read --sizes 1M --batches 1 --seconds 0.05");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  if (j.contains("skipped")) {
    EXPECT_EQ(j["skipped"].get<std::string>().rfind("no CUDA device: ", 0), 0u) << r.out;
  } else {
    ASSERT_EQ(j["results"].size(), 1u) << r.out;
    EXPECT_EQ(j["results"][0]["path"], "cuda_ipc");
    EXPECT_GT(j["results"][0]["gbps"].get<double>(), 0.0);
    EXPECT_GT(j["results"][0]["device_copy_gbps"].get<double>(), 0.0);
  }
  ExpectOneLineError(Eplbx("bench xfer --memory gpu"), "--memory: gpu not in {host,cuda}");
}

// Issue 17, items 15 and 16: each bad input gets its own clear line.
TEST_F(CliTest, UnclearErrorsNowSayWhatIsWrong) {
  ExpectOneLineError(Eplbx("--bogus"), "unknown option '--bogus' before a command");
  ExpectOneLineError(Eplbx("bench frob"), "unknown command 'bench frob' (expected one of: xfer)");
  ExpectOneLineError(Eplbx("bench xfer --batches 0"), "--batches: batch is '0': out of range");
  ExpectOneLineError(Eplbx("plan --slots 2 --ranks 1 --load " + Write("big.csv", "1,2\n1e999,3\n")),
                     "line 2, column 1: '1e999' is beyond a double's range");
  CliRun tiny = Eplbx("plan --slots 2 --ranks 1 --load " + Write("tiny.csv", "1,2\n1e-400,3\n"));
  EXPECT_EQ(tiny.exit_code, 0) << tiny.err;  // underflow reads as 0, as numpy does
  ExpectOneLineError(
      Eplbx("plan --slots 2 --ranks 1 --load " + Write("raw.csv", "1,2\n\xff\x01x,3\n")),
      "'\\xff\\x01x' is not a number");
  ExpectOneLineError(Eplbx("plan --slots 2 --ranks 1 --load " +
                           Write("long.csv", "1,2\n" + std::string(1 << 20, 'z') + "\n")),
                     "'zzzzzzzz");
  CliRun longline = Eplbx("plan --slots 2 --ranks 1 --load " + (dir_ / "long.csv").string());
  EXPECT_LT(longline.err.size(), 400u);  // a 1 MB cell no longer makes a 1 MB line
  const std::string trace = (dir_ / "t.jsonl").string();
  ASSERT_EQ(Eplbx("trace synth --layers 1 --experts 4 --steps 5 --out " + trace).exit_code, 0);
  CliRun plot = Eplbx("simulate --slots 4 --ranks 2 --trace " + trace + " --plot " +
                      (dir_ / "missing/p.png").string());
  ExpectOneLineError(plot, "/missing does not exist");
}

// Small inputs that imply gigabytes or minutes are refused with the limit in the message
// (issue 17, item 11): 65536 ranks x 65536 experts took 4.2 GB and 9 s in `balanced`; a
// hot expert with 32513 replicas padded log2phy to experts x slots per layer; a placement
// file's logcnt a million wide made `migrate` allocate gigabytes.
TEST_F(CliTest, InputsBeyondThePlanningLimitsAreRefused) {
  std::string wide = "[[";
  for (int e = 0; e < 65536; ++e) wide += e ? ",1" : "1";
  wide += "]]";
  ExpectOneLineError(Eplbx("plan --slots 65536 --ranks 65536 --policy balanced --load " +
                           Write("wide.json", wide)),
                     "ranks x experts is 4294967296; the planning limit is 16777216");
  std::string hot = "[";
  for (int l = 0; l < 4; ++l) {
    hot += l ? ",[1000000" : "[1000000";
    for (int e = 1; e < 256; ++e) hot += ",1";
    hot += "]";
  }
  hot += "]";
  const std::string hot_file = Write("hot.json", hot);
  ExpectOneLineError(Eplbx("plan --slots 32768 --ranks 8 --load " + hot_file),
                     "log2phy padded to 32513 replicas for each of 256 experts in 4 layers); "
                     "the limit is 16777216");
  EXPECT_EQ(Eplbx("plan --slots 32768 --ranks 8 --format table --load " + hot_file).exit_code, 0);
  std::string logcnt = "[";
  for (int e = 0; e < 1 << 17; ++e) logcnt += e ? ",0" : "0";
  logcnt += "]";
  const std::string placement =
      Write("p.json", "{\"phy2log\": [[0, 1, 2, 3]], \"logcnt\": [" + logcnt + "]}");
  ExpectOneLineError(Eplbx("migrate --ranks 2 --old " + placement + " --new " + placement),
                     "must be at most 65536 (the planning limit)");
}

TEST_F(CliTest, HelpAndVersion) {
  CliRun h = Eplbx("plan --help");
  EXPECT_EQ(h.exit_code, 0);
  EXPECT_NE(h.out.find("--slots"), std::string::npos);
  CliRun v = Eplbx("--version");
  EXPECT_EQ(v.exit_code, 0);
  EXPECT_NE(v.out.find("eplbx"), std::string::npos);
}

}  // namespace
