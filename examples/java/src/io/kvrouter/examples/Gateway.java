package io.kvrouter.examples;

import com.sun.net.httpserver.HttpExchange;
import com.sun.net.httpserver.HttpServer;
import io.kvrouter.EngineWorker;
import io.kvrouter.Ingest;
import io.kvrouter.KvRouterException;
import io.kvrouter.RequestOptions;
import io.kvrouter.RouteResult;
import io.kvrouter.Router;
import io.kvrouter.RouterOptions;
import java.io.BufferedReader;
import java.io.IOException;
import java.io.InputStream;
import java.io.InputStreamReader;
import java.io.OutputStream;
import java.io.PrintStream;
import java.net.InetSocketAddress;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.atomic.AtomicLong;
import java.util.concurrent.atomic.DoubleAdder;

/**
 * An LLM gateway routed by kvrouter: OpenAI-style completions with token-id prompts, on the JDK's
 * own HTTP server and client (no framework).
 *
 * <pre>
 * java -cp kvrouter-0.2.0.jar:classes io.kvrouter.examples.Gateway --port 8000 --block-size 16 \
 *     --engine 1=http://127.0.0.1:9001 --engine 2=http://127.0.0.1:9002 \
 *     --kv-listen tcp://127.0.0.1:5557            # engines publish KV events here
 *     [--engine-zmq 1=tcp://10.0.0.5:5557 ...]    # or: vLLM/SGLang ZMQ KV publishers
 * </pre>
 *
 * <p>For each {@code POST /v1/completions} ({@code {"prompt": [token ids], "max_tokens": N,
 * "stream": bool}}) the gateway asks the router for the worker that holds the longest cached prefix
 * of the prompt at the lowest load and books the request there ({@code findBestMatch} with a request
 * id), sends it to that engine, and streams the engine's server-sent events through to the client
 * (or gathers them into one JSON answer for {@code "stream": false}). The request's first token
 * marks its prefill completed; the end of the stream, an engine failure or the client going away
 * (seen when a write to it fails) frees it. Engines' KV events reach the router through an ingest
 * loop (a native stream listener, or ZMQ subscriptions to vLLM/SGLang publishers), so the index
 * follows what every engine caches. {@code GET /metrics} serves the router's and the ingest's
 * Prometheus text and the gateway's own counters; {@code GET /health} answers ok.
 *
 * <p>On start it prints one JSON line to stdout: {@code {"listening": URL, "kv_endpoint":
 * ENDPOINT}} (the tests read it; port 0 picks free ports).
 */
public final class Gateway implements AutoCloseable {
  private final Map<Long, String> engines = new LinkedHashMap<>();
  private final Router router;
  private final Ingest ingest;
  private final String kvEndpoint;
  private final HttpServer server;
  private final ExecutorService executor = Executors.newCachedThreadPool();
  private final HttpClient client =
      HttpClient.newBuilder()
          .version(HttpClient.Version.HTTP_1_1)
          .connectTimeout(Duration.ofSeconds(5))
          .build();
  private final AtomicLong ids = new AtomicLong();
  private final AtomicLong requests = new AtomicLong();
  private final AtomicLong completed = new AtomicLong();
  private final AtomicLong disconnects = new AtomicLong();
  private final AtomicLong engineErrors = new AtomicLong();
  private final DoubleAdder firstTokenSeconds = new DoubleAdder();

  /** The command line, parsed. */
  static final class Options {
    String host = "127.0.0.1";
    int port = 8000;
    int blockSize = 16;
    Map<Long, String> engines = new LinkedHashMap<>();
    String kvListen;
    Map<Long, String> engineZmq = new LinkedHashMap<>();
    Double queueThreshold;

    static Options parse(String[] args) {
      Options o = new Options();
      for (int i = 0; i < args.length; ++i) {
        String a = args[i];
        if (a.equals("-h") || a.equals("--help")) usage(null);
        if (i + 1 >= args.length) usage(a + " needs a value");
        String v = args[++i];
        switch (a) {
          case "--host":
            o.host = v;
            break;
          case "--port":
            o.port = Integer.parseInt(v);
            break;
          case "--block-size":
            o.blockSize = Integer.parseInt(v);
            break;
          case "--engine":
            putWorker(o.engines, v);
            break;
          case "--kv-listen":
            o.kvListen = v;
            break;
          case "--engine-zmq":
            putWorker(o.engineZmq, v);
            break;
          case "--queue-threshold":
            o.queueThreshold = Double.parseDouble(v);
            break;
          default:
            usage("unknown option " + a);
        }
      }
      if (o.engines.isEmpty()) usage("at least one --engine ID=URL");
      return o;
    }

