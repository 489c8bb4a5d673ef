// Backup sources for experts no member holds any more (docs/placement.md, "Backup
// sources"; docs/deploy.md, "The host backup"), and the recovery that fills a rank's
// recovered slots from them. Public: an engine (or ServingGroup, eplbx/serving.h) passes
// its sources to RecoverSlots.
//
// - BackupSource: anything that can hand back an expert's rows, checked.
// - HostBackup: a host copy of experts in a private file of the node (/dev/shm): one rank
//   creates it, the node's others open it through the name shared over the bootstrap, then
//   the name is removed and the descriptors keep it (it outlives a lost rank's process; no
//   file is left behind). Every row carries a checksum taken when it was captured.
//   TensorRT-LLM's host pool, SGLang's DRAM backup. Its memory cost is held_bytes(): the rows
//   captured (the file is sparse).
// - RecoverSlots: reads every row a rank must recover (checked) before writing any, so an
//   error leaves its weights as they were.
// (The checkpoint as a source, CheckpointBackup, is the CLI's: src/io/backup.h.)
#ifndef EPLBX_BACKUP_H_
#define EPLBX_BACKUP_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "eplbx/bootstrap.h"
#include "eplbx/layout.h"
#include "eplbx/placement.h"
#include "eplbx/status.h"
#include "eplbx/survivors.h"

namespace eplbx {

class BackupSource {
 public:
  virtual ~BackupSource() = default;
  // "host backup '/dev/shm/eplbx-backup-0'", "checkpoint (3 files)".
  virtual std::string Describe() const = 0;
  // Whether it holds every tensor's row of (layer, expert).
  virtual bool Holds(int layer, int expert) const = 0;
  // Copies the row of `expert` of the tensor named spec.name in `layer` into `dst`
  // (spec.bytes_per_expert bytes) after checking dtype, shape and bytes against `spec`; on
  // error (named: source, layer, tensor, both values) nothing is written.
  virtual Status ReadRow(int layer, int expert, const TensorSpec& spec, uint8_t* dst) const = 0;
};

// A backup file's identity: the device and inode of the file the creator made, so a process
// that opens it by name can check it got that file and not one planted in its place.
struct BackupFileId {
  uint64_t device = 0;
  uint64_t inode = 0;
};

class HostBackup final : public BackupSource {
 public:
  // Creates a new backup in directory `dir` (a node's /dev/shm, say) with room for every expert
  // of every layer of `layout`'s tensors; nothing is held yet. The file is private and its
  // name unguessable: eplbx-backup-PID-<128 random bits>, created exclusively (an existing
  // file or link at that name is an error, never followed), mode 0600, owned by this user.
  // First it removes this user's stale backups in `dir` (RemoveStaleBackups). The creator owns
  // the name: Unlink() or the destructor removes it (the node's other ranks, once they
  // opened it, keep the file through their descriptors).
  static Result<std::unique_ptr<HostBackup>> Create(const std::string& dir,
                                                    const RankLayout& layout, int experts);
  // Opens a backup another process of this node created, at `path` (shared through the
  // bootstrap with `id`, what the creator's id() said). Refused by name: a link, anything but
  // a regular file, a file another user owns or others may read or write, a file that is not
  // `id`, a header that does not describe the file.
  static Result<std::unique_ptr<HostBackup>> Open(const std::string& path,
                                                  std::optional<BackupFileId> id = std::nullopt);
  // What Create made, to pass to the node's other ranks: "DEVICE:INODE:PATH"; and its reader.
  std::string ShareName() const;
  static Result<std::unique_ptr<HostBackup>> OpenShared(const std::string& share_name);
  // Checks a backup's first bytes (the fixed part and the header) as Open does, for a file of
  // `file_bytes`. The fuzz target's entry.
  static Status CheckHead(std::string_view head, uint64_t file_bytes);
  ~HostBackup() override;
  HostBackup(const HostBackup&) = delete;
  HostBackup& operator=(const HostBackup&) = delete;

  // Copies the rows of every expert `layout.rank`'s slots hold under `placement` from its
  // weights (the layout's addresses, rows by RowOf), each with its checksum, and marks them
  // held. The layout must match the backup's tensors (names, dtypes, shapes, bytes): else a
  // named error, nothing copied.
  Status Capture(const Placement& placement, const RankLayout& layout);
  // Loads expert `expert` of `layer` from elsewhere (the checkpoint, say: a node's backup of
  // every expert): `read(tensor_name, dst, bytes)` writes each of the layer's tensors' row;
  // then the expert is held (with checksums of what `read` wrote). A layer or expert out of
  // range is a named error.
  Status Load(int layer, int expert,
              const std::function<void(const std::string&, uint8_t*, uint64_t)>& read);

  std::string Describe() const override;
  bool Holds(int layer, int expert) const override;
  // Reads the row through the file's descriptor (a file cut short after it was opened is a
  // named Corruption, never a SIGBUS) and checks it against the checksum taken when it was
  // captured: a changed row names the layer, expert, tensor, the backup and both checksums.
  // `dst` is scratch: on error its bytes are unspecified (RecoverSlots stages every row).
  Status ReadRow(int layer, int expert, const TensorSpec& spec, uint8_t* dst) const override;
  // The file still has the size its header describes (a truncated file is named).
  Status Check() const;
  // Removes the file's name (the creator, once every rank of the node opened it); open
  // descriptors keep the file. Idempotent.
  Status Unlink();

