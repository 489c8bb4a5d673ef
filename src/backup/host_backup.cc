// The host backup file. See eplbx/backup.h.
//
// Host backup file (little-endian): "EPXB", u16 version 2, u16 0, u64 header bytes, then the
// header: u32 layers, u32 experts, per layer u32 tensors and per tensor name (str16), dtype
// (str16), u32 dims + u64 each, u64 bytes per expert. Then one byte per (layer, expert), 1
// when held (64-byte aligned); one u64 checksum per (layer, expert, tensor) (64-byte
// aligned); then the rows (4096-byte aligned): layer by layer, expert by expert, the layer's
// tensors one after another. Every access goes through the descriptor (pread / pwrite), so a
// file cut short while in use is an error, not a SIGBUS.
#include "eplbx/backup.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "common/bytes.h"
#include "common/strings.h"

namespace eplbx {
namespace {

using internal::Printable;
using internal::StrCat;

constexpr char kMagic[4] = {'E', 'P', 'X', 'B'};
constexpr uint16_t kVersion = 2;
constexpr uint64_t kFixed = 16;  // magic, version, reserved, header bytes
constexpr uint64_t kMaxHeader = 64u << 20;
constexpr char kPrefix[] = "eplbx-backup-";

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

std::string ShapeText(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += StrCat(i ? ", " : "", s[i]);
  return out + "]";
}

std::string Errno() { return std::strerror(errno); }

std::string Hex(uint64_t v) {
  static const char kDigits[] = "0123456789abcdef";
  std::string out(16, '0');
  for (int i = 15; i >= 0; --i, v >>= 4) out[i] = kDigits[v & 15];
  return out;
}

// The parts of a file an opener checks: a regular file of this user that nobody else may
// read or write.
std::string NotPrivate(const struct stat& st) {
  if (!S_ISREG(st.st_mode)) return "it is not a regular file";
  if (st.st_uid != geteuid()) {
    return StrCat("it belongs to user ", st.st_uid, ", not to this process's user ", geteuid());
  }
  if ((st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return StrCat("its mode is ", mode, " (others may read or write it; a backup is 0600)");
  }
  return "";
}

}  // namespace

uint64_t RowChecksum(const uint8_t* data, uint64_t n) { return XXH3_64bits(data, n); }

int RemoveStaleBackups(const std::string& dir) {
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return 0;
  int removed = 0;
  const int dfd = dirfd(d);
  while (const dirent* ent = readdir(d)) {
    const std::string_view name(ent->d_name);
    if (name.substr(0, sizeof(kPrefix) - 1) != kPrefix) continue;
    const std::string rest(name.substr(sizeof(kPrefix) - 1));
    char* end = nullptr;
    errno = 0;
    const long pid = std::strtol(rest.c_str(), &end, 10);
    if (errno != 0 || end == rest.c_str() || *end != '-' || pid <= 0) continue;
    struct stat st {};
    if (fstatat(dfd, ent->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode) ||
        st.st_uid != geteuid()) {
      continue;
    }
    if (kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;  // still running
    if (unlinkat(dfd, ent->d_name, 0) == 0) ++removed;
  }
  closedir(d);
  return removed;
}

HostBackup::~HostBackup() {
  if (owns_name_) unlink(path_.c_str());
  if (fd_ >= 0) close(fd_);
}

Status HostBackup::WriteAt(uint64_t offset, const void* src, uint64_t n) const {
  const auto* p = static_cast<const uint8_t*>(src);
  for (uint64_t done = 0; done < n;) {
    const ssize_t put = pwrite(fd_, p + done, n - done, static_cast<off_t>(offset + done));
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) {
      return Status::IoError(StrCat(Describe(), ": writing ", n, " bytes at byte ", offset, ": ",
                                    put < 0 ? Errno() : "no progress"));
    }
    done += static_cast<uint64_t>(put);
  }
  return Status::OK();
}

Status HostBackup::ReadAt(uint64_t offset, void* dst, uint64_t n) const {
  auto* p = static_cast<uint8_t*>(dst);
  for (uint64_t done = 0; done < n;) {
    const ssize_t got = pread(fd_, p + done, n - done, static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      return Status::Corruption(
          StrCat(Describe(), ": ", n, " bytes at byte ", offset, " could not be read (",
                 got < 0 ? Errno() : "the file ends there: cut short after it was written", ")"));
    }
    done += static_cast<uint64_t>(got);
  }
  return Status::OK();
}

Status HostBackup::Layout(uint64_t header_bytes) {
  const uint64_t layers = layers_.size(), experts = static_cast<uint64_t>(experts_);
  held_offset_ = AlignUp(kFixed + header_bytes, 64);
  sums_offset_ = AlignUp(held_offset_ + layers * experts, 64);
  uint64_t sums = 0;
  layer_sums_.clear();
  for (const std::vector<Tensor>& tensors : layers_) {
    layer_sums_.push_back(sums);
    sums += experts * tensors.size();
  }
  uint64_t cursor = AlignUp(sums_offset_ + sums * 8, 4096);
  layer_base_.clear();
  for (uint64_t row : layer_row_) {
    layer_base_.push_back(cursor);
    uint64_t bytes = 0;
    if (__builtin_mul_overflow(row, experts, &bytes) ||
        __builtin_add_overflow(cursor, bytes, &cursor) || cursor > (uint64_t{1} << 56)) {
      return Status::Corruption(StrCat(Describe(), ": rows too large to address"));
    }
  }
  size_ = cursor;
  return Status::OK();
}

Result<std::unique_ptr<HostBackup>> HostBackup::Create(const std::string& dir,
                                                       const RankLayout& layout, int experts) {
  const std::string where = StrCat("host backup in '", dir, "'");
  if (experts <= 0) return Status::InvalidArgument(StrCat(where, ": ", experts, " experts"));
  std::unique_ptr<HostBackup> b(new HostBackup());
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
            StrCat(where, ": tensor '", t.name, "' has 0 bytes per expert"));
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
  RemoveStaleBackups(dir);
  uint64_t random[2] = {0, 0};
  if (getrandom(random, sizeof(random), 0) != static_cast<ssize_t>(sizeof(random))) {
    return Status::Unavailable(StrCat(where, ": no random name (getrandom: ", Errno(), ")"));
  }
  b->path_ = StrCat(dir, "/", kPrefix, getpid(), "-", Hex(random[0]), Hex(random[1]));
  EPLBX_RETURN_IF_ERROR(b->Layout(header.size()));
  b->fd_ = open(b->path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (b->fd_ < 0) return Status::IoError(StrCat(b->Describe(), ": creating it: ", Errno()));
  b->owns_name_ = true;  // from here on the destructor removes it
  struct stat st {};
  if (fstat(b->fd_, &st) != 0) return Status::IoError(StrCat(b->Describe(), ": ", Errno()));
  if (fchmod(b->fd_, 0600) != 0)  // whatever the umask left
    return Status::IoError(StrCat(b->Describe(), ": chmod 0600: ", Errno()));
  b->id_ = {static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)};
  if (ftruncate(b->fd_, static_cast<off_t>(b->size_)) != 0) {
    return Status::IoError(StrCat(b->Describe(), ": sizing it to ", b->size_, " bytes: ", Errno()));
  }
  internal::ByteWriter fixed;
  fixed.Raw(std::string_view(kMagic, 4));
  fixed.U16(kVersion);
  fixed.U16(0);
  fixed.U64(header.size());
  const std::string head = fixed.Take() + header;
  EPLBX_RETURN_IF_ERROR(b->WriteAt(0, head.data(), head.size()));
  return b;
}

Result<std::unique_ptr<HostBackup>> ShareHostBackup(Bootstrap& boot, uint32_t creator,
                                                    std::unique_ptr<HostBackup> mine,
                                                    std::chrono::milliseconds timeout) {
  const bool made = mine != nullptr && boot.rank() == creator;
  EPLBX_ASSIGN_OR_RETURN(std::vector<std::string> names,
                         boot.AllGather(made ? mine->ShareName() : "", timeout));
  if (mine != nullptr) return mine;
  if (creator >= names.size()) {
    return Status::InvalidArgument(
        StrCat("host backup: rank ", creator, " is not in a group of ", names.size()));
  }
  return HostBackup::OpenShared(names[creator]);
}

namespace {

// Every expert of every layer into `b` through `load`.
Status LoadEvery(HostBackup& b, const RankLayout& layout, int experts, const ExpertLoader& load) {
  for (int l = 0; l < static_cast<int>(layout.layers.size()); ++l) {
    for (int e = 0; e < experts; ++e) {
      EPLBX_RETURN_IF_ERROR(b.Load(l, e, [&](const std::string& name, uint8_t* dst, uint64_t n) {
        load(l, e, name, dst, n);
      }));
    }
  }
  return Status::OK();
}

}  // namespace

Result<std::unique_ptr<HostBackup>> LoadHostBackup(const std::string& dir, const RankLayout& layout,
                                                   int experts, const ExpertLoader& load) {
  if (load == nullptr) return Status::InvalidArgument("a backup of every expert needs a loader");
  EPLBX_ASSIGN_OR_RETURN(std::unique_ptr<HostBackup> b, HostBackup::Create(dir, layout, experts));
  EPLBX_RETURN_IF_ERROR(LoadEvery(*b, layout, experts, load));
  EPLBX_RETURN_IF_ERROR(b->Unlink());
  return b;
}

Result<std::unique_ptr<HostBackup>> SetUpNodeBackup(Bootstrap& boot, const std::string& node,
                                                    const std::string& dir,
                                                    const RankLayout& layout, int experts,
                                                    const Placement& placement,
                                                    std::chrono::milliseconds timeout,
                                                    const ExpertLoader& load) {
  EPLBX_ASSIGN_OR_RETURN(std::vector<std::string> nodes, boot.AllGather(node, timeout));
  const uint32_t rank = boot.rank();
  uint32_t creator = rank;
  for (uint32_t r = 0; r < rank && r < nodes.size(); ++r) {
    if (nodes[r] == node) {
      creator = r;
      break;
    }
  }
  std::unique_ptr<HostBackup> mine;
  if (rank == creator) {
    EPLBX_ASSIGN_OR_RETURN(mine, HostBackup::Create(dir, layout, experts));
    if (load != nullptr) EPLBX_RETURN_IF_ERROR(LoadEvery(*mine, layout, experts, load));
  }
  EPLBX_ASSIGN_OR_RETURN(std::unique_ptr<HostBackup> b,
                         ShareHostBackup(boot, creator, std::move(mine), timeout));
  if (load == nullptr) EPLBX_RETURN_IF_ERROR(b->Capture(placement, layout));
  // Once every rank has its file open the name goes.
  EPLBX_RETURN_IF_ERROR(boot.Barrier(timeout));
  EPLBX_RETURN_IF_ERROR(b->Unlink());
  return b;
}

std::string HostBackup::ShareName() const { return StrCat(id_.device, ":", id_.inode, ":", path_); }

Result<std::unique_ptr<HostBackup>> HostBackup::OpenShared(const std::string& share_name) {
  const size_t a = share_name.find(':'),
               b = a == std::string::npos ? a : share_name.find(':', a + 1);
  BackupFileId id;
  auto number = [](const std::string& text, uint64_t* out) {
    if (text.empty() || text.size() > 20 ||
        text.find_first_not_of("0123456789") != std::string::npos)
      return false;
    errno = 0;
    *out = std::strtoull(text.c_str(), nullptr, 10);
    return errno == 0;
  };
  if (b == std::string::npos || !number(share_name.substr(0, a), &id.device) ||
      !number(share_name.substr(a + 1, b - a - 1), &id.inode) || b + 1 == share_name.size()) {
    return Status::Corruption(StrCat("host backup: the name shared for it, ",
                                     Printable(share_name.substr(0, 200)),
                                     ", is not DEVICE:INODE:PATH"));
  }
  return Open(share_name.substr(b + 1), id);
}

Result<std::unique_ptr<HostBackup>> HostBackup::Open(const std::string& path,
                                                     std::optional<BackupFileId> id) {
  std::unique_ptr<HostBackup> b(new HostBackup());
  b->path_ = path;
  const std::string who = b->Describe();
  b->fd_ = open(path.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC);
  if (b->fd_ < 0) {
    return Status::IoError(
        StrCat(who, ": ", Errno(),
               errno == ELOOP ? " (a link: a backup is never reached through one)" : ""));
  }
  struct stat st {};
  if (fstat(b->fd_, &st) != 0) return Status::IoError(StrCat(who, ": ", Errno()));
  if (std::string why = NotPrivate(st); !why.empty()) {
    return Status::InvalidArgument(StrCat(who, " is refused: ", why,
                                          " (remove it; the rank that creates the backup makes "
                                          "a private file of its own)"));
  }
  b->id_ = {static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)};
  if (id && (id->device != b->id_.device || id->inode != b->id_.inode)) {
    return Status::InvalidArgument(StrCat(
        who, " is refused: it is file ", b->id_.device, ":", b->id_.inode, ", not ", id->device,
        ":", id->inode, " that its creator made (replaced since it was created?)"));
  }
  const uint64_t file_bytes = static_cast<uint64_t>(st.st_size);
  if (file_bytes < kFixed) {
    return Status::Corruption(StrCat(who, ": ", file_bytes, " bytes, too short for a backup"));
  }
  std::string fixed(kFixed, '\0');
  EPLBX_RETURN_IF_ERROR(b->ReadAt(0, fixed.data(), kFixed));
  uint64_t header_bytes = 0;
  EPLBX_RETURN_IF_ERROR(b->ParseFixed(fixed, file_bytes, &header_bytes));
  std::string header(header_bytes, '\0');
  EPLBX_RETURN_IF_ERROR(b->ReadAt(kFixed, header.data(), header_bytes));
  EPLBX_RETURN_IF_ERROR(b->ParseHeader(header));
  if (b->size_ != file_bytes) {
    return Status::Corruption(StrCat(who, ": the header describes ", b->size_,
                                     " bytes but the file has ", file_bytes,
                                     " (truncated, or written by another layout)"));
  }
  return b;
}

