// Backup sources (issue 20, item 3): experts no survivor holds are recovered from a host
// backup another process wrote, or from the checkpoint's safetensors files; every row is
// checked against the layout, and a recovery that cannot finish writes nothing.
#include "io/backup.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

namespace eplbx::io {
namespace {

constexpr int kRanks = 4, kPerRank = 3, kExperts = 8, kLayers = 2;

// Byte i of tensor t's row of (layer, expert).
uint8_t Pattern(int layer, int expert, int tensor, size_t i) {
  return static_cast<uint8_t>(layer * 31 + expert * 7 + tensor * 101 + i);
}

struct TensorShape {
  const char* name;
  const char* dtype;
  std::vector<int64_t> shape;
  uint64_t bytes;
};
const std::vector<TensorShape> kTensors = {{"w13", "bf16", {2, 4}, 16}, {"w2", "f32", {3}, 12}};

// Four ranks of three slots; slot s holds expert s % 8, so experts 0-3 have two replicas and
// 4-7 one: losing rank 1 (slots 3-5: experts 3, 4, 5) takes experts 4 and 5 with it.
struct Cluster {
  Topology topo{.ranks = kRanks, .nodes = 1, .slots = kRanks * kPerRank, .groups = 1};
  Placement in_force;
  LoadMatrix load;
  std::vector<std::vector<uint8_t>> memory;  // [rank x layer x tensor]
  std::vector<RankLayout> layouts;

  Cluster() {
    std::vector<int32_t> map;
    for (int l = 0; l < kLayers; ++l) {
      for (int s = 0; s < kRanks * kPerRank; ++s) map.push_back(s % kExperts);
    }
    in_force = *Placement::FromPhy2Log(kLayers, kRanks * kPerRank, kExperts, map);
    std::vector<double> values;
    for (int i = 0; i < kLayers * kExperts; ++i) values.push_back(10 + i % 5);
    load = *LoadMatrix::Create(kLayers, kExperts, values);
    memory.resize(kRanks * kLayers * kTensors.size());
    for (int r = 0; r < kRanks; ++r) {
      RankLayout layout;
      layout.rank = r;
      for (int l = 0; l < kLayers; ++l) {
        std::vector<TensorSpec> tensors;
        for (size_t t = 0; t < kTensors.size(); ++t) {
          std::vector<uint8_t>& m = memory[(r * kLayers + l) * kTensors.size() + t];
          m.resize(kPerRank * kTensors[t].bytes);
          for (int s = 0; s < kPerRank; ++s) {
            const int expert = in_force.phy2log(l, r * kPerRank + s);
            for (size_t i = 0; i < kTensors[t].bytes; ++i) {
              m[s * kTensors[t].bytes + i] = Pattern(l, expert, static_cast<int>(t), i);
            }
          }
          tensors.push_back(TensorSpec{kTensors[t].name, kTensors[t].dtype, kTensors[t].shape,
                                       reinterpret_cast<uintptr_t>(m.data()), kTensors[t].bytes,
                                       kPerRank});
        }
        layout.layers.push_back(std::move(tensors));
      }
      layouts.push_back(std::move(layout));
    }
  }

  // Slot `s` of rank `r` holds expert `e` in `layer`, every tensor's bytes.
  bool RowIs(int r, int layer, int s, int e) const {
    for (size_t t = 0; t < kTensors.size(); ++t) {
      const std::vector<uint8_t>& m = memory[(r * kLayers + layer) * kTensors.size() + t];
      for (size_t i = 0; i < kTensors[t].bytes; ++i) {
        if (m[s * kTensors[t].bytes + i] != Pattern(layer, e, static_cast<int>(t), i)) {
          return false;
        }
      }
    }
    return true;
  }

