// KV event ingestion through the C ABI: the ingest object over kvrouter::IngestService. In a
// build without a transport (KVR_WITH_ZMQ, KVR_WITH_NATS), its functions return KVR_UNIMPLEMENTED.
#include <algorithm>

#include "capi_internal.h"
#include "ingest/ingest_service.h"
#include "prometheus_text.h"
#include "wire/flatbuffers_codec.h"

using namespace kvrouter::capi;

struct kvr_ingest {
  std::unique_ptr<kvrouter::IngestService> service;
  const kvr_router* router;  // outlives the ingest (kvr_ingest_new)
};

namespace {

// KVR_UNIMPLEMENTED, naming the build option, when this build has no such transport: first,
// whatever the arguments, so that a caller learns what is missing rather than what it passed.
kvr_status CheckTransport(kvr_error** err, kvrouter::IngestTransport transport) {
  return FromStatus(err, kvrouter::TransportAvailable(transport));
}

kvr_status CheckIngest(kvr_error** err, const kvr_ingest* ingest) {
  if (kvr_status s = CheckTransport(err, kvrouter::IngestTransport::kLoop)) return s;
  return RequireNonNull(err, ingest, "ingest");
}

// As BindRouterOptions (router.cc): the fields kvr_ingest_options shares with the core's
// IngestOptions, for the C defaults (core to C) and kvr_ingest_new (C to core).
template <typename COptions, typename CoreOptions, typename Bind>
void BindIngestOptions(COptions& c, CoreOptions& core, Bind&& bind) {
  bind(c.max_frame_bytes, core.max_frame_bytes);
  bind(c.replay_timeout_ms, core.replay_timeout_ms);
  bind(c.replica_heartbeat_ms, core.replica_heartbeat_ms);
  bind(c.replica_timeout_ms, core.replica_timeout_ms);
}

kvr_ingest_stats ToCStats(const kvrouter::IngestStats& s) {
  kvr_ingest_stats out = Defaults<kvr_ingest_stats>();
  out.state_unknown = static_cast<uint32_t>(s.state_unknown);
  out.messages = s.messages;
  out.events_applied = s.events_applied;
  for (int i = 0; i < kvrouter::kNumIngestRejects; ++i) out.rejected[i] = s.rejected[i];
  out.gaps = s.gaps;
  out.missed_messages = s.missed_messages;
  out.restarts = s.restarts;
  out.recoveries = s.recoveries;
  out.connections = s.connections;
  out.lag_samples = s.lag_samples;
  out.lag_total_us = s.lag_total_us;
  out.lag_max_us = s.lag_max_us;
  out.lag_last_us = s.lag_last_us;
  out.published = s.published;
  out.publish_failures = s.publish_failures;
  // Cut to fit with its NUL, not inside a UTF-8 sequence (an engine's tag may be any text).
  size_t n = std::min(s.last_reject.size(), sizeof out.last_reject - 1);
  if (n < s.last_reject.size()) {
    while (n > 0 && (static_cast<unsigned char>(s.last_reject[n]) & 0xC0) == 0x80) --n;
  }
  std::memcpy(out.last_reject, s.last_reject.data(), n);
  out.last_reject[n] = '\0';
  out.stream_sequence = s.stream_sequence;
  out.consumer_remakes = s.consumer_remakes;
  out.consumer_remake_failures = s.consumer_remake_failures;
  out.events_ignored = s.events_ignored;
  out.bookings_trimmed = s.bookings_trimmed;
  return out;
}

std::string_view SourceKindName(kvrouter::IngestSourceKind kind) {
  switch (kind) {
    case kvrouter::IngestSourceKind::kListener:
      return "listener";
    case kvrouter::IngestSourceKind::kEngine:
      return "engine";
    case kvrouter::IngestSourceKind::kNats:
      return "nats";
    case kvrouter::IngestSourceKind::kReplicas:
      return "replicas";
    case kvrouter::IngestSourceKind::kJetStream:
      return "jetstream";
    case kvrouter::IngestSourceKind::kJetStreamRelay:
      return "jetstream_relay";
  }
  return "unknown";
}

// One family: its HELP and TYPE, then a sample per source from `value_of(stats)`.
template <typename ValueOf>
void AppendPerSource(PrometheusText& text, const std::vector<kvrouter::IngestSource>& sources,
                     std::string_view name, std::string_view type, std::string_view help,
                     ValueOf value_of) {
  text.Family(name, type, help);
  for (const kvrouter::IngestSource& source : sources) {
    const std::string id = absl::StrCat(source.id);
    text.Sample(
        name,
        {{"source_id", id}, {"kind", SourceKindName(source.kind)}, {"endpoint", source.endpoint}},
        value_of(source.stats));
  }
}

std::string RenderIngestPrometheus(const kvrouter::IngestService& service) {
  using Stats = kvrouter::IngestStats;
  const std::vector<kvrouter::IngestSource> sources = service.Sources();
  PrometheusText text;
  const auto counter = [&](std::string_view name, std::string_view help, auto value_of) {
    AppendPerSource(text, sources, name, "counter", help, value_of);
  };
  counter("kvrouter_ingest_messages_total", "Frames or ZMQ messages received.",
          [](const Stats& s) { return s.messages; });
  counter("kvrouter_ingest_events_applied_total", "KV events applied to the index.",
          [](const Stats& s) { return s.events_applied; });
  text.Family("kvrouter_ingest_rejected_total", "counter",
              "Messages or events not applied, by reason.");
  for (const kvrouter::IngestSource& source : sources) {
    const std::string id = absl::StrCat(source.id);
    for (int r = 0; r < kvrouter::kNumIngestRejects; ++r) {
      text.Sample("kvrouter_ingest_rejected_total",
                  {{"source_id", id},
                   {"kind", SourceKindName(source.kind)},
                   {"endpoint", source.endpoint},
                   {"reason", kvrouter::IngestRejectName(static_cast<kvrouter::IngestReject>(r))}},
                  source.stats.rejected[r]);
    }
  }
  counter("kvrouter_ingest_gaps_total", "Sequence jumps forward (messages lost in transit).",
          [](const Stats& s) { return s.gaps; });
  counter("kvrouter_ingest_missed_messages_total", "Messages lost in those jumps.",
          [](const Stats& s) { return s.missed_messages; });
  counter("kvrouter_ingest_restarts_total", "Publisher restarts recognised.",
          [](const Stats& s) { return s.restarts; });
  counter("kvrouter_ingest_recoveries_total",
          "Worker ranks cleared because their state was lost (gap or restart).",
          [](const Stats& s) { return s.recoveries; });
  counter("kvrouter_ingest_connections_total",
          "Stream connections accepted; NATS connections and reconnections.",
          [](const Stats& s) { return s.connections; });
  counter("kvrouter_ingest_consumer_remakes_total",
          "JetStream: the consumer made again because deliveries were lost on the way (they "
          "come again from the new one); core NATS and replica sync: the connection made again "
          "after the client gave it up.",
          [](const Stats& s) { return s.consumer_remakes; });
  counter("kvrouter_ingest_consumer_remake_failures_total",
          "Attempts to make a JetStream consumer or a NATS connection again that failed and "
          "were retried.",
          [](const Stats& s) { return s.consumer_remake_failures; });
  counter("kvrouter_ingest_events_ignored_total",
          "Engine events of KV-cache groups neither full attention nor a sized sliding window "
          "(hybrid models), not indexed by design.",
          [](const Stats& s) { return s.events_ignored; });
  AppendPerSource(text, sources, "kvrouter_ingest_stream_sequence", "gauge",
                  "JetStream: the stream sequence of the last message applied (0 for other "
                  "sources): a snapshot taken after reading it holds the stream up to there.",
                  [](const Stats& s) { return s.stream_sequence; });
  AppendPerSource(text, sources, "kvrouter_ingest_state_unknown_ranks", "gauge",
                  "Worker ranks whose state was lost and is not yet re-established, or whose "
                  "engine connection dropped and no message of the next one was judged yet.",
                  [](const Stats& s) { return s.state_unknown; });
  // The lag as a summary without quantiles: its sum and count give the mean over any window.
  text.Family("kvrouter_ingest_lag_seconds", "summary",
              "From a message's publication to its events applied, for messages that carry "
              "their publication time.");
  for (const kvrouter::IngestSource& source : sources) {
    const std::string id = absl::StrCat(source.id);
    const PrometheusText::Labels labels = {
        {"source_id", id}, {"kind", SourceKindName(source.kind)}, {"endpoint", source.endpoint}};
    text.Sample("kvrouter_ingest_lag_seconds_sum", labels, source.stats.lag_total_us / 1e6);
    text.Sample("kvrouter_ingest_lag_seconds_count", labels, source.stats.lag_samples);
  }
  AppendPerSource(text, sources, "kvrouter_ingest_lag_max_seconds", "gauge",
                  "The largest lag seen.", [](const Stats& s) { return s.lag_max_us / 1e6; });
  AppendPerSource(text, sources, "kvrouter_ingest_lag_last_seconds", "gauge",
                  "The most recent message's lag.",
                  [](const Stats& s) { return s.lag_last_us / 1e6; });
  counter("kvrouter_ingest_published_total", "Replica sync: booking changes published.",
          [](const Stats& s) { return s.published; });
  counter("kvrouter_ingest_publish_failures_total",
          "Replica sync: publications the NATS client refused.",
          [](const Stats& s) { return s.publish_failures; });
  counter("kvrouter_ingest_bookings_trimmed_total",
          "Replica sync: publications of a booking with only its leading block ids (the "
          "transport's messages too short for them all).",
          [](const Stats& s) { return s.bookings_trimmed; });
  return std::move(text).Take();
}

// A kvr_jetstream_source, checked and converted; `id` receives the source id of `connect`'s
// result.
template <typename Connect>
kvr_status WithJetStream(kvr_error** err, kvr_ingest* ingest, const kvr_jetstream_source* source,
                         uint64_t* source_id, Connect connect) {
  if (kvr_status s = CheckTransport(err, kvrouter::IngestTransport::kNats)) return s;
  if (kvr_status s = CheckIngest(err, ingest)) return s;
  if (kvr_status s = RequireNonNull(err, source, "source")) return s;
  kvr_jetstream_source in;
  if (kvr_status s = ReadVersioned(err, source, in)) return s;
  if (kvr_status s = RequireNonNull(err, in.url, "source->url")) return s;
  if (kvr_status s = RequireNonNull(err, in.stream, "source->stream")) return s;
  if (kvr_status s = RequireNonNull(err, in.subject, "source->subject")) return s;
  if (kvr_status s =
          CheckFlags(err, in.flags, kKnownJetstreamFlags, "kvr_jetstream_source.flags")) {
    return s;
  }
  const kvrouter::JetStreamSource config{
      .url = in.url,
      .stream = in.stream,
      .subject = in.subject,
      .durable = std::string(OrEmpty(in.durable)),
      .start_sequence = in.start_sequence,
      .resume = (in.flags & KVR_JETSTREAM_RESUME) != 0,
      .create_stream = (in.flags & KVR_JETSTREAM_CREATE_STREAM) != 0,
      .max_age_seconds = in.max_age_seconds,
      .max_bytes = in.max_bytes};
  absl::StatusOr<uint64_t> id = connect(*ingest->service, config);
  if (!id.ok()) return FromStatus(err, id.status());
  if (source_id != nullptr) *source_id = *id;
  return KVR_OK;
}

}  // namespace