Status HostBackup::ParseFixed(std::string_view fixed_bytes, uint64_t file_bytes,
                              uint64_t* header_bytes) const {
  const std::string who = Describe();
  internal::ByteReader fixed(fixed_bytes, who);
  std::string magic;
  uint16_t version = 0, reserved = 0;
  if (!fixed.Raw("magic", 4, &magic) || !fixed.U16("version", &version) ||
      !fixed.U16("reserved", &reserved) || !fixed.U64("header bytes", header_bytes)) {
    return fixed.status();
  }
  if (magic != std::string_view(kMagic, 4)) {
    return Status::Corruption(StrCat(who, ": not a host backup (magic ", Printable(magic), ")"));
  }
  if (version != kVersion) {
    return Status::NotSupported(
        StrCat(who, ": version ", version, "; this build reads version ", kVersion));
  }
  if (*header_bytes > kMaxHeader || kFixed + *header_bytes > file_bytes) {
    return Status::Corruption(
        StrCat(who, ": header of ", *header_bytes, " bytes in a file of ", file_bytes));
  }
  return Status::OK();
}

Status HostBackup::CheckHead(std::string_view head, uint64_t file_bytes) {
  HostBackup b;
  b.path_ = "(bytes)";
  uint64_t header_bytes = 0;
  EPLBX_RETURN_IF_ERROR(b.ParseFixed(head.substr(0, kFixed), file_bytes, &header_bytes));
  if (head.size() < kFixed + header_bytes) {
    return Status::Corruption(
        StrCat(b.Describe(), ": ", head.size(), " bytes hold no header of ", header_bytes));
  }
  EPLBX_RETURN_IF_ERROR(b.ParseHeader(head.substr(kFixed, header_bytes)));
  if (b.size_ != file_bytes) {
    return Status::Corruption(StrCat(b.Describe(), ": the header describes ", b.size_,
                                     " bytes but the file has ", file_bytes));
  }
  return Status::OK();
}

