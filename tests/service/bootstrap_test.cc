// The pieces of --bootstrap-from that need no peer: the positions header and the peer URL.
// Warm starts from a live peer are tested end to end in kvrouterd_e2e_test.cc and, with
// JetStream, in tests/fault/replica_fleet_test.cc.
#include "kvrouterd/bootstrap.h"

#include <gtest/gtest.h>

#include "nats_server.h"  // FreePort (tests/ingest)

namespace kvrouterd {
namespace {

TEST(BootstrapTest, StreamSequencesRoundTrip) {
  const StreamSequences sequences{{"KV", 42}, {"OTHER", 0}};
  const std::string text = FormatStreamSequences(sequences);
  EXPECT_EQ(text, "KV=42, OTHER=0");
  EXPECT_EQ(ParseStreamSequences(text), sequences);
  EXPECT_EQ(ParseStreamSequences(" KV=7 ,"), (StreamSequences{{"KV", 7}}));
  EXPECT_EQ(ParseStreamSequences(""), StreamSequences{});
}

TEST(BootstrapTest, BadStreamSequencesAreRefused) {
  for (const char* bad : {"KV", "=3", "KV=", "KV=-1", "KV=3x", "KV=18446744073709551616"}) {
    EXPECT_EQ(ParseStreamSequences(bad), std::nullopt) << bad;
  }
}

TEST(BootstrapTest, PeerUrls) {
  std::string host;
  int port = 0;
  EXPECT_EQ(ParsePeerUrl("http://router-a:8080/", &host, &port), "");
  EXPECT_EQ(host, "router-a");
  EXPECT_EQ(port, 8080);
  EXPECT_EQ(ParsePeerUrl("http://[::1]:9000", &host, &port), "");
  EXPECT_EQ(host, "::1");
  for (const char* bad : {"router-a:8080", "https://a:1", "http://a", "http://a:0",
                          "http://a:8080/v1/snapshot", "http://:8080"}) {
    EXPECT_NE(ParsePeerUrl(bad, &host, &port), "") << bad;
  }
}

// A peer's answer too short to hold a status is an error, not an exception (which stopped the
// start instead of starting cold).
TEST(BootstrapTest, MalformedAnswersAreErrors) {
  PeerSnapshot snapshot;
  for (const char* bad : {"HTTP/1.\r\n\r\nX", "HTTP/1.1\r\n\r\n", "HTTP/1.1 20\r\n\r\n",
                          "HTTP/1.1_200 OK\r\n\r\n", "HTTP/1.1 200 OK\r\n"}) {
    std::string error;
    EXPECT_NO_THROW(error = ParseSnapshotAnswer(bad, &snapshot)) << bad;
    EXPECT_NE(error, "") << bad;
  }
  EXPECT_EQ(ParseSnapshotAnswer("HTTP/1.1 404 Not Found\r\n\r\n", &snapshot), "answered 404");
  ASSERT_EQ(ParseSnapshotAnswer("HTTP/1.1 200 OK\r\nContent-Length: 3\r\n"
                                "Kvrouter-Stream-Sequences: KV=7\r\n\r\nabc",
                                &snapshot),
            "");
  EXPECT_EQ(snapshot.bytes, "abc");
  EXPECT_EQ(snapshot.sequences, (StreamSequences{{"KV", 7}}));
}

TEST(BootstrapTest, AnUnreachablePeerSaysWhy) {
  std::string error;
  const std::string url = "http://127.0.0.1:" + std::to_string(kvrouter::FreePort());
  EXPECT_EQ(FetchPeerSnapshot(url, std::chrono::seconds(2), &error), std::nullopt);
  EXPECT_NE(error.find("cannot connect"), std::string::npos) << error;
}

}  // namespace
}  // namespace kvrouterd