  Result<SurvivorPlan> LoseRank1(const BackupSource& source) const {
    SurvivorOptions o;
    o.backup = [&](int l, int e) { return source.Holds(l, e); };
    return PlanSurvivors(in_force, load, topo, {true, false, true, true}, o);
  }
};

std::string TempPath(const std::string& name) { return testing::TempDir() + "/" + name; }

TEST(HostBackupTest, ExpertsOfALostRankComeBackFromTheBackupItsProcessWrote) {
  Cluster c;
  auto backup = HostBackup::Create(testing::TempDir(), c.layouts[0], kExperts);
  ASSERT_TRUE(backup.ok()) << backup.status().ToString();
  const std::string share = (*backup)->ShareName();
  // Its memory cost: every expert of every layer, each tensor's row (plus a page of header).
  const uint64_t rows = uint64_t{kLayers} * kExperts * (16 + 12);
  EXPECT_GE((*backup)->bytes(), rows);
  EXPECT_LE((*backup)->bytes(), rows + 2 * 4096);
  EXPECT_EQ((*backup)->experts_held(), 0);
  // Rank 1 writes its experts from its own process, then that process is gone.
  const pid_t child = fork();
  if (child == 0) {
    auto mine = HostBackup::OpenShared(share);
    _exit(mine.ok() && (*mine)->Capture(c.in_force, c.layouts[1]).ok() ? 0 : 1);
  }
  int wstatus = 0;
  ASSERT_EQ(waitpid(child, &wstatus, 0), child);
  ASSERT_TRUE(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0);
  for (int r : {0, 2, 3}) ASSERT_TRUE((*backup)->Capture(c.in_force, c.layouts[r]).ok());
  EXPECT_EQ((*backup)->experts_held(), kLayers * kExperts);
  EXPECT_EQ((*backup)->held_bytes(), rows);

  // A survivor maps it and plans: experts 4 and 5 of each layer are recovered.
  auto opened = HostBackup::OpenShared(share);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  Result<SurvivorPlan> plan = c.LoseRank1(**opened);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();

  EXPECT_EQ(plan->experts_recovered, 2 * kLayers);
  ASSERT_EQ(plan->recovered.size(), static_cast<size_t>(2 * kLayers));
  int64_t written = 0;
  for (int r : {0, 2, 3}) {
    Result<int64_t> n = RecoverSlots(*plan, c.layouts[r], **opened);
    ASSERT_TRUE(n.ok()) << n.status().ToString();
    written += *n;
  }
  EXPECT_EQ(written, static_cast<int64_t>(plan->recovered.size() * kTensors.size()));
  for (const RecoveredSlot& rec : plan->recovered) {
    EXPECT_TRUE(rec.expert == 4 || rec.expert == 5) << rec.expert;
    EXPECT_NE(rec.slot / kPerRank, 1);
    EXPECT_TRUE(c.RowIs(rec.slot / kPerRank, rec.layer, rec.slot % kPerRank, rec.expert))
        << "layer " << rec.layer << " slot " << rec.slot << " expert " << rec.expert;
  }
}

// A node's own backup loaded with every expert (from the checkpoint, say) restores a lost
// rank's experts without any rank having captured them; out of range is named.
TEST(HostBackupTest, ABackupLoadedWithEveryExpertRestoresALostRank) {
  Cluster c;
  auto backup = HostBackup::Create(testing::TempDir(), c.layouts[0], kExperts);
  ASSERT_TRUE(backup.ok()) << backup.status().ToString();
  for (int l = 0; l < kLayers; ++l) {
    for (int e = 0; e < kExperts; ++e) {
      Status loaded = (*backup)->Load(l, e, [&](const std::string& name, uint8_t* dst, uint64_t n) {
        int t = 0;
        while (kTensors[t].name != name) ++t;
        for (uint64_t i = 0; i < n; ++i) dst[i] = Pattern(l, e, t, i);
      });
      ASSERT_TRUE(loaded.ok()) << loaded.ToString();
    }
  }
  EXPECT_EQ((*backup)->experts_held(), kLayers * kExperts);
  Status out = (*backup)->Load(kLayers, 0, [](const std::string&, uint8_t*, uint64_t) {});
  EXPECT_EQ(out.code(), Code::kOutOfRange);
  EXPECT_NE(out.message().find("expert 0 of layer " + std::to_string(kLayers) + " is outside"),
            std::string::npos)
      << out.ToString();
  Result<SurvivorPlan> plan = c.LoseRank1(**backup);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  ASSERT_FALSE(plan->recovered.empty());
  for (int r : {0, 2, 3}) ASSERT_TRUE(RecoverSlots(*plan, c.layouts[r], **backup).ok());
  for (const RecoveredSlot& rec : plan->recovered) {
    EXPECT_TRUE(c.RowIs(rec.slot / kPerRank, rec.layer, rec.slot % kPerRank, rec.expert))
        << "layer " << rec.layer << " slot " << rec.slot << " expert " << rec.expert;
  }
}

TEST(HostBackupTest, AnExpertTheBackupLacksFailsTheRecoveryAndWritesNothing) {
  Cluster c;
  auto full = HostBackup::Create(testing::TempDir(), c.layouts[0], kExperts);
  auto part = HostBackup::Create(testing::TempDir(), c.layouts[0], kExperts);
  ASSERT_TRUE(full.ok() && part.ok());
  for (int r = 0; r < kRanks; ++r) ASSERT_TRUE((*full)->Capture(c.in_force, c.layouts[r]).ok());
  ASSERT_TRUE((*part)->Capture(c.in_force, c.layouts[0]).ok());
  EXPECT_EQ((*part)->experts_held(), kLayers * kPerRank);  // rank 0's slots: experts 0, 1, 2
  EXPECT_EQ((*part)->held_bytes(), uint64_t{kLayers} * kPerRank * (16 + 12));
  // Without rank 1's experts the plan itself fails, naming them.
  Result<SurvivorPlan> refused = c.LoseRank1(**part);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("layer 0: 4, 5"), std::string::npos)
      << refused.status().ToString();
  // A plan made with another source, recovered from one that lacks them: named, and no
  // row changes.
  Result<SurvivorPlan> plan = c.LoseRank1(**full);
  ASSERT_TRUE(plan.ok());
  auto lacking = HostBackup::Create(testing::TempDir(), c.layouts[0], kExperts);
  ASSERT_TRUE(lacking.ok());
  for (int r : {0, 2, 3}) ASSERT_TRUE((*lacking)->Capture(c.in_force, c.layouts[r]).ok());
  std::vector<int> touched;
  for (const RecoveredSlot& rec : plan->recovered) touched.push_back(rec.slot / kPerRank);
  const int rank = touched.front();
  const std::vector<std::vector<uint8_t>> before = c.memory;
  Result<int64_t> n = RecoverSlots(*plan, c.layouts[rank], **lacking);
  ASSERT_FALSE(n.ok());
  EXPECT_NE(n.status().message().find("rank " + std::to_string(rank) + " must recover expert "),
            std::string::npos)
      << n.status().ToString();
  EXPECT_NE(n.status().message().find("does not hold it (nothing was written)"), std::string::npos);
  EXPECT_EQ(c.memory, before);
}

TEST(HostBackupTest, AnotherLayoutOrADamagedFileIsRefusedByName) {
  Cluster c;
  auto backup = HostBackup::Create(testing::TempDir(), c.layouts[0], kExperts);
  ASSERT_TRUE(backup.ok());
  const std::string path = (*backup)->path();
  RankLayout other = c.layouts[2];
  other.layers[1][1].dtype = "bf16";
  other.layers[1][1].bytes_per_expert = 6;
  Status s = (*backup)->Capture(c.in_force, other);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), Code::kMismatch);
  EXPECT_NE(s.message().find("rank 2: layer 1 tensor 'w2' is bf16 [3], 6 bytes per expert; the "
                             "backup has f32 [3], 12 bytes per expert"),
            std::string::npos)
      << s.ToString();
  EXPECT_EQ((*backup)->experts_held(), 0);  // nothing copied
  // Truncated: the header describes more than the file holds.
  ASSERT_EQ(truncate(path.c_str(), static_cast<off_t>((*backup)->bytes() - 1)), 0);
  auto cut = HostBackup::Open(path);
  ASSERT_FALSE(cut.ok());
  EXPECT_NE(cut.status().message().find("(truncated, or written by another layout)"),
            std::string::npos)
      << cut.status().ToString();
  std::ofstream(path, std::ios::binary) << std::string(64, 'x');
  auto junk = HostBackup::Open(path);
  ASSERT_FALSE(junk.ok());
  EXPECT_NE(junk.status().message().find("not a host backup"), std::string::npos)
      << junk.status().ToString();
}

