// Traces the replay reads, turned into one shape: Mooncake records (arrival, lengths, 512-token
// prefix block ids; tools/replay/trace/mooncake_trace.h expands ids into token ids).
//
// Mooncake JSONL (kvcache-ai/Mooncake FAST'25): read as is.
// Azure LLM inference CSV (Splitwise, ISCA'24: TIMESTAMP,ContextTokens,GeneratedTokens): lengths
// only, so each request gets fresh block ids (no sharing) unless synthetic shared prefixes are
// asked for: then request i draws one of `groups` prefixes (seeded) and its first
// `prefix_tokens` tokens are that group's, like a system prompt shared by an application.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "replay/trace/mooncake_trace.h"

namespace kvrouter::replay {

using trace::TraceRecord;

enum class TraceFormat { kMooncake, kAzure };

// "mooncake" / "azure", or from the file name (.jsonl / .csv) for "auto". Throws
// std::invalid_argument for an unknown name or extension.
TraceFormat ResolveTraceFormat(const std::string& format, const std::string& path);

struct AzurePrefixOptions {
  uint32_t groups = 0;         // 0: no shared prefixes
  uint32_t prefix_tokens = 0;  // shared tokens per request (capped by its context length)
  uint64_t seed = 0;
};

// Loads a trace, sorted by arrival (stable), keeping at most max_requests (0 = all) of the
// first arrivals. Throws trace::TraceParseError naming the file and line of a bad record.
std::vector<TraceRecord> LoadReplayTrace(const std::string& path, TraceFormat format,
                                         const AzurePrefixOptions& azure, size_t max_requests);

// Removes the requests whose prompt is longer than `max_prompt_tokens` (an engine's context
// limit: it would reject them) and returns how many it removed. 0 removes nothing.
size_t RejectOverContext(std::vector<TraceRecord>& trace, uint64_t max_prompt_tokens);

// Parses Azure CSV text (header line first). `source` names it in errors.
std::vector<TraceRecord> ParseAzureCsv(std::istream& in, const std::string& source,
                                       const AzurePrefixOptions& azure);

// Token-weighted prefix hit rate of one infinite cache shared by every worker at `block_size`
// (the upper bound of any routing policy, workloads.md §7).
double InfiniteCacheHitRate(const std::vector<TraceRecord>& trace, uint32_t block_size);

}  // namespace kvrouter::replay
