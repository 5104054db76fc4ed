#include "replay/trace_source.h"

#include <algorithm>
#include <fstream>
#include <optional>
#include <random>
#include <stdexcept>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"

namespace kvrouter::replay {
namespace {

using trace::kMooncakeBlockTokens;
using trace::TraceParseError;

bool EndsWith(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() &&
         text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

uint64_t BlocksFor(uint64_t tokens) {
  return (tokens + kMooncakeBlockTokens - 1) / kMooncakeBlockTokens;
}

// Azure timestamps look like "2023-11-16 18:15:46.6805900" (UTC, sub-second digits vary).
absl::Time ParseAzureTime(absl::string_view text, const std::string& source, size_t line) {
  absl::Time time;
  std::string error;
  if (!absl::ParseTime("%Y-%m-%d %H:%M:%E*S", std::string(text), absl::UTCTimeZone(), &time,
                       &error)) {
    throw TraceParseError(source, line, "bad TIMESTAMP \"" + std::string(text) + "\": " + error);
  }
  return time;
}

uint64_t ParseCount(absl::string_view text, const char* column, const std::string& source,
                    size_t line) {
  uint64_t value = 0;
  if (!absl::SimpleAtoi(text, &value)) {
    throw TraceParseError(
        source, line,
        std::string(column) + " must be a non-negative integer, got \"" + std::string(text) + "\"");
  }
  return value;
}

// Assigns block ids: the group's shared prefix blocks first (ids below groups × prefix blocks),
// then fresh ids that no other request uses.
class AzureBlockIds {
 public:
  explicit AzureBlockIds(const AzurePrefixOptions& options)
      : options_(options),
        prefix_blocks_(BlocksFor(options.prefix_tokens)),
        next_fresh_id_(uint64_t{options.groups} * prefix_blocks_),
        random_(options.seed) {}

  std::vector<uint64_t> For(uint64_t context_tokens) {
    std::vector<uint64_t> ids;
    const uint64_t total = BlocksFor(context_tokens);
    ids.reserve(total);
    if (options_.groups > 0 && prefix_blocks_ > 0) {
      const uint64_t group = random_() % options_.groups;
      // A prefix that ends inside a block leaves that block shared only up to its end; the
      // request's own tokens then start in a fresh block, which is exact at 512-token
      // granularity when prefix_tokens is a multiple of 512 (the flag requires it).
      const uint64_t shared = std::min(prefix_blocks_, total);
      for (uint64_t b = 0; b < shared; ++b) ids.push_back(group * prefix_blocks_ + b);
    }
    while (ids.size() < total) ids.push_back(next_fresh_id_++);
    return ids;
  }

 private:
  AzurePrefixOptions options_;
  uint64_t prefix_blocks_;
  uint64_t next_fresh_id_;
  std::mt19937_64 random_;
};

}  // namespace

TraceFormat ResolveTraceFormat(const std::string& format, const std::string& path) {
  if (format == "mooncake") return TraceFormat::kMooncake;
  if (format == "azure") return TraceFormat::kAzure;
  if (format != "auto" && !format.empty()) {
    throw std::invalid_argument("unknown --format \"" + format + "\" (mooncake, azure or auto)");
  }
  if (EndsWith(path, ".jsonl") || EndsWith(path, ".json")) return TraceFormat::kMooncake;
  if (EndsWith(path, ".csv")) return TraceFormat::kAzure;
  throw std::invalid_argument("cannot tell the format of " + path +
                              " from its extension; pass --format=mooncake or --format=azure");
}

std::vector<TraceRecord> ParseAzureCsv(std::istream& in, const std::string& source,
                                       const AzurePrefixOptions& azure) {
  std::vector<TraceRecord> records;
  AzureBlockIds ids(azure);
  std::optional<absl::Time> start;
  std::string line;
  size_t line_number = 0;
  while (std::getline(in, line)) {
    ++line_number;
    const absl::string_view text = absl::StripAsciiWhitespace(line);
    if (text.empty()) continue;
    std::vector<absl::string_view> fields = absl::StrSplit(text, ',');
    if (line_number == 1) {
      if (fields.size() < 3 || fields[0] != "TIMESTAMP") {
        throw TraceParseError(source, line_number,
                              "expected the header TIMESTAMP,ContextTokens,GeneratedTokens");
      }
      continue;
    }
    if (fields.size() != 3) {
      throw TraceParseError(
          source, line_number,
          "expected 3 comma-separated fields, got " + std::to_string(fields.size()));
    }
    const absl::Time time = ParseAzureTime(fields[0], source, line_number);
    if (!start) start = time;
    TraceRecord record;
    record.timestamp_ms = absl::ToInt64Milliseconds(time - *start);
    record.input_length = ParseCount(fields[1], "ContextTokens", source, line_number);
    record.output_length = ParseCount(fields[2], "GeneratedTokens", source, line_number);
    record.hash_ids = ids.For(record.input_length);
    records.push_back(std::move(record));
  }
  if (in.bad()) throw std::runtime_error(source + ": read error");
  return records;
}

std::vector<TraceRecord> LoadReplayTrace(const std::string& path, TraceFormat format,
                                         const AzurePrefixOptions& azure, size_t max_requests) {
  std::vector<TraceRecord> records;
  if (format == TraceFormat::kMooncake) {
    records = trace::LoadTrace(path);
  } else {
    std::ifstream in(path);
    if (!in) throw std::runtime_error("cannot open trace " + path);
    records = ParseAzureCsv(in, path, azure);
  }
  std::stable_sort(records.begin(), records.end(), [](const TraceRecord& a, const TraceRecord& b) {
    return a.timestamp_ms < b.timestamp_ms;
  });
  if (max_requests > 0 && records.size() > max_requests) records.resize(max_requests);
  if (records.empty()) throw std::runtime_error(path + ": the trace has no requests");
  return records;
}

double InfiniteCacheHitRate(const std::vector<TraceRecord>& trace, uint32_t block_size) {
  // Sub-block s of trace block id h has the same tokens wherever it appears, so (h, s) names
  // an engine block as well as its hash would.
  const uint64_t per_id = kMooncakeBlockTokens / block_size;
  absl::flat_hash_set<uint64_t> seen;
  uint64_t cached = 0, total = 0;
  for (const TraceRecord& record : trace) {
    const uint64_t tokens = trace::ExpandedLength(record);
    total += tokens;
    if (tokens == 0) continue;
    // Like the engines: at least the last prompt token is always computed.
    const uint64_t usable_blocks = (tokens - 1) / block_size;
    const uint64_t full_blocks = tokens / block_size;
    bool prefix_hit = true;
    for (uint64_t b = 0; b < full_blocks; ++b) {
      const uint64_t key = record.hash_ids[b / per_id] * per_id + b % per_id;
      const bool inserted = seen.insert(key).second;
      if (inserted) prefix_hit = false;
      if (prefix_hit && b < usable_blocks) cached += block_size;
    }
  }
  return total == 0 ? 0.0 : static_cast<double>(cached) / static_cast<double>(total);
}

size_t RejectOverContext(std::vector<TraceRecord>& trace, uint64_t max_prompt_tokens) {
  if (max_prompt_tokens == 0) return 0;
  return std::erase_if(trace, [max_prompt_tokens](const TraceRecord& record) {
    return trace::ExpandedLength(record) > max_prompt_tokens;
  });
}

}  // namespace kvrouter::replay
