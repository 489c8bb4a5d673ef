// Backup sources and recovery. See backup.h.
//
// Host backup file (little-endian): "EPXB", u16 version 1, u16 0, u64 header bytes, then the
// header: u32 layers, u32 experts, per layer u32 tensors and per tensor name (str16), dtype
// (str16), u32 dims + u64 each, u64 bytes per expert. Then one byte per (layer, expert), 1
// when held (64-byte aligned), then the rows (4096-byte aligned): layer by layer, expert by
// expert, the layer's tensors one after another.
#include "io/backup.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/bytes.h"
#include "common/strings.h"

namespace eplbx::io {
namespace {

using internal::Printable;
using internal::StrCat;

constexpr char kMagic[4] = {'E', 'P', 'X', 'B'};
constexpr uint16_t kVersion = 1;
constexpr uint64_t kFixed = 16;  // magic, version, reserved, header bytes
constexpr uint64_t kMaxHeader = 64u << 20;

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

std::string ShapeText(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += StrCat(i ? ", " : "", s[i]);
  return out + "]";
}

std::string Errno() { return std::strerror(errno); }

}  // namespace

HostBackup::~HostBackup() {
  if (map_ != nullptr) munmap(map_, size_);
}

Status HostBackup::Map(int fd, uint64_t size, bool writable) {
  void* p = mmap(nullptr, size, PROT_READ | (writable ? PROT_WRITE : 0), MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    return Status::IoError(
        StrCat("host backup '", path_, "': mmap of ", size, " bytes: ", Errno()));
  }
  map_ = static_cast<uint8_t*>(p);
  size_ = size;
  return Status::OK();
}

Result<std::unique_ptr<HostBackup>> HostBackup::Create(const std::string& path,
                                                       const RankLayout& layout, int experts) {
  const std::string who = StrCat("host backup '", path, "'");
  if (experts <= 0) return Status::InvalidArgument(StrCat(who, ": ", experts, " experts"));
  std::unique_ptr<HostBackup> b(new HostBackup());
  b->path_ = path;
  b->experts_ = experts;
  internal::ByteWriter w;
  w.U32(static_cast<uint32_t>(layout.layers.size()));
  w.U32(static_cast<uint32_t>(experts));
  for (const std::vector<TensorSpec>& layer : layout.layers) {
    std::vector<Tensor> tensors;
    uint64_t row = 0;
    w.U32(static_cast<uint32_t>(layer.size()));
    for (const TensorSpec& t : layer) {
      if (t.bytes_per_expert == 0) {
        return Status::InvalidArgument(
            StrCat(who, ": tensor '", t.name, "' has 0 bytes per expert"));
      }
      w.Str16(t.name);
      w.Str16(t.dtype);
      w.U32(static_cast<uint32_t>(t.expert_shape.size()));
      for (int64_t d : t.expert_shape) w.U64(static_cast<uint64_t>(d));
      w.U64(t.bytes_per_expert);
      tensors.push_back(Tensor{t.name, t.dtype, t.expert_shape, t.bytes_per_expert, row});
      row += t.bytes_per_expert;
    }
    b->layers_.push_back(std::move(tensors));
    b->layer_row_.push_back(row);
  }
  const std::string header = w.Take();
  b->held_offset_ = AlignUp(kFixed + header.size(), 64);
  uint64_t cursor =
      AlignUp(b->held_offset_ + b->layers_.size() * static_cast<uint64_t>(experts), 4096);
  for (uint64_t row : b->layer_row_) {
    b->layer_base_.push_back(cursor);
    cursor += row * static_cast<uint64_t>(experts);
  }
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return Status::IoError(StrCat(who, ": ", Errno()));
  if (ftruncate(fd, static_cast<off_t>(cursor)) != 0) {
    const std::string e = Errno();
    close(fd);
    return Status::IoError(StrCat(who, ": sizing it to ", cursor, " bytes: ", e));
  }
  Status s = b->Map(fd, cursor, true);
  close(fd);
  EPLBX_RETURN_IF_ERROR(s);
  internal::ByteWriter fixed;
  fixed.Raw(std::string_view(kMagic, 4));
  fixed.U16(kVersion);
  fixed.U16(0);
  fixed.U64(header.size());
  const std::string f = fixed.Take();
  std::memcpy(b->map_, f.data(), f.size());
  std::memcpy(b->map_ + kFixed, header.data(), header.size());
  return b;
}

Result<std::unique_ptr<HostBackup>> HostBackup::Open(const std::string& path) {
  const std::string who = StrCat("host backup '", path, "'");
  const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return Status::IoError(StrCat(who, ": ", Errno()));
  struct stat st {};
  if (fstat(fd, &st) != 0 || st.st_size < static_cast<off_t>(kFixed)) {
    close(fd);
    return Status::Corruption(StrCat(who, ": ", st.st_size, " bytes, too short for a backup"));
  }
  std::unique_ptr<HostBackup> b(new HostBackup());
  b->path_ = path;
  Status s = b->Map(fd, static_cast<uint64_t>(st.st_size), true);
  close(fd);
  EPLBX_RETURN_IF_ERROR(s);
  const std::string_view all(reinterpret_cast<const char*>(b->map_), b->size_);
  internal::ByteReader fixed(all.substr(0, kFixed), who);
  std::string magic;
  uint16_t version = 0, reserved = 0;
  uint64_t header_bytes = 0;
  if (!fixed.Raw("magic", 4, &magic) || !fixed.U16("version", &version) ||
      !fixed.U16("reserved", &reserved) || !fixed.U64("header bytes", &header_bytes)) {
    return fixed.status();
  }
  if (magic != std::string_view(kMagic, 4)) {
    return Status::Corruption(StrCat(who, ": not a host backup (magic ", Printable(magic), ")"));
  }
  if (version != kVersion) {
    return Status::NotSupported(
        StrCat(who, ": version ", version, "; this build reads version ", kVersion));
  }
  if (header_bytes > kMaxHeader || kFixed + header_bytes > b->size_) {
    return Status::Corruption(
        StrCat(who, ": header of ", header_bytes, " bytes in a file of ", b->size_));
  }
  internal::ByteReader r(all.substr(kFixed, header_bytes), who);
  uint32_t layers = 0, experts = 0;
  if (!r.U32("layers", &layers) || !r.U32("experts", &experts)) return r.status();
  if (experts == 0 || experts > (1u << 20) || layers > (1u << 20)) {
    return Status::Corruption(StrCat(who, ": ", layers, " layers of ", experts, " experts"));
  }
  b->experts_ = static_cast<int>(experts);
  for (uint32_t l = 0; l < layers; ++l) {
    uint32_t n = 0;
    if (!r.U32("tensors", &n)) return r.status();
    if (n > 4096) return Status::Corruption(StrCat(who, ": layer ", l, " has ", n, " tensors"));
    std::vector<Tensor> tensors;
    uint64_t row = 0;
    for (uint32_t t = 0; t < n; ++t) {
      Tensor x;
      uint32_t dims = 0;
      if (!r.Str16("name", 1024, &x.name) || !r.Str16("dtype", 64, &x.dtype) ||
          !r.U32("dims", &dims)) {
        return r.status();
      }
      if (dims > 16)
        return Status::Corruption(StrCat(who, ": tensor '", x.name, "' has ", dims, " dims"));
      for (uint32_t d = 0; d < dims; ++d) {
        uint64_t v = 0;
        if (!r.U64("dim", &v)) return r.status();
        x.shape.push_back(static_cast<int64_t>(v));
      }
      if (!r.U64("bytes per expert", &x.bytes)) return r.status();
      x.offset = row;
      if (x.bytes == 0 || __builtin_add_overflow(row, x.bytes, &row)) {
        return Status::Corruption(
            StrCat(who, ": tensor '", x.name, "' has ", x.bytes, " bytes per expert"));
      }
      tensors.push_back(std::move(x));
    }
    b->layers_.push_back(std::move(tensors));
    b->layer_row_.push_back(row);
  }
  if (r.remaining() != 0) {
    return Status::Corruption(StrCat(who, ": ", r.remaining(), " bytes after the header"));
  }
  b->held_offset_ = AlignUp(kFixed + header_bytes, 64);
  uint64_t cursor = AlignUp(b->held_offset_ + static_cast<uint64_t>(layers) * experts, 4096);
  for (uint64_t row : b->layer_row_) {
    b->layer_base_.push_back(cursor);
    uint64_t bytes = 0;
    if (__builtin_mul_overflow(row, static_cast<uint64_t>(experts), &bytes) ||
        __builtin_add_overflow(cursor, bytes, &cursor)) {
      return Status::Corruption(StrCat(who, ": rows too large to address"));
    }
  }
  if (cursor != b->size_) {
    return Status::Corruption(StrCat(who, ": the header describes ", cursor,
                                     " bytes but the file has ", b->size_,
                                     " (truncated, or written by another layout)"));
  }
  return b;
}

std::string HostBackup::Describe() const { return StrCat("host backup '", path_, "'"); }

const HostBackup::Tensor* HostBackup::Find(int layer, const std::string& name) const {
  if (layer < 0 || static_cast<size_t>(layer) >= layers_.size()) return nullptr;
  for (const Tensor& t : layers_[layer]) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

uint8_t* HostBackup::Row(int layer, int expert, const Tensor& t) const {
  return map_ + layer_base_[layer] + static_cast<uint64_t>(expert) * layer_row_[layer] + t.offset;
}

bool HostBackup::Holds(int layer, int expert) const {
  if (layer < 0 || static_cast<size_t>(layer) >= layers_.size() || expert < 0 ||
      expert >= experts_) {
    return false;
  }
  return map_[held_offset_ + static_cast<uint64_t>(layer) * experts_ + expert] == 1;
}

int64_t HostBackup::experts_held() const {
  int64_t n = 0;
  for (size_t l = 0; l < layers_.size(); ++l) {
    for (int e = 0; e < experts_; ++e) n += Holds(static_cast<int>(l), e);
  }
  return n;
}

uint64_t HostBackup::held_bytes() const {
  uint64_t n = 0;
  for (size_t l = 0; l < layers_.size(); ++l) {
    for (int e = 0; e < experts_; ++e) n += Holds(static_cast<int>(l), e) ? layer_row_[l] : 0;
  }
  return n;
}

Status HostBackup::Capture(const Placement& placement, const RankLayout& layout) {
  const std::string who = StrCat(Describe(), ": rank ", layout.rank);
  if (layout.layers.size() != layers_.size() ||
      placement.layers() != static_cast<int>(layers_.size()) || placement.experts() != experts_) {
    return Status::Mismatch(StrCat(who, ": the backup has ", layers_.size(), " layers of ",
                                   experts_, " experts; the layout has ", layout.layers.size(),
                                   " layers and the placement ", placement.layers(), " of ",
                                   placement.experts()));
  }
  // Every tensor must match before anything is copied.
  for (size_t l = 0; l < layers_.size(); ++l) {
    if (layout.layers[l].size() != layers_[l].size()) {
      return Status::Mismatch(StrCat(who, ": layer ", l, " has ", layout.layers[l].size(),
                                     " tensors; the backup has ", layers_[l].size()));
    }
    for (const TensorSpec& spec : layout.layers[l]) {
      const Tensor* t = Find(static_cast<int>(l), spec.name);
      if (t == nullptr || t->dtype != spec.dtype || t->shape != spec.expert_shape ||
          t->bytes != spec.bytes_per_expert) {
        return Status::Mismatch(StrCat(who, ": layer ", l, " tensor '", spec.name, "' is ",
                                       spec.dtype, " ", ShapeText(spec.expert_shape), ", ",
                                       spec.bytes_per_expert, " bytes per expert; the backup ",
                                       t == nullptr
                                           ? std::string("has no such tensor")
                                           : StrCat("has ", t->dtype, " ", ShapeText(t->shape),
                                                    ", ", t->bytes, " bytes per expert"),
                                       " (a backup made for another model or quantization)"));
      }
    }
  }
  for (size_t l = 0; l < layers_.size(); ++l) {
    const uint32_t slots = layout.slots(l);
    for (uint32_t s = 0; s < slots; ++s) {
      const int64_t slot = static_cast<int64_t>(layout.rank) * slots + s;
      if (slot >= placement.slots()) {
        return Status::Mismatch(StrCat(who, ": slot ", slot, " of layer ", l,
                                       " is past the placement's ", placement.slots(), " slots"));
      }
      const int32_t e = placement.phy2log(static_cast<int>(l), static_cast<int>(slot));
      if (e < 0) continue;
      for (const TensorSpec& spec : layout.layers[l]) {
        const Tensor* t = Find(static_cast<int>(l), spec.name);
        const auto* src = reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(
            spec.base + static_cast<uint64_t>(layout.RowOf(l, s)) * spec.bytes_per_expert));
        std::memcpy(Row(static_cast<int>(l), e, *t), src, spec.bytes_per_expert);
      }
      map_[held_offset_ + l * static_cast<uint64_t>(experts_) + static_cast<uint64_t>(e)] = 1;
    }
  }
  return Status::OK();
}

Status HostBackup::Load(int layer, int expert,
                        const std::function<void(const std::string&, uint8_t*, uint64_t)>& read) {
  if (layer < 0 || layer >= static_cast<int>(layers_.size()) || expert < 0 || expert >= experts_) {
    return Status::OutOfRange(StrCat(Describe(), ": expert ", expert, " of layer ", layer,
                                     " is outside its ", layers_.size(), " layers x ", experts_,
                                     " experts"));
  }
  for (const Tensor& t : layers_[layer]) read(t.name, Row(layer, expert, t), t.bytes);
  map_[held_offset_ + static_cast<uint64_t>(layer) * experts_ + static_cast<uint64_t>(expert)] = 1;
  return Status::OK();
}

Status HostBackup::ReadRow(int layer, int expert, const TensorSpec& spec, uint8_t* dst) const {
  const Tensor* t = Find(layer, spec.name);
  if (t == nullptr) {
    return Status::NotFound(StrCat(Describe(), ": no tensor '", spec.name, "' in layer ", layer));
  }
  if (t->dtype != spec.dtype || t->shape != spec.expert_shape ||
      t->bytes != spec.bytes_per_expert) {
    return Status::Mismatch(StrCat(Describe(), ": layer ", layer, " tensor '", spec.name, "' is ",
                                   t->dtype, " ", ShapeText(t->shape), ", ", t->bytes,
                                   " bytes per expert; the layout's is ", spec.dtype, " ",
                                   ShapeText(spec.expert_shape), ", ", spec.bytes_per_expert));
  }
  if (!Holds(layer, expert)) {
    return Status::NotFound(
        StrCat(Describe(), " does not hold expert ", expert, " of layer ", layer));
  }
  std::memcpy(dst, Row(layer, expert, *t), t->bytes);
  return Status::OK();
}

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
                             const BackupSource& source) {
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
    if (!source.Holds(rec.layer, rec.expert)) {
      return Status::NotFound(StrCat("rank ", layout.rank, " must recover expert ", rec.expert,
                                     " of layer ", rec.layer, " (slot ", rec.slot, ") but ",
                                     source.Describe(), " does not hold it; nothing was written"));
    }
    for (const TensorSpec& spec : layout.layers[rec.layer]) {
      Pending p;
      p.dst = reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(
          spec.base + static_cast<uint64_t>(layout.RowOf(rec.layer, s)) * spec.bytes_per_expert));
      p.bytes.resize(spec.bytes_per_expert);
      Status st =
          source.ReadRow(rec.layer, rec.expert, spec, reinterpret_cast<uint8_t*>(p.bytes.data()));
      if (!st.ok()) {
        return st.WithPrefix(StrCat("rank ", layout.rank, " recovering expert ", rec.expert,
                                    " of layer ", rec.layer, " (nothing was written)"));
      }
      rows.push_back(std::move(p));
    }
  }
  for (const Pending& p : rows) std::memcpy(p.dst, p.bytes.data(), p.bytes.size());
  return static_cast<int64_t>(rows.size());
}

}  // namespace eplbx::io