namespace kvrouter::capi {

template <>
kvr_ingest_options Defaults() noexcept {
  const kvrouter::IngestOptions core;
  kvr_ingest_options c{};
  c.struct_size = sizeof c;
  BindIngestOptions(c, core, [](auto& c_field, const auto& core_field) { c_field = core_field; });
  return c;
}

template <>
kvr_jetstream_source Defaults() noexcept {
  const kvrouter::JetStreamSource core;
  kvr_jetstream_source c{};
  c.struct_size = sizeof c;
  c.start_sequence = core.start_sequence;
  c.max_age_seconds = core.max_age_seconds;
  c.max_bytes = core.max_bytes;
  return c;
}

template <>
kvr_engine_worker Defaults() noexcept {
  const kvrouter::EngineWorker core;
  kvr_engine_worker c{};
  c.struct_size = sizeof c;
  c.engine = KVR_ENGINE_VLLM;
  BindWorkerRanks(c, core, [](auto& c_field, const auto& core_field) { c_field = core_field; });
  return c;
}

}  // namespace kvrouter::capi

extern "C" {

KVR_API kvr_status kvr_ingest_options_init(kvr_ingest_options* options, size_t size) {
  return InitVersioned(options, size);
}

KVR_API kvr_status kvr_ingest_new(kvr_router* router, const kvr_ingest_options* opts,
                                  kvr_ingest** out, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckTransport(err, kvrouter::IngestTransport::kLoop)) return s;
    if (kvr_status s = CheckRouter(err, router)) return s;
    if (kvr_status s = RequireNonNull(err, out, "out")) return s;
    kvr_ingest_options in;
    if (kvr_status s = ReadVersioned(err, opts, in)) return s;
    kvrouter::IngestOptions options;
    BindIngestOptions(in, options,
                      [](const auto& c_field, auto& core_field) { core_field = c_field; });
    auto service = kvrouter::IngestService::Create(router->router.get(), options);
    if (!service.ok()) return FromStatus(err, service.status());
    *out = new kvr_ingest{std::move(*service), router};
    return KVR_OK;
  });
}