  // The file's size (room for every expert; a sparse file: pages nobody wrote cost nothing
  // on tmpfs) and what the rows held cost in host memory.
  uint64_t bytes() const { return size_; }
  uint64_t held_bytes() const;
  int64_t experts_held() const;
  const std::string& path() const { return path_; }
  BackupFileId id() const { return id_; }

 private:
  struct Tensor {
    std::string name, dtype;
    std::vector<int64_t> shape;
    uint64_t bytes = 0;   // per expert
    uint64_t offset = 0;  // within an expert's rows of its layer
  };
  HostBackup() = default;
  Status Layout(uint64_t header_bytes);  // offsets of the held flags, checksums and rows
  Status ParseFixed(std::string_view fixed, uint64_t file_bytes, uint64_t* header_bytes) const;
  Status ParseHeader(std::string_view header);  // after the fixed part; then Layout
  const Tensor* Find(int layer, const std::string& name) const;
  uint64_t RowOffset(int layer, int expert, const Tensor& t) const;
  uint64_t SumOffset(int layer, int expert, const Tensor& t) const;
  Status WriteAt(uint64_t offset, const void* src, uint64_t n) const;
  Status ReadAt(uint64_t offset, void* dst, uint64_t n) const;
  Status MarkHeld(int layer, int expert);
  std::string HeldFlags() const;  // a byte per (layer, expert); empty if unreadable

  std::string path_;
  int fd_ = -1;
  bool owns_name_ = false;  // the creator, until Unlink
  BackupFileId id_;
  uint64_t size_ = 0;
  int experts_ = 0;
  std::vector<std::vector<Tensor>> layers_;
  std::vector<uint64_t> layer_base_;  // file offset of each layer's rows
  std::vector<uint64_t> layer_row_;   // bytes of one expert's rows in each layer
  std::vector<uint64_t> layer_sums_;  // index of each layer's first checksum
  uint64_t held_offset_ = 0;          // one byte per (layer, expert): 1 when held
  uint64_t sums_offset_ = 0;          // u64 per (layer, expert, tensor)
};

// A node's backup for every rank of the group: rank `creator` made `mine` (the other ranks
// pass null) and its ShareName() goes to them in one all-gather over `boot` (a collective:
// every rank calls it); each other rank opens it (OpenShared, every check of Open). Returns
// this rank's backup. Once every rank of the node has it, the creator's Unlink() removes the
// name (the serving drill does so after its start barrier).
Result<std::unique_ptr<HostBackup>> ShareHostBackup(Bootstrap& boot, uint32_t creator,
                                                    std::unique_ptr<HostBackup> mine,
                                                    std::chrono::milliseconds timeout);

// The node's host backup in one collective call (every rank of the group calls it): the
// ranks that name the same `node` share one file, made in `dir` by the lowest of them. With
// `load` null every rank captures what its rows hold under `placement` (together the node's
// ranks hold what they serve); with `load` the creator fills every expert through it (from
// the checkpoint: a lost node's experts are then in every other node's backup). Returns
// this rank's backup once every rank of the group has its file open; the creator has then
// removed the name (nothing is left behind, even by a crash).
using ExpertLoader = std::function<void(int layer, int expert, const std::string& tensor,
                                        uint8_t* dst, uint64_t bytes)>;
Result<std::unique_ptr<HostBackup>> SetUpNodeBackup(Bootstrap& boot, const std::string& node,
                                                    const std::string& dir,
                                                    const RankLayout& layout, int experts,
                                                    const Placement& placement,
                                                    std::chrono::milliseconds timeout,
                                                    const ExpertLoader& load = nullptr);

// A backup of this process alone in `dir` (private, its name removed at once), every expert
// filled through `load`: what a process that joins a group under way keeps (its node's file
// can no longer be shared with it), so that experts stay recoverable after it joined (an
// expert counts as recoverable only where every member's backups hold it).
Result<std::unique_ptr<HostBackup>> LoadHostBackup(const std::string& dir, const RankLayout& layout,
                                                   int experts, const ExpertLoader& load);

// Removes this user's backups in `dir` whose creating process is gone (names
// eplbx-backup-PID-..., a regular file owned by this user, PID not running): what a crash
// between Create and Unlink leaves. Returns how many it removed; links and other users'
// files are left alone.
int RemoveStaleBackups(const std::string& dir);

// The checksum of a backup row: XXH3, 64 bits (docs/deploy.md, "The host backup").
uint64_t RowChecksum(const uint8_t* data, uint64_t n);

// Fills the slots of `rank` that `plan` recovers (plan.recovered) from `sources`, in the
// weights `layout` describes (rank = slot / slots per rank, row by RowOf). Each expert comes
// whole (every tensor's row) from the first source that holds it and reads it back intact;
// a source that fails (a changed row, a mismatched tensor) is passed over for the next, and
// an expert no source yields is named unrecoverable with every source's reason. Every row is
// read and checked first; only then is any written, so an error leaves the weights
// unchanged. Returns the rows written.
Result<int64_t> RecoverSlots(const SurvivorPlan& plan, const RankLayout& layout,
                             const std::vector<const BackupSource*>& sources);
inline Result<int64_t> RecoverSlots(const SurvivorPlan& plan, const RankLayout& layout,
                                    const BackupSource& source) {
  return RecoverSlots(plan, layout, std::vector<const BackupSource*>{&source});
}

}  // namespace eplbx

#endif  // EPLBX_BACKUP_H_
