// Writing the Prometheus text exposition format (version 0.0.4): one metric family's HELP and
// TYPE lines, then its samples, each with escaped label values.
#pragma once

#include <absl/strings/str_cat.h>
#include <absl/strings/str_format.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>

namespace kvrouter::capi {

class PrometheusText {
 public:
  using Labels = std::initializer_list<std::pair<std::string_view, std::string_view>>;

  // The HELP and TYPE lines that open a metric family.
  void Family(std::string_view name, std::string_view type, std::string_view help) {
    // std::string_view is not absl::string_view in Debian's Abseil: plain appends.
    out_.append("# HELP ").append(name).append(" ").append(help);
    out_.append("\n# TYPE ").append(name).append(" ").append(type).append("\n");
  }
  void Sample(std::string_view name, Labels labels, uint64_t value) {
    Name(name, labels);
    absl::StrAppend(&out_, " ", value, "\n");
  }
  void Sample(std::string_view name, Labels labels, int64_t value) {
    Name(name, labels);
    absl::StrAppend(&out_, " ", value, "\n");
  }
  void Sample(std::string_view name, Labels labels, double value) {
    Name(name, labels);
    absl::StrAppendFormat(&out_, " %.9g\n", value);
  }
  // A family of one unlabelled sample.
  template <typename T>
  void Scalar(std::string_view name, std::string_view type, std::string_view help, T value) {
    Family(name, type, help);
    Sample(name, {}, value);
  }

  std::string Take() && { return std::move(out_); }

 private:
  void Name(std::string_view name, Labels labels) {
    out_.append(name);
    if (labels.size() == 0) return;
    char separator = '{';
    for (const auto& [label, value] : labels) {
      out_.push_back(separator);
      out_.append(label).append("=\"");
      AppendEscaped(value);
      out_.push_back('"');
      separator = ',';
    }
    out_.push_back('}');
  }
  // Label values escape backslash, double quote and line feed (the format's only escapes).
  void AppendEscaped(std::string_view value) {
    for (char c : value) {
      if (c == '\\' || c == '"') {
        out_.push_back('\\');
        out_.push_back(c);
      } else if (c == '\n') {
        out_.append("\\n");
      } else {
        out_.push_back(c);
      }
    }
  }

  std::string out_;
};

}  // namespace kvrouter::capi
