package io.kvrouter;

import static io.kvrouter.HotPathAllocationFfmIT.bytesPerCall;
import static io.kvrouter.HotPathFfmIT.HASHES;
import static io.kvrouter.HotPathFfmIT.PROMPT;
import static io.kvrouter.HotPathFfmIT.router;
import static org.junit.jupiter.api.Assertions.assertTrue;

import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.Timeout;

/**
 * {@link HotPathAllocationFfmIT} for the calls of a prompt given hashed: the hashes are copied to
 * the thread's native buffer, and the call allocates nothing but its result. A class (so a JVM)
 * of its own, as that one is, so that neither class's calls shape what the JIT compiles for the
 * other's.
 */
@Timeout(300)
class HotPathHashedAllocationFfmIT {
  @Test
  void hashedCallsAllocateNothingButTheirResult() {
    try (Router r = router()) {
      RequestOptions admit = RequestOptions.admit("alloc-hashed");
      double result = 96; // the result record (80 bytes), as in HotPathAllocationFfmIT
      double admitFree =
          bytesPerCall(
              () -> {
                r.findBestMatchHashed(HASHES, PROMPT.length, admit);
                r.freeRequest("alloc-hashed");
              },
              result);
      assertTrue(admitFree <= result, admitFree + " bytes per hashed admit+free");
      double preview =
          bytesPerCall(() -> r.findBestMatchHashed(HASHES, PROMPT.length, null), result);
      assertTrue(preview <= result, preview + " bytes per hashed preview");
      double previewRoute =
          bytesPerCall(() -> r.previewRouteHashed(HASHES, PROMPT.length, null, null), result);
      assertTrue(previewRoute <= result, previewRoute + " bytes per hashed previewRoute");
    }
  }
}
