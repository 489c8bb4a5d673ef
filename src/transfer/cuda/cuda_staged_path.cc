// The "cuda_staged" data path. See cuda_staged_path.h and docs/transfer.md, "Device memory
// across hosts".
//
// Messages (UcxWorker::SendStage; one head format, the rows as the message's data):
//   PULL       receiving side -> sending side: send piece `piece` of transfer `xfer`
//              (role READ: the rows at [addr, +bytes) of your device memory, checked against
//              your registered device regions; role WRITE: the piece of your WRITE `xfer`)
//   DATA       the piece's bytes, into the memory the receiving side set aside at its PULL
//   REFUSE     the piece will not come; `text` says why (the transfer fails with it)
//   WRITE      the writer's pieces (addr, bytes) in the target's memory, as data; the target
//              checks every piece against its registered memory, then pulls them in order
//   WRITE_DONE the target landed every piece in its memory (`text` empty) or why not; the
//              writer's transfer ends with it, so a notification after it finds the rows there
// Threads: UCX calls the sink on its progress thread; device copies run on this path's own
// thread (the poller), which also sends the pulls. One mutex guards the state.
#include "transfer/cuda/cuda_staged_path.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <tuple>
#include <utility>

#include "common/bytes.h"
#include "common/strings.h"
#include "transfer/cuda/cuda_driver.h"
#include "transfer/ucx/ucx_worker.h"

namespace eplbx::internal {
namespace {

using cuda::Driver;

enum class Msg : uint8_t { kPull = 1, kData = 2, kRefuse = 3, kWrite = 4, kWriteDone = 5 };
// Whose transfer a piece belongs to: a READ of the receiving side, or a WRITE of the sending
// side (the receiving side is then its target).
enum class Role : uint8_t { kRead = 0, kWrite = 1 };

constexpr uint8_t kSectionVersion = 1;
constexpr size_t kWindow = 8;            // pulls in flight per transfer
constexpr size_t kMaxPieces = 1u << 20;  // per WRITE (4 TiB at 4 MiB a piece)
constexpr size_t kMaxTextBytes = 1024;   // REFUSE / WRITE_DONE reasons
constexpr size_t kPieceListEntry = 16;   // WRITE's data: u64 addr, u64 bytes per piece

struct Head {
  Msg msg = Msg::kPull;
  Role role = Role::kRead;
  TransferId xfer = 0;
  uint32_t piece = 0;
  uint64_t addr = 0;
  uint64_t bytes = 0;
  std::string text;
};

Head Make(Msg msg, Role role, TransferId xfer, uint32_t piece = 0, uint64_t addr = 0,
          uint64_t bytes = 0) {
  Head h;
  h.msg = msg;
  h.role = role;
  h.xfer = xfer;
  h.piece = piece;
  h.addr = addr;
  h.bytes = bytes;
  return h;
}

std::string Encode(const Head& h) {
  ByteWriter w;
  w.U8(static_cast<uint8_t>(h.msg));
  w.U8(static_cast<uint8_t>(h.role));
  w.U64(h.xfer);
  w.U32(h.piece);
  w.U64(h.addr);
  w.U64(h.bytes);
  w.Str16(h.text.substr(0, kMaxTextBytes));
  return w.Take();
}

std::optional<Head> Decode(std::string_view bytes) {
  ByteReader r(bytes, "cuda_staged message");
  Head h;
  uint8_t msg = 0, role = 0;
  if (!r.U8("msg", &msg) || !r.U8("role", &role) || !r.U64("xfer", &h.xfer) ||
      !r.U32("piece", &h.piece) || !r.U64("addr", &h.addr) || !r.U64("bytes", &h.bytes) ||
      !r.Str16("text", kMaxTextBytes, &h.text) || r.remaining() != 0) {
    return std::nullopt;
  }
  if (msg < 1 || msg > 5 || role > 1) return std::nullopt;
  h.msg = static_cast<Msg>(msg);
  h.role = static_cast<Role>(role);
  return h;
}

struct Piece {
  enum class State : uint8_t { kWaiting, kPulled, kReceiving, kLanded, kCopying, kDone };
  uint64_t dst = 0;
  uint64_t src = 0;
  uint64_t bytes = 0;
  bool dst_device = false;
  bool src_device = false;
  State state = State::kWaiting;
  int slot = -1;  // receive slot (a device destination)
};

using Key = std::tuple<PeerId, Role, TransferId>;

// Pieces landing here: a READ we posted, or a peer's WRITE into our memory.
struct Sink {
  std::vector<Piece> pieces;
  size_t next = 0;    // the next piece to pull
  size_t active = 0;  // pulled and not done
  Status error;       // the first failure: no more pulls; the transfer ends once none is active
};

// A WRITE we posted: its pieces (the target pulls them).
struct WriteJob {
  std::vector<Piece> pieces;
};

// A piece we send: from host memory at once, from device memory through a send slot.
struct Serve {
  PeerId peer = 0;
  Role role = Role::kRead;
  TransferId xfer = 0;
  uint32_t piece = 0;
  uint64_t src = 0;
  uint64_t bytes = 0;
  bool device = false;
  int slot = -1;
};

// A device copy in flight, done when its slot's event is.
struct Copy {
  bool landing = false;  // host -> device into our memory; else device -> host to send
  int slot = -1;
  Key key{};
  uint32_t piece = 0;
  Serve serve;
};

struct Slot {
  char* mem = nullptr;
  CUevent event = nullptr;
  bool busy = false;
};

struct Region {
  uint64_t addr = 0;
  uint64_t bytes = 0;
  MemoryKind kind = MemoryKind::kHost;
};

class Staged final : public ucx::StageSink, public std::enable_shared_from_this<Staged> {
 public:
  Staged(ucx::UcxWorker* worker, std::string agent, CoreListener* listener)
      : worker_(worker), agent_(std::move(agent)), listener_(listener) {}

