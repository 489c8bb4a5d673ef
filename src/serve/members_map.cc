#include "serve/members_map.h"

#include <bit>
#include <cmath>
#include <limits>

#include "common/bytes.h"
#include "common/strings.h"

namespace eplbx::internal {

namespace {
constexpr uint8_t kVersion = 2;
}  // namespace

std::string EncodeMembersMap(int step, uint64_t placed_at, const std::vector<int32_t>& own,
                             const std::vector<double>& window,
                             const std::vector<uint8_t>& backed) {
  ByteWriter w;
  w.U8(kVersion);
  w.U32(static_cast<uint32_t>(step + 1));  // a joiner: 0
  w.U64(placed_at);
  w.U32(static_cast<uint32_t>(own.size()));
  for (int32_t e : own) w.U32(static_cast<uint32_t>(e));
  w.U32(static_cast<uint32_t>(window.size()));
  for (double v : window) w.U64(std::bit_cast<uint64_t>(v));
  w.U32(static_cast<uint32_t>(backed.size()));
  for (uint8_t b : backed) w.U8(b != 0 ? 1 : 0);
  return w.Take();
}

Result<MembersRound> DecodeMembersRound(const std::vector<std::string>& all, int layers, int rows,
                                        int experts) {
  if (layers <= 0 || rows <= 0 || all.empty()) {
    return Status::InvalidArgument(
        StrCat("members' maps: ", layers, " layers, ", rows, " rows, ", all.size(), " ranks"));
  }
  const int64_t slots = static_cast<int64_t>(all.size()) * rows;
  const uint64_t per_member = static_cast<uint64_t>(layers) * static_cast<uint64_t>(rows);
  if (slots > std::numeric_limits<int32_t>::max() || per_member > (1u << 26)) {
    return Status::InvalidArgument(StrCat("members' maps: ", all.size(), " ranks x ", rows,
                                          " rows x ", layers, " layers is too large"));
  }
  MembersRound out;
  size_t step_rank = 0;  // the first member that said its step
  std::vector<int32_t> flat(static_cast<size_t>(layers) * static_cast<size_t>(slots), -1);
  bool first = true, first_backed = true;
  for (size_t r = 0; r < all.size(); ++r) {
    const std::string& b = all[r];
    if (b.empty()) continue;  // not a member
    const std::string what = StrCat("rank ", r, "'s map");
    ByteReader in(b, what);
    uint8_t version = 0;
    uint32_t at = 0, n = 0;
    uint64_t placed = 0;
    if (!in.U8("version", &version) || !in.U32("step", &at) || !in.U64("placed_at", &placed) ||
        !in.U32("slots", &n)) {
      return in.status();
    }
    if (version != kVersion) {
      return Status::Corruption(
          StrCat(what, " is version ", +version, "; this build reads version ", +kVersion));
    }
    if (n != per_member || in.remaining() < uint64_t{n} * 4 + 4) {
      return Status::Corruption(StrCat(what, " has ", n, " slots in ", b.size(), " bytes; ",
                                       per_member, " expected (", layers, " layers x ", rows,
                                       " rows)"));
    }
    if (at > static_cast<uint32_t>(std::numeric_limits<int32_t>::max())) {
      return Status::Corruption(StrCat(what, " says step ", at, ": not a step"));
    }
    const int member_step = static_cast<int>(at) - 1;  // -1: a joiner
    // Members are in step (the step's collective); a joiner says none.
    if (member_step >= 0 && out.step >= 0 && member_step != out.step) {
      return Status::Internal(StrCat("rank ", r, " is at step ", member_step, ", rank ", step_rank,
                                     " at step ", out.step, ": the members are not in step"));
    }
    if (member_step >= 0 && out.step < 0) {
      out.step = member_step;
      step_rank = r;
    }
    if (placed == 0) out.not_placed += StrCat(out.not_placed.empty() ? "rank " : ", ", r);
    // Settled only when every member placed, all at one epoch.
    if (placed == 0 || (!first && placed != out.placed_at)) out.all_placed = false;
    if (first) out.placed_at = placed;
    first = false;
    for (int l = 0; l < layers; ++l) {
      for (int row = 0; row < rows; ++row) {
        uint32_t e = 0;
        if (!in.U32("slot", &e)) return in.status();
        const int32_t expert = static_cast<int32_t>(e);
        if (expert < -1 || expert >= experts) {
          return Status::Corruption(StrCat(what, ": layer ", l, " row ", row, " holds expert ",
                                           expert, " (expected -1 .. ", experts - 1, ")"));
        }
        flat[static_cast<size_t>(l) * static_cast<size_t>(slots) + r * rows + row] = expert;
      }
    }
    uint32_t w = 0;
    if (!in.U32("window", &w)) return in.status();
    const uint64_t want = static_cast<uint64_t>(layers) * static_cast<uint64_t>(experts);
    if ((w != 0 && w != want) || in.remaining() < uint64_t{w} * 8 + 4) {
      return Status::Corruption(StrCat(what, " has a window of ", w, " loads in ", in.remaining(),
                                       " bytes; 0 or ", want, " expected (", layers, " layers x ",
                                       experts, " experts)"));
    }
    std::vector<double> window(w);
    for (uint32_t i = 0; i < w; ++i) {
      uint64_t bits = 0;
      if (!in.U64("load", &bits)) return in.status();
      window[i] = std::bit_cast<double>(bits);
      if (!std::isfinite(window[i]) || window[i] < 0) {
        return Status::Corruption(StrCat(what, ": the window's load of layer ", i / experts,
                                         " expert ", i % experts, " is ", window[i],
                                         " (expected a finite number >= 0)"));
      }
    }
    if (out.window.empty()) out.window = std::move(window);
    uint32_t nb = 0;
    if (!in.U32("backed", &nb)) return in.status();
    if ((nb != 0 && nb != want) || in.remaining() != nb) {
      return Status::Corruption(StrCat(what, " has ", nb, " backup flags in ", in.remaining(),
                                       " bytes; 0 or ", want, " expected (", layers, " layers x ",
                                       experts, " experts)"));
    }
    std::string flags;
    if (!in.Raw("backed", nb, &flags)) return in.status();
    // Recoverable where every member's backups hold it (none sent: none held).
    if (first_backed) out.backed.assign(want, 1);
    first_backed = false;
    for (uint64_t i = 0; i < nb; ++i) {
      if (flags[i] != 0 && flags[i] != 1) {
        return Status::Corruption(StrCat(what, ": backup flag ", i, " is ",
                                         +static_cast<uint8_t>(flags[i]), " (expected 0 or 1)"));
      }
    }
    for (uint64_t i = 0; i < want; ++i) {
      if (nb == 0 || flags[i] == 0) out.backed[i] = 0;
    }
  }
  EPLBX_ASSIGN_OR_RETURN(out.in_force, Placement::FromPhy2Log(layers, static_cast<int>(slots),
                                                              experts, std::move(flat)));
  return out;
}

}  // namespace eplbx::internal
