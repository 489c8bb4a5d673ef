// The rearrangement protocol: wire records and the per-layer state machine, driven with a
// fake clock and a simulated network that reorders and duplicates records.
#include <algorithm>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <set>

#include <gtest/gtest.h>

#include "common/bytes.h"
#include "protocol/layer_protocol.h"
#include "protocol/records.h"

namespace eplbx::protocol {
namespace {

using std::chrono::seconds;

TEST(RecordTest, RoundTripsEveryKind) {
  for (RecordKind k : {RecordKind::kReady, RecordKind::kDone, RecordKind::kAbort}) {
    Record r{k, 77, 3, 12, 1, 2, k == RecordKind::kAbort ? "rank 1: boom" : ""};
    r.epoch = 0x100000004;
    Result<Record> d = DecodeRecord(EncodeRecord(r));
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    EXPECT_EQ(d->kind, k);
    EXPECT_EQ(d->generation, 77u);
    EXPECT_EQ(d->epoch, 0x100000004u);
    EXPECT_EQ(d->layer, 3u);
    EXPECT_EQ(d->expert, 12u);
    EXPECT_EQ(d->source, 1u);
    EXPECT_EQ(d->reader, 2u);
    EXPECT_EQ(d->reason, r.reason);
  }
}

// Kind 2 was READ_DONE (protocol version 5 and before): no longer a record. A peer of an
// older build is refused by its version first.
TEST(RecordTest, RetiredReadDoneAndOlderVersionsAreRefused) {
  std::string bytes = EncodeRecord({RecordKind::kDone, 5, 2, 0, 1, 0, ""});
  std::string kind2 = bytes;
  kind2[6] = 2;
  EXPECT_NE(DecodeRecord(kind2).status().message().find("unknown kind 2"), std::string::npos);
  std::string v5 = bytes;
  v5[4] = 5;  // little-endian
  v5[5] = 0;
  EXPECT_NE(DecodeRecord(v5).status().message().find("version 5 (this build speaks 6)"),
            std::string::npos)
      << DecodeRecord(v5).status().ToString();
}

TEST(RecordTest, MapsRoundTripAndMalformedMaps) {
  Record m;
  m.kind = RecordKind::kMaps;
  m.generation = 3;
  m.layer = 1;
  m.expert = 2048;  // first slot of the chunk
  m.source = 2;
  m.reader = 2;  // old and new
  m.map_slots = 2051;
  m.maps = {4, 5, -1, 7, 8, 9};
  Result<Record> d = DecodeRecord(EncodeRecord(m));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->kind, RecordKind::kMaps);
  EXPECT_EQ(d->map_slots, 2051u);
  EXPECT_EQ(d->maps, m.maps);
  EXPECT_EQ(d->reader, 2u);
  const std::string good = EncodeRecord(m);
  for (size_t n = 0; n < good.size(); ++n) EXPECT_FALSE(DecodeRecord(good.substr(0, n)).ok()) << n;
  m.reader = 3;  // old, new and row tables (swap mode)
  m.maps = {4, 5, 6, 7, 8, 9};
  ASSERT_TRUE(DecodeRecord(EncodeRecord(m)).ok());
  m.reader = 4;
  m.maps = {4, 5, 6, 7, 8, 9, 10, 11};
  EXPECT_NE(DecodeRecord(EncodeRecord(m)).status().message().find("MAPS of 4 maps (1 to 3"),
            std::string::npos);
  m.reader = 2;
  m.maps = {1, 2, 3};
  EXPECT_NE(DecodeRecord(EncodeRecord(m)).status().message().find("2 maps with 3 entries"),
            std::string::npos);
}

// Map entries leave as little-endian u32s, in slot order, after the slot count (written in
// one piece, not entry by entry: the bytes must be the same on every host).
TEST(RecordTest, MapEntriesAreLittleEndianOnTheWire) {
  Record m;
  m.kind = RecordKind::kMaps;
  m.reader = 2;
  m.map_slots = 1;
  m.maps = {0x01020304, -1};
  const std::string bytes = EncodeRecord(m);
  ASSERT_EQ(bytes.size(), kRecordFixedBytes + 12);
  EXPECT_EQ(bytes.substr(kRecordFixedBytes - 2),
            std::string("\x0c\x00\x01\x00\x00\x00\x04\x03\x02\x01\xff\xff\xff\xff", 14));
  // The largest chunk, every kind of entry (holes, large experts), round trips.
  m.reader = 1;
  m.map_slots = static_cast<uint32_t>(kMaxMapEntries);
  m.maps.clear();
  for (size_t i = 0; i < kMaxMapEntries; ++i)
    m.maps.push_back(i % 7 == 0 ? -1 : static_cast<int32_t>(i * 40503u % 1000003u));
  Result<Record> d = DecodeRecord(EncodeRecord(m));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->maps, m.maps);
}

TEST(BytesTest, AnArrayOfU32sReadsWhatWasWrittenAndNamesItsFieldWhenShort) {
  internal::ByteWriter w;
  const std::vector<int32_t> v = {7, -2, 0x7fffffff, 0};
  w.U32s(v);
  w.U32s({});
  const std::string bytes = w.Take();
  ASSERT_EQ(bytes.size(), 16u);
  std::vector<int32_t> back = {99};
  internal::ByteReader r(bytes, "test record");
  ASSERT_TRUE(r.U32s("entries", 4, &back));
  EXPECT_EQ(back, v);
  EXPECT_TRUE(r.U32s("none", 0, &back));
  EXPECT_TRUE(back.empty());
  internal::ByteReader shortr(std::string_view(bytes).substr(0, 15), "test record");
  EXPECT_FALSE(shortr.U32s("entries", 4, &back));
  EXPECT_EQ(shortr.status().message(),
            "test record truncated at field 'entries' (offset 0): needs 16 bytes, 15 left");
  internal::ByteReader huge(bytes, "test record");  // a count whose byte size overflows
  EXPECT_FALSE(huge.U32s("entries", SIZE_MAX / 2, &back));
  EXPECT_NE(huge.status().message().find("truncated at field 'entries'"), std::string::npos);
}

