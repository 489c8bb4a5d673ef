// Internal: the checkpoint's safetensors files as a backup source (docs/placement.md,
// "Backup sources"): one tensor per (layer, tensor of the layout), each [experts, ...]; every
// row checked against the layout when read. The other sources and RecoverSlots are public
// (eplbx/backup.h).
#ifndef EPLBX_SRC_IO_BACKUP_H_
#define EPLBX_SRC_IO_BACKUP_H_

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "eplbx/backup.h"
#include "io/safetensors.h"

namespace eplbx::io {

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

}  // namespace eplbx::io

#endif  // EPLBX_SRC_IO_BACKUP_H_