// Per layer a safetensors file with "model.layers.L.w13" BF16 [8, 2, 4] and
// "model.layers.L.w2" F32 [8, 3] (or `w2_dtype`), rows in Pattern.
std::string WriteCheckpoint(int layer, const std::string& w2_dtype = "F32") {
  std::string data;
  for (size_t t = 0; t < kTensors.size(); ++t) {
    for (int e = 0; e < kExperts; ++e) {
      for (size_t i = 0; i < kTensors[t].bytes; ++i)
        data += static_cast<char>(Pattern(layer, e, static_cast<int>(t), i));
    }
  }
  const uint64_t w13 = kExperts * 16, w2 = kExperts * 12;
  const std::string p = "model.layers." + std::to_string(layer);
  const std::string w2_shape = w2_dtype == "F32" ? "[8, 3]" : "[8, 6]";
  const std::string header = "{\"" + p + ".w13\": {\"dtype\": \"BF16\", \"shape\": [8, 2, 4], " +
                             "\"data_offsets\": [0, " + std::to_string(w13) + "]}, \"" + p +
                             ".w2\": {\"dtype\": \"" + w2_dtype + "\", \"shape\": " + w2_shape +
                             ", \"data_offsets\": [" + std::to_string(w13) + ", " +
                             std::to_string(w13 + w2) + "]}}";
  const std::string path =
      TempPath("ckpt-" + std::to_string(layer) + "-" + w2_dtype + ".safetensors");
  std::string len(8, '\0');
  for (int i = 0; i < 8; ++i) len[i] = static_cast<char>(header.size() >> (8 * i));
  std::ofstream(path, std::ios::binary) << len << header << data;
  return path;
}

