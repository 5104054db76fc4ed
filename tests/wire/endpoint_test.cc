// The one endpoint parser (wire/endpoint.h): stream listeners, publishers and engine ranks.
#include "wire/endpoint.h"

#include <gtest/gtest.h>

#include "absl/status/status.h"

namespace kvrouter {
namespace {

TEST(StreamEndpoint, ParsesTcpWithIpv4OrHostName) {
  auto e = ParseStreamEndpoint("tcp://127.0.0.1:5557");
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_FALSE(e->unix_socket);
  EXPECT_EQ(e->host_or_path, "127.0.0.1");
  EXPECT_EQ(e->port, 5557);
  e = ParseStreamEndpoint("tcp://localhost:0");
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->host_or_path, "localhost");
  EXPECT_EQ(e->port, 0);
}

TEST(StreamEndpoint, DropsTheBracketsOfAnIpv6Address) {
  auto e = ParseStreamEndpoint("tcp://[::1]:65535");
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->host_or_path, "::1");
  EXPECT_EQ(e->port, 65535);
}

TEST(StreamEndpoint, ParsesUnixPaths) {
  auto e = ParseStreamEndpoint("unix:///tmp/kv.sock");
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_TRUE(e->unix_socket);
  EXPECT_EQ(e->host_or_path, "/tmp/kv.sock");
}

TEST(StreamEndpoint, RejectsOtherSchemesBadPortsAndEmptyPaths) {
  for (const char* bad : {"ipc:///tmp/x", "127.0.0.1:80", "tcp://host", "tcp://host:",
                          "tcp://host:http", "tcp://host:65536", "tcp://host:-1", "unix://", ""}) {
    auto e = ParseStreamEndpoint(bad);
    EXPECT_TRUE(absl::IsInvalidArgument(e.status())) << bad;
  }
}

TEST(RankEndpoint, TcpRanksBindConsecutivePortsOthersGetASuffix) {
  EXPECT_EQ(RankEndpoint("tcp://*:5557", 0), "tcp://*:5557");
  EXPECT_EQ(RankEndpoint("tcp://*:5557", 2), "tcp://*:5559");
  EXPECT_EQ(RankEndpoint("tcp://[::1]:5557", 1), "tcp://[::1]:5558");
  EXPECT_EQ(RankEndpoint("ipc:///tmp/kv", 1), "ipc:///tmp/kv_dp1");
  EXPECT_EQ(RankEndpoint("tcp://host", 1), "tcp://host_dp1");
}

// Issue 19: port 99999 and a replay endpoint "garbage" were accepted.
TEST(EngineEndpoint, EveryRanksPortMustExistAndOnlyTcpOrIpcConnect) {
  EXPECT_TRUE(CheckEngineEndpoint("tcp://127.0.0.1:5557", 1, "endpoint").ok());
  EXPECT_TRUE(CheckEngineEndpoint("tcp://[::1]:65534", 2, "endpoint").ok());
  EXPECT_TRUE(CheckEngineEndpoint("ipc:///tmp/kv", 8, "endpoint").ok());
  const absl::Status port = CheckEngineEndpoint("tcp://127.0.0.1:99999", 1, "endpoint");
  EXPECT_EQ(absl::StatusCode::kInvalidArgument, port.code());
  EXPECT_NE(std::string::npos, port.message().find("port in 1..65535")) << port;
  const absl::Status ranks = CheckEngineEndpoint("tcp://127.0.0.1:65535", 2, "endpoint");
  EXPECT_NE(std::string::npos, ranks.message().find("past 65535")) << ranks;
  const absl::Status garbage = CheckEngineEndpoint("garbage", 1, "replay_endpoint");
  EXPECT_NE(std::string::npos, garbage.message().find("replay_endpoint 'garbage'")) << garbage;
  for (const char* bad : {"", "tcp://127.0.0.1", "tcp://:5557", "tcp://127.0.0.1:0",
                          "tcp://127.0.0.1:x", "ipc://", "udp://127.0.0.1:5557"}) {
    EXPECT_FALSE(CheckEngineEndpoint(bad, 1, "endpoint").ok()) << bad;
  }
}

TEST(WithoutUserInfo, DropsCredentialsOnly) {
  EXPECT_EQ(WithoutUserInfo("nats://user:secret@127.0.0.1:4222"), "nats://127.0.0.1:4222");
  EXPECT_EQ(WithoutUserInfo("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
  EXPECT_EQ(WithoutUserInfo("nats://host:4222/a@b"), "nats://host:4222/a@b");
  EXPECT_EQ(WithoutUserInfo("host:4222"), "host:4222");
}

}  // namespace
}  // namespace kvrouter
