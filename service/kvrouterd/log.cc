#include "kvrouterd/log.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <mutex>

namespace kvrouterd {
namespace {

std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
std::mutex g_write_mutex;  // one line at a time: lines of two threads never interleave

}  // namespace

bool ParseLogLevel(std::string_view text, LogLevel* out) {
  for (LogLevel level : {LogLevel::kDebug, LogLevel::kInfo, LogLevel::kWarn, LogLevel::kError}) {
    if (text == LogLevelName(level)) {
      *out = level;
      return true;
    }
  }
  return false;
}

const char* LogLevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug:
      return "debug";
    case LogLevel::kInfo:
      return "info";
    case LogLevel::kWarn:
      return "warn";
    case LogLevel::kError:
      return "error";
  }
  return "info";
}

void SetLogLevel(LogLevel level) { g_level.store(static_cast<int>(level)); }

bool LogEnabled(LogLevel level) { return static_cast<int>(level) >= g_level.load(); }

std::string Rfc3339Now() {
  const auto now = std::chrono::system_clock::now();
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count();
  const std::time_t seconds = static_cast<std::time_t>(ms / 1000);
  std::tm utc{};
  gmtime_r(&seconds, &utc);
  char text[64];  // room for any int the format could take, so no truncation warning
  std::snprintf(text, sizeof text, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", utc.tm_year + 1900,
                utc.tm_mon + 1, utc.tm_mday, utc.tm_hour, utc.tm_min, utc.tm_sec,
                static_cast<int>(ms % 1000));
  return text;
}

void Log(LogLevel level, std::string_view msg, const nlohmann::json& fields) {
  if (!LogEnabled(level)) return;
  nlohmann::ordered_json line;
  line["ts"] = Rfc3339Now();
  line["level"] = LogLevelName(level);
  line["msg"] = msg;
  if (fields.is_object()) {
    for (const auto& [key, value] : fields.items()) line[key] = value;
  }
  // Invalid UTF-8 (a client's bytes in a field) is replaced rather than thrown on.
  const std::string text = line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  std::lock_guard<std::mutex> lock(g_write_mutex);
  std::fprintf(stderr, "%s\n", text.c_str());
  std::fflush(stderr);
}

void LogContained(LogLevel level, std::string_view msg, std::string_view key,
                  std::string_view value) noexcept {
  try {
    Log(level, msg, {{std::string(key), std::string(value)}});
  } catch (...) {
  }
}

}  // namespace kvrouterd
