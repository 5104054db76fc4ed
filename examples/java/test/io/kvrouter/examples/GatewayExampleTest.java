package io.kvrouter.examples;

import java.io.BufferedReader;
import java.io.IOException;
import java.io.InputStream;
import java.io.InputStreamReader;
import java.io.OutputStream;
import java.net.ServerSocket;
import java.net.Socket;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.charset.StandardCharsets;
import java.nio.file.Path;
import java.time.Duration;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.function.BooleanSupplier;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

/**
 * The gateway example against two fake engines, each a process of its own on 127.0.0.1 started
 * with this JVM's class path: routing, prefix affinity once the engines' KV events are in, prefill
 * marked and requests freed (loads back to zero) after complete answers and after a client that
 * leaves mid-stream, /metrics. Exits 0 and prints "gateway example: ok", or fails with an
 * AssertionError. scripts/test-java.sh runs it without LD_LIBRARY_PATH.
 */
public final class GatewayExampleTest {
  private static final Duration WAIT = Duration.ofSeconds(60);
  private static final HttpClient HTTP = HttpClient.newHttpClient();
  private static final List<Process> processes = new ArrayList<>();

  public static void main(String[] args) throws Exception {
    try {
      run();
      System.out.println("gateway example: ok");
    } finally {
      for (Process p : processes) p.destroy();
      for (Process p : processes) p.waitFor();
    }
  }