    private static void putWorker(Map<Long, String> map, String spec) {
      int eq = spec.indexOf('=');
      if (eq <= 0) usage("expected ID=VALUE, got " + spec);
      map.put(Long.parseUnsignedLong(spec.substring(0, eq)), spec.substring(eq + 1));
    }

    private static void usage(String error) {
      PrintStream out = error == null ? System.out : System.err;
      if (error != null) out.println("gateway: " + error);
      out.println(
          "usage: Gateway [--host H] [--port P (0: free)] [--block-size N] --engine ID=URL..."
              + " [--kv-listen tcp://HOST:PORT|unix://PATH] [--engine-zmq ID=ENDPOINT...]"
              + " [--queue-threshold X (negative: never queue)]");
      System.exit(error == null ? 0 : 2);
    }
  }

  Gateway(Options o) throws IOException {
    for (Map.Entry<Long, String> e : o.engines.entrySet()) {
      engines.put(e.getKey(), e.getValue().replaceAll("/+$", ""));
    }
    RouterOptions.Builder options = RouterOptions.builder().blockSize(o.blockSize);
    if (o.queueThreshold != null) options.queueThreshold(o.queueThreshold);
    router = new Router(options.build());
    for (long worker : engines.keySet()) router.addWorker(worker);
    ingest = new Ingest(router);
    kvEndpoint = o.kvListen == null ? null : ingest.listen(o.kvListen).endpoint();
    for (Map.Entry<Long, String> e : o.engineZmq.entrySet()) {
      ingest.addEngineWorker(
          EngineWorker.builder(e.getValue(), e.getKey()).blockSize(o.blockSize).build());
    }
    ingest.start();

    server = HttpServer.create(new InetSocketAddress(o.host, o.port), 128);
    server.setExecutor(executor); // a thread per request: streams and queued requests block
    server.createContext("/", this::handle);
    server.start();
  }

  String url() {
    InetSocketAddress a = server.getAddress();
    return "http://" + a.getHostString() + ":" + a.getPort();
  }

  @Override
  public void close() {
    server.stop(0);
    executor.shutdownNow();
    ingest.close();
    router.close();
  }

  // ---- HTTP

  /** An answer other than 200, with its message. */
  static final class HttpError extends Exception {
    private static final long serialVersionUID = 1L;
    final int status;

    HttpError(int status, String message) {
      super(message);
      this.status = status;
    }
  }

  private void handle(HttpExchange exchange) {
    try {
      String path = exchange.getRequestURI().getPath();
      String method = exchange.getRequestMethod();
      if (path.equals("/v1/completions")) {
        if (!method.equals("POST")) throw new HttpError(405, "POST only");
        completions(exchange);
      } else if (path.equals("/metrics") && method.equals("GET")) {
        // The router's text, the ingest sources' (other names), and the gateway's counters.
        String text = router.metricsPrometheus() + ingest.metricsPrometheus() + gatewayMetrics();
        send(exchange, 200, "text/plain; version=0.0.4; charset=utf-8", text);
      } else if (path.equals("/health")) {
        send(exchange, 200, "application/json", "{\"status\":\"ok\"}");
      } else {
        throw new HttpError(404, "no route " + path);
      }
    } catch (HttpError e) {
      Map<String, Object> error = new LinkedHashMap<>();
      error.put("message", e.getMessage());
      try {
        send(exchange, e.status, "application/json", Json.write(Map.of("error", error)));
      } catch (IOException gone) {
        // the client went away
      }
    } catch (IOException e) {
      // the client went away
    } catch (RuntimeException e) {
      e.printStackTrace(); // a bug; the exchange is closed below (the client sees it end)
    } finally {
      exchange.close();
    }
  }

  private static void send(HttpExchange exchange, int status, String type, String body)
      throws IOException {
    byte[] bytes = body.getBytes(StandardCharsets.UTF_8);
    exchange.getResponseHeaders().set("content-type", type);
    exchange.sendResponseHeaders(status, bytes.length == 0 ? -1 : bytes.length);
    try (OutputStream out = exchange.getResponseBody()) {
      out.write(bytes);
    }
  }

