// A test fixture for NATS ingestion: its own nats-server on 127.0.0.1 (a free port), a router
// of the given block size with an ingest service feeding it, and a NATS client to publish with.
#pragma once

#include <gtest/gtest.h>
#include <nats/nats.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/router.h"
#include "ingest/ingest_service.h"
#include "nats_server.h"

namespace kvrouter {

class NatsIngestFixture : public ::testing::Test {
 protected:
  explicit NatsIngestFixture(uint32_t block_size) : block_size_(block_size) {}

  void SetUp() override {
    const int port = FreePort();
    ASSERT_GT(port, 0);
    server_ = std::make_unique<NatsServer>(port);
    ASSERT_TRUE(server_->Start());
    router_ = *Router::Create(RouterOptions{.block_size = block_size_});
    ingest_ = *IngestService::Create(router_.get(), {});
    ASSERT_TRUE(ingest_->Start().ok());
    ASSERT_EQ(NATS_OK, natsConnection_ConnectTo(&publisher_, server_->url().c_str()));
  }
  void TearDown() override {
    ingest_.reset();
    if (publisher_ != nullptr) natsConnection_Destroy(publisher_);
    server_.reset();
  }

  void Publish(const std::string& subject, const std::vector<uint8_t>& data) {
    ASSERT_EQ(NATS_OK, natsConnection_Publish(publisher_, subject.c_str(), data.data(),
                                              static_cast<int>(data.size())));
    ASSERT_EQ(NATS_OK, natsConnection_FlushTimeout(publisher_, 5000));
  }

  // The server stopped and started again on its port (its subscribers reconnect on their own),
  // and the test's publisher connected to it again: whether all went well.
  bool RestartServer() {
    natsConnection_Destroy(std::exchange(publisher_, nullptr));
    server_->Stop();
    return server_->Start() &&
           natsConnection_ConnectTo(&publisher_, server_->url().c_str()) == NATS_OK;
  }

  // The source's stats once it has counted `messages` (or 10 s have passed: then a failure).
  IngestStats WaitForMessages(uint64_t source, uint64_t messages) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    IngestStats stats = *ingest_->Stats(source);
    while (stats.messages < messages && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      stats = *ingest_->Stats(source);
    }
    EXPECT_EQ(messages, stats.messages);
    return stats;
  }

  const uint32_t block_size_;
  std::unique_ptr<NatsServer> server_;
  std::unique_ptr<Router> router_;
  std::unique_ptr<IngestService> ingest_;
  natsConnection* publisher_ = nullptr;
};

}  // namespace kvrouter
