// Internal: the physical limits benchmarks and the demo compare against (used by the CLI
// and the Python module).
#ifndef EPLBX_SRC_TOOLS_MEASURE_H_
#define EPLBX_SRC_TOOLS_MEASURE_H_

#include <cstdint>
#include <vector>

namespace eplbx::internal {

// Single-thread memcpy GB/s (10^9 bytes/s) of 64 MiB blocks, median of 9 copies.
double MeasureMemcpyGbps();

// The fastest this machine copies each byte once: `threads` threads at the same time, each
// copying its own 64 MiB blocks with CopyBytes (streaming stores), in 4 MiB pieces as the
// copier does. Aggregate GB/s, median of 7 rounds.
double MeasureCopyLimitGbps(int threads);

// The same measurement taken again and again on the same blocks (allocated and touched once,
// 2 x 64 MiB a thread): a sample costs its rounds' copies alone, no allocation, no page
// zeroing. `eplbx demo --limit-each-step` samples it between steps.
class CopyLimitProbe {
 public:
  explicit CopyLimitProbe(int threads);
  // Aggregate GB/s, median of `rounds` rounds (at least 1).
  double Sample(int rounds);

 private:
  int threads_;
  std::vector<std::vector<uint8_t>> src_, dst_;
};

}  // namespace eplbx::internal

#endif  // EPLBX_SRC_TOOLS_MEASURE_H_