TEST(RecordTest, VotesRoundTripWithTheirReason) {
  Record v{RecordKind::kVote, 7, 12, 3, 2, 1, "rank 2: layer 3 failed"};
  Result<Record> d = DecodeRecord(EncodeRecord(v));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->kind, RecordKind::kVote);
  EXPECT_EQ(d->generation, 7u);
  EXPECT_EQ(d->layer, 12u);  // the step
  EXPECT_EQ(d->expert, 3u);  // layers ready
  EXPECT_EQ(d->reader, 1u);  // failed
  EXPECT_EQ(d->reason, "rank 2: layer 3 failed");
  EXPECT_EQ(KindName(RecordKind::kVote), "VOTE");
}

TEST(RecordTest, RejectsEveryMalformedRecord) {
  const std::string good = EncodeRecord({RecordKind::kAbort, 5, 1, 2, 3, 4, "why"});
  for (size_t n = 0; n < good.size(); ++n) {
    EXPECT_FALSE(DecodeRecord(good.substr(0, n)).ok()) << "prefix " << n;
  }
  EXPECT_NE(DecodeRecord(good + "x").status().message().find("the header says"), std::string::npos);
  auto patched = [&](size_t at, char v) {
    std::string s = good;
    s[at] = v;
    return DecodeRecord(s).status();
  };
  EXPECT_NE(patched(0, 'X').message().find("bad magic"), std::string::npos);
  EXPECT_EQ(patched(4, 1).code(), Code::kNotSupported);  // version 1: before MAPS
  EXPECT_EQ(patched(4, 2).code(), Code::kNotSupported);  // version 2: before VOTE
  EXPECT_EQ(patched(4, 3).code(), Code::kNotSupported);  // version 3: before row tables
  EXPECT_EQ(patched(4, 4).code(), Code::kNotSupported);  // version 4: before epochs
  EXPECT_EQ(patched(4, 5).code(), Code::kNotSupported);  // version 5: with READ_DONE
  EXPECT_EQ(patched(4, 7).code(), Code::kNotSupported);
  EXPECT_NE(patched(6, 0).message().find("unknown kind 0"), std::string::npos);
  EXPECT_NE(patched(6, 9).message().find("unknown kind 9"), std::string::npos);
  EXPECT_NE(patched(7, 1).message().find("reserved"), std::string::npos);
  EXPECT_NE(patched(6, 1).message().find("READY carries a reason"), std::string::npos);
  std::string huge = good;
  huge[40] = static_cast<char>(0xff);  // the variable part's length
  huge[41] = static_cast<char>(0xff);
  EXPECT_NE(DecodeRecord(huge).status().message().find("limit"), std::string::npos);
}

// A world of LayerProtocols exchanging records through a queue the test controls.
struct World {
  std::vector<LayerProtocol> ranks;
  struct Msg {
    uint32_t from, to;
    Record r;
  };
  std::deque<Msg> net;
  std::vector<std::pair<uint32_t, ReadTask>> reads;  // posted, not completed
  std::vector<int> commits;
  std::vector<std::string> aborts;
  Clock::time_point now{};

  explicit World(const std::vector<LayerStep>& steps) {
    commits.assign(steps.size(), 0);
    aborts.assign(steps.size(), "");
    for (const auto& s : steps) ranks.emplace_back(s, now, seconds(10));
  }
  void Apply(uint32_t self, const std::vector<Action>& actions) {
    for (const Action& a : actions) {
      switch (a.kind) {
        case ActionKind::kSend:
          net.push_back({self, a.peer, a.record});
          break;
        case ActionKind::kPostRead:
          reads.push_back({self, a.read});
          posted.push_back({self, a.read});
          break;
        case ActionKind::kCommit:
          // Commit safety: no READ of any rank's rows is still under way anywhere (in place,
          // a source overwrites its rows at its commit).
          EXPECT_TRUE(reads.empty())
              << "rank " << self << " committed with " << reads.size()
              << " READ(s) under way, the first from rank " << reads[0].second.source;
          ++commits[self];
          break;
        case ActionKind::kAbort:
          aborts[self] = a.reason;
          break;
      }
    }
  }
  std::vector<std::pair<uint32_t, ReadTask>> posted;  // every READ ever posted

  // Delivers everything in a random order, duplicating some records.
  void Run(std::mt19937& rng) {
    for (uint32_t r = 0; r < ranks.size(); ++r) Apply(r, ranks[r].Start());
    while (!net.empty() || !reads.empty()) {
      const bool do_read = !reads.empty() && (net.empty() || rng() % 2);
      if (do_read) {
        size_t i = rng() % reads.size();
        auto [self, task] = reads[i];
        reads.erase(reads.begin() + static_cast<long>(i));
        Apply(self, ranks[self].OnReadComplete(task, Status::OK()));
        continue;
      }
      size_t i = rng() % net.size();
      Msg m = net[i];
      net.erase(net.begin() + static_cast<long>(i));
      if (rng() % 5 == 0) net.push_back(m);  // a duplicate
      bool deferred = false;
      Apply(m.to, ranks[m.to].OnRecord(m.from, m.r, now, &deferred));
      EXPECT_FALSE(deferred);
      if (after_record) after_record(m);
    }
  }
  std::function<void(const Msg&)> after_record;
};

// A random plan: each rank reads some experts from other ranks.
std::vector<LayerStep> RandomSteps(uint32_t world, std::mt19937& rng, uint64_t gen = 9) {
  std::vector<LayerStep> steps(world);
  for (uint32_t r = 0; r < world; ++r) steps[r] = LayerStep{gen, 4, r, world, {}, {}};
  std::set<std::pair<uint32_t, uint32_t>> seen;  // (reader, expert)
  const int n = static_cast<int>(rng() % (3 * world));
  for (int i = 0; i < n; ++i) {
    uint32_t reader = rng() % world, source = rng() % world, expert = rng() % 16;
    if (reader == source || !seen.insert({reader, expert}).second) continue;
    steps[reader].reads.push_back({expert, source});
    steps[source].serves.push_back({expert, reader});
  }
  return steps;
}

