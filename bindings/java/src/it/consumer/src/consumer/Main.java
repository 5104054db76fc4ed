package consumer;

import io.kvrouter.KvRouter;
import io.kvrouter.RequestOptions;
import io.kvrouter.RouteResult;
import io.kvrouter.Router;
import io.kvrouter.RouterOptions;
import io.kvrouter.StoredEvent;
import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.Arrays;

/**
 * A user of the kvrouter jar and nothing else: routes one request to the worker that holds its
 * prefix, then checks that no libkvrouter shared library was mapped into the process (the jar's
 * native carries the library). Prints "routed to worker 2 ..." and exits 0, or fails.
 */
public final class Main {
  public static void main(String[] args) throws IOException {
    try (Router router = new Router(RouterOptions.builder().blockSize(16).build())) {
      for (long id = 1; id <= 3; ++id) router.addWorker(id);
      int[] prompt = new int[48];
      for (int i = 0; i < prompt.length; ++i) prompt[i] = 500 + i;
      router.applyStored(
          StoredEvent.builder(2).blockHashes(7, 8).tokenIds(Arrays.copyOf(prompt, 32)).build());
      RouteResult r = router.findBestMatch(prompt, RequestOptions.admit("consumer-1"));
      router.markPrefillCompleted("consumer-1");
      router.freeRequest("consumer-1");
      if (r.workerId() != 2 || r.cachedTokens() != 32) {
        throw new AssertionError("expected worker 2 with 32 tokens cached, got " + r);
      }
      System.out.println(
          "routed to worker " + r.workerId() + " (" + r.cachedTokens() + " tokens cached), kvrouter "
              + KvRouter.versionString() + ", module " + Router.class.getModule().getName());
    }
    Path maps = Path.of("/proc/self/maps");
    if (Files.exists(maps)) {
      for (String line : Files.readAllLines(maps)) {
        if (line.contains("/libkvrouter.so")) {
          throw new AssertionError("a shared libkvrouter was loaded: " + line);
        }
      }
    }
  }
}