Status HostBackup::ParseHeader(std::string_view header) {
  const std::string who = Describe();
  internal::ByteReader r(header, who);
  uint32_t layers = 0, experts = 0;
  if (!r.U32("layers", &layers) || !r.U32("experts", &experts)) return r.status();
  if (experts == 0 || experts > (1u << 20) || layers > (1u << 20)) {
    return Status::Corruption(StrCat(who, ": ", layers, " layers of ", experts, " experts"));
  }
  experts_ = static_cast<int>(experts);
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
      if (dims > 16) {
        return Status::Corruption(
            StrCat(who, ": tensor ", Printable(x.name), " has ", dims, " dims"));
      }
      for (uint32_t d = 0; d < dims; ++d) {
        uint64_t v = 0;
        if (!r.U64("dim", &v)) return r.status();
        if (v > (uint64_t{1} << 40)) {
          return Status::Corruption(
              StrCat(who, ": tensor ", Printable(x.name), " has a dimension of ", v));
        }
        x.shape.push_back(static_cast<int64_t>(v));
      }
      if (!r.U64("bytes per expert", &x.bytes)) return r.status();
      x.offset = row;
      if (x.bytes == 0 || __builtin_add_overflow(row, x.bytes, &row)) {
        return Status::Corruption(
            StrCat(who, ": tensor ", Printable(x.name), " has ", x.bytes, " bytes per expert"));
      }
      tensors.push_back(std::move(x));
    }
    layers_.push_back(std::move(tensors));
    layer_row_.push_back(row);
  }
  if (r.remaining() != 0) {
    return Status::Corruption(StrCat(who, ": ", r.remaining(), " bytes after the header"));
  }
  return Layout(header.size());
}

