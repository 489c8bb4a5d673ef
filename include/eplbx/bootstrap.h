// How ranks find each other: an all-gather of byte blobs with a deadline. The rearranger
// uses it once per communicator to exchange agent metadata and layouts.
#ifndef EPLBX_BOOTSTRAP_H_
#define EPLBX_BOOTSTRAP_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "eplbx/env.h"
#include "eplbx/status.h"

namespace eplbx {

class Bootstrap {
 public:
  virtual ~Bootstrap() = default;
  virtual uint32_t rank() const = 0;
  virtual uint32_t size() const = 0;
  // Every rank contributes `mine`; returns all contributions indexed by rank, or kTimeout /
  // kUnavailable naming the rank that did not contribute. REQUIRES: every rank calls it the
  // same number of times.
  virtual Result<std::vector<std::string>> AllGather(std::string_view mine,
                                                     std::chrono::milliseconds timeout) = 0;
  // Returns once every rank called it (or the error naming who did not).
  Status Barrier(std::chrono::milliseconds timeout) { return AllGather({}, timeout).status(); }
  // Membership with epochs (a coordinator that tracks it, see ServeSocketBootstrap): the
  // epoch this member last heard of and which ranks were members then. Without it: epoch 0,
  // every rank a member.
  virtual uint64_t epoch() const { return 0; }
  virtual std::vector<bool> members() const { return std::vector<bool>(size(), true); }
};

// Membership an engine feeds (docs/architecture.md, "Serving: ServingGroup"): an engine that
// owns its processes (torch.distributed groups rebuilt after a failure, Mooncake's active
// ranks, MPI) tells eplbx the epoch and the members, and its own collective carries eplbx's
// all-gathers; eplbx runs no coordinator of its own. Like torch's PrefixStore over a Store.
//
// `gather(epoch, mine, timeout)`: this rank's contribution to one round among the members of
// `epoch` (every member calls it the same number of times per epoch); returns one entry per
// rank of the group (empty for non-members), or an error (a member lost, the engine's
// collective failed). When the engine's member set changes, every member calls Update() with
// the same epoch and members, then ServingGroup::OnMembershipChanged() at the same step.
class MembersView final : public Bootstrap {
 public:
  using Gather = std::function<Result<std::vector<std::string>>(
      uint64_t epoch, std::string_view mine, std::chrono::milliseconds timeout)>;
  // Starts at epoch 1 with `members` (empty: every rank).
  MembersView(uint32_t rank, uint32_t size, Gather gather, std::vector<bool> members = {});
  uint32_t rank() const override { return rank_; }
  uint32_t size() const override { return size_; }
  Result<std::vector<std::string>> AllGather(std::string_view mine,
                                             std::chrono::milliseconds timeout) override;
  uint64_t epoch() const override { return epoch_; }
  std::vector<bool> members() const override { return members_; }
  // The engine's member set changed: rounds from now on are at `epoch` among `members` (one
  // flag per rank). Refused (kInvalidArgument) when the epoch does not go forward or the
  // flags do not fit the group.
  Status Update(uint64_t epoch, std::vector<bool> members);

 private:
  uint32_t rank_, size_;
  Gather gather_;
  uint64_t epoch_ = 1;
  std::vector<bool> members_;
};

// A member of a group that talks to one coordinator over a connected stream socket: the
// embedded rendezvous of `eplbx demo` (the coordinator runs ServeSocketBootstrap).
class SocketBootstrap final : public Bootstrap {
 public:
  // Takes ownership of fd. Deadlines are measured on `env`'s clock (null: Env::Default()).
  SocketBootstrap(int fd, uint32_t rank, uint32_t size, Env* env = nullptr);
  ~SocketBootstrap() override;
  SocketBootstrap(const SocketBootstrap&) = delete;
  SocketBootstrap& operator=(const SocketBootstrap&) = delete;

  uint32_t rank() const override { return rank_; }
  uint32_t size() const override { return size_; }
  Result<std::vector<std::string>> AllGather(std::string_view mine,
                                             std::chrono::milliseconds timeout) override;
  // A frame for the coordinator's `on_message` (reports).
  Status SendMessage(std::string_view bytes);
  // With a coordinator that tracks membership: every contribution carries this member's
  // epoch; a round result or a refusal brings the current epoch and member set. A refusal
  // (a member was lost, or this member's epoch is old) is kAborted naming why: learn the new
  // member set (members()) and contribute again. Non-members' contributions are empty.
  uint64_t epoch() const override { return epoch_; }
  std::vector<bool> members() const override { return members_; }
  // Welcomed as a process for a rank that is no member (JoinTcpStore into a group under way:
  // a restarted worker, a rank added later): it joins where the members are
  // (ServingGroup::Join) instead of starting with them.
  bool joining() const { return joining_; }
  void set_joining(bool joining) { joining_ = joining; }

