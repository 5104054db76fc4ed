#include "replay/trace/mooncake_trace.h"

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>

namespace kvrouter::trace {
namespace {

using nlohmann::json;

std::string FormatParseError(std::string_view source, size_t line_number, std::string_view reason) {
  // Appended piece by piece: GCC 12 warns (-Wrestrict, a false positive) on ":" + a temporary.
  std::string out(source);
  out += ':';
  out += std::to_string(line_number);
  out += ": ";
  out += reason;
  return out;
}

const json& RequireKey(const json& obj, const char* key, std::string_view source, size_t line) {
  auto it = obj.find(key);
  if (it == obj.end()) {
    throw TraceParseError(source, line, std::string("missing key \"") + key + "\"");
  }
  return *it;
}

// JSON integers only: 12.0 or "12" are rejected rather than silently converted, so a trace
// from a different tool fails loudly instead of being misread.
uint64_t RequireUnsigned(const json& value, const char* what, std::string_view source,
                         size_t line) {
  if (!value.is_number_unsigned()) {
    throw TraceParseError(
        source, line,
        std::string("\"") + what + "\" must be a non-negative integer, got " + value.dump());
  }
  return value.get<uint64_t>();
}

uint64_t RequireTokenCount(const json& value, const char* what, std::string_view source,
                           size_t line) {
  const uint64_t tokens = RequireUnsigned(value, what, source, line);
  CheckTokenCount(tokens, what, source, line);
  return tokens;
}

int64_t RequireInteger(const json& value, const char* what, std::string_view source, size_t line) {
  if (!value.is_number_integer()) {
    throw TraceParseError(source, line,
                          std::string("\"") + what + "\" must be an integer, got " + value.dump());
  }
  return value.get<int64_t>();
}

std::vector<uint64_t> RequireIdArray(const json& value, std::string_view source, size_t line) {
  if (!value.is_array()) {
    throw TraceParseError(source, line, "\"hash_ids\" must be an array, got " + value.dump());
  }
  std::vector<uint64_t> ids;
  ids.reserve(value.size());
  for (const json& id : value) ids.push_back(RequireUnsigned(id, "hash_ids[]", source, line));
  return ids;
}

bool IsBlank(std::string_view line) {
  return std::all_of(line.begin(), line.end(),
                     [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; });
}

// The splitmix64 finaliser: a bijection on 64-bit values that mixes every input bit into
// every output bit, so distinct (hash_id, pair) keys give distinct, well-spread token pairs.
uint64_t Mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

constexpr uint32_t kPairsPerBlock = kMooncakeBlockTokens / 2;

uint64_t TokenPair(uint64_t hash_id, uint32_t pair) {
  return Mix64(hash_id * kPairsPerBlock + pair);
}

void CheckBlockSize(uint32_t block_size) {
  if (block_size == 0 || kMooncakeBlockTokens % block_size != 0) {
    throw std::invalid_argument("block size " + std::to_string(block_size) +
                                " does not divide the trace block of 512 tokens");
  }
}

}  // namespace

TraceParseError::TraceParseError(std::string_view source, size_t line_number,
                                 std::string_view reason)
    : std::runtime_error(FormatParseError(source, line_number, reason)),
      line_number_(line_number) {}

void CheckTokenCount(uint64_t tokens, std::string_view what, std::string_view source,
                     size_t line_number) {
  if (tokens > kMaxRequestTokens) {
    throw TraceParseError(source, line_number,
                          std::string(what) + " " + std::to_string(tokens) + " is above " +
                              std::to_string(kMaxRequestTokens) +
                              " tokens, the most a request may have");
  }
}

TraceRecord ParseTraceLine(std::string_view line, std::string_view source, size_t line_number) {
  json obj;
  try {
    obj = json::parse(line);
  } catch (const json::exception& e) {
    // Not only syntax (parse_error): a number too large for any type is out_of_range.
    throw TraceParseError(source, line_number, std::string("invalid JSON: ") + e.what());
  }
  if (!obj.is_object()) throw TraceParseError(source, line_number, "not a JSON object");
  TraceRecord record;
  record.timestamp_ms = RequireInteger(RequireKey(obj, "timestamp", source, line_number),
                                       "timestamp", source, line_number);
  record.input_length = RequireTokenCount(RequireKey(obj, "input_length", source, line_number),
                                          "input_length", source, line_number);
  record.output_length = RequireTokenCount(RequireKey(obj, "output_length", source, line_number),
                                           "output_length", source, line_number);
  record.hash_ids =
      RequireIdArray(RequireKey(obj, "hash_ids", source, line_number), source, line_number);
  return record;
}

std::vector<TraceRecord> ParseTrace(std::istream& in, std::string_view source) {
  std::vector<TraceRecord> records;
  std::string line;
  for (size_t line_number = 1; std::getline(in, line); ++line_number) {
    if (IsBlank(line)) continue;  // a trailing newline or an empty line is not a record
    records.push_back(ParseTraceLine(line, source, line_number));
  }
  if (in.bad()) throw std::runtime_error(std::string(source) + ": read error");
  return records;
}

std::vector<TraceRecord> LoadTrace(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open trace " + path);
  return ParseTrace(in, path);
}

std::string DefaultConversationTracePath() {
  return std::string(KVR_DATA_DIR) + "/mooncake/conversation_trace.jsonl";
}

size_t ExpandedLength(const TraceRecord& record) {
  const uint64_t available = record.hash_ids.size() * uint64_t{kMooncakeBlockTokens};
  return static_cast<size_t>(std::min(record.input_length, available));
}

uint32_t TraceBlockToken(uint64_t hash_id, uint32_t position) {
  const uint64_t pair = TokenPair(hash_id, position / 2);
  return static_cast<uint32_t>(position % 2 == 0 ? pair : pair >> 32);
}

std::vector<uint32_t> ExpandTokens(const TraceRecord& record, uint32_t block_size) {
  std::vector<uint32_t> tokens;
  ExpandTokensInto(record, block_size, tokens);
  return tokens;
}

void ExpandTokensInto(const TraceRecord& record, uint32_t block_size, std::vector<uint32_t>& out) {
  CheckBlockSize(block_size);
  const size_t length = ExpandedLength(record);
  out.resize(length);
  // Whole pairs are written at once; the last pair may be cut by the truncation.
  for (size_t pos = 0; pos < length; pos += 2) {
    const uint64_t hash_id = record.hash_ids[pos / kMooncakeBlockTokens];
    const uint64_t pair = TokenPair(hash_id, (pos % kMooncakeBlockTokens) / 2);
    out[pos] = static_cast<uint32_t>(pair);
    if (pos + 1 < length) out[pos + 1] = static_cast<uint32_t>(pair >> 32);
  }
}

}  // namespace kvrouter::trace
