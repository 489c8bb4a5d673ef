// The checkpoint as a backup source. See backup.h.
#include <algorithm>
#include <cstring>

#include "common/strings.h"
#include "io/backup.h"

namespace eplbx::io {

using internal::Printable;
using internal::StrCat;

Result<std::unique_ptr<CheckpointBackup>> CheckpointBackup::Open(
    std::vector<CheckpointTensor> tensors) {
  std::unique_ptr<CheckpointBackup> b(new CheckpointBackup());
  for (const CheckpointTensor& t : tensors) {
    auto it = b->files_.find(t.file);
    if (it == b->files_.end()) {
      Result<SafetensorsFile> f = SafetensorsFile::Open(t.file);
      if (!f.ok()) return f.status();
      it = b->files_.emplace(t.file, std::move(*f)).first;
    }
    const SafetensorsTensor* found = nullptr;
    for (const SafetensorsTensor& x : it->second.tensors()) {
      if (x.name == t.name) found = &x;
    }
    if (found == nullptr || found->shape.empty()) {
      return Status::NotFound(StrCat("checkpoint '", t.file, "' has no tensor ", Printable(t.name),
                                     found == nullptr ? "" : " with an expert dimension",
                                     " (for layer ", t.layer, " tensor '", t.tensor, "')"));
    }
    if (!b->tensors_.emplace(std::make_pair(t.layer, t.tensor), std::make_pair(t.file, t.name))
             .second) {
      return Status::InvalidArgument(
          StrCat("checkpoint: layer ", t.layer, " tensor '", t.tensor, "' listed twice"));
    }
    auto [e, fresh] = b->layer_experts_.try_emplace(t.layer, found->shape[0]);
    if (!fresh) e->second = std::min(e->second, found->shape[0]);
  }
  return b;
}

std::string CheckpointBackup::Describe() const {
  return StrCat("checkpoint (", files_.size(), files_.size() == 1 ? " file" : " files", ")");
}

bool CheckpointBackup::Holds(int layer, int expert) const {
  auto it = layer_experts_.find(layer);
  return it != layer_experts_.end() && expert >= 0 && expert < it->second;
}

Status CheckpointBackup::ReadRow(int layer, int expert, const TensorSpec& spec,
                                 uint8_t* dst) const {
  auto it = tensors_.find({layer, spec.name});
  if (it == tensors_.end()) {
    return Status::NotFound(
        StrCat(Describe(), ": no file given for layer ", layer, " tensor '", spec.name, "'"));
  }
  if (expert < 0) return Status::InvalidArgument(StrCat("checkpoint: expert ", expert));
  return files_.at(it->second.first)
      .ReadExpertRow(it->second.second, static_cast<uint32_t>(expert), spec, dst);
}

}  // namespace eplbx::io