 private:
  bool joining_ = false;
  int fd_;
  uint32_t rank_;
  uint32_t size_;
  Env* env_;
  uint64_t epoch_ = 1;
  std::vector<bool> members_;
};

// The coordinator: reads frames from the members' sockets (index = rank), answers each
// all-gather round once every member contributed, and hands other frames to `on_message`.
// The rules are the pure state machine of src/bootstrap/coordinator.h; this drives it.
// Returns when every member closed its socket, when `stop` (if set) returns true (checked
// at least every 200 ms), or kTimeout when `idle_timeout` passed with no frame. A member
// that closes before a round completes fails that round for the others with an error
// naming it ("rank 2 left before the all-gather completed"). A round still incomplete after
// `round_timeout` (if non-zero) fails for the members that contributed, naming the others.
// `on_lost` (if set) hears of every member that closed its socket or missed a round's
// timeout: one that will not report any more (a callback may come twice for one member).
// Timeouts are measured on `env`'s clock (null: Env::Default()).
//
// `membership` (docs/deploy.md, "Membership and epochs"): the group starts at epoch 1 with
// every rank a member. A member that closes its socket or misses a round's timeout is
// declared lost: the epoch goes up by one and the rank is no member from then on. A round in
// progress then fails for every member in it with the new epoch and member set ("rank 2 left:
// epoch 2, members 0, 1"), so every survivor acts on the same set; a contribution made at an
// older epoch is refused the same way, naming both epochs. A round completes when every
// member contributed; its result carries the epoch and the member set. Any frame from a rank
// declared lost is answered "declared lost at epoch N: rejoin as a new member" and the rank is
// not heard any more.
//
// Joining (membership only): a rank whose fd is -1 is no member at the start. `joins` (if
// set, polled at least every 200 ms) hands the coordinator new connections, (rank, fd) each,
// which it owns from then on: a process that takes the place of a rank that is no member (one
// that never was, left or was declared lost). Its first contribution asks to join: the epoch
// goes up by one and the rank is a member from then on; a round in progress fails for every
// member in it ("rank 4 joined: epoch 3, members 0, 1, 2, 3, 4") and the joiner's contribution
// is refused the same way, so the joiner and the members all learn the new set and contribute
// again together. Until then it is not waited for (the members serve on while a new process
// starts). A connection for a rank that is a member is refused by name and closed.
using JoinSource = std::function<std::vector<std::pair<uint32_t, int>>()>;
struct CoordinatorOptions {
  // Return kTimeout when no frame came for this long.
  std::chrono::milliseconds idle_timeout{30000};
  std::function<void(uint32_t, std::string)> on_message;  // reports (null: dropped)
  std::function<bool()> stop;                             // checked at least every 200 ms
  // A round still incomplete after this long fails, naming the late (0: never).
  std::chrono::milliseconds round_timeout{0};
  std::function<void(uint32_t)> on_lost;
  Env* env = nullptr;  // its clock measures the timeouts (null: Env::Default())
  bool membership = false;
  JoinSource joins;
};
Status ServeSocketBootstrap(const std::vector<int>& fds, const CoordinatorOptions& options);

// ---- TCP rendezvous (multi-host) -------------------------------------------------------
//
// Configured like torchrun: EPLBX_MASTER_ADDR, EPLBX_MASTER_PORT, EPLBX_RANK,
// EPLBX_WORLD_SIZE, and a shared secret EPLBX_TOKEN that every member must present.

struct RendezvousEnv {
  std::string addr;
  uint16_t port = 0;
  uint32_t rank = 0;
  uint32_t world = 0;
  std::string token;  // never printed
};
// Reads the EPLBX_* variables; names the missing or malformed one. `need_rank` false (the
// standalone store): EPLBX_RANK is neither needed nor read.
// Variables come from `env` (null: the process environment).
Result<RendezvousEnv> RendezvousFromEnv(bool need_rank = true, Env* env = nullptr);

// The store, served by rank 0 (`eplbx worker`) or by `eplbx store`. Members join with
// (rank, world size, token); the token is compared in constant time. A wrong token, a
// world-size mismatch, an out-of-range or duplicate rank is refused with its own message to
// that member (and counted in refused_peers()); the others keep waiting.
class TcpStore {
 public:
  // What the store refused, bounded however many hellos come: one entry per peer address
  // (at most kMaxRefusedPeers; refusals from further addresses are only counted), with the
  // count, the first and last time (seconds after Listen) and the last reason. A rank named
  // in a hello with a wrong token is only the unauthenticated peer's claim.
  struct RefusedPeer {
    std::string address;
    uint64_t count = 0;
    double first_s = 0, last_s = 0;
    std::string last_reason;
  };
  static constexpr size_t kMaxRefusedPeers = 32;

