// libFuzzer harness: a trace file given to the replay tool (`kvrouter replay --trace`), Mooncake
// JSONL or Azure CSV (the first byte picks which, and the Azure shared-prefix options). A bad
// file must be refused with a TraceParseError naming its line, never crash, hang or throw
// anything else; a good one's records must expand into tokens and feed the replay's statistics.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>

#include "replay/trace/mooncake_trace.h"
#include "replay/trace_source.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvrouter;
  if (size == 0) return 0;
  const uint8_t selector = data[0];
  std::istringstream in(std::string(reinterpret_cast<const char*>(data + 1), size - 1));
  std::vector<trace::TraceRecord> records;
  try {
    if (selector & 1) {
      const replay::AzurePrefixOptions azure{.groups = static_cast<uint32_t>(selector >> 4),
                                             .prefix_tokens = (selector >> 1 & 7u) * 100,
                                             .seed = selector};
      records = replay::ParseAzureCsv(in, "<fuzz>", azure);
    } else {
      records = trace::ParseTrace(in, "<fuzz>");
    }
  } catch (const trace::TraceParseError& e) {
    if (e.line_number() == 0) {
      std::fprintf(stderr, "a parse error without its line: %s\n", e.what());
      std::abort();
    }
    return 0;
  }
  // What the replay does with a trace it accepted: its cache bound, and every prompt's tokens.
  // Not for a trace whose prompts come to more than kMostExpandedTokens: records may declare
  // up to 2^24 tokens each (the parser's limit, which the parsing above checks), and expanding
  // and hashing millions of tokens is the same loop over and over, 1-2 s an input under the
  // sanitizers; such inputs were most of this harness's time in long runs.
  constexpr uint64_t kMostExpandedTokens = uint64_t{1} << 18;
  uint64_t expanded = 0;
  for (const trace::TraceRecord& record : records) expanded += trace::ExpandedLength(record);
  if (expanded > kMostExpandedTokens) return 0;
  (void)replay::InfiniteCacheHitRate(records, 16);
  std::vector<uint32_t> tokens;
  for (const trace::TraceRecord& record : records) {
    trace::ExpandTokensInto(record, 16, tokens);
    if (tokens.size() != trace::ExpandedLength(record)) std::abort();
  }
  (void)replay::RejectOverContext(records, 4096);
  return 0;
}
