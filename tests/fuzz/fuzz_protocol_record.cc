// libFuzzer: the rearrangement protocol record decoder, and the state machine fed with
// whatever decodes (it must never crash on a hostile peer).
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "protocol/layer_protocol.h"
#include "protocol/records.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace eplbx::protocol;
  std::string_view in(reinterpret_cast<const char*>(data), size);
  auto r = DecodeRecord(in);
  if (!r.ok()) return 0;
  if (EncodeRecord(*r) != in) __builtin_trap();
  LayerStep step;
  step.generation = r->generation;
  step.layer = r->layer;
  step.self = 0;
  step.world = 3;
  step.reads = {{1, 1}, {2, 2}};
  step.serves = {{3, 1}};
  LayerProtocol p(step, Clock::time_point{}, std::chrono::seconds(1));
  p.Start();
  bool deferred = false;
  for (uint32_t from = 0; from < 4; ++from)
    (void)p.OnRecord(from, *r, Clock::time_point{}, &deferred);
  (void)p.OnTick(Clock::time_point{} + std::chrono::seconds(2));
  return 0;
}