std::vector<CheckpointTensor> Entries(const std::vector<std::string>& files) {
  std::vector<CheckpointTensor> out;
  for (int l = 0; l < kLayers; ++l) {
    for (const char* t : {"w13", "w2"}) {
      out.push_back({l, t, files[l], "model.layers." + std::to_string(l) + "." + t});
    }
  }
  return out;
}

TEST(CheckpointBackupTest, ExpertsComeBackFromTheCheckpointCheckedAgainstTheLayout) {
  Cluster c;
  auto ckpt = CheckpointBackup::Open(Entries({WriteCheckpoint(0), WriteCheckpoint(1)}));
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  EXPECT_EQ((*ckpt)->Describe(), "checkpoint (2 files)");
  Result<SurvivorPlan> plan = c.LoseRank1(**ckpt);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  for (int r : {0, 2, 3}) ASSERT_TRUE(RecoverSlots(*plan, c.layouts[r], **ckpt).ok());
  ASSERT_FALSE(plan->recovered.empty());
  for (const RecoveredSlot& rec : plan->recovered) {
    EXPECT_TRUE(c.RowIs(rec.slot / kPerRank, rec.layer, rec.slot % kPerRank, rec.expert));
  }
  // Layer 1's w2 quantized otherwise in the checkpoint: named, nothing written.
  auto other = CheckpointBackup::Open(Entries({WriteCheckpoint(0), WriteCheckpoint(1, "BF16")}));
  ASSERT_TRUE(other.ok()) << other.status().ToString();
  Cluster fresh;
  const std::vector<std::vector<uint8_t>> before = fresh.memory;
  bool refused = false;
  for (int r : {0, 2, 3}) {
    Result<int64_t> n = RecoverSlots(*plan, fresh.layouts[r], **other);
    if (n.ok()) continue;
    refused = true;
    EXPECT_NE(n.status().message().find("tensor 'model.layers.1.w2' is BF16 [8, 6]"),
              std::string::npos)
        << n.status().ToString();
    EXPECT_NE(n.status().message().find("(nothing was written)"), std::string::npos);
    // Not even its layer-0 rows, which were readable.
    for (size_t i = r * kLayers * kTensors.size(); i < (r + 1) * kLayers * kTensors.size(); ++i) {
      EXPECT_EQ(fresh.memory[i], before[i]) << "rank " << r;
    }
  }
  EXPECT_TRUE(refused);
  // No row of layer 1 changed anywhere.
  for (int r = 0; r < kRanks; ++r) {
    for (size_t t = 0; t < kTensors.size(); ++t) {
      const size_t i = (r * kLayers + 1) * kTensors.size() + t;
      EXPECT_EQ(fresh.memory[i], before[i]) << "rank " << r << " layer 1 tensor " << t;
    }
  }
  // A truncated checkpoint is refused when opened.
  const std::string cut = WriteCheckpoint(0);
  ASSERT_EQ(truncate(cut.c_str(), 100), 0);
  auto bad = CheckpointBackup::Open(Entries({cut, WriteCheckpoint(1)}));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("ckpt-0-F32.safetensors"), std::string::npos)
      << bad.status().ToString();
}