KVR_API kvr_status kvr_ingest_start(kvr_ingest* ingest, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckIngest(err, ingest)) return s;
    return FromStatus(err, ingest->service->Start());
  });
}

KVR_API kvr_status kvr_ingest_stop(kvr_ingest* ingest, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckIngest(err, ingest)) return s;
    ingest->service->Stop();
    return KVR_OK;
  });
}

KVR_API void kvr_ingest_free(kvr_ingest* ingest) {
  try {
    delete ingest;
  } catch (...) {  // nothing may unwind into C
  }
}

KVR_API kvr_status kvr_ingest_listen(kvr_ingest* ingest, const char* endpoint, uint64_t* source_id,
                                     char* bound, size_t cap, size_t* len, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckIngest(err, ingest)) return s;
    if (kvr_status s = RequireNonNull(err, endpoint, "endpoint")) return s;
    if (cap > 0 && bound == nullptr) return RequireNonNull(err, bound, "bound");
    std::string bound_endpoint;
    auto id = ingest->service->Listen(endpoint, &bound_endpoint);
    if (!id.ok()) return FromStatus(err, id.status());
    if (source_id != nullptr) *source_id = *id;
    const size_t needed = bound_endpoint.size() + 1;
    if (len != nullptr) *len = needed;
    if (cap > 0 && cap < needed) {
      return Fail(err, KVR_BUFFER_TOO_SMALL,
                  "the bound endpoint needs " + std::to_string(needed) + " bytes");
    }
    if (cap > 0) std::memcpy(bound, bound_endpoint.c_str(), needed);
    return KVR_OK;
  });
}

