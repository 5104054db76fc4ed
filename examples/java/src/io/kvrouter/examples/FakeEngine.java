package io.kvrouter.examples;

import com.sun.net.httpserver.HttpExchange;
import com.sun.net.httpserver.HttpServer;
import io.kvrouter.EventBatch;
import io.kvrouter.Hashing;
import io.kvrouter.Publisher;
import io.kvrouter.StoredEvent;
import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.net.InetSocketAddress;
import java.nio.charset.StandardCharsets;
import java.util.Arrays;
import java.util.HashSet;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.Executors;
import java.util.concurrent.atomic.AtomicLong;

/**
 * A fake LLM engine for the gateway example and its test: an OpenAI-style completions server that
 * "generates" one token every {@code --token-delay-ms} and, like a real engine with prefix caching,
 * publishes KV events for the blocks it caches.
 *
 * <pre>
 * java -cp kvrouter-0.2.0.jar:classes io.kvrouter.examples.FakeEngine --port 9001 --worker-id 1 \
 *     --kv-endpoint tcp://127.0.0.1:5557
 * </pre>
 *
 * <p>Before its first token it caches the prompt's complete blocks and publishes a stored event
 * for the blocks it did not hold yet (engine hashes: the chained sequence hashes; parent: the last
 * block it held) through kvrouter's native stream {@link Publisher}. It never evicts. {@code GET
 * /stats} counts requests, those completed and those the client (the gateway) abandoned. Prints
 * {@code {"listening": URL}} on start.
 */
public final class FakeEngine {
  private final long workerId;
  private final int blockSize;
  private final long tokenDelayMs;
  private final Publisher publisher; // null: no events
  private final Set<Long> cache = new HashSet<>(); // engine hashes held
  private final AtomicLong requests = new AtomicLong();
  private final AtomicLong completed = new AtomicLong();
  private final AtomicLong cancelled = new AtomicLong();
  private final AtomicLong storedBlocks = new AtomicLong();

  FakeEngine(long workerId, int blockSize, long tokenDelayMs, String kvEndpoint) {
    this.workerId = workerId;
    this.blockSize = blockSize;
    this.tokenDelayMs = tokenDelayMs;
    this.publisher = kvEndpoint == null ? null : Publisher.connect(kvEndpoint);
  }

  /** Caches the prompt's complete blocks; publishes the new ones. */
  private synchronized void cachePrompt(int[] prompt) {
    long[] engine = Hashing.sequenceHashes(Hashing.blockHashes(prompt, blockSize));
    int held = 0;
    while (held < engine.length && cache.contains(engine[held])) ++held;
    if (held == engine.length) return;
    for (int i = held; i < engine.length; ++i) cache.add(engine[i]);
    storedBlocks.addAndGet(engine.length - held);
    if (publisher == null) return;
    StoredEvent.Builder event =
        StoredEvent.builder(workerId)
            .blockHashes(Arrays.copyOfRange(engine, held, engine.length))
            .tokenIds(Arrays.copyOfRange(prompt, held * blockSize, engine.length * blockSize));
    if (held > 0) event.parentHash(engine[held - 1]);
    try (EventBatch batch = new EventBatch()) {
      batch.addStored(event.build());
      publisher.send(batch);
    }
  }

  private void handle(HttpExchange exchange) {
    try {
      String path = exchange.getRequestURI().getPath();
      if (path.equals("/stats")) {
        Map<String, Object> stats = new LinkedHashMap<>();
        stats.put("requests", requests.get());
        stats.put("completed", completed.get());
        stats.put("cancelled", cancelled.get());
        stats.put("stored_blocks", storedBlocks.get());
        byte[] body = Gateway.Json.write(stats).getBytes(StandardCharsets.UTF_8);
        exchange.getResponseHeaders().set("content-type", "application/json");
        exchange.sendResponseHeaders(200, body.length);
        exchange.getResponseBody().write(body);
        return;
      }
      Map<?, ?> req;
      try (InputStream in = exchange.getRequestBody()) {
        req = (Map<?, ?>) Gateway.Json.parse(new String(in.readAllBytes(), StandardCharsets.UTF_8));
      }
      List<?> list = (List<?>) req.get("prompt");
      int[] prompt = new int[list.size()];
      for (int i = 0; i < prompt.length; ++i) prompt[i] = (int) (long) (Long) list.get(i);
      Object max = req.get("max_tokens");
      long n = max instanceof Long ? (Long) max : 16;
      requests.incrementAndGet();
      cachePrompt(prompt);
      exchange.getResponseHeaders().set("content-type", "text/event-stream");
      exchange.sendResponseHeaders(200, 0);
      OutputStream out = exchange.getResponseBody();
      try {
        for (long i = 0; i < n; ++i) {
          Thread.sleep(tokenDelayMs);
          Map<String, Object> choice = new LinkedHashMap<>();
          choice.put("index", 0L);
          choice.put("text", " t" + i);
          choice.put("finish_reason", i == n - 1 ? "length" : null);
          Map<String, Object> chunk = new LinkedHashMap<>();
          chunk.put("id", "cmpl");
          chunk.put("object", "text_completion");
          chunk.put("created", System.currentTimeMillis() / 1000);
          chunk.put("model", "fake-" + workerId);
          chunk.put("choices", List.of(choice));
          out.write(("data: " + Gateway.Json.write(chunk) + "\n\n").getBytes(StandardCharsets.UTF_8));
          out.flush();
        }
        out.write("data: [DONE]\n\n".getBytes(StandardCharsets.UTF_8));
        out.close();
        completed.incrementAndGet();
      } catch (IOException gone) {
        cancelled.incrementAndGet();
      }
    } catch (IOException | RuntimeException e) {
      if (!(e instanceof IOException)) e.printStackTrace();
    } catch (InterruptedException e) {
      Thread.currentThread().interrupt();
    } finally {
      exchange.close();
    }
  }

  public static void main(String[] args) throws Exception {
    int port = 0;
    long workerId = -1;
    int blockSize = 16;
    long delay = 5;
    String kv = null;
    for (int i = 0; i + 1 < args.length; i += 2) {
      String v = args[i + 1];
      switch (args[i]) {
        case "--port":
          port = Integer.parseInt(v);
          break;
        case "--worker-id":
          workerId = Long.parseUnsignedLong(v);
          break;
        case "--block-size":
          blockSize = Integer.parseInt(v);
          break;
        case "--token-delay-ms":
          delay = Long.parseLong(v);
          break;
        case "--kv-endpoint":
          kv = v;
          break;
        default:
          System.err.println("fake engine: unknown option " + args[i]);
          System.exit(2);
      }
    }
    if (workerId == -1 || args.length % 2 != 0) {
      System.err.println(
          "usage: FakeEngine --worker-id ID [--port P] [--block-size N] [--token-delay-ms MS]"
              + " [--kv-endpoint tcp://HOST:PORT]");
      System.exit(2);
    }
    FakeEngine engine = new FakeEngine(workerId, blockSize, delay, kv);
    HttpServer server = HttpServer.create(new InetSocketAddress("127.0.0.1", port), 128);
    server.setExecutor(Executors.newCachedThreadPool());
    server.createContext("/", engine::handle);
    server.start();
    System.out.println(
        "{\"listening\":\"http://127.0.0.1:" + server.getAddress().getPort() + "\"}");
    System.out.flush();
    CountDownLatch stopped = new CountDownLatch(1);
    Runtime.getRuntime()
        .addShutdownHook(
            new Thread(
                () -> {
                  server.stop(0);
                  if (engine.publisher != null) engine.publisher.close();
                  stopped.countDown();
                }));
    stopped.await();
  }
}
