// The native stream listener with a raw TCP client: what a publisher that dies mid-frame leaves
// behind is counted (issue 19: a cut frame was dropped, but counted nowhere), with its reason.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
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

// A Unix socket bound to `path` (listening if `listen_on_it`), or -1.
int BindUnix(const std::string& path, bool listen_on_it) {
  const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      (listen_on_it && listen(fd, 4) != 0)) {
    close(fd);
    return -1;
  }
  return fd;
}

bool ConnectsToUnix(const std::string& path) {
  const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  const bool connected = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  close(fd);
  return connected;
}

bool Exists(const std::string& path) {
  struct stat st {};
  return lstat(path.c_str(), &st) == 0;
}

// A listener killed without closing (SIGKILL, a crash) leaves its socket file behind, and
// binding the path again failed with EADDRINUSE: the router could not listen where it did until
// someone removed the file. A stale socket (nobody listens) is removed; a socket someone listens
// on, or a file that is no socket, is left alone and the listen fails as before.
TEST(StreamListener, AStaleUnixSocketFileIsReplacedButNothingElse) {
  auto router = Router::Create(RouterOptions{.block_size = 16});
  ASSERT_TRUE(router.ok());
  auto ingest = IngestService::Create(router->get(), {});
  ASSERT_TRUE(ingest.ok()) << ingest.status();
  ASSERT_TRUE((*ingest)->Start().ok());
  const std::string base = "/tmp/kvr-stale-" + std::to_string(getpid());

  const std::string stale = base + "-stale.sock";  // bound, then closed without unlinking
  unlink(stale.c_str());
  const int dead = BindUnix(stale, /*listen_on_it=*/true);
  ASSERT_GE(dead, 0);
  close(dead);
  ASSERT_TRUE(Exists(stale));
  ASSERT_FALSE(ConnectsToUnix(stale));
  auto source = (*ingest)->Listen("unix://" + stale, nullptr);
  EXPECT_TRUE(source.ok()) << source.status();
  EXPECT_TRUE(ConnectsToUnix(stale));

  const std::string live = base + "-live.sock";  // another process's listener: not ours
  unlink(live.c_str());
  const int other = BindUnix(live, /*listen_on_it=*/true);
  ASSERT_GE(other, 0);
  EXPECT_EQ(absl::StatusCode::kUnavailable,
            (*ingest)->Listen("unix://" + live, nullptr).status().code());
  EXPECT_TRUE(ConnectsToUnix(live));  // still its own
  close(other);

  const std::string file = base + "-file";
  std::ofstream(file) << "not a socket";
  EXPECT_EQ(absl::StatusCode::kUnavailable,
            (*ingest)->Listen("unix://" + file, nullptr).status().code());
  EXPECT_TRUE(Exists(file));

  ingest->reset();
  unlink(stale.c_str());
  unlink(live.c_str());
  unlink(file.c_str());
}

}  // namespace
}  // namespace kvrouter
