// Internal: backup sources for experts no surviving rank holds (issue 20, item 3;
// docs/placement.md, "Backup sources"), and the recovery that fills a rank's recovered slots
// from one.
//
// - HostBackup: a host copy of experts in a shared file (a /dev/shm file: it outlives the
//   rank process that wrote it, any process of the node maps it, and an agent can register
//   it like any shared file). TensorRT-LLM's host pool, SGLang's DRAM backup. Its memory
//   cost is held_bytes(): the rows captured (the file is sparse).
// - CheckpointBackup: the checkpoint's safetensors files, one tensor per (layer, tensor of
//   the layout), each [experts, ...]; every row checked against the layout when read.
// - RecoverSlots: reads every row a rank must recover (checked) before writing any, so an
//   error leaves its weights as they were.
#ifndef EPLBX_SRC_IO_BACKUP_H_
#define EPLBX_SRC_IO_BACKUP_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "eplbx/layout.h"
#include "eplbx/placement.h"
#include "eplbx/status.h"
#include "eplbx/survivors.h"
#include "io/safetensors.h"

namespace eplbx::io {

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

class HostBackup final : public BackupSource {
 public:
  // Creates `path` (replacing a file there) with room for every expert of every layer of
  // `layout`'s tensors; nothing is held yet.
  static Result<std::unique_ptr<HostBackup>> Create(const std::string& path,
                                                    const RankLayout& layout, int experts);
  // Maps a backup another process created, checking its header against the file.
  static Result<std::unique_ptr<HostBackup>> Open(const std::string& path);
  ~HostBackup() override;

  // Copies the rows of every expert `layout.rank`'s slots hold under `placement` from its
  // weights (the layout's addresses, rows by RowOf) and marks them held. The layout must
  // match the backup's tensors (names, dtypes, shapes, bytes): else a named error, nothing
  // copied.
  Status Capture(const Placement& placement, const RankLayout& layout);
  // Loads expert `expert` of `layer` from elsewhere (the checkpoint, say: a node's backup of
  // every expert): `read(tensor_name, dst, bytes)` writes each of the layer's tensors' row;
  // then the expert is held. A layer or expert out of range is a named error.
  Status Load(int layer, int expert,
              const std::function<void(const std::string&, uint8_t*, uint64_t)>& read);

  std::string Describe() const override;
  bool Holds(int layer, int expert) const override;
  Status ReadRow(int layer, int expert, const TensorSpec& spec, uint8_t* dst) const override;

  // The file's size (room for every expert; a sparse file: pages nobody wrote cost nothing
  // on tmpfs) and what the rows held cost in host memory.
  uint64_t bytes() const { return size_; }
  uint64_t held_bytes() const;
  int64_t experts_held() const;
  const std::string& path() const { return path_; }

 private:
  struct Tensor {
    std::string name, dtype;
    std::vector<int64_t> shape;
    uint64_t bytes = 0;   // per expert
    uint64_t offset = 0;  // within an expert's rows of its layer
  };
  HostBackup() = default;
  Status Map(int fd, uint64_t size, bool writable);
  const Tensor* Find(int layer, const std::string& name) const;
  uint8_t* Row(int layer, int expert, const Tensor& t) const;

  std::string path_;
  uint8_t* map_ = nullptr;
  uint64_t size_ = 0;
  int experts_ = 0;
  std::vector<std::vector<Tensor>> layers_;
  std::vector<uint64_t> layer_base_;  // file offset of each layer's rows
  std::vector<uint64_t> layer_row_;   // bytes of one expert's rows in each layer
  uint64_t held_offset_ = 0;          // one byte per (layer, expert): 1 when held
};

// One tensor of the checkpoint: the layout's tensor `tensor` of `layer` is `name` in `file`.
struct CheckpointTensor {
  int layer = 0;
  std::string tensor;
  std::string file;
  std::string name;
};

class CheckpointBackup final : public BackupSource {
 public:
  // Opens every file once and checks its header (a truncated or malformed file is named).
  static Result<std::unique_ptr<CheckpointBackup>> Open(std::vector<CheckpointTensor> tensors);

  std::string Describe() const override;
  // The layer has tensors listed and `expert` is a row of each.
  bool Holds(int layer, int expert) const override;
  Status ReadRow(int layer, int expert, const TensorSpec& spec, uint8_t* dst) const override;

 private:
  std::map<std::string, SafetensorsFile> files_;
  std::map<std::pair<int, std::string>, std::pair<std::string, std::string>> tensors_;
  std::map<int, int64_t> layer_experts_;  // the fewest rows among a layer's tensors
};

// Fills the slots of `rank` that `plan` recovers (plan.recovered) from `source`, in the
// weights `layout` describes (rank = slot / slots per rank, row by RowOf). Every row is read
// and checked first; only then is any written, so an error (an expert the source does not
// hold, a mismatched tensor) leaves the weights unchanged. Returns the rows written.
Result<int64_t> RecoverSlots(const SurvivorPlan& plan, const RankLayout& layout,
                             const BackupSource& source);

}  // namespace eplbx::io

#endif  // EPLBX_SRC_IO_BACKUP_H_
