// The recovery that fills a rank's recovered slots from backup sources. See eplbx/backup.h.
#include <algorithm>
#include <cstring>

#include "common/strings.h"
#include "eplbx/backup.h"

namespace eplbx {

using internal::Printable;
using internal::StrCat;

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

}  // namespace eplbx
