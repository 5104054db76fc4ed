package io.kvrouter;

import static org.junit.jupiter.api.Assertions.assertEquals;

import org.junit.jupiter.api.Test;

/** The example of bindings/java/README.md, as written there. */
class ReadmeExampleTest {
  @Test
  void theReadmeExampleRoutesToWorkerTwo() {
    RouteResult seen;
    try (Router router = new Router(RouterOptions.builder().blockSize(16).build())) {
      for (long id = 1; id <= 4; ++id) router.addWorker(id);
      int[] prompt = new int[48];
      for (int i = 0; i < prompt.length; ++i) prompt[i] = 1000 + i;
      router.applyStored(
          StoredEvent.builder(2)
              .blockHashes(0xA1, 0xA2) // worker 2 cached
              .tokenIds(java.util.Arrays.copyOf(prompt, 32))
              .build()); // two blocks of it
      RouteResult r = router.findBestMatch(prompt, RequestOptions.admit("req-1"));
      System.out.println("worker " + r.workerId() + ", " + r.cachedTokens() + " tokens cached");
      router.markPrefillCompleted("req-1"); // first token
      router.freeRequest("req-1"); // request ended
      seen = r;
    }
    assertEquals(2, seen.workerId());
    assertEquals(32, seen.cachedTokens());
  }
}
