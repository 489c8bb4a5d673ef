// Writes the binary seed corpora (valid encodings) into tests/fuzz/corpus/. Run once when a
// format changes: build-fuzz/bin/fuzz_seeds tests/fuzz/corpus
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "common/bytes.h"
#include "eplbx/backup.h"
#include "eplbx/layout.h"
#include "protocol/records.h"
#include "serve/members_map.h"
#include "transfer/metadata.h"
#ifdef EPLBX_WITH_CUDA
#include "transfer/cuda/cuda_section.h"
#endif

namespace {
void Put(const std::filesystem::path& dir, const std::string& name, const std::string& bytes) {
  std::filesystem::create_directories(dir);
  std::ofstream(dir / name, std::ios::binary) << bytes;
}
}  // namespace

int main(int argc, char** argv) {
  const std::filesystem::path root = argc > 1 ? argv[1] : "tests/fuzz/corpus";
  using namespace eplbx;
  internal::AgentMetadata m;
  m.name = "rank3";
  m.host_id = "host/boot/net:[1]/pid:[2]";
  m.pid = 77;
  m.control = "ucx";
  m.conn_info = std::string(40, '\x11');
  m.regions.push_back({0x10000, 1 << 20, MemoryKind::kHost});
  m.regions.push_back({0x200000, 4096, MemoryKind::kHostFile});
  internal::ByteWriter shm, cma, ucx;
  shm.U32(2);
  shm.U32(static_cast<uint32_t>(-1));
  shm.U64(0);
  shm.U32(5);
  shm.U64(8192);
  cma.U64(4096);
  ucx.U32(2);
  ucx.Str32(std::string(30, 'k'));
  ucx.Str32("r");
  m.sections = {{"shm", shm.Take()}, {"cma", cma.Take()}, {"ucx", ucx.Take()}};
  Put(root / "fuzz_agent_metadata", "two_regions", internal::EncodeAgentMetadata(m));
#ifdef EPLBX_WITH_CUDA
  // Device memory: a legacy IPC region and a two-chunk cuMem region.
  m.regions.push_back({0x7f0000100000, 1 << 20, MemoryKind::kCuda});
  m.regions.push_back({0x7f0000400000, 4 << 20, MemoryKind::kCuda});
  std::vector<internal::cuda::RegionHandle> h(4);
  h[2] = {internal::cuda::HandleKind::kLegacy,
          std::string(16, 'u'),
          0x7f0000000000,
          2 << 20,
          std::string(64, 'h'),
          {}};
  h[3] = {
      internal::cuda::HandleKind::kVmm,          std::string(16, 'v'), 0x7f0000400000, 4 << 20, "",
      {{0, 2 << 20, 17}, {2 << 20, 2 << 20, 18}}};
  internal::ByteWriter ucx4;
  ucx4.U32(4);
  ucx4.Str32(std::string(30, 'k'));
  ucx4.Str32("r");
  ucx4.Str32("");
  ucx4.Str32("");
  m.sections = {{"ucx", ucx4.Take()}, {"cuda_ipc", internal::cuda::EncodeCudaSection(h)}};
  Put(root / "fuzz_agent_metadata", "device_regions", internal::EncodeAgentMetadata(m));
#endif
  m.regions.clear();
  m.sections = {{"loopback", ""}};
  Put(root / "fuzz_agent_metadata", "no_regions", internal::EncodeAgentMetadata(m));
  Put(root / "fuzz_agent_metadata", "message_header",
      internal::EncodeMessageHeader({internal::MessageKind::kNotify, "rank1"}) + "payload");
  RankLayout l;
  l.rank = 0;
  l.layers = {{{"w13", "bf16", {7168, 512}, 0x1000, 7340032, 8},
               {"w2", "bf16", {512, 7168}, 0x9000, 7340032, 8}}};
  Put(root / "fuzz_layout", "one_layer", EncodeLayout(l));
  l.layers.push_back(l.layers[0]);
  Put(root / "fuzz_layout", "two_layers", EncodeLayout(l));
  {
    // A coordinator's answers: a round at epoch 2 (members 0, 1, 3) with four contributions,
    // a refusal, a plain round and a failure.
    auto frame = [](uint8_t type, const std::string& body) {
      internal::ByteWriter w;
      w.U8(type);
      w.U32(static_cast<uint32_t>(body.size()));
      return w.Take() + body;
    };
    internal::ByteWriter at, refused, plain;
    at.U64(2);
    at.U32(4);
    for (uint8_t m : {1, 1, 0, 1}) at.U8(m);
    at.U32(4);
    for (const char* c : {"zero", "mine", "", "three"}) at.Str32(c);
    refused.U64(3);
    refused.U32(4);
    for (uint8_t m : {1, 1, 0, 0}) refused.U8(m);
    refused.Str32("rank 3 left: epoch 3, members 0, 1");
    plain.U32(4);
    for (const char* c : {"a", "b", "c", "d"}) plain.Str32(c);
    Put(root / "fuzz_bootstrap_frames", "gathered_at", frame(8, at.Take()));
    Put(root / "fuzz_bootstrap_frames", "refused_then_gathered",
        frame(9, refused.Take()) + frame(3, plain.Take()));
    Put(root / "fuzz_bootstrap_frames", "failed", frame(4, "the coordinator gave up"));
  }
#ifdef EPLBX_WITH_CUDA
  {
    // cuda_staged heads: a PULL of piece 3 and a REFUSE with its reason.
    auto head = [](uint8_t msg, uint8_t role, const std::string& text) {
      internal::ByteWriter w;
      w.U8(msg);
      w.U8(role);
      w.U64(42);
      w.U32(3);
      w.U64(0x7f0000001000);
      w.U64(4 << 20);
      w.Str16(text);
      return w.Take();
    };
    Put(root / "fuzz_staged_head", "pull", head(1, 0, ""));
    Put(root / "fuzz_staged_head", "refuse", head(3, 1, "rank1 (cuda_staged): not registered"));
  }
#endif
  {
    // etcd's answers: a range with two keys, a transaction with a range, a view, base64, a
    // watch's event.
    Put(root / "fuzz_etcd_response", "range",
        std::string("\0\0", 2) +
            R"({"header":{"revision":"12"},"kvs":[{"key":"L2VwbGJ4L2cvbWVtYmVycy8wMDAwMQ==",)"
            R"("create_revision":"3","mod_revision":"3","version":"1","value":"MTI=","lease":"7"}],)"
            R"("count":"1"})");
    Put(root / "fuzz_etcd_response", "txn",
        std::string("\1\0", 2) +
            R"({"header":{"revision":"40"},"succeeded":true,"responses":[{"response_put":{}},)"
            R"({"response_range":{"header":{"revision":"40"},"kvs":[]}}]})");
    Put(root / "fuzz_etcd_response", "view", std::string("\2\3", 2) + "eplbx-view 1 4 5 0 9 11");
    Put(root / "fuzz_etcd_response", "base64", std::string("\3\0", 2) + "Zm9vYg==");
    Put(root / "fuzz_etcd_response", "watch",
        std::string("\4\0", 2) +
            R"({"result":{"header":{"revision":"9"},"events":[{"type":"DELETE","kv":)"
            R"({"key":"L2VwbGJ4L2cvbWVtYmVycy8wMDAwMQ==","mod_revision":"9"}}]}})");
  }
  {
    // Three ranks' maps (2 layers x 3 rows of 5 experts): a member (with its window and
    // backup flags), no member, a joiner.
    const std::string cut = "\xff\xfe";
    Put(root / "fuzz_members_map", "member_none_joiner",
        internal::EncodeMembersMap(7, 2, {0, 1, 2, 3, 4, 0}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10.5},
                                   {1, 1, 0, 1, 1, 1, 1, 0, 1, 1}) +
            cut + cut + internal::EncodeMembersMap(-1, 0, {-1, -1, -1, -1, -1, -1}));
  }
  {
    // A host backup of two layers (two tensors, then one) of 8 experts, the whole file.
    RankLayout small;
    small.layers = {{{"w13", "bf16", {2, 4}, 0, 16, 3}, {"w2", "f32", {3}, 0, 12, 3}},
                    {{"w13", "bf16", {2, 4}, 0, 16, 3}}};
    auto b = HostBackup::Create(std::filesystem::temp_directory_path().string(), small, 8);
    if (b.ok()) {
      std::ifstream in((*b)->path(), std::ios::binary);
      Put(root / "fuzz_backup_header", "two_layers",
          std::string(std::istreambuf_iterator<char>(in), {}));
    }
  }
  using protocol::Record;
  using protocol::RecordKind;
  auto record = [](RecordKind kind, uint32_t expert, uint32_t source, uint32_t reader) {
    Record r;
    r.kind = kind;
    r.generation = 1;
    r.expert = expert;
    r.source = source;
    r.reader = reader;
    return r;
  };
  Put(root / "fuzz_protocol_record", "ready",
      protocol::EncodeRecord(record(RecordKind::kReady, 1, 1, 0)));
  Put(root / "fuzz_protocol_record", "done",
      protocol::EncodeRecord(record(RecordKind::kDone, 0, 2, 0)));
  Record abort = record(RecordKind::kAbort, 0, 1, 0);
  abort.reason = "rank 1: x";
  Put(root / "fuzz_protocol_record", "abort", protocol::EncodeRecord(abort));
  Record maps = record(RecordKind::kMaps, 0, 1, 2);
  maps.map_slots = 4;
  maps.maps = {0, 1, 2, -1, 3, 2, 1, 0};
  Put(root / "fuzz_protocol_record", "maps", protocol::EncodeRecord(maps));
  return 0;
}