TEST(LayerProtocolTest, EveryRankCommitsUnderAnyDeliveryOrder) {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 2000; ++trial) {
    const uint32_t world = 1 + rng() % 6;
    World w(RandomSteps(world, rng));
    w.Run(rng);
    for (uint32_t r = 0; r < world; ++r) {
      ASSERT_EQ(w.ranks[r].state(), LayerState::kCommitted)
          << "trial " << trial << " rank " << r << ": " << w.aborts[r];
      ASSERT_EQ(w.commits[r], 1);
    }
  }
}

// A held DONE (LayerStep::hold_done): every read and serve completes, yet no rank commits
// before every rank released its DONE; then every rank commits, once. Random worlds, ranks
// released one by one in a random order, deliveries in between.
TEST(LayerProtocolTest, NoRankCommitsBeforeEveryRankReleasedItsDone) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 2000; ++trial) {
    const uint32_t world = 1 + rng() % 6;
    std::vector<LayerStep> steps = RandomSteps(world, rng);
    for (LayerStep& st : steps) st.hold_done = true;
    World w(steps);
    w.Run(rng);
    EXPECT_TRUE(w.reads.empty()) << "trial " << trial << ": reads wait for nothing";
    std::vector<uint32_t> order(world);
    std::iota(order.begin(), order.end(), 0u);
    std::shuffle(order.begin(), order.end(), rng);
    for (size_t k = 0; k < order.size(); ++k) {
      for (uint32_t r = 0; r < world; ++r) {
        ASSERT_EQ(w.commits[r], 0) << "trial " << trial << ": rank " << r << " committed with "
                                   << world - k << " rank(s) still holding DONE";
        ASSERT_EQ(w.ranks[r].state(), LayerState::kRunning) << "trial " << trial << " rank " << r;
      }
      w.Apply(order[k], w.ranks[order[k]].ReleaseDone(w.now));
      EXPECT_TRUE(w.ranks[order[k]].ReleaseDone(w.now).empty()) << "released twice";
      w.Run(rng);
    }
    for (uint32_t r = 0; r < world; ++r) {
      ASSERT_EQ(w.ranks[r].state(), LayerState::kCommitted)
          << "trial " << trial << " rank " << r << ": " << w.aborts[r];
      ASSERT_EQ(w.commits[r], 1);
    }
  }
}

// Layers run together as the synchronous loop runs them (Rearranger::Rearrange): per rank,
// one LayerProtocol a layer, DONE held until the layer before was applied here, layers
// applied in order, the first that fails stopping the rest; with `ahead`, ReleaseDonesAhead
// after every event. Records and READ completions in a random order; `drop` loses one DONE
// record (a partition) and the clock then runs past every deadline.
struct LayersWorld {
  uint32_t world, layers;
  bool ahead;
  std::vector<std::vector<std::unique_ptr<LayerProtocol>>> p;  // [rank][layer]
  std::vector<uint32_t> applied;                               // per rank
  std::vector<std::vector<bool>> committed;                    // [rank][layer]
  std::vector<bool> stopped;
  struct Msg {
    uint32_t from, to;
    Record r;
  };
  std::vector<Msg> net;
  struct Read {
    uint32_t rank, layer;
    ReadTask task;
  };
  std::vector<Read> reads;
  // The order each rank's DONEs left, and whether the layer before was applied by then.
  std::vector<std::vector<std::pair<uint32_t, bool>>> dones_sent;
  Clock::time_point now{};
  static constexpr uint64_t kGen = 100;

