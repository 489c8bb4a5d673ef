// Internal: the physical limits the CLI's benchmarks and demo compare against.
#ifndef EPLBX_SRC_CLI_MEASURE_H_
#define EPLBX_SRC_CLI_MEASURE_H_

namespace eplbx::cli {

// Single-thread memcpy GB/s (10^9 bytes/s) of 64 MiB blocks, median of 9 copies.
double MeasureMemcpyGbps();

}  // namespace eplbx::cli

#endif  // EPLBX_SRC_CLI_MEASURE_H_