// ---- Issue 33, items 1, 2 and 5: a private, verified backup, between real processes. ----

// A fresh private directory under the test's temp dir.
std::string FreshDir(const std::string& name) {
  std::string templ = testing::TempDir() + "/" + name + "-XXXXXX";
  EXPECT_NE(mkdtemp(templ.data()), nullptr);
  return templ;
}

// Runs `body` in a child process; true when it exited 0.
bool InChild(const std::function<bool()>& body) {
  const pid_t child = fork();
  if (child == 0) _exit(body() ? 0 : 1);
  int wstatus = 0;
  return waitpid(child, &wstatus, 0) == child && WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0;
}

std::unique_ptr<HostBackup> FullBackup(const Cluster& c, const std::string& dir) {
  auto b = HostBackup::Create(dir, c.layouts[0], kExperts);
  EXPECT_TRUE(b.ok()) << b.status().ToString();
  if (!b.ok()) return nullptr;
  for (int r = 0; r < kRanks; ++r) EXPECT_TRUE((*b)->Capture(c.in_force, c.layouts[r]).ok());
  return std::move(*b);
}

TEST(HostBackupTest, ABackupIsAPrivateFileWithAnUnguessableNameAndNoNameIsLeft) {
  Cluster c;
  const std::string dir = FreshDir("private");
  auto a = HostBackup::Create(dir, c.layouts[0], kExperts);
  auto b = HostBackup::Create(dir, c.layouts[0], kExperts);
  ASSERT_TRUE(a.ok() && b.ok());
  const std::string prefix = dir + "/eplbx-backup-" + std::to_string(getpid()) + "-";
  const std::string path = (*a)->path();
  ASSERT_EQ(path.substr(0, prefix.size()), prefix);
  const std::string random = path.substr(prefix.size());
  EXPECT_EQ(random.size(), 32u);
  EXPECT_EQ(random.find_first_not_of("0123456789abcdef"), std::string::npos) << random;
  EXPECT_NE((*b)->path(), path);
  struct stat st {};
  ASSERT_EQ(lstat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(st.st_uid, geteuid());
  // The node's other ranks open it by its shared name; then the creator removes the name and
  // every descriptor still reads and writes it.
  auto other = HostBackup::OpenShared((*a)->ShareName());
  ASSERT_TRUE(other.ok()) << other.status().ToString();
  ASSERT_TRUE((*a)->Unlink().ok());
  EXPECT_NE(access(path.c_str(), F_OK), 0);
  EXPECT_FALSE(HostBackup::OpenShared((*a)->ShareName()).ok());
  ASSERT_TRUE((*other)->Capture(c.in_force, c.layouts[1]).ok());
  EXPECT_EQ((*a)->experts_held(), kLayers * kPerRank);
  EXPECT_TRUE((*a)->Check().ok());
  // The creator that never unlinked removes its name when it goes.
  const std::string second = (*b)->path();
  b->reset();
  EXPECT_NE(access(second.c_str(), F_OK), 0);
}

// What an engine's ranks do (the serving drill does the same): one rank of the node creates
// the backup, ShareHostBackup hands it to the others over the bootstrap, the creator removes
// the name, and every rank captures and reads through its own descriptor.
TEST(HostBackupTest, ShareHostBackupHandsTheCreatorsFileToEveryRank) {
  Cluster c;
  const std::string dir = FreshDir("share");
  InMemoryGroup group(kRanks);
  std::vector<std::unique_ptr<HostBackup>> got(kRanks);
  std::vector<Status> status(kRanks);
  std::vector<std::thread> ranks;
  for (uint32_t r = 0; r < kRanks; ++r) {
    ranks.emplace_back([&, r] {
      std::unique_ptr<Bootstrap> boot = group.Member(r);
      std::unique_ptr<HostBackup> mine;
      if (r == 2) {
        auto made = HostBackup::Create(dir, c.layouts[0], kExperts);
        if (!made.ok()) {
          status[r] = made.status();
          return;
        }
        mine = std::move(*made);
      }
      auto shared = ShareHostBackup(*boot, 2, std::move(mine), std::chrono::seconds(10));
      if (!shared.ok()) {
        status[r] = shared.status();
        return;
      }
      got[r] = std::move(*shared);
      status[r] = boot->Barrier(std::chrono::seconds(10));  // every rank opened it
      if (status[r].ok() && r == 2) status[r] = got[r]->Unlink();
      if (status[r].ok()) status[r] = boot->Barrier(std::chrono::seconds(10));
      if (status[r].ok()) status[r] = got[r]->Capture(c.in_force, c.layouts[r]);
    });
  }
  for (std::thread& t : ranks) t.join();
  for (uint32_t r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r].ToString();
    EXPECT_EQ(got[r]->id().inode, got[2]->id().inode) << "rank " << r;
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir));            // no name left
  EXPECT_EQ(got[0]->experts_held(), kLayers * kExperts);  // every rank's experts, one file
}

