package io.kvrouter;

import static io.kvrouter.TestSupport.await;
import static io.kvrouter.TestSupport.tokens;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.io.ByteArrayOutputStream;
import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.net.Socket;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.time.Instant;
import java.util.List;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.Timeout;
import org.junit.jupiter.api.io.TempDir;

/** Live ingestion: stream listeners with the publisher, engine workers, NATS. */
@Timeout(60)
class IngestTest {
  private static final int[] PROMPT = tokens(64, 1000); // 4 blocks
  private static final Duration WAIT = Duration.ofSeconds(10);

  private static StoredEvent cached(long worker) {
    return StoredEvent.builder(worker)
        .eventId(1)
        .blockHashes(0xa1, 0xa2, 0xa3, 0xa4)
        .tokenIds(PROMPT)
        .build();
  }

  @Test
  void unixSocketPublisherAndStats(@TempDir Path dir) {
    try (Router router = TestSupport.routerWithWorkers(8);
        Ingest ingest = new Ingest(router)) {
      Listener listener = ingest.listen("unix://" + dir.resolve("events.sock"));
      assertEquals("unix://" + dir.resolve("events.sock"), listener.endpoint());
      assertEquals(listener.endpoint(), ingest.sourceEndpoint(listener.sourceId()));
      KvRouterException unknown =
          assertThrows(KvRouterException.class, () -> ingest.sourceEndpoint(12345));
      assertEquals(Status.NOT_FOUND, unknown.status());
      ingest.start();
      KvRouterException again = assertThrows(KvRouterException.class, ingest::start);
      assertEquals(Status.FAILED_PRECONDITION, again.status());

      Instant published = Instant.now().minusMillis(5);
      try (Publisher publisher = Publisher.connect(listener.endpoint());
          EventBatch batch = new EventBatch()) {
        batch.addStored(cached(7));
        batch.setPublishTime(published);
        publisher.send(batch);
        batch.clear().addRemoved(RemovedEvent.builder(7).eventId(2).blockHashes(0xa4).build());
        publisher.sendEncoded(batch.encode());
        publisher.sendEncoded(new byte[] {1, 2, 3, 4, 5, 6, 7, 8}); // not an EventBatch
        batch
            .clear()
            .addStored(
                StoredEvent.builder(7)
                    .parentHash(0xdead)
                    .blockHashes(0xb1)
                    .tokenIds(tokens(16, 1))
                    .build());
        publisher.send(batch); // applied, but refused by the index: unknown parent
      }
      await("4 frames", WAIT, () -> ingest.stats(listener.sourceId()).messages() >= 4);
      IngestStats stats = ingest.stats(listener.sourceId());
      assertEquals(4, stats.messages());
      assertEquals(2, stats.eventsApplied());
      assertEquals(1, stats.rejected(IngestReject.BAD_FLATBUFFERS));
      assertEquals(1, stats.rejected(IngestReject.INDEX));
      assertEquals(2, stats.rejectedTotal());
      // The most recent reject's reason, in the index's words.
      assertTrue(stats.lastReject().contains("parent block"), stats.lastReject());
      assertEquals(1, stats.connections());
      assertEquals(0, stats.gaps());
      assertEquals(0, stats.stateUnknown());
      // lag: publication (set explicitly 5 ms back, or stamped at send) to events applied
      assertTrue(stats.lagSamples() >= 2, stats.toString());
      assertTrue(stats.lagMaxMicros() >= 5_000, "max lag " + stats.lagMaxMicros());
      assertTrue(stats.lagTotalMicros() >= stats.lagMaxMicros());
      assertTrue(stats.lagLastMicros() <= stats.lagMaxMicros());
      assertTrue(stats.lagMeanMicros() > 0);
      assertEquals(0, stats.published());
      assertEquals(stats.messages(), ingest.stats().messages()); // source 0: the sum

      List<Overlap> overlaps = router.overlapScores(PROMPT);
      assertEquals(1, overlaps.size());
      assertEquals(7, overlaps.get(0).workerId());
      assertEquals(3, overlaps.get(0).deviceBlocks());
      assertEquals(7, router.findBestMatch(PROMPT).workerId());

      KvRouterException e = assertThrows(KvRouterException.class, () -> ingest.stats(999));
      assertEquals(Status.NOT_FOUND, e.status());
      ingest.stop();
      ingest.stop(); // idempotent
    }
  }