KVR_API kvr_status kvr_ingest_source_endpoint(kvr_ingest* ingest, uint64_t source_id, char* buf,
                                              size_t cap, size_t* len, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckIngest(err, ingest)) return s;
    auto endpoint = ingest->service->Endpoint(source_id);
    if (!endpoint.ok()) return FromStatus(err, endpoint.status());
    return CopyOutString(err, *endpoint, buf, cap, len, "source endpoint");
  });
}

KVR_API kvr_status kvr_engine_worker_init(kvr_engine_worker* worker, size_t size) {
  return InitVersioned(worker, size);
}

KVR_API kvr_status kvr_ingest_add_engine_worker(kvr_ingest* ingest, const kvr_engine_worker* worker,
                                                uint64_t* source_id, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckTransport(err, kvrouter::IngestTransport::kZmq)) return s;
    if (kvr_status s = CheckIngest(err, ingest)) return s;
    if (kvr_status s = RequireNonNull(err, worker, "worker")) return s;
    kvr_engine_worker in;
    if (kvr_status s = ReadVersioned(err, worker, in)) return s;
    if (kvr_status s = RequireNonNull(err, in.endpoint, "worker->endpoint")) return s;
    if (kvr_status s =
            CheckValue(err, KnownEngine, in.engine, "kvr_engine_worker.engine", "KVR_ENGINE_*")) {
      return s;
    }
    if (kvr_status s = CheckFlags(err, in.flags, KVR_STORED_EAGLE, "kvr_engine_worker.flags")) {
      return s;
    }
    kvrouter::EngineWorker config;
    config.endpoint = in.endpoint;
    BindWorkerRanks(in, config,
                    [](const auto& c_field, auto& core_field) { core_field = c_field; });
    config.topic = std::string(OrEmpty(in.topic));
    config.eagle = (in.flags & KVR_STORED_EAGLE) != 0;
    config.replay_endpoint = std::string(OrEmpty(in.replay_endpoint));
    auto id = ingest->service->AddEngineWorker(config);
    if (!id.ok()) return FromStatus(err, id.status());
    if (source_id != nullptr) *source_id = *id;
    return KVR_OK;
  });
}