TEST(HostBackupTest, APlantedLinkOrAForeignFileIsNeverOpened) {
  Cluster c;
  const std::string dir = FreshDir("planted");
  auto real = FullBackup(c, dir);
  ASSERT_NE(real, nullptr);
  auto decoy = HostBackup::Create(dir, c.layouts[0], kExperts);
  ASSERT_TRUE(decoy.ok());
  // A link at the name a rank opens, pointing at a file the attacker wants written.
  const std::string victim = dir + "/victim";
  std::ofstream(victim) << "precious";
  const std::string link = dir + "/eplbx-backup-link";
  ASSERT_EQ(symlink(victim.c_str(), link.c_str()), 0);
  Result<std::unique_ptr<HostBackup>> linked = HostBackup::Open(link);
  ASSERT_FALSE(linked.ok());
  EXPECT_NE(linked.status().message().find("a link: a backup is never reached through one"),
            std::string::npos)
      << linked.status().ToString();
  std::ifstream in(victim);
  std::string kept((std::istreambuf_iterator<char>(in)), {});
  EXPECT_EQ(kept, "precious");
  // Someone else's file, or one others may read or write, is refused.
  ASSERT_EQ(chmod((*decoy)->path().c_str(), 0666), 0);
  Result<std::unique_ptr<HostBackup>> open = HostBackup::Open((*decoy)->path());
  ASSERT_FALSE(open.ok());
  EXPECT_NE(open.status().message().find("its mode is 0666 (others may read or write it"),
            std::string::npos)
      << open.status().ToString();
  if (geteuid() == 0) {
    ASSERT_EQ(chmod((*decoy)->path().c_str(), 0600), 0);
    ASSERT_EQ(chown((*decoy)->path().c_str(), 65534, 65534), 0);
    Result<std::unique_ptr<HostBackup>> foreign = HostBackup::Open((*decoy)->path());
    ASSERT_FALSE(foreign.ok());
    EXPECT_NE(foreign.status().message().find("it belongs to user 65534"), std::string::npos)
        << foreign.status().ToString();
  } else {
    std::cout << "[ SKIPPED ] the foreign-owner case needs root to chown a file\n";
  }
  // The name shared for one file, with another file at that path: refused.
  const BackupFileId id = real->id();
  const std::string swapped =
      std::to_string(id.device) + ":" + std::to_string(id.inode + 1) + ":" + real->path();
  Result<std::unique_ptr<HostBackup>> replaced = HostBackup::OpenShared(swapped);
  ASSERT_FALSE(replaced.ok());
  EXPECT_NE(replaced.status().message().find("that its creator made (replaced since"),
            std::string::npos)
      << replaced.status().ToString();
  for (const std::string& bad :
       {std::string(""), std::string("1:2"), std::string("x:2:/a"), std::string("1:2:"),
        std::string("99999999999999999999999:1:/a")}) {
    Result<std::unique_ptr<HostBackup>> r = HostBackup::OpenShared(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), Code::kCorruption) << bad << ": " << r.status().ToString();
  }
}

