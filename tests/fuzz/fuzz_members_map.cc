// libFuzzer: the members' map exchange after a member-set change (serve/members_map.h): the
// input split at each "\xff\xfe" into up to 8 ranks' blobs, as the all-gather delivers them
// from peers; decoded for 2 layers of 3 rows of 5 experts.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "serve/members_map.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view in(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> all;
  while (all.size() < 8) {
    const size_t cut = in.find("\xff\xfe");
    all.emplace_back(in.substr(0, cut));
    if (cut == std::string_view::npos) break;
    in.remove_prefix(cut + 2);
  }
  (void)eplbx::internal::DecodeMembersRound(all, 2, 3, 5);
  return 0;
}