  @SuppressWarnings("try") // the sockets are held open, then closed: that is the test
  private static void run() throws Exception {
    int port1 = freePort();
    int port2 = freePort();
    String engine1 = "http://127.0.0.1:" + port1;
    String engine2 = "http://127.0.0.1:" + port2;
    Map<String, Object> gw =
        start(
            "io.kvrouter.examples.Gateway",
            "--port", "0",
            "--block-size", "16",
            "--engine", "1=" + engine1,
            "--engine", "2=" + engine2,
            "--kv-listen", "tcp://127.0.0.1:0");
    String gateway = (String) gw.get("listening");
    String kv = (String) gw.get("kv_endpoint");
    check(kv != null && kv.startsWith("tcp://127.0.0.1:"), "kv endpoint " + kv);
    // Engine 1 slow enough for a client to leave mid-stream.
    start("io.kvrouter.examples.FakeEngine", "--port", "" + port1, "--worker-id", "1",
        "--token-delay-ms", "20", "--kv-endpoint", kv);
    start("io.kvrouter.examples.FakeEngine", "--port", "" + port2, "--worker-id", "2",
        "--token-delay-ms", "20", "--kv-endpoint", kv);

    check(get(gateway, "/health").body().contains("ok"), "/health");
    check(metric(gateway, "kvrouter_workers") == 2, "two workers");

    // A first request: routed somewhere, nothing cached; a complete JSON answer.
    int[] a = prompt(64, 1000);
    HttpResponse<String> r = complete(gateway, a, 4, false);
    check(r.statusCode() == 200, "status " + r.statusCode() + ": " + r.body());
    long wa = Long.parseLong(r.headers().firstValue("x-kvrouter-worker").orElseThrow());
    check(r.headers().firstValue("x-kvrouter-cached-tokens").orElseThrow().equals("0"),
        "nothing cached yet");
    check(r.body().contains("\" t0 t1 t2 t3\"") && r.body().contains("\"finish_reason\":\"length\""),
        "the answer gathers the engine's tokens: " + r.body());
    // (The gateway frees a request once its answer is written: the client may read it first.)
    await("freed after a complete answer", () -> metric(gateway, "kvrouter_requests_active") == 0);

    // Once worker wa's stored event is in, a longer prompt with the same prefix goes there.
    await("worker " + wa + "'s 4 blocks indexed",
        () -> metric(gateway, "kvrouter_index_blocks") >= 4);
    int[] a2 = concat(a, prompt(32, 5000));
    r = complete(gateway, a2, 3, true);
    check(r.statusCode() == 200, "status " + r.statusCode());
    check(r.headers().firstValue("x-kvrouter-worker").orElseThrow().equals("" + wa),
        "prefix affinity: worker " + wa + ", got " + r.headers().firstValue("x-kvrouter-worker"));
    check(r.headers().firstValue("x-kvrouter-cached-tokens").orElseThrow().equals("64"),
        "64 tokens cached, got " + r.headers().firstValue("x-kvrouter-cached-tokens"));
    check(r.headers().firstValue("content-type").orElseThrow().startsWith("text/event-stream"),
        "a stream");
    check(count(r.body(), "data: {") == 3 && r.body().trim().endsWith("data: [DONE]"),
        "three chunks then [DONE]: " + r.body());

    // Another prefix, sent while worker wa is busy with a long stream: it lands on the other
    // worker; once its blocks are in, it keeps going there when both are idle.
    long wb = wa == 1 ? 2 : 1;
    int[] b = prompt(64, 9000);
    try (Socket busy = streamAndReadFirstChunk(gateway, concat(a, prompt(16, 7000)), 500)) {
      r = complete(gateway, b, 2, false);
      check(r.headers().firstValue("x-kvrouter-worker").orElseThrow().equals("" + wb),
          "the idle worker " + wb + " takes a new prefix");
    }
    await("worker " + wb + "'s blocks indexed", () -> metric(gateway, "kvrouter_index_blocks") >= 8);
    await("the abandoned request freed", () -> metric(gateway, "kvrouter_requests_active") == 0);
    r = complete(gateway, concat(b, prompt(16, 3000)), 2, false);
    check(r.headers().firstValue("x-kvrouter-worker").orElseThrow().equals("" + wb),
        "prefix affinity: worker " + wb);
    check(r.headers().firstValue("x-kvrouter-cached-tokens").orElseThrow().equals("64"), "64 cached");

    // A client that leaves mid-stream: the request is active while it streams, freed after.
    double disconnectsBefore = metric(gateway, "kvrouter_gateway_disconnects_total");
    await("the last answer's request freed",
        () -> metric(gateway, "kvrouter_requests_active") == 0);
    try (Socket s = streamAndReadFirstChunk(gateway, a2, 500)) {
      check(metric(gateway, "kvrouter_requests_active") == 1, "active while streaming");
      check(metric(gateway, "kvrouter_worker_active_decode_blocks{worker_id=\"" + wa + "\"") > 0,
          "the load is on worker " + wa);
    }
    await("the abandoned request freed", () -> metric(gateway, "kvrouter_requests_active") == 0);
    await("the disconnect counted",
        () -> metric(gateway, "kvrouter_gateway_disconnects_total") == disconnectsBefore + 1);
    String engineA = wa == 1 ? engine1 : engine2;
    await("the engine saw the cancel",
        () -> get(engineA, "/stats").body().matches(".*\"cancelled\":[1-9].*"));
    check(metric(gateway, "kvrouter_worker_active_prefill_tokens{worker_id=\"" + wa + "\"") == 0,
        "no prefill load left on worker " + wa);

    // /metrics: the router's text, the ingest's counters by way of the index, the gateway's own.
    String text = get(gateway, "/metrics").body();
    check(metric(gateway, "kvrouter_decisions_total") == 6, "6 decisions:\n" + text);
    check(metric(gateway, "kvrouter_gateway_requests_total") == 6, "6 requests");
    check(metric(gateway, "kvrouter_gateway_completed_total") == 4, "4 completed:\n" + text);
    check(metric(gateway, "kvrouter_kv_events_total{kind=\"stored\",outcome=\"ok\"") >= 4,
        "stored events applied:\n" + text);
    check(text.contains("# TYPE kvrouter_gateway_first_token_seconds_total counter"), text);
    check(text.contains("# TYPE kvrouter_decision_duration_seconds histogram"), text);
    // The library times one routing call in 16, the first included: 1 of the 6.
    check(metric(gateway, "kvrouter_decision_duration_seconds_count") == 1, "1 decision timed");
    // The ingest's text: the listener's counters, labelled with its endpoint.
    check(metric(gateway, "kvrouter_ingest_events_applied_total{source_id=\"1\",kind=\"listener\","
            + "endpoint=\"" + kv + "\"") >= 4, "events applied by the listener:\n" + text);
    check(metric(gateway, "kvrouter_ingest_connections_total{source_id=\"1\"") == 2,
        "two engines connected:\n" + text);

    // Errors: a bad body, an unknown path.
    HttpResponse<String> bad =
        HTTP.send(
            HttpRequest.newBuilder(URI.create(gateway + "/v1/completions"))
                .POST(HttpRequest.BodyPublishers.ofString("{\"prompt\": \"text\"}"))
                .build(),
            HttpResponse.BodyHandlers.ofString());
    check(bad.statusCode() == 400 && bad.body().contains("token ids"), "400: " + bad.body());
    check(get(gateway, "/nowhere").statusCode() == 404, "404");
  }

  // ---- helpers

  private static void check(boolean ok, String what) {
    if (!ok) throw new AssertionError(what);
  }

  private static void await(String what, BooleanSupplier condition) throws InterruptedException {
    long deadline = System.nanoTime() + WAIT.toNanos();
    while (!condition.getAsBoolean()) {
      if (System.nanoTime() > deadline) throw new AssertionError("timed out waiting for " + what);
      Thread.sleep(10);
    }
  }

