// Structured logs: one JSON object per line on stderr, {"ts", "level", "msg", fields...}, so
// that a log collector needs no parser of its own. Thread-safe: the loop thread, the routing
// threads of the thread pool and the signal handlers' callbacks all log.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace kvrouterd {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

// "debug", "info", "warn" or "error"; false for anything else.
bool ParseLogLevel(std::string_view text, LogLevel* out);
const char* LogLevelName(LogLevel level);

void SetLogLevel(LogLevel level);
bool LogEnabled(LogLevel level);

// Writes one line if `level` is enabled; `fields` (an object) are added after "msg".
void Log(LogLevel level, std::string_view msg, const nlohmann::json& fields = nullptr);

// Log with one field, for libuv's callbacks, which must not throw: a line the heap refuses
// memory to is lost, not the daemon.
void LogContained(LogLevel level, std::string_view msg, std::string_view key,
                  std::string_view value) noexcept;

// The time now as RFC 3339 in UTC with milliseconds, e.g. "2026-12-02T14:00:08.123Z".
std::string Rfc3339Now();

}  // namespace kvrouterd
