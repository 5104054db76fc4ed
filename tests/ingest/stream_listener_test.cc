// The native stream listener with a raw TCP client: what a publisher that dies mid-frame leaves
// behind is counted (issue 19: a cut frame was dropped, but counted nowhere), with its reason.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "core/router.h"
#include "ingest/ingest_service.h"
#include "wire/endpoint.h"

namespace kvrouter {
namespace {

// A connected TCP socket to the listener's bound "tcp://127.0.0.1:PORT".
int Connect(const std::string& bound) {
  auto where = ParseStreamEndpoint(bound);
  EXPECT_TRUE(where.ok()) << where.status();
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(where->port));
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  EXPECT_EQ(0, connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr));
  return fd;
}

IngestStats WaitFor(IngestService& ingest, uint64_t source, IngestReject reason, uint64_t n) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  IngestStats stats = *ingest.Stats(source);
  while (stats.rejected[static_cast<int>(reason)] < n &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    stats = *ingest.Stats(source);
  }
  return stats;
}

TEST(StreamListener, AFrameCutByTheCloseIsCountedWithItsReason) {
  auto router = Router::Create(RouterOptions{.block_size = 16});
  ASSERT_TRUE(router.ok());
  auto ingest = IngestService::Create(router->get(), {});
  ASSERT_TRUE(ingest.ok()) << ingest.status();
  ASSERT_TRUE((*ingest)->Start().ok());
  std::string bound;
  auto source = (*ingest)->Listen("tcp://127.0.0.1:0", &bound);
  ASSERT_TRUE(source.ok()) << source.status();

  // A header announcing 100 bytes, then 10 of them, then the publisher is gone.
  const int fd = Connect(bound);
  const uint8_t cut[4 + 10] = {100, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  ASSERT_EQ(static_cast<ssize_t>(sizeof cut), send(fd, cut, sizeof cut, 0));
  close(fd);
  IngestStats stats = WaitFor(**ingest, *source, IngestReject::kBadFlatBuffers, 1);
  EXPECT_EQ(1u, stats.rejected[static_cast<int>(IngestReject::kBadFlatBuffers)]);
  EXPECT_EQ(0u, stats.messages);  // no frame came whole
  EXPECT_EQ("the connection closed inside a frame (14 bytes of it received)", stats.last_reject);

  // A connection closed between frames leaves nothing to count.
  const int clean = Connect(bound);
  close(clean);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while ((*ingest)->Stats(*source)->connections < 2 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  (*ingest)->Stop();  // the close is handled before the loop ends
  stats = *(*ingest)->Stats(*source);
  EXPECT_EQ(2u, stats.connections);
  EXPECT_EQ(1u, stats.rejected[static_cast<int>(IngestReject::kBadFlatBuffers)]);
}

}  // namespace
}  // namespace kvrouter