  private static int freePort() throws IOException {
    try (ServerSocket s = new ServerSocket(0)) {
      return s.getLocalPort();
    }
  }

  /** Starts a main class of the examples in a JVM of its own; returns its first stdout line. */
  private static Map<String, Object> start(String main, String... args) throws IOException {
    List<String> command = new ArrayList<>();
    command.add(Path.of(System.getProperty("java.home"), "bin", "java").toString());
    command.add("--enable-native-access=ALL-UNNAMED");
    command.add("-cp");
    command.add(System.getProperty("java.class.path"));
    command.add(main);
    command.addAll(List.of(args));
    Process p =
        new ProcessBuilder(command).redirectError(ProcessBuilder.Redirect.INHERIT).start();
    processes.add(p);
    BufferedReader out =
        new BufferedReader(new InputStreamReader(p.getInputStream(), StandardCharsets.UTF_8));
    String line = out.readLine();
    if (line == null) throw new AssertionError(main + " did not start");
    @SuppressWarnings("unchecked")
    Map<String, Object> hello = (Map<String, Object>) Gateway.Json.parse(line);
    return hello;
  }

  private static int[] prompt(int n, int base) {
    int[] t = new int[n];
    for (int i = 0; i < n; ++i) t[i] = base + i;
    return t;
  }

  private static int[] concat(int[] x, int[] y) {
    int[] t = java.util.Arrays.copyOf(x, x.length + y.length);
    System.arraycopy(y, 0, t, x.length, y.length);
    return t;
  }

  private static int count(String text, String what) {
    int n = 0;
    for (int i = text.indexOf(what); i >= 0; i = text.indexOf(what, i + 1)) ++n;
    return n;
  }

  private static String body(int[] prompt, int maxTokens, boolean stream) {
    List<Object> tokens = new ArrayList<>();
    for (int t : prompt) tokens.add((long) t);
    Map<String, Object> req = new LinkedHashMap<>();
    req.put("model", "m");
    req.put("prompt", tokens);
    req.put("max_tokens", (long) maxTokens);
    req.put("stream", stream);
    return Gateway.Json.write(req);
  }

  private static HttpResponse<String> get(String base, String path) {
    try {
      return HTTP.send(
          HttpRequest.newBuilder(URI.create(base + path)).build(),
          HttpResponse.BodyHandlers.ofString());
    } catch (IOException e) {
      throw new AssertionError("GET " + base + path + ": " + e, e);
    } catch (InterruptedException e) {
      Thread.currentThread().interrupt();
      throw new AssertionError(e);
    }
  }

  private static HttpResponse<String> complete(
      String base, int[] prompt, int maxTokens, boolean stream) throws Exception {
    return HTTP.send(
        HttpRequest.newBuilder(URI.create(base + "/v1/completions"))
            .header("content-type", "application/json")
            .POST(HttpRequest.BodyPublishers.ofString(body(prompt, maxTokens, stream)))
            .build(),
        HttpResponse.BodyHandlers.ofString());
  }

  /** A value of the gateway's /metrics: the first sample whose line starts with {@code name}. */
  private static double metric(String base, String name) {
    String text = get(base, "/metrics").body();
    Matcher m = Pattern.compile("(?m)^" + Pattern.quote(name) + "(?:[{,}][^\\n]*)? (\\S+)$").matcher(text);
    if (!m.find()) throw new AssertionError("no metric " + name + " in\n" + text);
    return Double.parseDouble(m.group(1));
  }

  /**
   * A streamed request on a raw socket, read up to its first data chunk; the caller closes the
   * socket to leave mid-stream.
   */
  private static Socket streamAndReadFirstChunk(String base, int[] prompt, int maxTokens)
      throws IOException {
    URI uri = URI.create(base);
    Socket s = new Socket(uri.getHost(), uri.getPort());
    byte[] payload = body(prompt, maxTokens, true).getBytes(StandardCharsets.UTF_8);
    OutputStream out = s.getOutputStream();
    out.write(
        ("POST /v1/completions HTTP/1.1\r\nhost: " + uri.getAuthority()
                + "\r\ncontent-type: application/json\r\ncontent-length: " + payload.length
                + "\r\n\r\n")
            .getBytes(StandardCharsets.UTF_8));
    out.write(payload);
    out.flush();
    InputStream in = s.getInputStream();
    StringBuilder seen = new StringBuilder();
    while (seen.indexOf("data: {") < 0) {
      int c = in.read();
      if (c < 0) throw new AssertionError("the stream ended before its first chunk: " + seen);
      seen.append((char) c);
    }
    check(seen.toString().startsWith("HTTP/1.1 200"), "streaming: " + seen);
    return s;
  }
}
