// IngestService in a build without the ingest loop (KVR_WITH_ZMQ and KVR_WITH_NATS both OFF):
// Create is Unimplemented, so no service exists and the other methods are never reached.
#include "ingest/ingest_service.h"

namespace kvrouter {

struct IngestService::Impl {};

namespace {
absl::Status Unavailable() { return TransportAvailable(IngestTransport::kLoop); }
}  // namespace

IngestService::IngestService(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
IngestService::~IngestService() = default;

absl::StatusOr<std::unique_ptr<IngestService>> IngestService::Create(Router*, IngestOptions) {
  return Unavailable();
}
absl::Status IngestService::Start() { return Unavailable(); }
void IngestService::Stop() {}
absl::StatusOr<uint64_t> IngestService::Listen(const std::string&, std::string*) {
  return Unavailable();
}
absl::StatusOr<uint64_t> IngestService::AddEngineWorker(const EngineWorker&) {
  return TransportAvailable(IngestTransport::kZmq);
}
absl::Status IngestService::RemoveEngineWorker(uint64_t, bool) {
  return TransportAvailable(IngestTransport::kZmq);
}
absl::StatusOr<uint64_t> IngestService::SubscribeNats(const std::string&, const std::string&) {
  return TransportAvailable(IngestTransport::kNats);
}
absl::StatusOr<uint64_t> IngestService::SyncReplicas(const std::string&, const std::string&,
                                                     const std::string&) {
  return TransportAvailable(IngestTransport::kNats);
}
absl::StatusOr<uint64_t> IngestService::SubscribeJetStream(const JetStreamSource&) {
  return TransportAvailable(IngestTransport::kNats);
}
absl::StatusOr<uint64_t> IngestService::RelayToJetStream(const JetStreamSource&) {
  return TransportAvailable(IngestTransport::kNats);
}
absl::StatusOr<IngestStats> IngestService::Stats(uint64_t) const { return Unavailable(); }
absl::StatusOr<std::string> IngestService::Endpoint(uint64_t) const { return Unavailable(); }
std::vector<IngestSource> IngestService::Sources() const { return {}; }

}  // namespace kvrouter
