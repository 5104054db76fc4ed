package consumer;

import io.kvrouter.KvRouter;
import io.kvrouter.RequestOptions;
import io.kvrouter.RouteResult;
import io.kvrouter.Router;
import io.kvrouter.RouterOptions;
import io.kvrouter.StoredEvent;
import java.io.IOException;
import java.io.InputStream;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;

/**
 * A user of the kvrouter jar and nothing else: routes one request to the worker that holds its
 * prefix, then checks that no libkvrouter shared library was mapped into the process (the jar's
 * native carries the library) and that the shared libraries the jar carries for it (libnats,
 * libzmq, libuv, Abseil, and theirs) were mapped from the jar's extraction directory, not from the
 * system. Prints "routed to worker 2 ..." and exits 0, or fails.
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
      List<String> mapped = new ArrayList<>();
      for (String line : Files.readAllLines(maps)) {
        if (line.contains("/libkvrouter.so")) {
          throw new AssertionError("a shared libkvrouter was loaded: " + line);
        }
        int slash = line.indexOf('/');
        if (slash < 0) continue;
        String file = line.substring(slash).replaceFirst(" \\(deleted\\)$", "");
        if (!mapped.contains(file)) mapped.add(file);
      }
      checkVendored(mapped);
    }
  }

  /**
   * The shared libraries the jar carries (its index, linux/x86_64/libkvrouter_jni.libs) are the
   * ones in use although the system has its own copies: each is mapped from the directory the glue
   * was loaded from, and no other file of that library is mapped.
   */
  private static void checkVendored(List<String> mapped) throws IOException {
    List<String> index = new ArrayList<>();
    try (InputStream in =
        Router.class.getModule().getResourceAsStream("linux/x86_64/libkvrouter_jni.libs")) {
      if (in == null) throw new AssertionError("the jar has no linux/x86_64/libkvrouter_jni.libs");
      for (String line : new String(in.readAllBytes(), StandardCharsets.UTF_8).split("\n")) {
        if (!line.isBlank() && !line.startsWith("#")) index.add(line.strip());
      }
    }
    Path glue =
        mapped.stream()
            .map(Path::of)
            .filter(p -> p.getFileName().toString().equals("libkvrouter_jni.so"))
            .findFirst()
            .orElseThrow(() -> new AssertionError("libkvrouter_jni.so is not mapped"));
    Path dir = glue.getParent();
    if (dir.startsWith("/usr") || dir.startsWith("/lib")) {
      throw new AssertionError("the glue was loaded from " + dir);
    }
    for (String prefix : List.of("libnats.so", "libzmq.so", "libuv.so", "libabsl_")) {
      if (index.stream().noneMatch(n -> n.startsWith(prefix))) {
        throw new AssertionError(prefix + "* is not in the jar's index " + index);
      }
    }
    for (String name : index) {
      String vendored = dir.resolve(name).toString();
      if (!mapped.contains(vendored)) throw new AssertionError(vendored + " is not mapped");
      String stem = name.substring(0, name.indexOf(".so") + 3); // libzmq.so of libzmq.so.5
      for (String file : mapped) {
        if (Path.of(file).getFileName().toString().startsWith(stem) && !file.equals(vendored)) {
          throw new AssertionError(file + " is mapped besides the jar's " + vendored);
        }
      }
    }
    System.out.println(
        index.size() + " libraries from the jar, mapped from " + dir + " (no system copy)");
  }
}
