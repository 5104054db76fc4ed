// How fast the fleet works through prefill backlogs, learnt online from the prefill completions
// the gateway already reports (the predicted-TTFT cost, selector.h).
//
// A rank is modelled as a first-come-first-served server of prompt tokens: a request booked
// when the rank still had B prompt tokens to prefill, and bringing U uncached tokens of its own,
// gets its first token after (B + U) / rate seconds. Each completion is one sample
// (work = B + U, time = booking to first token); the rate is the ratio of the samples' sums,
// each sample multiplying the old sums by kKeep (a window of about 256 completions), so long
// prefills weigh more than short ones, as they should in a rate. B counts the whole prompt of a
// request that is already half prefilled: the prediction uses the same B, so the bias cancels.
// Before the first sample the rate is the configured prior (0 = unknown).
//
// One rate for the fleet, not one per rank: per-rank rates (windows of 16 to 256 completions,
// shrunk towards the fleet's) were measured worse on every trace of docs/replay.md. A sample's
// time includes a fixed latency (the step that emits the first token) that dominates small
// prefills, so a rank's ratio depends on the sizes of the prompts routed to it; at light load
// that bias, not speed, then decided between ranks holding the same prefix and herded requests.
//
// Thread-safety: none (ActiveSequences owns it under the router's admission gate).
#pragma once

namespace kvrouter {

class PrefillRate {
 public:
  static constexpr double kKeep = 1 - 1.0 / 256;

  // `prior_tokens_per_second`: the rate before the first sample; 0 = unknown.
  explicit PrefillRate(double prior_tokens_per_second = 0) : prior_(prior_tokens_per_second) {}

  // One completion. Samples without work or time carry no rate and are ignored.
  void Add(double work_tokens, double seconds) {
    if (!(work_tokens > 0) || !(seconds > 0)) return;
    work_ = work_ * kKeep + work_tokens;
    seconds_ = seconds_ * kKeep + seconds;
  }

  // Tokens per second; 0 when neither a sample nor the prior gives one.
  double tokens_per_second() const { return seconds_ > 0 ? work_ / seconds_ : prior_; }

 private:
  double prior_;
  double work_ = 0;
  double seconds_ = 0;
};

}  // namespace kvrouter
