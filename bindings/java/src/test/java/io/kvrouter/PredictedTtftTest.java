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
   * Every request's prefill completes 100 ms after its booking on the router's clock: the fleet's
   * rate is learnt as 560 / 0.1 = 5,600 tokens per second, one rate for every rank. A fresh
   * 512-token prompt is then priced in seconds at that rate, (backlog + 512) / rate + 3 × 512 /
   * rate, so worker 1, with a 512-token backlog, is avoided; the credit form, asked for this
   * request only, prices blocks again.
   */
  @Test
  void predictedTtftPricesSecondsAtTheLearntRate() {
    final int warmTokens = 560;
    final int prefill = 512;
    final double rate = warmTokens / 0.1;
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
      int[] warm = tokens(warmTokens, 1);
      for (int i = 0; i < 4; ++i) {
        for (int w = 1; w <= WORKERS; ++w) {
          String name = "warm-" + w + "-" + i;
          router.addRequest(warm, w, 0, RequestOptions.withId(name));
          now += 100_000_000L;
          router.setTime(now);
          router.markPrefillCompleted(name);
          router.freeRequest(name);
        }
      }
      router.addRequest(tokens(prefill, 100_000), 1, 0, RequestOptions.withId("backlog"));
      int[] fresh = tokens(prefill, 500_000); // cached nowhere
      RouteResult r = router.findBestMatch(fresh, null, WORKERS);
      assertNotEquals(1, r.workerId(), r.toString());
      assertEquals(WORKERS, r.candidates().size());
      for (Candidate c : r.candidates()) {
        // (backlog + 512) / rate + 3 × 512 / rate: 0.457 s behind worker 1's backlog, 0.366 s.
        double backlog = c.workerId() == 1 ? prefill : 0;
        assertEquals((backlog + 4.0 * prefill) / rate, c.cost(), 1e-9, c.toString());
      }
      // The credit form, asked for this request only, prices blocks: 512 / 16 + 32 new = 64.
      RouteResult credit =
          router.findBestMatch(
              fresh, RequestOptions.builder().costFunction(CostFunction.CREDIT).build());
      assertEquals(64.0, credit.cost());
      // Time never goes back.
      final long past = now - 1;
      KvRouterException e = assertThrows(KvRouterException.class, () -> router.setTime(past));
      assertEquals(Status.INVALID_ARGUMENT, e.status());
    }
  }
}
