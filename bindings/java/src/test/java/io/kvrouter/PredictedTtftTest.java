package io.kvrouter;

import static io.kvrouter.TestSupport.BLOCK;
import static io.kvrouter.TestSupport.routerWithWorkers;
import static io.kvrouter.TestSupport.tokens;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertNotEquals;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import org.junit.jupiter.api.Test;

/**
 * The predicted-TTFT cost ({@link RouterOptions.Builder#costFunction}, its per-request overrides)
 * and the router's clock driven by hand ({@link Router#setTime(long)}).
 */
class PredictedTtftTest {
  private static final int WORKERS = 4;

  @Test
  void optionsDefaultRoundTripAndRefuseBadValues() {
    RouterOptions d = RouterOptions.defaults();
    assertEquals(CostFunction.CREDIT, d.costFunction());
    assertEquals(3.0, d.ttftMissWeight());
    assertEquals(0.0, d.prefillTokensPerSecond());
    RequestOptions r = RequestOptions.builder().build();
    assertNull(r.costFunction());
    assertTrue(Double.isNaN(r.ttftMissWeight()));
    RequestOptions set =
        RequestOptions.builder()
            .costFunction(CostFunction.PREDICTED_TTFT)
            .ttftMissWeight(0.5)
            .build()
            .toBuilder()
            .build();
    assertEquals(CostFunction.PREDICTED_TTFT, set.costFunction());
    assertEquals(0.5, set.ttftMissWeight());
    assertNull(set.toBuilder().costFunction(null).build().costFunction());
    // An unknown cost function cannot be written as a CostFunction; the library's refusal of one
    // is tested in C (tests/capi/routing_test.c). CostFunction.of refuses one coming back.
    assertThrows(IllegalArgumentException.class, () -> CostFunction.of(7));

    for (RouterOptions bad :
        new RouterOptions[] {
          RouterOptions.builder().ttftMissWeight(-1).build(),
          RouterOptions.builder().ttftMissWeight(Double.POSITIVE_INFINITY).build(),
          RouterOptions.builder()
              .costFunction(CostFunction.PREDICTED_TTFT)
              .trackPrefillTokens(false)
              .build(),
        }) {
      KvRouterException e = assertThrows(KvRouterException.class, () -> new Router(bad));
      assertEquals(Status.INVALID_ARGUMENT, e.status(), e.getMessage());
    }
    try (Router router = routerWithWorkers(1)) {
      int[] prompt = tokens(32, 1);
      KvRouterException e =
          assertThrows(
              KvRouterException.class,
              () ->
                  router.findBestMatch(
                      prompt, RequestOptions.builder().ttftMissWeight(-1).build()));
      assertEquals(Status.INVALID_ARGUMENT, e.status());
      router.findBestMatch(prompt, set);
      // Time never goes back.
      router.setTime(5_000_000_000L);
      router.setTime(5_000_000_000L);
      e = assertThrows(KvRouterException.class, () -> router.setTime(4_999_999_999L));
      assertEquals(Status.INVALID_ARGUMENT, e.status());
    }
  }

  /**
   * Worker 1 prefills ten times as fast as the others (its requests complete in 10 ms of the
   * router's clock, theirs in 100 ms): with a 512-token backlog it still gives a fresh 512-token
   * prompt its first token soonest, which the predicted-TTFT cost sees and the credit form does
   * not.
   */
  @Test
  void predictedTtftFollowsTheCalibratedRates() {
    RouterOptions options =
        RouterOptions.builder()
            .blockSize(BLOCK)
            .randomSeed(7)
            .costFunction(CostFunction.PREDICTED_TTFT)
            .build();
    try (Router router = new Router(options)) {
      for (int w = 1; w <= WORKERS; ++w) router.addWorker(w);
      long now = 5_000_000_000L;
      router.setTime(now);
      int[] warm = tokens(512, 1);
      for (int i = 0; i < 16; ++i) {
        for (int w = 1; w <= WORKERS; ++w) {
          String name = "warm-" + w + "-" + i;
          router.addRequest(warm, w, 0, RequestOptions.withId(name));
          now += w == 1 ? 10_000_000L : 100_000_000L;
          router.setTime(now);
          router.markPrefillCompleted(name);
          router.freeRequest(name);
        }
      }
      router.addRequest(tokens(512, 100_000), 1, 0, RequestOptions.withId("backlog"));
      int[] fresh = tokens(512, 500_000); // cached nowhere
      RouteResult r = router.findBestMatch(fresh, null, WORKERS);
      assertEquals(1, r.workerId());
      assertEquals(WORKERS, r.candidates().size());
      for (Candidate c : r.candidates()) {
        // Seconds: (backlog + 3 × 512 tokens) at thousands of tokens per second.
        assertTrue(c.cost() > 0 && c.cost() < 1.0, c.toString());
      }
      // The credit form, asked for this request only, avoids worker 1's backlog.
      RouteResult credit =
          router.findBestMatch(
              fresh, RequestOptions.builder().costFunction(CostFunction.CREDIT).build());
      assertNotEquals(1, credit.workerId());
    }
  }
}