  @Test
  void tcpListenerWhileRoutingAndTheRouterClosedFirst() throws Exception {
    Router router = TestSupport.routerWithWorkers(8);
    Ingest ingest = new Ingest(router);
    Listener listener = ingest.listen("tcp://127.0.0.1:0");
    assertTrue(
        listener.endpoint().matches("tcp://127\\.0\\.0\\.1:[1-9][0-9]*"), listener.endpoint());
    ingest.start();
    try (Publisher publisher = Publisher.connect(listener.endpoint());
        EventBatch batch = new EventBatch()) {
      for (int w = 1; w <= 8; ++w) {
        batch
            .clear()
            .addStored(
                StoredEvent.builder(w).blockHashes(w * 10L).tokenIds(tokens(16, 1000)).build());
        publisher.send(batch);
        router.findBestMatch(PROMPT); // routing goes on while the loop thread applies events
      }
    }
    await("8 batches", WAIT, () -> ingest.stats().eventsApplied() >= 8);
    assertEquals(8, router.overlapScores(PROMPT).size());
    // The Router is closed while the ingest object still feeds it: the native router stays
    // alive until the ingest object is closed.
    router.close();
    assertThrows(IllegalStateException.class, () -> router.findBestMatch(PROMPT));
    try (Publisher publisher = Publisher.connect(listener.endpoint());
        EventBatch batch = new EventBatch()) {
      publisher.send(batch.addCleared(1, 0, 9));
    }
    await("the clear", WAIT, () -> ingest.stats().messages() >= 9);
    assertEquals(2, ingest.stats().connections());
    ingest.close();
    ingest.close();
    assertThrows(IllegalStateException.class, ingest::stats);
  }

  /** The replica liveness settings reach the library, which refuses more than an hour. */
  @Test
  void replicaLivenessSettingsReachTheLibrary() {
    try (Router router = TestSupport.routerWithWorkers(1)) {
      for (IngestOptions o :
          List.of(
              IngestOptions.builder().replicaHeartbeatMs(3_600_001).build(),
              IngestOptions.builder().replicaTimeoutMs(-1).build())) {
        KvRouterException e = assertThrows(KvRouterException.class, () -> new Ingest(router, o));
        assertEquals(Status.INVALID_ARGUMENT, e.status());
      }
      new Ingest(
              router,
              IngestOptions.builder().replicaHeartbeatMs(3_600_000).replicaTimeoutMs(0).build())
          .close();
    }
  }

  @Test
  void badEndpointsAndEngineWorkers() {
    try (Router router = TestSupport.routerWithWorkers(1);
        Ingest ingest = new Ingest(router, IngestOptions.builder().replayTimeoutMs(500).build())) {
      KvRouterException e =
          assertThrows(KvRouterException.class, () -> Publisher.connect("tcp://127.0.0.1:1"));
      assertEquals(Status.UNAVAILABLE, e.status());
      e = assertThrows(KvRouterException.class, () -> Publisher.connect("nonsense"));
      assertEquals(Status.INVALID_ARGUMENT, e.status());
      e =
          assertThrows(
              KvRouterException.class, () -> ingest.listen("unix:///nonexistent-dir/x/y.sock"));
      assertEquals(Status.UNAVAILABLE, e.status());

      e =
          assertThrows(
              KvRouterException.class,
              () ->
                  ingest.addEngineWorker(
                      EngineWorker.builder("tcp://127.0.0.1:5557", 5).blockSize(32).build()));
      assertEquals(Status.INVALID_ARGUMENT, e.status());
      e =
          assertThrows(
              KvRouterException.class,
              () ->
                  ingest.addEngineWorker(
                      EngineWorker.builder("tcp://127.0.0.1:5557", 5).dpSize(0).build()));
      assertEquals(Status.INVALID_ARGUMENT, e.status());
      long source =
          ingest.addEngineWorker(
              EngineWorker.builder("tcp://127.0.0.1:5557", 5)
                  .engine(EngineKind.SGLANG)
                  .dpSize(2)
                  .topic("kv")
                  .build());
      assertTrue(source > 0);
      assertEquals(0, ingest.stats(source).messages());
      e =
          assertThrows(
              KvRouterException.class,
              () ->
                  ingest.addEngineWorker(EngineWorker.builder("tcp://127.0.0.1:6000", 5).build()));
      assertEquals(Status.ALREADY_EXISTS, e.status());
      ingest.start();
      ingest.removeEngineWorker(5, true);
      e = assertThrows(KvRouterException.class, () -> ingest.removeEngineWorker(5, false));
      assertEquals(Status.NOT_FOUND, e.status());
      e =
          assertThrows(
              KvRouterException.class, () -> ingest.subscribeNats("nats://127.0.0.1:1", "kv.>"));
      assertEquals(Status.UNAVAILABLE, e.status());
    }
  }

