// What a build without a transport says (CMake options KVR_WITH_ZMQ, KVR_WITH_NATS): each
// IngestService method of a transport left out is Unimplemented, naming the option; the others
// are there. KVR_TEST_WITH_* tell the test what this build was configured with.
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "core/router.h"
#include "ingest/ingest_service.h"

namespace kvrouter {
namespace {

constexpr bool kWithZmq = KVR_TEST_WITH_ZMQ;
constexpr bool kWithNats = KVR_TEST_WITH_NATS;

void ExpectLeftOut(const absl::Status& status, const char* option) {
  EXPECT_TRUE(absl::IsUnimplemented(status)) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), option)) << status;
}

TEST(Transports, TransportAvailableMatchesTheBuild) {
  const absl::Status loop = TransportAvailable(IngestTransport::kLoop);
  const absl::Status zmq = TransportAvailable(IngestTransport::kZmq);
  const absl::Status nats = TransportAvailable(IngestTransport::kNats);
  if (kWithZmq || kWithNats) {
    EXPECT_TRUE(loop.ok()) << loop;
  } else {
    ExpectLeftOut(loop, "-DKVR_WITH_ZMQ=OFF and -DKVR_WITH_NATS=OFF");
  }
  if (kWithZmq) {
    EXPECT_TRUE(zmq.ok()) << zmq;
  } else {
    ExpectLeftOut(zmq, "-DKVR_WITH_ZMQ=OFF");
  }
  if (kWithNats) {
    EXPECT_TRUE(nats.ok()) << nats;
  } else {
    ExpectLeftOut(nats, "-DKVR_WITH_NATS=OFF");
  }
}

TEST(Transports, TheServiceOffersWhatTheBuildHas) {
  auto router = Router::Create(RouterOptions{});
  ASSERT_TRUE(router.ok()) << router.status();
  auto service = IngestService::Create(router->get(), IngestOptions{});
  if (!kWithZmq && !kWithNats) {
    ExpectLeftOut(service.status(), "KVR_WITH_NATS=OFF");
    return;
  }
  ASSERT_TRUE(service.ok()) << service.status();
  // Arguments every transport refuses before it connects anywhere, so that a build that has the
  // transport answers InvalidArgument and one without it Unimplemented.
  const absl::Status engine =
      (*service)->AddEngineWorker({.endpoint = "", .worker_id = 1}).status();
  const absl::Status removed = (*service)->RemoveEngineWorker(1, false);
  const absl::Status nats = (*service)->SubscribeNats("", "kv").status();
  const absl::Status sync = (*service)->SyncReplicas("", "kv", "replica-a").status();
  if (kWithZmq) {
    EXPECT_TRUE(absl::IsInvalidArgument(engine)) << engine;
    EXPECT_TRUE(absl::IsNotFound(removed)) << removed;
  } else {
    ExpectLeftOut(engine, "KVR_WITH_ZMQ");
    ExpectLeftOut(removed, "KVR_WITH_ZMQ");
  }
  if (kWithNats) {
    EXPECT_TRUE(absl::IsInvalidArgument(nats)) << nats;
    EXPECT_TRUE(absl::IsInvalidArgument(sync)) << sync;
  } else {
    ExpectLeftOut(nats, "KVR_WITH_NATS");
    ExpectLeftOut(sync, "KVR_WITH_NATS");
  }
  // The stream listener comes with the loop.
  std::string bound;
  auto listener = (*service)->Listen("tcp://127.0.0.1:0", &bound);
  EXPECT_TRUE(listener.ok()) << listener.status();
}

}  // namespace
}  // namespace kvrouter