  LayersWorld(uint32_t w, uint32_t l, bool a, std::mt19937& rng)
      : world(w),
        layers(l),
        ahead(a),
        p(w),
        applied(w, 0),
        committed(w, std::vector<bool>(l, false)),
        stopped(w, false),
        dones_sent(w) {
    for (uint32_t layer = 0; layer < layers; ++layer) {
      std::vector<LayerStep> steps = RandomSteps(world, rng, kGen + layer);
      for (uint32_t r = 0; r < world; ++r) {
        steps[r].layer = layer;
        steps[r].hold_done = layer > 0;
        p[r].push_back(std::make_unique<LayerProtocol>(steps[r], now, seconds(10)));
      }
    }
  }
  void Apply(uint32_t r, uint32_t layer, const std::vector<Action>& actions) {
    for (const Action& a : actions) {
      if (a.kind == ActionKind::kSend) {
        if (a.record.kind == RecordKind::kDone && a.peer == (r + 1) % world) {
          dones_sent[r].push_back({layer, layer == 0 || applied[r] >= layer});
        }
        net.push_back({r, a.peer, a.record});
      } else if (a.kind == ActionKind::kPostRead) {
        reads.push_back({r, layer, a.read});
      } else if (a.kind == ActionKind::kCommit) {
        for (const Read& rd : reads) {  // commit safety: every READ of the layer completed
          EXPECT_NE(rd.layer, layer)
              << "rank " << r << " committed layer " << layer << " while rank " << rd.rank
              << " still READs from rank " << rd.task.source;
        }
      }
    }
  }
  // What the loop does after every event: apply what is over, in order; release DONEs.
  void Settle(uint32_t r) {
    while (applied[r] < layers && p[r][applied[r]]->state() != LayerState::kRunning) {
      const uint32_t l = applied[r];
      if (p[r][l]->state() == LayerState::kCommitted && !stopped[r]) {
        committed[r][l] = true;
      } else if (!stopped[r]) {
        stopped[r] = true;
        for (uint32_t k = l + 1; k < layers; ++k)
          Apply(r, k, p[r][k]->Fail("a layer before failed"));
      }
      ++applied[r];
      if (!stopped[r] && applied[r] < layers) {
        Apply(r, applied[r], p[r][applied[r]]->ReleaseDone(now));
      }
    }
    if (!ahead || stopped[r] || applied[r] >= layers) return;
    std::vector<LayerProtocol*> open;
    for (uint32_t k = applied[r]; k < layers; ++k) open.push_back(p[r][k].get());
    for (auto& [i, actions] : ReleaseDonesAhead(open, now)) {
      Apply(r, applied[r] + static_cast<uint32_t>(i), actions);
    }
  }
  void Start() {
    for (uint32_t r = 0; r < world; ++r) {
      for (uint32_t l = 0; l < layers; ++l) Apply(r, l, p[r][l]->Start());
      Settle(r);
    }
  }
  // One event, at random: a READ completes or a record arrives (DONEs only if `dones`).
  // The `drop_done`-th DONE delivered (counting from 0) is lost instead (-1: none). Returns
  // false when no such event is left.
  bool Step(std::mt19937& rng, bool dones = true) {
    std::vector<size_t> msgs;
    for (size_t i = 0; i < net.size(); ++i) {
      if (dones || net[i].r.kind != RecordKind::kDone) msgs.push_back(i);
    }
    if (msgs.empty() && reads.empty()) return false;
    if (!reads.empty() && (msgs.empty() || rng() % 2)) {
      const size_t i = rng() % reads.size();
      Read rd = reads[i];
      reads.erase(reads.begin() + static_cast<long>(i));
      Apply(rd.rank, rd.layer, p[rd.rank][rd.layer]->OnReadComplete(rd.task, Status::OK()));
      Settle(rd.rank);
      return true;
    }
    const size_t i = msgs[rng() % msgs.size()];
    Msg m = net[i];
    net.erase(net.begin() + static_cast<long>(i));
    if (m.r.kind == RecordKind::kDone && dones_delivered++ == drop_done) {
      lost = m;  // a partition: it never arrives
      return true;
    }
    bool deferred = false;
    const uint32_t l = static_cast<uint32_t>(m.r.generation - kGen);
    Apply(m.to, l, p[m.to][l]->OnRecord(m.from, m.r, now, &deferred));
    EXPECT_FALSE(deferred);
    Settle(m.to);
    CheckVouched();
    return true;
  }
  // What the pipeline's votes rest on (src/rearrange/pipeline.cc, VouchedPrefix): once every
  // rank vouches for a layer (its DONE sent, every rank's maps matched its own), every READ
  // of the layer has completed, whatever has arrived where.
  void CheckVouched() {
    for (uint32_t l = 0; l < layers; ++l) {
      bool all = true;
      for (uint32_t r = 0; r < world; ++r)
        all = all && p[r][l]->done_sent() && p[r][l]->maps_agreed();
      if (!all) continue;
      for (const Read& rd : reads) {
        EXPECT_NE(rd.layer, l) << "every rank vouches for layer " << l << " while rank " << rd.rank
                               << " still READs from rank " << rd.task.source;
      }
    }
  }
  int drop_done = -1, dones_delivered = 0;
  std::optional<Msg> lost;
  void Expire() {
    now += seconds(3600);
    for (uint32_t round = 0; round < layers + 1; ++round) {
      for (uint32_t r = 0; r < world; ++r) {
        for (uint32_t l = 0; l < layers; ++l) Apply(r, l, p[r][l]->OnTick(now));
        Settle(r);
      }
    }
  }
};

// DONEs going ahead (the synchronous loop's default): with every READ over before any DONE
// arrives, every rank sends the DONE of every layer at once, where one held until the layer
// before was applied sends only the first; every rank still commits every layer, and a rank
// sends a layer's DONE only after the one before it (and, not going ahead, after applying
// it). 2,000 random worlds each way, records and completions in any order.
TEST(LayerProtocolTest, DonesGoAheadTogetherAndEveryLayerCommits) {
  std::mt19937 rng(41);
  for (int trial = 0; trial < 2000; ++trial) {
    const bool ahead = trial % 2 == 0;
    const uint32_t world = 2 + rng() % 4, layers = 1 + rng() % 6;
    LayersWorld w(world, layers, ahead, rng);
    w.Start();
    while (w.Step(rng, /*dones=*/false)) {  // every READ and every record but DONEs
    }
    size_t dones = 0;
    for (const auto& m : w.net) dones += m.r.kind == RecordKind::kDone;
    ASSERT_EQ(dones, size_t{world} * (world - 1) * (ahead ? layers : 1))
        << "trial " << trial << ": DONEs in flight before any arrived";
    while (w.Step(rng)) {
    }
    for (uint32_t r = 0; r < world; ++r) {
      for (uint32_t l = 0; l < layers; ++l) {
        ASSERT_TRUE(w.committed[r][l]) << "trial " << trial << " rank " << r << " layer " << l;
      }
      ASSERT_EQ(w.dones_sent[r].size(), layers);
      for (uint32_t k = 0; k < layers; ++k) {
        EXPECT_EQ(w.dones_sent[r][k].first, k) << "trial " << trial << ": DONEs out of order";
        if (!ahead) {
          EXPECT_TRUE(w.dones_sent[r][k].second) << "trial " << trial << ": held DONE left early";
        }
      }
    }
  }
}

// A DONE lost on the way (a partition), every order: every rank ends (the deadline), each
// rank's committed layers are a prefix, a layer is committed only where every rank sent its
// DONE, and the rank that missed the DONE commits nothing from that layer on. The ranks may
// disagree on that layer when DONEs are held, and on the layers whose DONEs the rank that
// missed one sent ahead when they go ahead (docs/protocol.md).
TEST(LayerProtocolTest, ALostDoneLeavesEveryRankAPrefixOfLayersItCommitted) {
  std::mt19937 rng(43);
  int lost_runs = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    const bool ahead = trial % 2 == 0;
    const uint32_t world = 2 + rng() % 4, layers = 1 + rng() % 6;
    LayersWorld w(world, layers, ahead, rng);
    w.drop_done = static_cast<int>(rng() % (world * (world - 1) * layers));
    w.Start();
    while (w.Step(rng)) {
    }
    w.Expire();
    std::vector<uint32_t> prefix(world, 0);
    for (uint32_t r = 0; r < world; ++r) {
      ASSERT_EQ(w.applied[r], layers) << "trial " << trial << " rank " << r << " still running";
      while (prefix[r] < layers && w.committed[r][prefix[r]]) ++prefix[r];
      for (uint32_t l = prefix[r]; l < layers; ++l) {
        ASSERT_FALSE(w.committed[r][l]) << "trial " << trial << ": rank " << r << " committed " << l
                                        << " after failing " << prefix[r];
      }
    }
    for (uint32_t l = 0; l < layers; ++l) {
      bool any = false;
      for (uint32_t r = 0; r < world; ++r) any = any || w.committed[r][l];
      if (!any) continue;
      for (uint32_t r = 0; r < world; ++r) {
        bool sent = false;
        for (const auto& [k, applied_before] : w.dones_sent[r]) sent = sent || k == l;
        ASSERT_TRUE(sent) << "trial " << trial << ": layer " << l << " committed without rank " << r
                          << "'s DONE";
      }
    }
    if (!w.lost) continue;
    ++lost_runs;
    const uint32_t victim = w.lost->to;
    const auto layer = static_cast<uint32_t>(w.lost->r.generation - LayersWorld::kGen);
    EXPECT_LE(prefix[victim], layer) << "trial " << trial;
    uint32_t most = 0, sent_through = 0;
    for (uint32_t r = 0; r < world; ++r) most = std::max(most, prefix[r]);
    for (const auto& [k, applied_before] : w.dones_sent[victim])
      sent_through = std::max(sent_through, k + 1);
    EXPECT_LE(most, ahead ? sent_through : layer + 1) << "trial " << trial;
  }
  EXPECT_GT(lost_runs, 1000);
}