  @Test
  void natsSubjectsWithWildcards() throws Exception {
    try (NatsServer nats = NatsServer.startOrSkip();
        Router router = TestSupport.routerWithWorkers(4);
        Ingest ingest = new Ingest(router)) {
      ingest.start();
      long source = ingest.subscribeNats(nats.url(), "kv.*.events");
      byte[] good;
      try (EventBatch batch = new EventBatch()) {
        good = batch.addStored(cached(3)).encode();
      }
      try (MiniNats client = new MiniNats(nats.port())) {
        client.publish("kv.w3.events", "garbage, not a batch".getBytes(StandardCharsets.UTF_8));
        client.publish("kv.w3.events", good);
        client.publish("other.subject", good); // not subscribed
        client.flush();
      }
      await("2 NATS messages", WAIT, () -> ingest.stats(source).messages() >= 2);
      IngestStats stats = ingest.stats(source);
      assertEquals(2, stats.messages());
      assertEquals(1, stats.eventsApplied());
      assertEquals(1, stats.rejected(IngestReject.BAD_FLATBUFFERS));
      assertEquals(1, stats.connections());
      assertEquals(3, router.findBestMatch(PROMPT).workerId());
      assertEquals(4, router.overlapScores(PROMPT).get(0).deviceBlocks());
    } // the ingest object closes (unsubscribes) before the server stops
  }

  /**
   * JetStream: the stream created by the source, a batch published into it with a plain NATS
   * publish, applied and acknowledged (streamSequence), and in the index; the refusals: a missing
   * stream without createStream, a stream name with '.', no server.
   */
  @Test
  void jetStreamStreamCreatedConsumedAndAcknowledged() throws Exception {
    try (NatsServer nats = NatsServer.startOrSkip(true);
        Router router = TestSupport.routerWithWorkers(4);
        Ingest ingest = new Ingest(router)) {
      ingest.start();
      KvRouterException e =
          assertThrows(
              KvRouterException.class,
              () ->
                  ingest.subscribeJetStream(
                      JetStreamSource.builder(nats.url(), "KV", "kv.>").durable("gw-1").build()));
      assertEquals(Status.NOT_FOUND, e.status(), e.getMessage());
      e =
          assertThrows(
              KvRouterException.class,
              () ->
                  ingest.subscribeJetStream(
                      JetStreamSource.builder(nats.url(), "K.V", "kv.>")
                          .createStream(true)
                          .build()));
      assertEquals(Status.INVALID_ARGUMENT, e.status(), e.getMessage());
      e =
          assertThrows(
              KvRouterException.class,
              () ->
                  ingest.subscribeJetStream(
                      JetStreamSource.builder("nats://127.0.0.1:1", "KV", "kv.>")
                          .createStream(true)
                          .build()));
      assertEquals(Status.UNAVAILABLE, e.status(), e.getMessage());

      long source =
          ingest.subscribeJetStream(
              JetStreamSource.builder(nats.url(), "KV", "kv.>")
                  .durable("gw-1")
                  .createStream(true)
                  .build());
      assertEquals(nats.url(), ingest.sourceEndpoint(source));
      byte[] good;
      try (EventBatch batch = new EventBatch()) {
        good = batch.addStored(cached(3)).encode();
      }
      try (MiniNats client = new MiniNats(nats.port())) {
        client.publish("kv.w1", good); // a core publish: the stream stores it
        client.flush();
      }
      await("stream sequence 1", WAIT, () -> ingest.stats(source).streamSequence() >= 1);
      IngestStats stats = ingest.stats(source);
      assertEquals(1, stats.streamSequence());
      assertEquals(1, stats.messages());
      assertEquals(1, stats.eventsApplied());
      assertEquals(1, ingest.stats().streamSequence()); // the largest over the sources
      assertEquals(3, router.findBestMatch(PROMPT).workerId());
      assertEquals(4, router.overlapScores(PROMPT).get(0).deviceBlocks());
    }
  }

