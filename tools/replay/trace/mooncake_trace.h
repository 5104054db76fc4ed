// Mooncake traces (kvcache-ai/Mooncake FAST'25 release; shared/reference/workloads.md §1):
// loading the JSONL files and turning each request into synthetic token ids.
//
// A trace line is {"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}.
// Each hash_id names one 512-token block *and its whole prefix* (ids are chained), so two
// requests share a prefix exactly as far as their leading ids agree.
//
// Expansion (workloads.md §1.4): id h becomes 512 deterministic tokens, so at block size B it
// is 512/B engine blocks whose tokens depend only on (h, sub-block index). Equal ids give equal
// tokens, different ids give different tokens, and the request is truncated to input_length.
// Prefix sharing in the trace therefore becomes prefix sharing of block hashes at any B.
//
// Used by the benchmarks and meant for the trace-replay tool; nothing here is on a hot path.
#pragma once

#include <cstdint>
#include <istream>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace kvrouter::trace {

// Tokens per trace block (a hash_id).
inline constexpr uint32_t kMooncakeBlockTokens = 512;

// One request of a trace.
struct TraceRecord {
  int64_t timestamp_ms = 0;        // arrival, relative to the start of the trace
  uint64_t input_length = 0;       // prompt tokens
  uint64_t output_length = 0;      // generated tokens
  std::vector<uint64_t> hash_ids;  // one per 512-token prompt block, the last one partial
};

// A line that is not a valid trace record. what() names the source and the 1-based line.
class TraceParseError : public std::runtime_error {
 public:
  TraceParseError(std::string_view source, size_t line_number, std::string_view reason);
  size_t line_number() const { return line_number_; }

 private:
  size_t line_number_;
};

// Parses one JSON line. Unknown keys are ignored; the four known keys are required.
// Throws TraceParseError naming `source` and `line_number`.
TraceRecord ParseTraceLine(std::string_view line, std::string_view source = "<trace>",
                           size_t line_number = 1);

// Parses every non-blank line of `in`. Throws TraceParseError at the first bad line.
std::vector<TraceRecord> ParseTrace(std::istream& in, std::string_view source = "<trace>");

// Reads and parses a JSONL file. Throws std::runtime_error if it cannot be opened.
std::vector<TraceRecord> LoadTrace(const std::string& path);

// The bundled conversation trace, data/mooncake/conversation_trace.jsonl (KVR_DATA_DIR is set
// by the build).
std::string DefaultConversationTracePath();

// Number of prompt tokens the expansion yields: input_length, capped at 512 per hash_id
// (a trace cannot say what lies beyond its last block).
size_t ExpandedLength(const TraceRecord& record);

// The token at `position` (0..511) of trace block `hash_id`. Tokens come in pairs: positions
// 2k and 2k+1 hold the two halves of a bijective 64-bit mix of (hash_id, k), so every aligned
// token pair of every block of every id differs from all others. Hence for any even block
// size each sub-block differs from every other sub-block of any id; for block size 1 single
// tokens collide with probability ~2^-32. Values span the full uint32 range (no vocabulary).
uint32_t TraceBlockToken(uint64_t hash_id, uint32_t position);

// Token ids of the request's prompt for engine block size `block_size`, which must divide
// 512 (throws std::invalid_argument otherwise). Tokens do not depend on the block size; it
// only fixes the sub-block boundaries (sub-block s of id h = tokens [s*B, (s+1)*B) of h).
std::vector<uint32_t> ExpandTokens(const TraceRecord& record, uint32_t block_size = 16);

// Same, into `out` (cleared first) so a loop can reuse its capacity.
void ExpandTokensInto(const TraceRecord& record, uint32_t block_size, std::vector<uint32_t>& out);

}  // namespace kvrouter::trace
