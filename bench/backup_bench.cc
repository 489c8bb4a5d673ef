// The host backup's checksum cost, against the copy it guards, in the same run; prints JSON.
//   build/bin/eplbx_backup_bench [--mib 1024] [--row-mib 16] [--dir /dev/shm]
//
// Rows of --row-mib MiB, --mib MiB in all, one layer of one tensor:
//   memcpy_gbps      : one core copying the rows (the physical limit of a single-threaded
//                      capture or restore);
//   checksum_gbps    : XXH3-64 over the rows (RowChecksum), and its cost per GiB;
//   capture_gbps     : HostBackup::Capture (checksum + pwrite into the backup file);
//   restore_gbps     : HostBackup::ReadRow (pread + checksum check), every row;
//   restore_unchecked_gbps : the same preads without the check (what the check costs).
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "eplbx/backup.h"
#include "eplbx/placement.h"

namespace {

double Seconds(const std::chrono::steady_clock::time_point& t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The best of three runs of `f`, in seconds.
template <typename F>
double Best(F&& f) {
  double best = 1e30;
  for (int i = 0; i < 3; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best, Seconds(t0));
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t mib = 1024, row_mib = 16;
  std::string dir = "/dev/shm";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--mib")
      mib = std::stoull(argv[i + 1]);
    else if (flag == "--row-mib")
      row_mib = std::stoull(argv[i + 1]);
    else if (flag == "--dir")
      dir = argv[i + 1];
    else {
      std::fprintf(stderr, "usage: eplbx_backup_bench [--mib N] [--row-mib N] [--dir DIR]\n");
      return 2;
    }
  }
  using namespace eplbx;
  const uint64_t row = row_mib << 20;
  const int experts = static_cast<int>(std::max<uint64_t>(1, mib / row_mib));
  const uint64_t total = row * static_cast<uint64_t>(experts);
  std::vector<uint8_t> weights(total), copy(total);
  for (uint64_t i = 0; i < total; i += 8) {
    const uint64_t v = i * 0x9E3779B97F4A7C15ull;
    std::memcpy(&weights[i], &v, std::min<uint64_t>(8, total - i));
  }
  const double memcpy_s = Best([&] { std::memcpy(copy.data(), weights.data(), total); });
  volatile uint64_t sink = 0;
  const double sum_s = Best([&] {
    for (int e = 0; e < experts; ++e) sink = sink + RowChecksum(&weights[e * row], row);
  });
  RankLayout layout;
  layout.rank = 0;
  layout.layers = {{TensorSpec{"w",
                               "u8",
                               {static_cast<int64_t>(row)},
                               reinterpret_cast<uintptr_t>(weights.data()),
                               row,
                               static_cast<uint32_t>(experts)}}};
  std::vector<int32_t> map;
  for (int e = 0; e < experts; ++e) map.push_back(e);
  Result<Placement> placement = Placement::FromPhy2Log(1, experts, experts, map);
  Result<std::unique_ptr<HostBackup>> backup = HostBackup::Create(dir, layout, experts);
  if (!placement.ok() || !backup.ok()) {
    std::fprintf(stderr, "eplbx_backup_bench: %s\n",
                 (placement.ok() ? backup.status() : placement.status()).ToString().c_str());
    return 1;
  }
  Status captured;
  const double capture_s = Best([&] { captured = (*backup)->Capture(*placement, layout); });
  Status restored;
  const double restore_s = Best([&] {
    for (int e = 0; e < experts && restored.ok(); ++e)
      restored = (*backup)->ReadRow(0, e, layout.layers[0][0], &copy[e * row]);
  });
  const int fd = open((*backup)->path().c_str(), O_RDONLY | O_CLOEXEC);
  const uint64_t base = (*backup)->bytes() - total;  // the rows are the file's last bytes
  const double plain_s = Best([&] {
    for (int e = 0; e < experts; ++e)
      sink = sink + static_cast<uint64_t>(pread(fd, &copy[e * row], row, base + e * row));
  });
  close(fd);
  if (!captured.ok() || !restored.ok() || std::memcmp(copy.data(), weights.data(), total) != 0) {
    std::fprintf(stderr, "eplbx_backup_bench: %s\n",
                 !captured.ok()   ? captured.ToString().c_str()
                 : !restored.ok() ? restored.ToString().c_str()
                                  : "the restored rows differ from the weights");
    return 1;
  }
  const double gb = static_cast<double>(total) / 1e9, gib = static_cast<double>(total) / (1 << 30);
  std::printf(
      "{\"bytes\": %llu, \"row_bytes\": %llu, \"checksum\": \"xxh3-64\",\n"
      " \"memcpy_gbps\": %.2f, \"checksum_gbps\": %.2f, \"checksum_s_per_gib\": %.4f,\n"
      " \"capture_gbps\": %.2f, \"restore_gbps\": %.2f, \"restore_unchecked_gbps\": %.2f,\n"
      " \"check_cost_ratio\": %.3f}\n",
      static_cast<unsigned long long>(total), static_cast<unsigned long long>(row), gb / memcpy_s,
      gb / sum_s, sum_s / gib, gb / capture_s, gb / restore_s, gb / plain_s, restore_s / plain_s);
  return 0;
}