  /**
   * The JetStream relay: a router fed by a stream listener relays its index changes into stream KV
   * on kv.relay.&lt;worker&gt;; a second router consuming kv.relay.&gt; ends with the same index.
   * The refusals: a consumer's field (a durable name) and a second relay.
   */
  @Test
  void jetStreamRelayFeedsAnotherRouter(@TempDir Path dir) throws Exception {
    try (NatsServer nats = NatsServer.startOrSkip(true);
        Router first = TestSupport.routerWithWorkers(4);
        Router second = TestSupport.routerWithWorkers(4);
        Ingest ingest = new Ingest(first);
        Ingest consumer = new Ingest(second)) {
      Listener listener = ingest.listen("unix://" + dir.resolve("relay.sock"));
      ingest.start();
      JetStreamSource target =
          JetStreamSource.builder(nats.url(), "KV", "kv.relay").createStream(true).build();
      KvRouterException e =
          assertThrows(
              KvRouterException.class,
              () ->
                  ingest.relayJetStream(
                      JetStreamSource.builder(nats.url(), "KV", "kv.relay")
                          .durable("relay-1")
                          .createStream(true)
                          .build()));
      assertEquals(Status.INVALID_ARGUMENT, e.status(), e.getMessage());
      long relay = ingest.relayJetStream(target);
      assertTrue(relay != 0 && relay != listener.sourceId(), "relay source id " + relay);
      e = assertThrows(KvRouterException.class, () -> ingest.relayJetStream(target));
      assertEquals(Status.FAILED_PRECONDITION, e.status(), e.getMessage());

      consumer.start();
      long consumed =
          consumer.subscribeJetStream(
              JetStreamSource.builder(nats.url(), "KV", "kv.relay.>").durable("gw-2").build());

      try (Publisher publisher = Publisher.connect(listener.endpoint());
          EventBatch batch = new EventBatch()) {
        publisher.send(batch.addStored(cached(3)));
      }
      await(
          "the relay caught up",
          WAIT,
          () -> {
            IngestStats s = ingest.stats(relay);
            return s.messages() >= 1
                && s.messages() == s.eventsApplied() + s.missedMessages()
                && s.stateUnknown() == 0;
          });
      IngestStats relayed = ingest.stats(relay);
      assertTrue(relayed.streamSequence() > 0, relayed.toString());
      assertTrue(relayed.published() > 0, relayed.toString());
      assertEquals(0, relayed.missedMessages());
      await(
          "the consumer at the relay's last message",
          WAIT,
          () -> consumer.stats(consumed).streamSequence() >= relayed.streamSequence());
      assertEquals(relayed.streamSequence(), consumer.stats(consumed).streamSequence());
      assertEquals(first.indexDigest(), second.indexDigest());
      assertEquals(3, second.findBestMatch(PROMPT).workerId());
      assertEquals(4, second.overlapScores(PROMPT).get(0).deviceBlocks());
    }
  }

  /** Just enough of the NATS client protocol to publish: CONNECT, PUB, PING/PONG. */
  private static final class MiniNats implements AutoCloseable {
    private final Socket socket;
    private final InputStream in;
    private final OutputStream out;

    MiniNats(int port) throws IOException {
      socket = new Socket("127.0.0.1", port);
      socket.setSoTimeout(10_000);
      in = socket.getInputStream();
      out = socket.getOutputStream();
      String info = readLine();
      assertTrue(info.startsWith("INFO "), info);
      out.write(
          "CONNECT {\"verbose\":false,\"pedantic\":false}\r\n".getBytes(StandardCharsets.US_ASCII));
    }

    void publish(String subject, byte[] payload) throws IOException {
      out.write(
          ("PUB " + subject + " " + payload.length + "\r\n").getBytes(StandardCharsets.US_ASCII));
      out.write(payload);
      out.write("\r\n".getBytes(StandardCharsets.US_ASCII));
    }

    /** PING, then wait for PONG: the server has processed everything sent before. */
    void flush() throws IOException {
      out.write("PING\r\n".getBytes(StandardCharsets.US_ASCII));
      out.flush();
      for (String line = readLine(); !line.equals("PONG"); line = readLine()) {
        assertFalse(line.startsWith("-ERR"), line);
      }
    }

    private String readLine() throws IOException {
      ByteArrayOutputStream line = new ByteArrayOutputStream();
      for (int b = in.read(); b != '\n'; b = in.read()) {
        if (b < 0) throw new IOException("NATS connection closed");
        if (b != '\r') line.write(b);
      }
      return line.toString(StandardCharsets.US_ASCII);
    }

    @Override
    public void close() throws IOException {
      socket.close();
    }
  }
}