LayerStep TwoRankReader() { return LayerStep{5, 2, 0, 2, {{7, 1}}, {}}; }

// A held layer's deadline runs again from its release: it waited on the layers before it.
TEST(LayerProtocolTest, AReleasedLayerHasItsDeadlineAgain) {
  LayerStep st = TwoRankReader();
  st.hold_done = true;
  Clock::time_point t0{};
  LayerProtocol p(st, t0, seconds(10));
  (void)p.Start();
  (void)p.ReleaseDone(t0 + seconds(9));
  EXPECT_TRUE(p.OnTick(t0 + seconds(18)).empty());
  EXPECT_EQ(p.state(), LayerState::kRunning);
  (void)p.OnTick(t0 + seconds(20));
  EXPECT_EQ(p.state(), LayerState::kAborted);
  EXPECT_NE(p.error().find("deadline"), std::string::npos) << p.error();
}

// The MAPS record rank `from` sends first (one chunk: maps of up to 2048 slots).
Record MapsOf(uint32_t from, uint64_t gen, uint32_t layer, std::vector<int32_t> old_map = {},
              std::vector<int32_t> new_map = {}, std::vector<int32_t> row_map = {}) {
  Record m;
  m.kind = RecordKind::kMaps;
  m.generation = gen;
  m.layer = layer;
  m.source = from;
  m.reader = new_map.empty() ? 1 : row_map.empty() ? 2 : 3;
  m.map_slots = static_cast<uint32_t>(old_map.size());
  m.maps = old_map;
  m.maps.insert(m.maps.end(), new_map.begin(), new_map.end());
  m.maps.insert(m.maps.end(), row_map.begin(), row_map.end());
  return m;
}

// Maps of `slots` slots, the same on every rank unless a test changes one.
void GiveMaps(std::vector<LayerStep>& steps, size_t slots, bool with_new, std::mt19937& rng) {
  std::vector<int32_t> old_map(slots), new_map(with_new ? slots : 0);
  for (int32_t& e : old_map) e = static_cast<int32_t>(rng() % 300);
  for (int32_t& e : new_map) e = static_cast<int32_t>(rng() % 300);
  for (LayerStep& s : steps) {
    s.old_map = old_map;
    s.new_map = new_map;
  }
}

TEST(LayerProtocolTest, RanksAgreeOnTheMapsUnderAnyDeliveryOrder) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    const uint32_t world = 2 + rng() % 4;
    std::vector<LayerStep> steps = RandomSteps(world, rng);
    // Up to 5000 slots: maps of several MAPS records each.
    GiveMaps(steps, rng() % 5000, rng() % 2, rng);
    World w(steps);
    w.Run(rng);
    for (uint32_t r = 0; r < world; ++r) {
      ASSERT_EQ(w.commits[r], 1) << "trial " << trial << " rank " << r << ": " << w.aborts[r];
    }
  }
}

// One rank's old map has two slots swapped (a stale map): no rank commits, nothing is read
// from a rank whose maps differ from the reader's, and the error names both ranks and the
// first differing slot (issue 17, item 1).
TEST(LayerProtocolTest, AStaleMapOnOneRankFailsTheLayerOnEveryRank) {
  std::mt19937 rng(12);
  int named = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const uint32_t world = 2 + rng() % 4;
    std::vector<LayerStep> steps = RandomSteps(world, rng);
    const size_t slots = 8 + rng() % 4000;
    const bool with_new = rng() % 2;
    GiveMaps(steps, slots, with_new, rng);
    const uint32_t stale = rng() % world;
    const size_t a = rng() % slots;
    size_t b = rng() % slots;
    while (b == a) b = rng() % slots;
    std::vector<int32_t>& map =
        (with_new && rng() % 2) ? steps[stale].new_map : steps[stale].old_map;
    map[a] = 300;  // no other slot holds 300: the swap changes both slots
    std::swap(map[a], map[b]);
    World w(steps);
    w.Run(rng);
    for (uint32_t r = 0; r < world; ++r) {
      ASSERT_EQ(w.commits[r], 0) << "trial " << trial << " rank " << r;
      ASSERT_EQ(w.ranks[r].state(), LayerState::kAborted);
      // No rank vouches for the layer (the pipeline's vote: src/rearrange/pipeline.cc).
      EXPECT_FALSE(w.ranks[r].maps_agreed()) << "trial " << trial << " rank " << r;
    }
    for (const auto& [reader, task] : w.posted) {
      EXPECT_TRUE(reader != stale && task.source != stale)
          << "rank " << reader << " read from rank " << task.source << " with maps that differ";
    }
    const std::string& e = w.aborts[stale];
    if (e.find("aborted by") != std::string::npos) continue;  // a peer noticed first
    EXPECT_NE(e.find("map of the layer differs between rank " + std::to_string(stale)),
              std::string::npos)
        << e;
    // The first differing slot of the first chunk that differs: one of the two (this test's
    // network reorders MAPS chunks; a real peer's arrive in order).
    EXPECT_TRUE(e.find("at slot " + std::to_string(std::min(a, b)) + " ") != std::string::npos ||
                e.find("at slot " + std::to_string(std::max(a, b)) + " ") != std::string::npos)
        << e << " (swapped slots " << a << ", " << b << ")";
    ++named;
  }
  EXPECT_GT(named, 50);
}

