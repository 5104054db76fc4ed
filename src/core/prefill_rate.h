// How fast each rank works through its prefill backlog, learnt online from the prefill
// completions the gateway already reports (the predicted-TTFT cost, selector.h).
//
// A rank is modelled as a first-come-first-served server of prompt tokens: a request booked
// when the rank still had B prompt tokens to prefill, and bringing U uncached tokens of its own,
// gets its first token after (B + U) / rate seconds. Each completion is one sample
// (work = B + U, time = booking to first token); the rate is the ratio of the samples' decayed
// sums, so long prefills weigh more than short ones, as they should in a rate. B counts the
// whole prompt of a request that is already half prefilled: the prediction uses the same B, so
// the bias cancels.
//
// A rank with few samples borrows from the fleet: its rate is
//   (work_r + k · mean_work_fleet) / (time_r + k · mean_time_fleet),   k = kFleetPriorSamples,
// the fleet's rate weighted as k samples of its own. Before any sample at all, the fleet's rate
// is the configured prior (0 = unknown: every rank is assumed equally fast).
//
// Thread-safety: none (ActiveSequences owns these under the router's admission gate).
#pragma once

#include <cstdint>

namespace kvrouter {

// Decayed sums of (work, time) samples: each sample multiplies the old sums by `keep`.
class RateSamples {
 public:
  explicit RateSamples(double keep) : keep_(keep) {}
  void Add(double work_tokens, double seconds) {
    work_ = work_ * keep_ + work_tokens;
    seconds_ = seconds_ * keep_ + seconds;
    weight_ = weight_ * keep_ + 1;
  }
  double work() const { return work_; }
  double seconds() const { return seconds_; }
  double weight() const { return weight_; }  // decayed sample count
  bool empty() const { return weight_ == 0; }

 private:
  double keep_;
  double work_ = 0;
  double seconds_ = 0;
  double weight_ = 0;
};

class PrefillRates {
 public:
  // A rank's own window is about 16 completions, the fleet's about 256: a rank's speed follows
  // its batch quickly, the fleet's default changes slowly.
  static constexpr double kRankKeep = 1 - 1.0 / 16;
  static constexpr double kFleetKeep = 1 - 1.0 / 256;
  static constexpr double kFleetPriorSamples = 4;

  // `prior_tokens_per_second`: the fleet's rate before its first sample; 0 = unknown.
  explicit PrefillRates(double prior_tokens_per_second = 0) : prior_(prior_tokens_per_second) {}

  // One completion on a rank (its samples) and the fleet. Samples without work or time carry
  // no rate and are ignored.
  void Add(RateSamples& rank, double work_tokens, double seconds) {
    if (!(work_tokens > 0) || !(seconds > 0)) return;
    rank.Add(work_tokens, seconds);
    fleet_.Add(work_tokens, seconds);
  }

  // The rank's rate in tokens per second; 0 when neither it, the fleet nor the prior knows one.
  double RateOf(const RateSamples& rank) const {
    if (fleet_.empty()) return prior_;
    const double k = kFleetPriorSamples / fleet_.weight();
    return (rank.work() + k * fleet_.work()) / (rank.seconds() + k * fleet_.seconds());
  }
  double fleet_rate() const { return fleet_.empty() ? prior_ : fleet_.work() / fleet_.seconds(); }

  static RateSamples NewRank() { return RateSamples(kRankKeep); }

 private:
  double prior_;
  RateSamples fleet_{kFleetKeep};
};

}  // namespace kvrouter