  ~Staged() override {
    if (d_ == nullptr || device_ < 0 || !cuda::UseDevice(*d_, device_).ok()) return;
    for (std::vector<Slot>* pool : {&send_slots_, &recv_slots_}) {
      for (Slot& s : *pool) {
        d_->cuEventDestroy(s.event);
        d_->cuMemFreeHost(s.mem);
      }
    }
    for (CUstream s : streams_) d_->cuStreamDestroy(s);
  }

  void Start() {
    poller_ = std::thread([this] { Run(); });
  }

  // Stops the poller; transfers still open end with kAborted.
  void Stop() {
    std::vector<TransferId> open;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      for (auto& [key, sink] : sinks_) {
        if (std::get<1>(key) == Role::kRead) open.push_back(std::get<2>(key));
      }
      for (auto& [key, job] : writes_) open.push_back(key.second);
      sinks_.clear();
      writes_.clear();
    }
    cv_.notify_all();
    if (poller_.joinable()) poller_.join();
    for (TransferId id : open) {
      listener_->OnDataDone(id, Status::Aborted(StrCat("agent '", agent_, "': shut down")));
    }
  }

  Status RegisterMemory(const LocalRegionView& region) {
    if (region.kind == MemoryKind::kCuda) {
      Result<const Driver*> d = cuda::LoadDriver();
      if (!d.ok()) return d.status().WithPrefix(StrCat("agent '", agent_, "'"));
      int ordinal = -1;
      if (CUresult r = (*d)->cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                                   region.addr);
          r != CUDA_SUCCESS) {
        return Status::Unavailable(StrCat("agent '", agent_, "': device region [", Hex(region.addr),
                                          "]: ", (*d)->Error("cuPointerGetAttribute", r)));
      }
      std::lock_guard<std::mutex> lock(mu_);
      if (device_ >= 0 && device_ != ordinal) {
        return Status::InvalidArgument(
            StrCat("agent '", agent_, "': device region [", Hex(region.addr),
                   "] is on CUDA device ", ordinal, " but this agent already uses device ", device_,
                   "; one device per agent (create one agent per GPU rank)"));
      }
      device_ = ordinal;
      d_ = *d;
    }
    std::lock_guard<std::mutex> lock(mu_);
    regions_[region.id] = Region{region.addr, region.bytes, region.kind};
    return Status::OK();
  }

  void DeregisterMemory(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    regions_.erase(id);
  }

  Status Connect(const PeerView& peer) {
    std::vector<MemoryKind> kinds;
    bool any_device = false;
    for (const RegionInfo& r : *peer.regions) {
      kinds.push_back(r.kind);
      any_device |= r.kind == MemoryKind::kCuda;
    }
    if (any_device && !peer.has_section) {
      return Status::NotSupported(
          "the peer publishes no cuda_staged section (an eplbx without it, or a data path "
          "list that leaves it out)");
    }
    if (peer.has_section &&
        (peer.section.size() != 1 || static_cast<uint8_t>(peer.section[0]) != kSectionVersion)) {
      return Status::NotSupported(StrCat("the peer's cuda_staged section is ",
                                         Printable(peer.section), "; this build speaks version ",
                                         +kSectionVersion));
    }
    std::lock_guard<std::mutex> lock(mu_);
    peers_[peer.id] = std::move(kinds);
    return Status::OK();
  }