TEST(HostBackupTest, StaleBackupsOfProcessesThatDiedAreRemoved) {
  Cluster c;
  const std::string dir = FreshDir("stale");
  // A rank that crashed between creating its backup and removing the name.
  std::string left;
  int pipefd[2];
  ASSERT_EQ(pipe(pipefd), 0);
  ASSERT_TRUE(InChild([&] {
    auto b = HostBackup::Create(dir, c.layouts[0], kExperts);
    if (!b.ok()) return false;
    const std::string p = (*b)->path();
    const bool sent = write(pipefd[1], p.data(), p.size()) == static_cast<ssize_t>(p.size());
    _exit(sent ? 0 : 1);  // as a crash: no destructor, no unlink
  }));
  close(pipefd[1]);
  char buf[4096];
  const ssize_t n = read(pipefd[0], buf, sizeof(buf));
  close(pipefd[0]);
  ASSERT_GT(n, 0);
  left.assign(buf, static_cast<size_t>(n));
  ASSERT_EQ(access(left.c_str(), F_OK), 0);
  // A live process's backup and a link with a backup's name stay.
  auto live = HostBackup::Create(dir, c.layouts[0], kExperts);  // removes the dead one's
  ASSERT_TRUE(live.ok());
  EXPECT_NE(access(left.c_str(), F_OK), 0) << left << " was left behind";
  const std::string link = dir + "/eplbx-backup-999999999-0";
  ASSERT_EQ(symlink((*live)->path().c_str(), link.c_str()), 0);
  EXPECT_EQ(RemoveStaleBackups(dir), 0);
  EXPECT_EQ(access((*live)->path().c_str(), F_OK), 0);
  struct stat st {};
  EXPECT_EQ(lstat(link.c_str(), &st), 0);
}