  private String gatewayMetrics() {
    StringBuilder b = new StringBuilder();
    counter(b, "kvrouter_gateway_requests_total", "Completion requests received.", requests);
    counter(b, "kvrouter_gateway_completed_total", "Requests streamed to their end.", completed);
    counter(
        b,
        "kvrouter_gateway_disconnects_total",
        "Requests whose client went away first.",
        disconnects);
    counter(b, "kvrouter_gateway_engine_errors_total", "Requests an engine failed.", engineErrors);
    b.append("# HELP kvrouter_gateway_first_token_seconds_total Time to first token, summed.\n")
        .append("# TYPE kvrouter_gateway_first_token_seconds_total counter\n")
        .append(
            String.format(
                java.util.Locale.ROOT,
                "kvrouter_gateway_first_token_seconds_total %.6f%n",
                firstTokenSeconds.sum()));
    return b.toString();
  }

  private static void counter(StringBuilder b, String name, String help, AtomicLong value) {
    b.append("# HELP ").append(name).append(' ').append(help).append('\n');
    b.append("# TYPE ").append(name).append(" counter\n");
    b.append(name).append(' ').append(value.get()).append('\n');
  }

  // ---- completions

  private void completions(HttpExchange exchange) throws IOException, HttpError {
    Map<String, Object> req;
    int[] prompt;
    try (InputStream in = exchange.getRequestBody()) {
      Object parsed = Json.parse(new String(in.readAllBytes(), StandardCharsets.UTF_8));
      if (!(parsed instanceof Map)) throw new IllegalArgumentException("not a JSON object");
      @SuppressWarnings("unchecked")
      Map<String, Object> map = (Map<String, Object>) parsed;
      req = map;
      prompt = tokenIds(req.get("prompt"));
    } catch (IllegalArgumentException e) {
      throw new HttpError(400, "bad completion request: " + e.getMessage());
    }
    requests.incrementAndGet();
    String requestId = "gw-" + ids.incrementAndGet();
    long started = System.nanoTime();
    RouteResult decision;
    try { // admitted: it may wait in the admission queue (this request's thread only)
      decision = router.findBestMatch(prompt, RequestOptions.admit(requestId));
    } catch (KvRouterException e) {
      throw new HttpError(503, "no worker: " + e.getMessage());
    }
    try {
      proxy(exchange, req, decision, requestId, started);
    } finally {
      try {
        router.freeRequest(requestId); // ended, failed or abandoned: no longer load
      } catch (KvRouterException e) {
        // already gone (a router reset); nothing to free
      }
    }
  }

  /** The prompt: a JSON list of token ids (unsigned 32-bit). */
  private static int[] tokenIds(Object prompt) {
    if (!(prompt instanceof List)) {
      throw new IllegalArgumentException("prompt must be a list of token ids");
    }
    List<?> list = (List<?>) prompt;
    int[] tokens = new int[list.size()];
    for (int i = 0; i < tokens.length; ++i) {
      Object t = list.get(i);
      if (!(t instanceof Long) || (Long) t < 0 || (Long) t > 0xFFFF_FFFFL) {
        throw new IllegalArgumentException("prompt must be a list of token ids");
      }
      tokens[i] = (int) (long) (Long) t;
    }
    return tokens;
  }