  bool Reaches(PeerId peer, uint32_t region, std::string* why) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(peer);
    if (it == peers_.end()) {
      *why = "not connected";
      return false;
    }
    if (region >= it->second.size() || it->second[region] != MemoryKind::kCuda) {
      why->clear();  // host memory: the core says "moves no host memory"
      return false;
    }
    return true;
  }

  void Disconnect(PeerId id) {
    std::vector<std::pair<TransferId, Status>> done;
    {
      std::lock_guard<std::mutex> lock(mu_);
      peers_.erase(id);
      EndPeer(id, Status::Aborted(StrCat("agent '", agent_, "': peer disconnected (cuda_staged)")),
              &done);
    }
    Report(done);
  }

  Status Post(PathRequest req) {
    std::unique_lock<std::mutex> lock(mu_);
    if (peers_.count(req.peer) == 0) {
      return Status::NotFound(StrCat("agent '", agent_, "': no cuda_staged peer ", req.peer));
    }
    std::vector<Piece> pieces;
    for (const Segment& s : req.segments) {
      auto r = regions_.find(s.local_region);
      const bool local_device = r != regions_.end() && r->second.kind == MemoryKind::kCuda;
      for (uint64_t off = 0; off < s.bytes; off += kStageChunk) {
        Piece p;
        p.bytes = std::min(kStageChunk, s.bytes - off);
        const bool read = req.op == XferOp::kRead;
        p.dst = (read ? s.local : s.remote) + off;
        p.src = (read ? s.remote : s.local) + off;
        p.dst_device = read ? local_device : true;
        p.src_device = read ? true : local_device;
        pieces.push_back(p);
      }
    }
    if (req.op == XferOp::kRead) {
      sinks_[{req.peer, Role::kRead, req.id}] = Sink{std::move(pieces), 0, 0, Status::OK()};
      work_ = true;
      cv_.notify_all();
      return Status::OK();
    }
    if (pieces.size() > kMaxPieces) {
      return Status::InvalidArgument(StrCat("agent '", agent_, "': a WRITE of ", pieces.size(),
                                            " pieces; at most ", kMaxPieces, " (cuda_staged)"));
    }
    ByteWriter w;
    for (const Piece& p : pieces) {
      w.U64(p.dst);
      w.U64(p.bytes);
    }
    // The list lives until UCX is done with it (its callback holds it), whatever becomes of
    // the job meanwhile.
    auto list = std::make_shared<const std::string>(w.Take());
    writes_[{req.peer, req.id}].pieces = std::move(pieces);
    std::function<void(Status)> sent = Sent(req.peer, Role::kWrite, req.id, 0, /*pull=*/false);
    Status s = worker_->SendStage(
        req.peer, Encode(Make(Msg::kWrite, Role::kWrite, req.id)), list->data(), list->size(),
        [list, sent = std::move(sent)](Status st) { sent(std::move(st)); });
    if (!s.ok()) writes_.erase({req.peer, req.id});
    return s;
  }

  // ---- StageSink (the UCX progress thread) ---------------------------------------------

  void* OnStage(PeerId peer, std::string_view head, size_t bytes) override {
    std::optional<Head> h = Decode(head);
    if (!h) return nullptr;
    std::vector<std::pair<TransferId, Status>> done;
    void* dest = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      switch (h->msg) {
        case Msg::kPull:
          OnPull(peer, *h);
          break;
        case Msg::kData:
          dest = OnData(peer, *h, bytes);
          break;
        case Msg::kRefuse:
          if (Sink* s = FindSink({peer, h->role, h->xfer}); s != nullptr) {
            FailPiece(*s, h->piece, Status::Unavailable(h->text));
          }
          break;
        case Msg::kWrite:
          // The piece list lands in a buffer of its own; checked once it is complete.
          if (bytes > 0 && bytes % kPieceListEntry == 0 && bytes / kPieceListEntry <= kMaxPieces &&
              write_lists_.count({peer, h->xfer}) == 0) {
            std::string& list = write_lists_[{peer, h->xfer}];
            list.resize(bytes);
            dest = list.data();
          }
          break;
        case Msg::kWriteDone:
          if (auto it = writes_.find({peer, h->xfer}); it != writes_.end()) {
            writes_.erase(it);
            done.emplace_back(h->xfer,
                              h->text.empty() ? Status::OK() : Status::Unavailable(h->text));
          }
          break;
      }
      work_ = true;
    }
    cv_.notify_all();
    Report(done);
    return dest;
  }

  void OnStageLanded(PeerId peer, const std::string& head, Status status) override {
    std::optional<Head> h = Decode(head);
    if (!h) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (h->msg == Msg::kData) {
        Sink* s = FindSink({peer, h->role, h->xfer});
        if (s != nullptr && h->piece < s->pieces.size() &&
            s->pieces[h->piece].state == Piece::State::kReceiving) {
          Piece& p = s->pieces[h->piece];
          if (!status.ok()) {
            FailPiece(*s, h->piece, std::move(status), /*receiving=*/true);
          } else if (p.dst_device) {
            p.state = Piece::State::kLanded;
            landed_.emplace_back(Key{peer, h->role, h->xfer}, h->piece);
          } else {
            p.state = Piece::State::kDone;
            --s->active;
          }
        }
      } else if (h->msg == Msg::kWrite) {
        auto it = write_lists_.find({peer, h->xfer});
        if (it != write_lists_.end()) {
          std::string list = std::move(it->second);
          write_lists_.erase(it);
          if (status.ok()) StartWriteTarget(peer, h->xfer, list);
        }
      }
      work_ = true;
    }
    cv_.notify_all();
  }

  std::string OnStageFromStranger(std::string_view sender, std::string_view head) override {
    std::optional<Head> h = Decode(head);
    if (!h || (h->msg != Msg::kPull && h->msg != Msg::kWrite)) return {};
    Head answer = h->msg == Msg::kPull ? Make(Msg::kRefuse, h->role, h->xfer, h->piece)
                                       : Make(Msg::kWriteDone, Role::kWrite, h->xfer);
    answer.text = StrCat(Who(), " (cuda_staged) is not connected to '", sender,
                         "': staged transfers need the two agents connected both ways (connect "
                         "each one's metadata on the other)");
    return Encode(answer);
  }

  void OnStagePeerFailed(PeerId peer, Status reason) override {
    std::vector<std::pair<TransferId, Status>> done;
    {
      std::lock_guard<std::mutex> lock(mu_);
      EndPeer(peer, std::move(reason), &done);
    }
    Report(done);
  }

 private:
  // ---- under mu_ ------------------------------------------------------------------------

  Sink* FindSink(const Key& key) {
    auto it = sinks_.find(key);
    return it == sinks_.end() ? nullptr : &it->second;
  }

  std::string Who() const { return StrCat("agent '", agent_, "'"); }

  // The region of ours holding [addr, +bytes), or null.
  const Region* RegionOf(uint64_t addr, uint64_t bytes) const {
    for (const auto& [id, r] : regions_) {
      if (addr >= r.addr && bytes <= r.bytes && addr - r.addr <= r.bytes - bytes) return &r;
    }
    return nullptr;
  }

  void Refuse(PeerId peer, const Head& pull, std::string why) {
    Head h = Make(Msg::kRefuse, pull.role, pull.xfer, pull.piece);
    h.text = StrCat(Who(), " (cuda_staged): ", why);
    static_cast<void>(worker_->SendStage(peer, Encode(h), nullptr, 0, [](Status) {}));
  }

  void OnPull(PeerId peer, const Head& h) {
    Serve s{peer, h.role, h.xfer, h.piece};
    if (h.role == Role::kRead) {
      const Region* r = RegionOf(h.addr, h.bytes);
      if (h.bytes == 0 || h.bytes > kStageChunk || r == nullptr || r->kind != MemoryKind::kCuda) {
        Refuse(peer, h,
               StrCat("rows [", Hex(h.addr), ", +", h.bytes,
                      ") are not in a registered device region of this agent"));
        return;
      }
      s.src = h.addr;
      s.bytes = h.bytes;
      s.device = true;
    } else {
      auto it = writes_.find({peer, h.xfer});
      if (it == writes_.end() || h.piece >= it->second.pieces.size()) {
        Refuse(peer, h, StrCat("no piece ", h.piece, " of a WRITE ", h.xfer, " to this peer"));
        return;
      }
      const Piece& p = it->second.pieces[h.piece];
      s.src = p.src;
      s.bytes = p.bytes;
      s.device = p.src_device;
    }
    if (s.device) {
      serves_.push_back(s);
    } else {
      SendData(s, reinterpret_cast<const void*>(static_cast<uintptr_t>(s.src)));
    }
  }

  // Sends a piece from `from` (our host memory, or a send slot: both stay valid until UCX is
  // done with them; the callback holds this path's state, slots included, alive till then).
  void SendData(const Serve& s, const void* from) {
    Head h = Make(Msg::kData, s.role, s.xfer, s.piece);
    const int slot = s.slot;
    Status st = worker_->SendStage(s.peer, Encode(h), from, s.bytes,
                                   [self = shared_from_this(), slot](Status) {
                                     {
                                       std::lock_guard<std::mutex> lock(self->mu_);
                                       if (slot >= 0) self->send_slots_[slot].busy = false;
                                       self->work_ = true;
                                     }
                                     self->cv_.notify_all();
                                   });
    if (!st.ok() && slot >= 0) send_slots_[slot].busy = false;
  }

  void* OnData(PeerId peer, const Head& h, size_t bytes) {
    Sink* s = FindSink({peer, h.role, h.xfer});
    if (s == nullptr || h.piece >= s->pieces.size()) return nullptr;
    Piece& p = s->pieces[h.piece];
    if (p.state != Piece::State::kPulled) return nullptr;
    if (bytes != p.bytes) {
      FailPiece(*s, h.piece,
                Status::Corruption(StrCat(Who(), " (cuda_staged): piece ", h.piece, " came with ",
                                          bytes, " bytes, asked for ", p.bytes)));
      return nullptr;
    }
    p.state = Piece::State::kReceiving;
    if (p.dst_device) return recv_slots_[p.slot].mem;
    return reinterpret_cast<void*>(static_cast<uintptr_t>(p.dst));
  }

  // A piece that will not land (anymore): its slot back, the transfer failed.
  void FailPiece(Sink& s, uint32_t piece, Status why, bool receiving = false) {
    if (piece >= s.pieces.size()) return;
    Piece& p = s.pieces[piece];
    const Piece::State expected = receiving ? Piece::State::kReceiving : Piece::State::kPulled;
    if (p.state != expected) return;
    if (p.slot >= 0) recv_slots_[p.slot].busy = false;
    p.slot = -1;
    p.state = Piece::State::kDone;
    --s.active;
    work_ = true;  // the slot may be waited for, the transfer may be over
    if (s.error.ok()) s.error = std::move(why);
  }

  void StartWriteTarget(PeerId peer, TransferId xfer, const std::string& list) {
    ByteReader r(list, "cuda_staged WRITE");
    Sink sink;
    std::string bad;
    for (size_t i = 0; i < list.size() / kPieceListEntry && bad.empty(); ++i) {
      Piece p;
      r.U64("addr", &p.dst);
      r.U64("bytes", &p.bytes);
      const Region* region = RegionOf(p.dst, p.bytes);
      if (p.bytes == 0 || p.bytes > kStageChunk || region == nullptr) {
        bad = StrCat("WRITE piece ", i, " [", Hex(p.dst), ", +", p.bytes,
                     ") is not in a registered region of this agent");
        break;
      }
      p.dst_device = region->kind == MemoryKind::kCuda;
      sink.pieces.push_back(p);
    }
    if (!bad.empty()) {
      Head h = Make(Msg::kWriteDone, Role::kWrite, xfer);
      h.text = StrCat(Who(), " (cuda_staged): ", bad, "; nothing was written");
      static_cast<void>(worker_->SendStage(peer, Encode(h), nullptr, 0, [](Status) {}));
      return;
    }
    sinks_[{peer, Role::kWrite, xfer}] = std::move(sink);
  }

  void EndPeer(PeerId peer, Status reason, std::vector<std::pair<TransferId, Status>>* done) {
    for (auto& [key, sink] : sinks_) {
      if (std::get<0>(key) != peer) continue;
      for (uint32_t i = 0; i < sink.pieces.size(); ++i) FailPiece(sink, i, reason);
      if (sink.error.ok()) sink.error = reason;
    }
    for (auto it = writes_.begin(); it != writes_.end();) {
      if (it->first.first == peer) {
        done->emplace_back(it->first.second, reason);
        it = writes_.erase(it);
      } else {
        ++it;
      }
    }
    std::erase_if(serves_, [&](const Serve& s) { return s.peer == peer; });
    work_ = true;
    cv_.notify_all();
  }

  // The callback of a message we send: a PULL that cannot leave fails its piece; a WRITE
  // list that cannot leave fails the WRITE.
  std::function<void(Status)> Sent(PeerId peer, Role role, TransferId xfer, uint32_t piece,
                                   bool pull) {
    std::weak_ptr<Staged> weak = weak_from_this();
    return [weak, peer, role, xfer, piece, pull](Status sent) {
      auto self = weak.lock();
      if (self == nullptr || sent.ok()) return;
      std::vector<std::pair<TransferId, Status>> done;
      {
        std::lock_guard<std::mutex> lock(self->mu_);
        if (pull) {
          if (Sink* s = self->FindSink({peer, role, xfer}); s != nullptr) {
            self->FailPiece(*s, piece, std::move(sent));
          }
        } else if (self->writes_.erase({peer, xfer}) > 0) {
          done.emplace_back(xfer, std::move(sent));
        }
        self->work_ = true;
      }
      self->cv_.notify_all();
      self->Report(done);
    };
  }

  // The driver, the streams and a pool of slots, on first use (the poller, with mu_ held).
  Status EnsureDevice() {
    if (!streams_.empty()) return Status::OK();
    if (d_ == nullptr || device_ < 0) {
      return Status::Internal(StrCat(Who(), " (cuda_staged): a device copy without device memory"));
    }
    EPLBX_RETURN_IF_ERROR(cuda::UseDevice(*d_, device_));
    for (int k = 0; k < 2; ++k) {
      CUstream s = nullptr;
      if (CUresult r = d_->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING); r != CUDA_SUCCESS) {
        for (CUstream t : streams_) d_->cuStreamDestroy(t);
        streams_.clear();
        return Status::Unavailable(StrCat(Who(), ": ", d_->Error("cuStreamCreate", r)));
      }
      streams_.push_back(s);
    }
    return Status::OK();
  }

  // A free slot of `pool` (allocated at first use: kStageSlots pinned buffers), -1 when all
  // are busy; an error when the pool cannot be made.
  Result<int> TakeSlot(std::vector<Slot>& pool) {
    EPLBX_RETURN_IF_ERROR(EnsureDevice());
    if (pool.empty()) {
      for (int i = 0; i < kStageSlots; ++i) {
        Slot s;
        void* mem = nullptr;
        CUresult r = d_->cuMemHostAlloc(&mem, kStageChunk, CU_MEMHOSTALLOC_PORTABLE);
        if (r == CUDA_SUCCESS) r = d_->cuEventCreate(&s.event, CU_EVENT_DISABLE_TIMING);
        if (r != CUDA_SUCCESS) {
          if (mem != nullptr) d_->cuMemFreeHost(mem);
          for (Slot& t : pool) {
            d_->cuEventDestroy(t.event);
            d_->cuMemFreeHost(t.mem);
          }
          pool.clear();
          return Status::Unavailable(StrCat(Who(), " (cuda_staged): pinned bounce buffers of ",
                                            kStageChunk,
                                            " bytes: ", d_->Error("cuMemHostAlloc", r)));
        }
        s.mem = static_cast<char*>(mem);
        pool.push_back(s);
      }
    }
    for (size_t i = 0; i < pool.size(); ++i) {
      if (!pool[i].busy) {
        pool[i].busy = true;
        return static_cast<int>(i);
      }
    }
    return -1;
  }

  // Starts `bytes` from `src` to `dst` on `stream`, then the slot's event.
  Status StartCopy(uint64_t dst, uint64_t src, uint64_t bytes, int stream, CUevent event) {
    CUresult r = d_->cuMemcpyAsync(dst, src, bytes, streams_[stream]);
    if (r == CUDA_SUCCESS) r = d_->cuEventRecord(event, streams_[stream]);
    if (r != CUDA_SUCCESS) {
      return Status::Internal(StrCat(Who(), " (cuda_staged): ", d_->Error("cuMemcpyAsync", r)));
    }
    return Status::OK();
  }

  // Everything that can move now; reports what ended into `done`.
  void Pump(std::vector<std::pair<TransferId, Status>>* done) {
    // Pulls, transfer by transfer (a device destination needs a receive slot first).
    for (auto& [key, sink] : sinks_) {
      while (sink.error.ok() && sink.next < sink.pieces.size() && sink.active < kWindow) {
        Piece& p = sink.pieces[sink.next];
        if (p.dst_device) {
          Result<int> slot = TakeSlot(recv_slots_);
          if (!slot.ok()) {
            sink.error = slot.status();
            break;
          }
          if (*slot < 0) break;
          p.slot = *slot;
        }
        const auto [peer, role, xfer] = key;
        const uint32_t index = static_cast<uint32_t>(sink.next);
        Head h = Make(Msg::kPull, role, xfer, index, p.src, p.bytes);
        p.state = Piece::State::kPulled;
        ++sink.active;
        ++sink.next;
        Status s =
            worker_->SendStage(peer, Encode(h), nullptr, 0, Sent(peer, role, xfer, index, true));
        if (!s.ok()) FailPiece(sink, index, std::move(s));
      }
    }
    // Device rows to send: into a send slot first.
    while (!serves_.empty()) {
      Result<int> slot = TakeSlot(send_slots_);
      Serve s = serves_.front();
      if (slot.ok() && *slot < 0) break;
      serves_.pop_front();
      Status st = slot.status();
      if (st.ok()) {
        s.slot = *slot;
        st = StartCopy(reinterpret_cast<uintptr_t>(send_slots_[s.slot].mem), s.src, s.bytes, 0,
                       send_slots_[s.slot].event);
      }
      if (!st.ok()) {
        if (s.slot >= 0) send_slots_[s.slot].busy = false;
        Refuse(s.peer, Make(Msg::kPull, s.role, s.xfer, s.piece), st.message());
        continue;
      }
      copies_.push_back(Copy{false, s.slot, {}, 0, s});
    }
    // Landed pieces for device memory: host -> device.
    for (const auto& [key, index] : landed_) {
      Sink* sink = FindSink(key);
      if (sink == nullptr) continue;
      Piece& p = sink->pieces[index];
      Status st = StartCopy(p.dst, reinterpret_cast<uintptr_t>(recv_slots_[p.slot].mem), p.bytes, 1,
                            recv_slots_[p.slot].event);
      if (!st.ok()) {
        p.state = Piece::State::kReceiving;
        FailPiece(*sink, index, std::move(st), /*receiving=*/true);
        continue;
      }
      p.state = Piece::State::kCopying;
      copies_.push_back(Copy{true, p.slot, key, index, {}});
    }
    landed_.clear();
    // Copies that ended.
    for (auto it = copies_.begin(); it != copies_.end();) {
      const bool landing = it->landing;
      Slot& slot = (landing ? recv_slots_ : send_slots_)[it->slot];
      const CUresult r = d_->cuEventQuery(slot.event);
      if (r == CUDA_ERROR_NOT_READY) {
        ++it;
        continue;
      }
      work_ = true;  // a slot comes free: pulls and serves waiting for one go next round
      Status st =
          r == CUDA_SUCCESS
              ? Status::OK()
              : Status::Internal(StrCat(Who(), " (cuda_staged): ", d_->Error("device copy", r)));
      if (landing) {
        if (Sink* sink = FindSink(it->key); sink != nullptr) {
          Piece& p = sink->pieces[it->piece];
          slot.busy = false;
          p.slot = -1;
          p.state = Piece::State::kDone;
          --sink->active;
          if (!st.ok() && sink->error.ok()) sink->error = std::move(st);
        } else {
          slot.busy = false;
        }
      } else if (st.ok()) {
        SendData(it->serve, slot.mem);
      } else {
        slot.busy = false;
        Refuse(it->serve.peer, Make(Msg::kPull, it->serve.role, it->serve.xfer, it->serve.piece),
               st.message());
      }
      it = copies_.erase(it);
    }
    // Transfers that ended: ours are reported, a peer's WRITE is answered.
    for (auto it = sinks_.begin(); it != sinks_.end();) {
      Sink& s = it->second;
      const bool over = s.active == 0 && (!s.error.ok() || s.next == s.pieces.size());
      if (!over) {
        ++it;
        continue;
      }
      const auto [peer, role, xfer] = it->first;
      if (role == Role::kRead) {
        done->emplace_back(xfer, s.error);
      } else {
        Head h = Make(Msg::kWriteDone, Role::kWrite, xfer);
        if (!s.error.ok()) h.text = StrCat(s.error.message(), "; the rows may be half written");
        static_cast<void>(worker_->SendStage(peer, Encode(h), nullptr, 0, [](Status) {}));
      }
      it = sinks_.erase(it);
    }
  }

  void Report(const std::vector<std::pair<TransferId, Status>>& done) {
    for (const auto& [id, status] : done) listener_->OnDataDone(id, status);
  }

  void Run() {
    cuda::UsePreciseSleeps();
    cuda::PollPacer pacer;
    std::unique_lock<std::mutex> lock(mu_);
    bool device_set = false;
    while (!stop_) {
      cv_.wait(lock, [&] { return stop_ || work_ || !copies_.empty(); });
      if (stop_) break;
      work_ = false;
      if (!device_set && d_ != nullptr && device_ >= 0) {
        device_set = cuda::UseDevice(*d_, device_).ok();
      }
      std::vector<std::pair<TransferId, Status>> done;
      Pump(&done);
      const bool polling = !copies_.empty();
      const bool progressed = work_ || !done.empty();  // a copy or a transfer completed
      lock.unlock();
      Report(done);
      lock.lock();
      if (progressed) {
        pacer.Progress();
      } else if (polling) {  // wait a while before querying again, unless new work comes
        if (cv_.wait_for(lock, pacer.Next(), [&] { return stop_ || work_; })) pacer.Progress();
      }
    }
  }

  ucx::UcxWorker* const worker_;
  const std::string agent_;
  CoreListener* const listener_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  bool work_ = false;  // something changed: pump again
  std::thread poller_;
  const Driver* d_ = nullptr;  // set by the first device region
  int device_ = -1;
  std::vector<CUstream> streams_;  // [0] device -> host, [1] host -> device
  std::vector<Slot> send_slots_, recv_slots_;
  std::map<uint64_t, Region> regions_;               // by id
  std::map<PeerId, std::vector<MemoryKind>> peers_;  // each peer's region kinds
  std::map<Key, Sink> sinks_;
  std::map<std::pair<PeerId, TransferId>, WriteJob> writes_;
  std::map<std::pair<PeerId, TransferId>, std::string> write_lists_;  // WRITE lists landing
  std::deque<Serve> serves_;                                          // waiting for a send slot
  std::vector<std::pair<Key, uint32_t>> landed_;                      // to copy to the device
  std::vector<Copy> copies_;
};