Status HostBackup::Check() const {
  struct stat st {};
  if (fstat(fd_, &st) != 0) return Status::IoError(StrCat(Describe(), ": ", Errno()));
  if (static_cast<uint64_t>(st.st_size) != size_) {
    return Status::Corruption(StrCat(Describe(), ": it has ", st.st_size,
                                     " bytes; its header "
                                     "describes ",
                                     size_,
                                     " (cut short or grown since it was "
                                     "created: its rows cannot be trusted)"));
  }
  return Status::OK();
}

Status HostBackup::Unlink() {
  if (!owns_name_) return Status::OK();
  owns_name_ = false;
  if (unlink(path_.c_str()) != 0 && errno != ENOENT) {
    return Status::IoError(StrCat(Describe(), ": removing its name: ", Errno()));
  }
  return Status::OK();
}

std::string HostBackup::Describe() const { return StrCat("host backup '", path_, "'"); }

const HostBackup::Tensor* HostBackup::Find(int layer, const std::string& name) const {
  if (layer < 0 || static_cast<size_t>(layer) >= layers_.size()) return nullptr;
  for (const Tensor& t : layers_[layer]) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

uint64_t HostBackup::RowOffset(int layer, int expert, const Tensor& t) const {
  return layer_base_[layer] + static_cast<uint64_t>(expert) * layer_row_[layer] + t.offset;
}

uint64_t HostBackup::SumOffset(int layer, int expert, const Tensor& t) const {
  const size_t index = static_cast<size_t>(&t - layers_[layer].data());
  return sums_offset_ +
         (layer_sums_[layer] + static_cast<uint64_t>(expert) * layers_[layer].size() + index) * 8;
}

Status HostBackup::MarkHeld(int layer, int expert) {
  const uint8_t one = 1;
  return WriteAt(held_offset_ + static_cast<uint64_t>(layer) * experts_ + expert, &one, 1);
}

bool HostBackup::Holds(int layer, int expert) const {
  if (layer < 0 || static_cast<size_t>(layer) >= layers_.size() || expert < 0 ||
      expert >= experts_) {
    return false;
  }
  uint8_t held = 0;
  return ReadAt(held_offset_ + static_cast<uint64_t>(layer) * experts_ + expert, &held, 1).ok() &&
         held == 1;
}

std::string HostBackup::HeldFlags() const {
  std::string held(layers_.size() * static_cast<uint64_t>(experts_), '\0');
  if (!ReadAt(held_offset_, held.data(), held.size()).ok()) return {};  // cut short: none
  return held;
}

int64_t HostBackup::experts_held() const {
  int64_t n = 0;
  for (char c : HeldFlags()) n += c == 1;
  return n;
}

uint64_t HostBackup::held_bytes() const {
  uint64_t n = 0;
  const std::string held = HeldFlags();
  if (held.empty()) return 0;
  for (size_t l = 0; l < layers_.size(); ++l) {
    for (int e = 0; e < experts_; ++e) n += held[l * experts_ + e] == 1 ? layer_row_[l] : 0;
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
    const uint32_t slots = layout.slots(l);
    const int64_t last = (static_cast<int64_t>(layout.rank) + 1) * slots;
    if (slots > 0 && last > placement.slots()) {
      return Status::Mismatch(StrCat(who, ": slot ", last - 1, " of layer ", l,
                                     " is past the placement's ", placement.slots(), " slots"));
    }
  }
  for (size_t l = 0; l < layers_.size(); ++l) {
    const int layer = static_cast<int>(l);
    const uint32_t slots = layout.slots(l);
    for (uint32_t s = 0; s < slots; ++s) {
      const int64_t slot = static_cast<int64_t>(layout.rank) * slots + s;
      const int32_t e = placement.phy2log(layer, static_cast<int>(slot));
      if (e < 0) continue;
      for (const TensorSpec& spec : layout.layers[l]) {
        const Tensor* t = Find(layer, spec.name);
        const auto* src = reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(
            spec.base + static_cast<uint64_t>(layout.RowOf(l, s)) * spec.bytes_per_expert));
        const uint64_t sum = RowChecksum(src, t->bytes);
        EPLBX_RETURN_IF_ERROR(WriteAt(RowOffset(layer, e, *t), src, t->bytes));
        EPLBX_RETURN_IF_ERROR(WriteAt(SumOffset(layer, e, *t), &sum, sizeof(sum)));
      }
      EPLBX_RETURN_IF_ERROR(MarkHeld(layer, e));
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
  std::vector<uint8_t> row;
  for (const Tensor& t : layers_[layer]) {
    row.assign(t.bytes, 0);
    read(t.name, row.data(), t.bytes);
    const uint64_t sum = RowChecksum(row.data(), t.bytes);
    EPLBX_RETURN_IF_ERROR(WriteAt(RowOffset(layer, expert, t), row.data(), t.bytes));
    EPLBX_RETURN_IF_ERROR(WriteAt(SumOffset(layer, expert, t), &sum, sizeof(sum)));
  }
  return MarkHeld(layer, expert);
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
  uint64_t want = 0;
  EPLBX_RETURN_IF_ERROR(ReadAt(SumOffset(layer, expert, *t), &want, sizeof(want)));
  EPLBX_RETURN_IF_ERROR(ReadAt(RowOffset(layer, expert, *t), dst, t->bytes));
  if (const uint64_t got = RowChecksum(dst, t->bytes); got != want) {
    return Status::Corruption(StrCat(Describe(), ": layer ", layer, " expert ", expert, " tensor '",
                                     spec.name, "' has checksum ", Hex(got), " but ", Hex(want),
                                     " when it was captured (the backup "
                                     "changed after it was written; this row is not restored)"));
  }
  return Status::OK();
}

}  // namespace eplbx