  private void proxy(
      HttpExchange exchange,
      Map<String, Object> req,
      RouteResult decision,
      String requestId,
      long started)
      throws IOException, HttpError {
    long worker = decision.workerId();
    boolean stream = Boolean.TRUE.equals(req.get("stream"));
    Map<String, Object> forward = new LinkedHashMap<>(req);
    forward.put("stream", true); // always stream from the engine: the first token marks prefill
    HttpRequest request =
        HttpRequest.newBuilder(URI.create(engines.get(worker) + "/v1/completions"))
            .header("content-type", "application/json")
            .header("x-request-id", requestId)
            .POST(HttpRequest.BodyPublishers.ofString(Json.write(forward)))
            .build();
    HttpResponse<InputStream> response;
    try {
      response = client.send(request, HttpResponse.BodyHandlers.ofInputStream());
    } catch (IOException e) {
      engineErrors.incrementAndGet();
      throw new HttpError(502, "engine " + worker + " unreachable: " + e);
    } catch (InterruptedException e) {
      Thread.currentThread().interrupt();
      throw new HttpError(503, "interrupted");
    }
    // Closing the engine's body before its end drops the connection: the engine stops.
    try (InputStream body = response.body()) {
      if (response.statusCode() != 200) {
        engineErrors.incrementAndGet();
        throw new HttpError(502, "engine " + worker + ": status " + response.statusCode());
      }
      var headers = exchange.getResponseHeaders();
      headers.set("x-kvrouter-worker", Long.toUnsignedString(worker));
      headers.set("x-kvrouter-cached-tokens", Long.toString(decision.cachedTokens()));
      headers.set("x-request-id", requestId);
      OutputStream out = null;
      if (stream) {
        headers.set("content-type", "text/event-stream");
        headers.set("cache-control", "no-cache");
        exchange.sendResponseHeaders(200, 0); // chunked
        out = exchange.getResponseBody();
      }
      BufferedReader lines =
          new BufferedReader(new InputStreamReader(body, StandardCharsets.UTF_8));
      boolean first = true;
      StringBuilder text = new StringBuilder();
      Object finish = null;
      String line;
      while ((line = readEngine(lines)) != null) {
        if (!line.startsWith("data:")) continue;
        String data = line.substring(5).trim();
        if (first) {
          first = false;
          router.markPrefillCompleted(requestId); // the first token is out
          firstTokenSeconds.add((System.nanoTime() - started) / 1e9);
        }
        if (stream) {
          try {
            out.write(("data: " + data + "\n\n").getBytes(StandardCharsets.UTF_8));
            out.flush(); // throws once the client is gone
          } catch (IOException gone) {
            disconnects.incrementAndGet();
            throw gone;
          }
        }
        if (data.equals("[DONE]")) break;
        if (!stream) {
          Map<?, ?> choice = firstChoice(Json.parse(data));
          Object t = choice.get("text");
          if (t instanceof String) text.append((String) t);
          if (choice.get("finish_reason") != null) finish = choice.get("finish_reason");
        }
      }
      if (stream) {
        out.close();
      } else {
        Map<String, Object> choice = new LinkedHashMap<>();
        choice.put("index", 0L);
        choice.put("text", text.toString());
        choice.put("finish_reason", finish);
        Map<String, Object> answer = new LinkedHashMap<>();
        answer.put("id", requestId);
        answer.put("object", "text_completion");
        answer.put("model", req.getOrDefault("model", ""));
        answer.put("choices", List.of(choice));
        try {
          send(exchange, 200, "application/json", Json.write(answer));
        } catch (IOException gone) {
          disconnects.incrementAndGet();
          throw gone;
        }
      }
      completed.incrementAndGet();
    }
  }

  /** A line of the engine's stream; an engine that fails mid-stream counts as an engine error. */
  private String readEngine(BufferedReader lines) throws IOException {
    try {
      return lines.readLine();
    } catch (IOException e) {
      engineErrors.incrementAndGet();
      throw e;
    }
  }

  private static Map<?, ?> firstChoice(Object chunk) {
    if (chunk instanceof Map) {
      Object choices = ((Map<?, ?>) chunk).get("choices");
      if (choices instanceof List && !((List<?>) choices).isEmpty()) {
        Object c = ((List<?>) choices).get(0);
        if (c instanceof Map) return (Map<?, ?>) c;
      }
    }
    return Map.of();
  }

  public static void main(String[] args) throws Exception {
    Options options = Options.parse(args);
    Gateway gateway = new Gateway(options);
    Map<String, Object> hello = new LinkedHashMap<>();
    hello.put("listening", gateway.url());
    hello.put("kv_endpoint", gateway.kvEndpoint);
    System.out.println(Json.write(hello)); // one line for whoever started us
    System.out.flush();
    CountDownLatch stopped = new CountDownLatch(1);
    Runtime.getRuntime()
        .addShutdownHook(
            new Thread(
                () -> {
                  gateway.close();
                  stopped.countDown();
                }));
    stopped.await();
  }

  // ---- JSON: the little a gateway needs (objects, arrays, strings, numbers, literals)

  /** A small JSON reader and writer: objects are maps, arrays lists, integers Longs. */
  static final class Json {
    private final String s;
    private int i;

    private Json(String s) {
      this.s = s;
    }