  // Deadlines are measured on `env`'s clock (null: Env::Default()).
  static Result<std::unique_ptr<TcpStore>> Listen(const std::string& addr, uint16_t port,
                                                  std::string token, uint32_t world,
                                                  Env* env = nullptr);
  ~TcpStore();
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;
  // The port it listens on: the one asked for, or the one the system chose for port 0.
  uint16_t port() const { return port_; }

  // Waits up to `join_timeout` for every rank to join (kTimeout naming the missing ranks),
  // then serves like ServeSocketBootstrap. With membership it keeps listening: a process
  // that joins (JoinTcpStore) for a rank that is no member any more becomes a member under a
  // new epoch (ServeSocketBootstrap's `joins`). With a round timeout, members' sockets get TCP
  // keepalive and a user timeout of about that long, so a member whose host or link died
  // is lost (closed, `on_lost`) within it even while nothing is sent.
  Status Serve(std::chrono::milliseconds join_timeout, std::chrono::milliseconds idle_timeout,
               const std::function<void(uint32_t, std::string)>& on_message,
               const std::function<bool()>& stop = nullptr,
               std::chrono::milliseconds round_timeout = std::chrono::milliseconds(0),
               const std::function<void(uint32_t)>& on_lost = nullptr);
  const std::vector<RefusedPeer>& refused_peers() const { return refused_; }
  uint64_t refused_elsewhere() const { return refused_elsewhere_; }  // past kMaxRefusedPeers
  // refused_peers() as at most kMaxRefusedPeers + 1 lines to log.
  std::vector<std::string> refusals() const;
  // Serve with membership and epochs (see ServeSocketBootstrap). Call before Serve.
  void set_membership(bool on) { membership_ = on; }
  // With membership: the ranks the start waits for (late[r]: rank r joins later, a non-member
  // until then; empty: every rank), and when a joining process may become a member: one that
  // connected for rank r is welcomed and then held (connected, not yet a member) until
  // admit(r) says yes (null: at once). Both checked on the serving thread. Call before Serve.
  void set_late_ranks(std::vector<bool> late) { late_ = std::move(late); }
  void set_admit(std::function<bool(uint32_t)> admit) { admit_ = std::move(admit); }

 private:
  TcpStore() = default;
  // Checks a hello; on success `fd` becomes the member's socket, else it is closed.
  bool Admit(int fd, const std::string& hello);
  // The refusal of a hello ("" when token, world size and rank are right); sets *rank.
  std::string CheckHello(const std::string& hello, uint32_t* rank) const;
  // Tells the peer on `fd` why (it may be gone), closes it, counts it by its address.
  void Refuse(int fd, const std::string& refusal);
  int listen_fd_ = -1;
  uint16_t port_ = 0;
  std::string token_;
  uint32_t world_ = 0;
  Env* env_ = nullptr;
  std::vector<int> members_;
  std::vector<RefusedPeer> refused_;
  uint64_t refused_elsewhere_ = 0;
  std::chrono::steady_clock::time_point started_{};
  bool membership_ = false;
  std::vector<bool> late_;
  std::function<bool(uint32_t)> admit_;
};

// Joins the store at addr:port (retrying until it listens, up to `timeout`).
Result<std::unique_ptr<SocketBootstrap>> JoinTcpStore(const std::string& addr, uint16_t port,
                                                      const std::string& token, uint32_t rank,
                                                      uint32_t world,
                                                      std::chrono::milliseconds timeout,
                                                      Env* env = nullptr);

// An all-gather among threads of one process (tests, single-process tools).
class InMemoryGroup {
 public:
  explicit InMemoryGroup(uint32_t size);
  ~InMemoryGroup();
  std::unique_ptr<Bootstrap> Member(uint32_t rank);

  struct Shared;  // implementation detail

 private:
  std::shared_ptr<Shared> shared_;
};

}  // namespace eplbx

#endif  // EPLBX_BOOTSTRAP_H_
