// Plans the DeepSeek README example through the installed package and checks one row.
#include <cstdio>
#include <vector>

#include "eplbx/policy.h"

int main() {
  eplbx::Result<eplbx::LoadMatrix> load =
      eplbx::LoadMatrix::FromRows({{90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86},
                                   {20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27}});
  if (!load.ok()) return 1;
  eplbx::Topology topology{.ranks = 8, .nodes = 2, .slots = 16, .groups = 4};
  eplbx::Result<eplbx::Placement> placement = eplbx::Plan(*load, topology);
  if (!placement.ok()) {
    std::fprintf(stderr, "%s\n", placement.status().ToString().c_str());
    return 1;
  }
  const std::vector<int32_t> want = {5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1};
  for (int s = 0; s < 16; ++s) {
    if (placement->phy2log(0, s) != want[s]) return 1;
  }
  std::printf("consumer ok\n");
  return 0;
}