TEST(LayerProtocolTest, MapsOfDifferentShapeAreRefusedByName) {
  bool d = false;
  LayerStep mine = TwoRankReader();
  mine.old_map = {1, 2, 3, 4};
  {
    LayerProtocol p(mine, Clock::time_point{}, seconds(10));
    p.Start();
    p.OnRecord(1, MapsOf(1, 5, 2, {1, 2, 3, 4}, {4, 3, 2, 1}), {}, &d);
    EXPECT_NE(p.error().find("rank 1 passed the old and new maps of the layer and rank 0 only "
                             "the old map"),
              std::string::npos)
        << p.error();
  }
  // Swap mode: the row tables go as a third map and are agreed like the maps, by slot and
  // both rows.
  LayerStep swap = mine;
  swap.new_map = {4, 3, 2, 1};
  swap.row_map = {0, 1, 3, 2};
  {
    LayerProtocol p(swap, Clock::time_point{}, seconds(10));
    std::vector<Action> start = p.Start();
    ASSERT_FALSE(start.empty());
    EXPECT_EQ(start[0].record.kind, RecordKind::kMaps);
    EXPECT_EQ(start[0].record.reader, 3u);  // old map, new map, row tables
    EXPECT_EQ(start[0].record.maps, (std::vector<int32_t>{1, 2, 3, 4, 4, 3, 2, 1, 0, 1, 3, 2}));
  }
  const std::pair<Record, const char*> swap_cases[] = {
      {MapsOf(1, 5, 2, {1, 2, 3, 4}, {4, 3, 2, 1}, {0, 1, 3, 2}), ""},  // agreed: runs on
      {MapsOf(1, 5, 2, {1, 2, 3, 4}, {4, 3, 2, 1}, {0, 1, 2, 3}),
       "row table of the layer differs between rank 0 and rank 1 at slot 2 (rank 0: row 3, "
       "rank 1: row 2)"},
      {MapsOf(1, 5, 2, {1, 2, 3, 4}, {4, 3, 2, 1}),
       "rank 1 passed the old and new maps of the layer and rank 0 maps and row tables; every "
       "rank must pass the same maps (and use the same commit mode)"},
  };
  for (const auto& [maps, want] : swap_cases) {
    LayerProtocol p(swap, Clock::time_point{}, seconds(10));
    p.Start();
    p.OnRecord(1, maps, {}, &d);
    if (*want == '\0') {
      EXPECT_EQ(p.state(), LayerState::kRunning) << p.error();
    } else {
      EXPECT_NE(p.error().find(want), std::string::npos) << p.error();
    }
  }
  {
    LayerProtocol p(mine, Clock::time_point{}, seconds(10));
    p.Start();
    p.OnRecord(1, MapsOf(1, 5, 2, {1, 2, 3}), {}, &d);
    EXPECT_NE(p.error().find("has 3 slots on rank 1 and 4 on rank 0"), std::string::npos)
        << p.error();
  }
  {
    // A chunk past the end of the map is malformed, not an out-of-bounds write (an empty
    // map has one chunk, of zero slots).
    LayerProtocol p(TwoRankReader(), Clock::time_point{}, seconds(10));
    p.Start();
    Record far = MapsOf(1, 5, 2);
    far.expert = 4096;
    p.OnRecord(1, far, {}, &d);
    EXPECT_NE(p.error().find("(malformed chunk)"), std::string::npos) << p.error();
  }
  {
    // A READY before the source's maps: the READ waits for them, then goes out.
    LayerProtocol p(mine, Clock::time_point{}, seconds(10));
    p.Start();
    EXPECT_TRUE(p.OnRecord(1, {RecordKind::kReady, 5, 2, 7, 1, 0, ""}, {}, &d).empty());
    auto a = p.OnRecord(1, MapsOf(1, 5, 2, {1, 2, 3, 4}), {}, &d);
    ASSERT_EQ(a.size(), 1u);
    EXPECT_EQ(a[0].kind, ActionKind::kPostRead);
  }
}

// A rank that finished (committed) may exit at once; its peers then see it fail, but once
// they hold its DONE nothing of the layer depends on it: they still commit. Before its DONE
// the same failure aborts.
TEST(LayerProtocolTest, APeerLostAfterItsDoneDoesNotFailTheLayer) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 200; ++trial) {
    World w(RandomSteps(3, rng));
    w.after_record = [&](const auto& m) {
      if (m.from == 0 && m.r.kind == RecordKind::kDone && m.to != 0) {
        w.Apply(m.to, w.ranks[m.to].OnPeerFailed(0, Status::Unavailable("connection lost")));
      }
    };
    w.Run(rng);
    for (uint32_t r = 0; r < 3; ++r) {
      EXPECT_EQ(w.commits[r], 1) << "trial " << trial << " rank " << r << ": " << w.aborts[r];
    }
  }
  LayerProtocol p(TwoRankReader(), Clock::time_point{}, seconds(10));
  p.Start();
  p.OnPeerFailed(1, Status::Unavailable("connection lost"));
  EXPECT_EQ(p.state(), LayerState::kAborted);
}

