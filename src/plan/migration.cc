#include "eplbx/migration.h"

#include <algorithm>
#include <cmath>
#include <span>
#include <tuple>

#include "common/strings.h"
#include "plan/round_coloring.h"
#include "plan/source_choice.h"

namespace eplbx {

using internal::StrCat;

namespace {

struct Shape {
  int ranks;
  int nodes;
  int rows;  // slots per rank
  int node_of(int rank) const { return rank / (ranks / nodes); }
};

// One layer. `from` / `to` are the layer's phy2log rows (ranks * rows entries).
Result<LayerMigration> PlanLayer(int layer, const int32_t* from, const int32_t* to,
                                 const Shape& shape, uint64_t bytes) {
  LayerMigration out;
  out.layer = layer;
  const int rows = shape.rows;
  // Holders of each expert in the old placement: (rank, lowest row), ranks ascending.
  int32_t max_expert = -1;
  for (int s = 0; s < shape.ranks * rows; ++s) max_expert = std::max({max_expert, from[s], to[s]});
  // Held flat, expert by expert (holders(e) is a span of one array: a layer is planned at
  // every rearrangement, and a vector per expert was most of its allocations).
  std::vector<int32_t> first(static_cast<size_t>(max_expert + 2), 0);
  std::vector<int32_t> last_rank(static_cast<size_t>(max_expert + 1), -1);
  for (int s = 0; s < shape.ranks * rows; ++s) {
    const int32_t e = from[s];
    if (e < 0 || last_rank[e] == s / rows) continue;
    last_rank[e] = s / rows;
    ++first[static_cast<size_t>(e) + 1];
  }
  for (size_t e = 1; e < first.size(); ++e) first[e] += first[e - 1];
  std::vector<std::pair<int32_t, int32_t>> held(static_cast<size_t>(first.back()));
  std::fill(last_rank.begin(), last_rank.end(), -1);
  std::vector<int32_t> fill(first.begin(), first.end() - 1);
  for (int s = 0; s < shape.ranks * rows; ++s) {
    const int32_t e = from[s];
    if (e < 0 || last_rank[e] == s / rows) continue;
    last_rank[e] = s / rows;
    held[fill[e]++] = {s / rows, s % rows};
  }
  auto holders = [&](int32_t e) {
    return std::span<const std::pair<int32_t, int32_t>>(held).subspan(
        first[e], static_cast<size_t>(first[e + 1] - first[e]));
  };

  struct PendingRead {
    int32_t dst, dst_row, expert;
  };
  std::vector<PendingRead> reads;
  for (int r = 0; r < shape.ranks; ++r) {
    const int32_t* old_rows = from + static_cast<ptrdiff_t>(r) * rows;
    const int32_t* new_rows = to + static_cast<ptrdiff_t>(r) * rows;
    for (int i = 0; i < rows; ++i) {
      const int32_t e = new_rows[i];
      if (e < 0 || e == old_rows[i]) continue;  // empty slot, or unchanged row
      // 1. The rank already holds e: copy locally from its lowest old row.
      const int32_t* held = std::find(old_rows, old_rows + rows, e);
      if (held != old_rows + rows) {
        out.local_copies.push_back(
            {r, static_cast<int32_t>(held - old_rows), i, e, CopySource::kOld});
        continue;
      }
      // 2. An earlier row of this rank receives e remotely: free-ride on it.
      const int32_t* first = std::find(new_rows, new_rows + i, e);
      if (first != new_rows + i) {
        out.local_copies.push_back(
            {r, static_cast<int32_t>(first - new_rows), i, e, CopySource::kNew});
        continue;
      }
      // 3. Otherwise one remote read into this row.
      if (holders(e).empty()) {
        return Status::InvalidArgument(
            StrCat("layer ", layer, ": expert ", e, " is placed on rank ", r, " (row ", i,
                   ") in the new placement but no rank holds it in the old placement; a migration "
                   "can only move experts that exist (load the expert's weights first)"));
      }
      reads.push_back({r, i, e});
    }
  }

  // Source candidates: holders on the reader's node when there are any, else all holders.
  std::vector<std::vector<int32_t>> candidates(reads.size());
  for (size_t k = 0; k < reads.size(); ++k) {
    const auto h = holders(reads[k].expert);
    for (const auto& [rank, row] : h) {
      if (shape.node_of(rank) == shape.node_of(reads[k].dst)) candidates[k].push_back(rank);
    }
    if (candidates[k].empty()) {
      for (const auto& [rank, row] : h) candidates[k].push_back(rank);
    }
  }
  const std::vector<int32_t> source = internal::ChooseSources(candidates, shape.ranks);

  // Rounds over distinct (reader, server) pairs, in (reader, server) order.
  std::vector<std::pair<int32_t, int32_t>> pairs;
  for (size_t k = 0; k < reads.size(); ++k) pairs.emplace_back(reads[k].dst, source[k]);
  std::sort(pairs.begin(), pairs.end());
  pairs.erase(std::unique(pairs.begin(), pairs.end()), pairs.end());
  const std::vector<int32_t> round = internal::ColorRounds(pairs, shape.ranks, &out.rounds);
  out.rounds_lower_bound = internal::RoundsLowerBound(pairs, shape.ranks);

  std::vector<uint64_t> in(static_cast<size_t>(shape.ranks), 0), served(in);
  for (size_t k = 0; k < reads.size(); ++k) {
    const int32_t src = source[k];
    const auto h = holders(reads[k].expert);
    const auto holder = std::find_if(h.begin(), h.end(), [&](auto& p) { return p.first == src; });
    const auto pair_at =
        std::lower_bound(pairs.begin(), pairs.end(), std::make_pair(reads[k].dst, src));
    out.transfers.push_back({src, holder->second, reads[k].dst, reads[k].dst_row, reads[k].expert,
                             round[pair_at - pairs.begin()]});
    in[reads[k].dst] += bytes;
    served[src] += bytes;
    out.bytes_remote += bytes;
    if (shape.node_of(src) != shape.node_of(reads[k].dst)) out.bytes_cross_node += bytes;
  }
  out.max_bytes_in = *std::max_element(in.begin(), in.end());
  out.max_bytes_out = *std::max_element(served.begin(), served.end());
  std::sort(out.transfers.begin(), out.transfers.end(), [](const auto& a, const auto& b) {
    return std::tie(a.round, a.dst, a.src, a.dst_row) < std::tie(b.round, b.dst, b.src, b.dst_row);
  });
  return out;
}

}  // namespace

Result<MigrationPlan> PlanMigration(const Placement& from, const Placement& to,
                                    const MigrationOptions& options) {
  if (from.layers() != to.layers() || from.slots() != to.slots()) {
    return Status::Mismatch(StrCat("old placement is ", from.layers(), " layers x ", from.slots(),
                                   " slots but new placement is ", to.layers(), " layers x ",
                                   to.slots(), " slots (they must describe the same slots)"));
  }
  Topology topology{.ranks = options.ranks, .nodes = options.nodes, .slots = from.slots()};
  EPLBX_RETURN_IF_ERROR(topology.Validate(/*experts=*/0));
  EPLBX_RETURN_IF_ERROR(topology.CheckWork(from.layers(), std::max(from.experts(), to.experts())));
  if (options.bytes_per_expert == 0) {
    return Status::InvalidArgument("bytes per expert is 0 (expected the size of one expert row)");
  }
  // Byte totals are counts x bytes per expert in uint64: this bound keeps every product exact.
  if (options.bytes_per_expert > kMaxBytesPerExpert) {
    return Status::InvalidArgument(StrCat("bytes per expert is ", options.bytes_per_expert,
                                          "; the limit is ", kMaxBytesPerExpert, " (2^40)"));
  }
  if (!(options.link_gbps > 0) || !std::isfinite(options.link_gbps)) {
    return Status::InvalidArgument(
        StrCat("link bandwidth is ", options.link_gbps, " Gb/s (expected a positive number)"));
  }
  const Shape shape{options.ranks, options.nodes, topology.slots_per_rank()};
  const double bytes_per_second = options.link_gbps * 1e9 / 8;
  MigrationPlan plan;
  MigrationSummary& sum = plan.summary;
  for (int l = 0; l < from.layers(); ++l) {
    const size_t offset = static_cast<size_t>(l) * static_cast<size_t>(from.slots());
    Result<LayerMigration> layer =
        PlanLayer(l, from.phy2log().data() + offset, to.phy2log().data() + offset, shape,
                  options.bytes_per_expert);
    if (!layer.ok()) return layer.status();
    const LayerMigration& m = *layer;
    sum.remote_transfers += static_cast<int64_t>(m.transfers.size());
    sum.local_copies += static_cast<int64_t>(m.local_copies.size());
    sum.bytes_moved += m.bytes_remote;
    sum.local_copy_bytes += m.local_copies.size() * options.bytes_per_expert;
    sum.cross_node_bytes += m.bytes_cross_node;
    sum.rounds += m.rounds;
    sum.rounds_lower_bound += m.rounds_lower_bound;
    sum.max_rounds_per_layer = std::max(sum.max_rounds_per_layer, m.rounds);
    sum.max_bytes_in = std::max(sum.max_bytes_in, m.max_bytes_in);
    sum.max_bytes_out = std::max(sum.max_bytes_out, m.max_bytes_out);
    sum.time_lower_bound_s +=
        static_cast<double>(std::max(m.max_bytes_in, m.max_bytes_out)) / bytes_per_second;
    plan.layers.push_back(std::move(*layer));
  }
  return plan;
}

Result<std::vector<int32_t>> ApplyMigration(const std::vector<int32_t>& contents,
                                            const LayerMigration& layer, int ranks) {
  if (ranks < 1 || contents.size() % static_cast<size_t>(ranks) != 0) {
    return Status::InvalidArgument(
        StrCat(contents.size(), " rows cannot be split over ", ranks, " ranks"));
  }
  const int rows = static_cast<int>(contents.size() / static_cast<size_t>(ranks));
  auto in_range = [&](int rank, int row) {
    return rank >= 0 && rank < ranks && row >= 0 && row < rows;
  };
  auto at = [&](int rank, int row) { return static_cast<size_t>(rank) * rows + row; };
  std::vector<int32_t> after = contents;
  for (const RemoteRead& t : layer.transfers) {  // sources: contents before the migration
    if (!in_range(t.src, t.src_row) || !in_range(t.dst, t.dst_row) ||
        contents[at(t.src, t.src_row)] != t.expert) {
      return Status::InvalidArgument(StrCat("layer ", layer.layer, ": transfer of expert ",
                                            t.expert, " from rank ", t.src, " row ", t.src_row,
                                            " to rank ", t.dst, " row ", t.dst_row,
                                            ": the source does not hold that expert"));
    }
    after[at(t.dst, t.dst_row)] = t.expert;
  }
  for (const CopySource pass : {CopySource::kOld, CopySource::kNew}) {
    for (const LocalCopy& c : layer.local_copies) {
      if (c.source != pass) continue;
      const bool ok =
          in_range(c.rank, c.src_row) && in_range(c.rank, c.dst_row) &&
          (pass == CopySource::kOld ? contents : after)[at(c.rank, c.src_row)] == c.expert;
      if (!ok) {
        return Status::InvalidArgument(StrCat("layer ", layer.layer, ": local copy of expert ",
                                              c.expert, " on rank ", c.rank, " from row ",
                                              c.src_row, " to row ", c.dst_row,
                                              ": the source row does not hold that expert"));
      }
      after[at(c.rank, c.dst_row)] = c.expert;
    }
  }
  return after;
}

}  // namespace eplbx