TEST(HostBackupTest, AChangedRowIsNeverRestoredAndAnotherSourceIsUsedInstead) {
  Cluster c;
  const std::string dir = FreshDir("changed");
  auto backup = FullBackup(c, dir);
  ASSERT_NE(backup, nullptr);
  Result<SurvivorPlan> plan = c.LoseRank1(*backup);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  ASSERT_FALSE(plan->recovered.empty());
  const RecoveredSlot rec = plan->recovered.front();
  const int rank = rec.slot / kPerRank;
  // Another process of the node flips one byte of the recovered expert's w2 row (the file's
  // rows are its last bytes; the expert's row of w2 is found by its pattern).
  const std::string path = backup->path();
  ASSERT_TRUE(InChild([&] {
    const int fd = open(path.c_str(), O_RDWR);
    if (fd < 0) return false;
    std::string all(backup->bytes(), '\0');
    if (pread(fd, all.data(), all.size(), 0) != static_cast<ssize_t>(all.size())) return false;
    std::string row;
    for (size_t i = 0; i < 12; ++i) row += static_cast<char>(Pattern(rec.layer, rec.expert, 1, i));
    const size_t at = all.rfind(row);
    if (at == std::string::npos) return false;
    const char flipped = static_cast<char>(all[at + 5] ^ 1);
    return pwrite(fd, &flipped, 1, static_cast<off_t>(at + 5)) == 1 && close(fd) == 0;
  }));
  const std::vector<std::vector<uint8_t>> before = c.memory;
  Result<int64_t> refused = RecoverSlots(*plan, c.layouts[rank], *backup);
  ASSERT_FALSE(refused.ok());
  const std::string want = "layer " + std::to_string(rec.layer) + " expert " +
                           std::to_string(rec.expert) + " tensor 'w2' has checksum ";
  EXPECT_NE(refused.status().message().find(want), std::string::npos)
      << refused.status().ToString();
  EXPECT_NE(refused.status().message().find(path), std::string::npos);
  EXPECT_NE(refused.status().message().find("unrecoverable"), std::string::npos);
  EXPECT_EQ(c.memory, before);  // nothing written, not even the intact rows
  // With the checkpoint as a second source, the expert comes whole from it.
  auto ckpt = CheckpointBackup::Open(Entries({WriteCheckpoint(0), WriteCheckpoint(1)}));
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  for (int r : {0, 2, 3}) {
    Result<int64_t> n = RecoverSlots(*plan, c.layouts[r], {backup.get(), ckpt->get()});
    ASSERT_TRUE(n.ok()) << n.status().ToString();
  }
  for (const RecoveredSlot& x : plan->recovered) {
    EXPECT_TRUE(c.RowIs(x.slot / kPerRank, x.layer, x.slot % kPerRank, x.expert))
        << "layer " << x.layer << " slot " << x.slot << " expert " << x.expert;
  }
}

TEST(HostBackupTest, ABackupCutShortWhileInUseIsANamedErrorNotASigbus) {
  Cluster c;
  const std::string dir = FreshDir("cut");
  auto backup = FullBackup(c, dir);
  ASSERT_NE(backup, nullptr);
  auto survivor = HostBackup::OpenShared(backup->ShareName());
  ASSERT_TRUE(survivor.ok());
  Result<SurvivorPlan> plan = c.LoseRank1(**survivor);
  ASSERT_TRUE(plan.ok());
  const std::string path = backup->path();
  const uint64_t half = backup->bytes() / 2;
  ASSERT_TRUE(InChild([&] { return truncate(path.c_str(), static_cast<off_t>(half)) == 0; }));
  const Status checked = (*survivor)->Check();
  EXPECT_EQ(checked.code(), Code::kCorruption);
  EXPECT_NE(checked.message().find("it has " + std::to_string(half) +
                                   " bytes; its header "
                                   "describes " +
                                   std::to_string(backup->bytes())),
            std::string::npos)
      << checked.ToString();
  const std::vector<std::vector<uint8_t>> before = c.memory;
  for (int r : {0, 2, 3}) {
    Result<int64_t> n = RecoverSlots(*plan, c.layouts[r], **survivor);
    bool touched = false;
    for (const RecoveredSlot& x : plan->recovered) touched |= x.slot / kPerRank == r;
    if (!touched) continue;
    ASSERT_FALSE(n.ok()) << "rank " << r;
    EXPECT_NE(n.status().message().find("could not be read (the file ends there"),
              std::string::npos)
        << n.status().ToString();
  }
  EXPECT_EQ(c.memory, before);
  ASSERT_TRUE(InChild([&] { return truncate(path.c_str(), 0) == 0; }));
  EXPECT_EQ((*survivor)->experts_held(), 0);
  EXPECT_FALSE((*survivor)->Holds(0, 0));
}

}  // namespace
}  // namespace eplbx::io
