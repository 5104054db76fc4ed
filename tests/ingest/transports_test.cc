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

// One call of a transport's function: in a build with the transport it answers `when_in`;
// otherwise Unimplemented, naming the option.
struct Expectation {
  const char* call;
  absl::Status status;
  bool in_build;
  absl::StatusCode when_in;
  const char* option;
};

void Check(const Expectation& e) {
  if (e.in_build) {
    EXPECT_EQ(e.status.code(), e.when_in) << e.call << ": " << e.status;
  } else {
    ExpectLeftOut(e.status, e.option);
  }
}

TEST(Transports, TransportAvailableMatchesTheBuild) {
  constexpr auto kOk = absl::StatusCode::kOk;
  for (const Expectation& e : {
           Expectation{"loop", TransportAvailable(IngestTransport::kLoop), kWithZmq || kWithNats,
                       kOk, "-DKVR_WITH_ZMQ=OFF and -DKVR_WITH_NATS=OFF"},
           Expectation{"zmq", TransportAvailable(IngestTransport::kZmq), kWithZmq, kOk,
                       "-DKVR_WITH_ZMQ=OFF"},
           Expectation{"nats", TransportAvailable(IngestTransport::kNats), kWithNats, kOk,
                       "-DKVR_WITH_NATS=OFF"},
       }) {
    Check(e);
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
  IngestService& s = **service;
  // Arguments every transport refuses before it connects anywhere, so that a build that has the
  // transport answers InvalidArgument (or NotFound) and one without it Unimplemented.
  using enum absl::StatusCode;
  for (const Expectation& e : {
           Expectation{"AddEngineWorker",
                       s.AddEngineWorker({.endpoint = "", .worker_id = 1}).status(), kWithZmq,
                       kInvalidArgument, "KVR_WITH_ZMQ"},
           Expectation{"RemoveEngineWorker", s.RemoveEngineWorker(1, false), kWithZmq, kNotFound,
                       "KVR_WITH_ZMQ"},
           Expectation{"SubscribeNats", s.SubscribeNats("", "kv").status(), kWithNats,
                       kInvalidArgument, "KVR_WITH_NATS"},
           Expectation{"SyncReplicas", s.SyncReplicas("", "kv", "replica-a").status(), kWithNats,
                       kInvalidArgument, "KVR_WITH_NATS"},
       }) {
    Check(e);
  }
  // The stream listener comes with the loop.
  std::string bound;
  auto listener = s.Listen("tcp://127.0.0.1:0", &bound);
  EXPECT_TRUE(listener.ok()) << listener.status();
}

}  // namespace
}  // namespace kvrouter
