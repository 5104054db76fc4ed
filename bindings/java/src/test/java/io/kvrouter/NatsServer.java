package io.kvrouter;

import static org.junit.jupiter.api.Assumptions.assumeTrue;

import java.io.IOException;
import java.net.InetAddress;
import java.net.InetSocketAddress;
import java.net.ServerSocket;
import java.net.Socket;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Comparator;
import java.util.List;
import java.util.concurrent.TimeUnit;

/**
 * A nats-server on 127.0.0.1 and a free port (JetStream on if asked), for one test; skips the test
 * without one.
 */
final class NatsServer implements AutoCloseable {
  private final Process process;
  private final int port;
  private final Path store; // JetStream's, or null
  private final Path config; // the configuration file's directory, or null

  private NatsServer(Process process, int port, Path store, Path config) {
    this.process = process;
    this.port = port;
    this.store = store;
    this.config = config;
  }

  static NatsServer startOrSkip() throws IOException {
    return startOrSkip(false);
  }

  /** With {@code jetstream}: JetStream on, its store in a temporary directory. */
  static NatsServer startOrSkip(boolean jetstream) throws IOException {
    return startOrSkip(jetstream, null);
  }

  /**
   * As {@link #startOrSkip(boolean)}, and with {@code config} (a configuration file's text, e.g.
   * {@code "max_payload: 4096\n"}) unless null, written into a temporary directory and passed
   * with {@code -c}.
   */
  static NatsServer startOrSkip(boolean jetstream, String config) throws IOException {
    Path server = null;
    for (String candidate : new String[] {"/usr/sbin/nats-server", "/usr/bin/nats-server"}) {
      if (Files.isExecutable(Path.of(candidate))) server = Path.of(candidate);
    }
    assumeTrue(server != null, "nats-server is not installed");
    int port;
    try (ServerSocket probe = new ServerSocket(0, 1, InetAddress.getLoopbackAddress())) {
      port = probe.getLocalPort();
    }
    List<String> command =
        new ArrayList<>(List.of(server.toString(), "-a", "127.0.0.1", "-p", Integer.toString(port)));
    Path store = null;
    if (jetstream) {
      store = Files.createTempDirectory("kvr-java-js");
      command.addAll(List.of("-js", "-sd", store.toString()));
    }
    Path configDir = null;
    if (config != null) {
      configDir = Files.createTempDirectory("kvr-java-nats");
      Path file = Files.writeString(configDir.resolve("nats.conf"), config);
      command.addAll(List.of("-c", file.toString()));
    }
    Process process =
        new ProcessBuilder(command)
            .redirectErrorStream(true)
            .redirectOutput(ProcessBuilder.Redirect.DISCARD)
            .start();
    NatsServer nats = new NatsServer(process, port, store, configDir);
    try {
      TestSupport.await("nats-server on port " + port, Duration.ofSeconds(10), nats::accepts);
    } catch (AssertionError e) {
      nats.close();
      throw e;
    }
    return nats;
  }

  int port() {
    return port;
  }

  String url() {
    return "nats://127.0.0.1:" + port;
  }

  private boolean accepts() {
    try (Socket s = new Socket()) {
      s.connect(new InetSocketAddress("127.0.0.1", port), 200);
      return true;
    } catch (IOException e) {
      return false;
    }
  }

  @Override
  public void close() {
    process.destroy();
    try {
      if (!process.waitFor(10, TimeUnit.SECONDS)) process.destroyForcibly().waitFor();
    } catch (InterruptedException e) {
      process.destroyForcibly();
      Thread.currentThread().interrupt();
    }
    for (Path dir : new Path[] {store, config}) {
      if (dir == null) continue;
      try (var files = Files.walk(dir)) {
        files.sorted(Comparator.reverseOrder()).forEach(p -> p.toFile().delete());
      } catch (IOException e) {
        // a temporary directory left behind
      }
    }
  }
}
