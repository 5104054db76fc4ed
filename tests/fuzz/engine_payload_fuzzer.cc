// libFuzzer harness: the vLLM / SGLang msgpack decoder and its conversion to router events must
// reject, never crash on, any bytes. Seeds: the payloads of data/vectors/*_kv_events_vectors.json.
#include <cstddef>
#include <cstdint>
#include <span>

#include "wire/engine_events.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto batch = kvrouter::DecodeEnginePayload(std::span(data, size));
  if (batch.ok()) (void)kvrouter::ToKvEvents(*batch, 1, 0, 16, false, 1);
  (void)kvrouter::DecodeSequence(std::span(data, size < 8 ? size : 8));
  return 0;
}