class CudaStagedPath final : public DataPath {
 public:
  CudaStagedPath(ucx::UcxWorker* worker, std::string agent, CoreListener* listener)
      : worker_(worker), impl_(std::make_shared<Staged>(worker, std::move(agent), listener)) {
    impl_->Start();
    worker_->SetStageSink(impl_);
  }
  ~CudaStagedPath() override {
    worker_->SetStageSink(nullptr);  // a receive in flight keeps impl_ alive until it ends
    impl_->Stop();
  }

  std::string_view name() const override { return "cuda_staged"; }
  PathCaps caps() const override {
    PathCaps c = DeviceMemoryCaps();
    // Other hosts only: on one host a device cuda_ipc cannot open is an error to fix
    // (visibility, peer access), not a reason to stage silently.
    c.other_hosts = true;
    return c;
  }
  Status RegisterMemory(const LocalRegionView& region) override {
    return impl_->RegisterMemory(region);
  }
  void DeregisterMemory(uint64_t id) override { impl_->DeregisterMemory(id); }
  std::string Section(const std::vector<LocalRegionView>&) const override {
    return std::string(1, static_cast<char>(kSectionVersion));
  }
  Status Connect(const PeerView& peer) override { return impl_->Connect(peer); }
  bool Reaches(PeerId peer, uint32_t region, std::string* why) const override {
    return impl_->Reaches(peer, region, why);
  }
  void Disconnect(PeerId id) override { impl_->Disconnect(id); }
  Status Post(PathRequest req) override { return impl_->Post(std::move(req)); }
  // Pieces in flight cannot be recalled; the transfer ends through OnDataDone.
  Status Cancel(TransferId) override { return Status::OK(); }

 private:
  ucx::UcxWorker* const worker_;
  std::shared_ptr<Staged> impl_;
};

}  // namespace

bool DecodeStagedHeadForTest(std::string_view bytes, std::string* reencoded) {
  std::optional<Head> h = Decode(bytes);
  if (!h) return false;
  *reencoded = Encode(*h);
  return true;
}

std::unique_ptr<DataPath> CreateCudaStagedPath(ucx::UcxWorker* worker, std::string agent,
                                               CoreListener* listener) {
  return std::make_unique<CudaStagedPath>(worker, std::move(agent), listener);
}

}  // namespace eplbx::internal