TEST(LayerProtocolTest, StaleFutureAndDuplicateRecords) {
  LayerProtocol p(TwoRankReader(), Clock::time_point{}, seconds(10));
  p.Start();
  bool deferred = false;
  EXPECT_TRUE(p.OnRecord(1, MapsOf(1, 5, 2), {}, &deferred).empty());
  EXPECT_TRUE(p.OnRecord(1, {RecordKind::kReady, 4, 2, 7, 1, 0, ""}, {}, &deferred).empty());
  EXPECT_FALSE(deferred);
  EXPECT_EQ(p.ignored(), 1u);
  EXPECT_TRUE(p.OnRecord(1, {RecordKind::kReady, 6, 2, 7, 1, 0, ""}, {}, &deferred).empty());
  EXPECT_TRUE(deferred);
  auto a = p.OnRecord(1, {RecordKind::kReady, 5, 2, 7, 1, 0, ""}, {}, &deferred);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(a[0].kind, ActionKind::kPostRead);
  EXPECT_EQ(a[0].read.expert, 7u);
  EXPECT_EQ(a[0].read.source, 1u);
  EXPECT_TRUE(
      p.OnRecord(1, {RecordKind::kReady, 5, 2, 7, 1, 0, ""}, {}, &deferred).empty());  // duplicate
  EXPECT_EQ(p.ignored(), 2u);
  auto done = p.OnReadComplete({7, 1}, Status::OK());
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].record.kind, RecordKind::kDone);
  auto commit = p.OnRecord(1, {RecordKind::kDone, 5, 2, 0, 1, 0, ""}, {}, &deferred);
  ASSERT_EQ(commit.size(), 1u);
  EXPECT_EQ(commit[0].kind, ActionKind::kCommit);
  EXPECT_EQ(p.state(), LayerState::kCommitted);
  // After commit, even an ABORT is ignored: the layer is final.
  EXPECT_TRUE(p.OnRecord(1, {RecordKind::kAbort, 5, 2, 0, 1, 0, "late"}, {}, &deferred).empty());
  EXPECT_EQ(p.state(), LayerState::kCommitted);
}

// Records of another membership epoch (a rank declared lost that still talks, or one that
// learned of a change first) are refused: nothing of them is acted on, not even an ABORT, and
// the layer's error names the first.
TEST(LayerProtocolTest, RecordsOfAnotherEpochAreRefusedByName) {
  LayerStep step = TwoRankReader();
  step.epoch = 2;
  LayerProtocol p(step, Clock::time_point{}, seconds(10));
  for (const Action& a : p.Start()) {
    if (a.kind == ActionKind::kSend) {
      EXPECT_EQ(a.record.epoch, 2u);  // what it sends carries it
    }
  }
  bool deferred = false;
  Record maps = MapsOf(1, 5, 2);
  maps.epoch = 2;
  EXPECT_TRUE(p.OnRecord(1, maps, {}, &deferred).empty());
  Record ready{RecordKind::kReady, 5, 2, 7, 1, 0, ""};
  ready.epoch = 1;
  EXPECT_TRUE(p.OnRecord(1, ready, {}, &deferred).empty());  // a zombie's READY: no READ
  Record abort{RecordKind::kAbort, 5, 2, 0, 1, 0, "rank 1: stale"};
  abort.epoch = 1;
  EXPECT_TRUE(p.OnRecord(1, abort, {}, &deferred).empty());  // nor its ABORT
  Record ahead = ready;
  ahead.epoch = 3;
  EXPECT_TRUE(p.OnRecord(1, ahead, {}, &deferred).empty());
  EXPECT_FALSE(deferred);
  EXPECT_EQ(p.state(), LayerState::kRunning);
  EXPECT_EQ(p.refused(), 3u);
  EXPECT_EQ(p.refused_note(),
            "READY from rank 1 at epoch 1; this rank is at epoch 2 (the sender was declared "
            "lost: it must rejoin as a new member)");
  // The same READY at this epoch is acted on.
  ready.epoch = 2;
  auto a = p.OnRecord(1, ready, {}, &deferred);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(a[0].kind, ActionKind::kPostRead);
  auto done = p.OnReadComplete({7, 1}, Status::OK());
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].record.kind, RecordKind::kDone);
  EXPECT_EQ(done[0].record.epoch, 2u);  // what it sends carries its epoch
  // At the deadline the error says what was refused.
  p.OnTick(Clock::time_point{} + seconds(11));
  ASSERT_EQ(p.state(), LayerState::kAborted);
  EXPECT_NE(p.error().find("deadline passed waiting for DONE from rank 1; 3 records of another "
                           "epoch refused, the first: READY from rank 1 at epoch 1"),
            std::string::npos)
      << p.error();
}

// A rank that is not a member at the step's epoch (lost, the survivors go on) is sent nothing
// and expected for nothing; a plan that still involves it fails at Start naming it.
TEST(LayerProtocolTest, AbsentRanksAreExpectedForNothing) {
  LayerStep step{5, 2, 0, 3, {{7, 1}}, {}};
  step.epoch = 2;
  step.members = {true, true, false};
  LayerProtocol p(step, Clock::time_point{}, seconds(10));
  for (const Action& a : p.Start()) {
    EXPECT_NE(a.peer, 2u) << "sent to the absent rank";
  }
  bool deferred = false;
  Record maps = MapsOf(1, 5, 2);
  maps.epoch = 2;
  EXPECT_TRUE(p.OnRecord(1, maps, {}, &deferred).empty());
  Record zombie{RecordKind::kAbort, 5, 2, 0, 2, 0, "rank 2: still here"};
  zombie.epoch = 2;
  EXPECT_TRUE(p.OnRecord(2, zombie, {}, &deferred).empty());  // refused, not acted on
  EXPECT_TRUE(p.OnPeerFailed(2, Status::Unavailable("gone")).empty());
  Record ready{RecordKind::kReady, 5, 2, 7, 1, 0, ""};
  ready.epoch = 2;
  ASSERT_EQ(p.OnRecord(1, ready, {}, &deferred).size(), 1u);
  auto done = p.OnReadComplete({7, 1}, Status::OK());
  ASSERT_EQ(done.size(), 1u);  // DONE to rank 1 only
  EXPECT_EQ(done[0].peer, 1u);
  Record done1{RecordKind::kDone, 5, 2, 0, 1, 0, ""};
  done1.epoch = 2;
  auto commit = p.OnRecord(1, done1, {}, &deferred);
  ASSERT_EQ(commit.size(), 1u);
  EXPECT_EQ(commit[0].kind, ActionKind::kCommit);  // nothing from rank 2 was needed
  EXPECT_EQ(p.refused(), 1u);
  EXPECT_EQ(p.refused_note(), "ABORT from rank 2 at epoch 2; rank 2 is not a member at epoch 2");
  // A plan that reads from the absent rank fails at once, telling the members only.
  LayerStep stale{5, 2, 0, 3, {{7, 2}}, {}};
  stale.epoch = 2;
  stale.members = {true, true, false};
  LayerProtocol q(stale, Clock::time_point{}, seconds(10));
  auto out = q.Start();
  EXPECT_EQ(q.state(), LayerState::kAborted);
  EXPECT_NE(q.error().find("the plan reads expert 7 from rank 2, which is not a member at epoch 2"),
            std::string::npos)
      << q.error();
  for (const Action& a : out) EXPECT_NE(a.peer, 2u);
}