    /** Objects as LinkedHashMap, arrays as ArrayList, integers as Long, other numbers Double. */
    static Object parse(String text) {
      Json p = new Json(text);
      Object v = p.value();
      p.space();
      if (p.i != text.length()) throw p.error("trailing characters");
      return v;
    }

    private IllegalArgumentException error(String what) {
      return new IllegalArgumentException("JSON: " + what + " at offset " + i);
    }

    private void space() {
      while (i < s.length() && " \t\r\n".indexOf(s.charAt(i)) >= 0) ++i;
    }

    private Object value() {
      space();
      if (i >= s.length()) throw error("unexpected end");
      char c = s.charAt(i);
      if (c == '{') {
        ++i;
        Map<String, Object> map = new LinkedHashMap<>();
        space();
        if (peek('}')) return map;
        do {
          space();
          if (i >= s.length() || s.charAt(i) != '"') throw error("expected a key");
          String key = string();
          space();
          expect(':');
          map.put(key, value());
          space();
        } while (peek(','));
        expect('}');
        return map;
      }
      if (c == '[') {
        ++i;
        List<Object> list = new ArrayList<>();
        space();
        if (peek(']')) return list;
        do {
          list.add(value());
          space();
        } while (peek(','));
        expect(']');
        return list;
      }
      if (c == '"') return string();
      if (s.startsWith("true", i)) return literal(4, Boolean.TRUE);
      if (s.startsWith("false", i)) return literal(5, Boolean.FALSE);
      if (s.startsWith("null", i)) return literal(4, null);
      return number();
    }

    private Object literal(int length, Object value) {
      i += length;
      return value;
    }

    private boolean peek(char c) {
      if (i < s.length() && s.charAt(i) == c) {
        ++i;
        return true;
      }
      return false;
    }

    private void expect(char c) {
      if (!peek(c)) throw error("expected '" + c + "'");
    }

    private Object number() {
      int start = i;
      while (i < s.length() && "+-0123456789.eE".indexOf(s.charAt(i)) >= 0) ++i;
      String n = s.substring(start, i);
      if (n.isEmpty()) throw error("unexpected character");
      try {
        return n.matches("-?[0-9]+") ? (Object) Long.parseLong(n) : (Object) Double.parseDouble(n);
      } catch (NumberFormatException e) {
        throw error("bad number " + n);
      }
    }

    private String string() {
      ++i; // the opening quote
      StringBuilder b = new StringBuilder();
      while (true) {
        if (i >= s.length()) throw error("unterminated string");
        char c = s.charAt(i++);
        if (c == '"') return b.toString();
        if (c != '\\') {
          b.append(c);
          continue;
        }
        if (i >= s.length()) throw error("unterminated string");
        char e = s.charAt(i++);
        switch (e) {
          case 'n':
            b.append('\n');
            break;
          case 't':
            b.append('\t');
            break;
          case 'r':
            b.append('\r');
            break;
          case 'b':
            b.append('\b');
            break;
          case 'f':
            b.append('\f');
            break;
          case 'u':
            if (i + 4 > s.length()) throw error("bad escape");
            b.append((char) Integer.parseInt(s.substring(i, i + 4), 16));
            i += 4;
            break;
          default:
            b.append(e); // \" \\ \/
        }
      }
    }

    static String write(Object v) {
      StringBuilder b = new StringBuilder();
      write(b, v);
      return b.toString();
    }

    private static void write(StringBuilder b, Object v) {
      if (v == null) {
        b.append("null");
      } else if (v instanceof String) {
        b.append('"');
        for (char c : ((String) v).toCharArray()) {
          if (c == '"' || c == '\\') b.append('\\').append(c);
          else if (c < 0x20) b.append(String.format("\\u%04x", (int) c));
          else b.append(c);
        }
        b.append('"');
      } else if (v instanceof Map) {
        b.append('{');
        boolean first = true;
        for (Map.Entry<?, ?> e : ((Map<?, ?>) v).entrySet()) {
          if (!first) b.append(',');
          first = false;
          write(b, String.valueOf(e.getKey()));
          b.append(':');
          write(b, e.getValue());
        }
        b.append('}');
      } else if (v instanceof List) {
        b.append('[');
        boolean first = true;
        for (Object o : (List<?>) v) {
          if (!first) b.append(',');
          first = false;
          write(b, o);
        }
        b.append(']');
      } else {
        b.append(v); // Long, Double, Boolean
      }
    }
  }
}
