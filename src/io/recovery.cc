// The checkpoint as a backup source, and the recovery that fills a rank's recovered slots
// from backup sources. See backup.h.
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

Result<int64_t> RecoverSlots(const SurvivorPlan& plan, const RankLayout& layout,
                             const std::vector<const BackupSource*>& sources) {
  struct Pending {
    uint8_t* dst = nullptr;
    std::string bytes;
  };
  std::vector<Pending> rows;
  for (const RecoveredSlot& rec : plan.recovered) {
    if (rec.layer < 0 || static_cast<size_t>(rec.layer) >= layout.layers.size()) {
      return Status::InvalidArgument(StrCat("rank ", layout.rank, ": the plan recovers layer ",
                                            rec.layer, "; the layout has ", layout.layers.size(),
                                            " layers"));
    }
    const uint32_t slots = layout.slots(rec.layer);
    if (slots == 0 || static_cast<uint32_t>(rec.slot) / slots != layout.rank) continue;
    const uint32_t s = static_cast<uint32_t>(rec.slot) % slots;
    const std::string what =
        StrCat("rank ", layout.rank, " must recover expert ", rec.expert, " of layer ", rec.layer,
               " (slot ", rec.slot, ") but it is unrecoverable");
    std::string reasons;
    std::vector<Pending> expert;  // every tensor's row, from one source
    for (const BackupSource* source : sources) {
      expert.clear();
      Status st;
      if (!source->Holds(rec.layer, rec.expert)) {
        st = Status::NotFound(StrCat(source->Describe(), " does not hold it"));
      }
      for (const TensorSpec& spec : layout.layers[rec.layer]) {
        if (!st.ok()) break;
        Pending p;
        p.dst = reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(
            spec.base + static_cast<uint64_t>(layout.RowOf(rec.layer, s)) * spec.bytes_per_expert));
        p.bytes.resize(spec.bytes_per_expert);
        st = source->ReadRow(rec.layer, rec.expert, spec,
                             reinterpret_cast<uint8_t*>(p.bytes.data()));
        expert.push_back(std::move(p));
      }
      if (st.ok()) break;
      reasons += StrCat(reasons.empty() ? "" : "; ", st.message());
      expert.clear();
    }
    if (expert.empty()) {
      return Status::NotFound(StrCat(what, ": ", sources.empty() ? "no backup source" : reasons,
                                     " (nothing was written)"));
    }
    for (Pending& p : expert) rows.push_back(std::move(p));
  }
  for (const Pending& p : rows) std::memcpy(p.dst, p.bytes.data(), p.bytes.size());
  return static_cast<int64_t>(rows.size());
}

}  // namespace eplbx::io