// Each misrouted or unexpected record aborts, broadcasts ABORT and names the sender.
TEST(LayerProtocolTest, MisroutedRecordsAbortNamingTheRank) {
  struct Case {
    uint32_t from;
    Record r;
    const char* says;
  };
  const std::vector<Case> cases = {
      {1, {RecordKind::kReady, 5, 3, 7, 1, 0, ""}, "rank 1 sent READY for layer 3"},
      {1, {RecordKind::kReady, 5, 2, 7, 2, 0, ""}, "rank 1 sent a misrouted READY"},
      {1, {RecordKind::kReady, 5, 2, 7, 1, 1, ""}, "rank 1 sent a misrouted READY"},
      {1, {RecordKind::kReady, 5, 2, 8, 1, 0, ""}, "rank 1 sent READY for expert 8"},
      {1, {RecordKind::kVote, 5, 2, 0, 1, 0, ""}, "rank 1 sent a VOTE into the layer"},
      {1, {RecordKind::kDone, 5, 2, 0, 0, 0, ""}, "rank 1 sent a misrouted DONE"},
      {7, {RecordKind::kDone, 5, 2, 0, 7, 0, ""}, "claims to come from rank 7"},
  };
  for (const Case& c : cases) {
    LayerProtocol p(TwoRankReader(), Clock::time_point{}, seconds(10));
    p.Start();
    bool deferred = false;
    auto a = p.OnRecord(c.from, c.r, {}, &deferred);
    EXPECT_EQ(p.state(), LayerState::kAborted) << c.says;
    EXPECT_NE(p.error().find(c.says), std::string::npos) << p.error();
    ASSERT_EQ(a.size(), 2u);
    EXPECT_EQ(a[0].kind, ActionKind::kSend);
    EXPECT_EQ(a[0].record.kind, RecordKind::kAbort);
    EXPECT_EQ(a[0].peer, 1u);
    EXPECT_EQ(a[1].kind, ActionKind::kAbort);
  }
}

TEST(LayerProtocolTest, FailuresAndDeadlinesNameWhatIsMissing) {
  const Clock::time_point t0{};
  {
    LayerProtocol p(TwoRankReader(), t0, seconds(10));
    p.Start();
    p.OnTick(t0 + seconds(10));
    EXPECT_NE(p.error().find("waiting for MAPS from rank 1"), std::string::npos) << p.error();
  }
  {
    LayerProtocol p(TwoRankReader(), t0, seconds(10));
    p.Start();
    bool d = false;
    p.OnRecord(1, MapsOf(1, 5, 2), t0, &d);
    EXPECT_TRUE(p.OnTick(t0 + seconds(9)).empty());
    auto a = p.OnTick(t0 + seconds(10));
    EXPECT_EQ(p.state(), LayerState::kAborted);
    EXPECT_NE(p.error().find("waiting for READY of expert 7 from rank 1"), std::string::npos)
        << p.error();
    EXPECT_EQ(a.back().kind, ActionKind::kAbort);
  }
  {
    LayerProtocol p(TwoRankReader(), t0, seconds(10));
    p.Start();
    bool d = false;
    p.OnRecord(1, {RecordKind::kReady, 5, 2, 7, 1, 0, ""}, t0, &d);
    p.OnReadComplete({7, 1},
                     Status::Unavailable("agent 'rank0': peer unreachable: 'rank1' (gone)"));
    EXPECT_NE(p.error().find("rank 1 unreachable"), std::string::npos) << p.error();
  }
  {
    LayerProtocol p(TwoRankReader(), t0, seconds(10));
    p.Start();
    p.OnPeerFailed(1, Status::Unavailable("no answer for 2000 ms"));
    EXPECT_NE(p.error().find("rank 1 unreachable: no answer"), std::string::npos);
  }
  {
    LayerProtocol p(TwoRankReader(), t0, seconds(10));
    p.Start();
    bool d = false;
    auto a = p.OnRecord(1, {RecordKind::kAbort, 5, 2, 0, 1, 0, "rank 1: disk on fire"}, t0, &d);
    ASSERT_EQ(a.size(), 1u);  // no re-broadcast
    EXPECT_NE(p.error().find("aborted by rank 1 (rank 1: disk on fire)"), std::string::npos);
  }
  {
    LayerProtocol p(TwoRankReader(), t0, seconds(10));
    p.Start();
    p.OnMalformed(1, Status::Corruption("protocol record: bad magic"));
    EXPECT_NE(p.error().find("rank 1 sent a malformed notification"), std::string::npos);
  }
  {
    // A source that reads nothing is DONE at once (its DONE says its READs completed; its
    // rows stay as they are until every rank's DONE, so until every READ of them completed),
    // then waits for its reader's DONE.
    LayerProtocol p(LayerStep{5, 2, 1, 2, {}, {{7, 0}}}, t0, seconds(10));
    auto start = p.Start();
    ASSERT_EQ(start.size(), 3u);
    EXPECT_EQ(start[0].record.kind, RecordKind::kMaps);  // maps first, then READY, then DONE
    EXPECT_EQ(start[1].record.kind, RecordKind::kReady);
    EXPECT_EQ(start[2].record.kind, RecordKind::kDone);
    bool d = false;
    p.OnRecord(0, MapsOf(0, 5, 2), t0, &d);
    EXPECT_EQ(p.state(), LayerState::kRunning);  // the reader's DONE: its READ is not over yet
    p.OnTick(t0 + seconds(11));
    EXPECT_NE(p.error().find("waiting for DONE from rank 0"), std::string::npos) << p.error();
  }
}

}  // namespace
}  // namespace eplbx::protocol