KVR_API kvr_status kvr_ingest_remove_engine_worker(kvr_ingest* ingest, uint64_t worker_id,
                                                   int clear_index, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckTransport(err, kvrouter::IngestTransport::kZmq)) return s;
    if (kvr_status s = CheckIngest(err, ingest)) return s;
    return FromStatus(err, ingest->service->RemoveEngineWorker(worker_id, clear_index != 0));
  });
}

KVR_API kvr_status kvr_ingest_subscribe_nats(kvr_ingest* ingest, const char* url,
                                             const char* subject, uint64_t* source_id,
                                             kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckTransport(err, kvrouter::IngestTransport::kNats)) return s;
    if (kvr_status s = CheckIngest(err, ingest)) return s;
    if (kvr_status s = RequireNonNull(err, url, "url")) return s;
    if (kvr_status s = RequireNonNull(err, subject, "subject")) return s;
    auto id = ingest->service->SubscribeNats(url, subject);
    if (!id.ok()) return FromStatus(err, id.status());
    if (source_id != nullptr) *source_id = *id;
    return KVR_OK;
  });
}

KVR_API kvr_status kvr_jetstream_source_init(kvr_jetstream_source* source, size_t size) {
  return InitVersioned(source, size);
}

KVR_API kvr_status kvr_ingest_subscribe_jetstream(kvr_ingest* ingest,
                                                  const kvr_jetstream_source* source,
                                                  uint64_t* source_id, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    return WithJetStream(
        err, ingest, source, source_id,
        [](kvrouter::IngestService& service, const kvrouter::JetStreamSource& config) {
          return service.SubscribeJetStream(config);
        });
  });
}

KVR_API kvr_status kvr_ingest_relay_jetstream(kvr_ingest* ingest,
                                              const kvr_jetstream_source* target,
                                              uint64_t* source_id, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    return WithJetStream(
        err, ingest, target, source_id,
        [](kvrouter::IngestService& service, const kvrouter::JetStreamSource& config) {
          return service.RelayToJetStream(config);
        });
  });
}

KVR_API kvr_status kvr_ingest_sync_replicas(kvr_ingest* ingest, const char* url,
                                            const char* subject, const char* replica_id,
                                            uint64_t* source_id, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckTransport(err, kvrouter::IngestTransport::kNats)) return s;
    if (kvr_status s = CheckIngest(err, ingest)) return s;
    // It installs the router's publisher, under the router's lock.
    if (kvr_status s = CheckRouter(err, ingest->router)) return s;
    if (kvr_status s = RequireNonNull(err, url, "url")) return s;
    if (kvr_status s = RequireNonNull(err, subject, "subject")) return s;
    if (kvr_status s = RequireNonNull(err, replica_id, "replica_id")) return s;
    auto id = ingest->service->SyncReplicas(url, subject, replica_id);
    if (!id.ok()) return FromStatus(err, id.status());
    if (source_id != nullptr) *source_id = *id;
    return KVR_OK;
  });
}

KVR_API kvr_status kvr_ingest_stats_init(kvr_ingest_stats* stats, size_t size) {
  return InitVersioned(stats, size);
}

KVR_API kvr_status kvr_ingest_get_stats(kvr_ingest* ingest, uint64_t source_id,
                                        kvr_ingest_stats* out, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckIngest(err, ingest)) return s;
    if (kvr_status s = CheckResultStruct(err, out)) return s;
    auto stats = ingest->service->Stats(source_id);
    if (!stats.ok()) return FromStatus(err, stats.status());
    return WriteVersioned(err, ToCStats(*stats), out);
  });
}

KVR_API kvr_status kvr_ingest_metrics_prometheus(kvr_ingest* ingest, char* buf, size_t cap,
                                                 size_t* len, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckIngest(err, ingest)) return s;
    return CopyOutString(err, RenderIngestPrometheus(*ingest->service), buf, cap, len,
                         "Prometheus text");
  });
}

}  // extern "C"
