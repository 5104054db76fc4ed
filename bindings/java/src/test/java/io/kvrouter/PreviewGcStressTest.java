package io.kvrouter;

import java.util.List;
import org.junit.jupiter.api.Test;

/**
 * Previews do not deadlock with a replica publisher that allocates under the router's lock while
 * collections run (the JNI path: previews used to read their {@code int[]} prompt inside a JNI
 * critical region, and a collection waited for it while it waited for the lock): {@link
 * PreviewGcStress} in a child JVM, which must finish.
 */
class PreviewGcStressTest {
  @Test
  void previewsBookingsAndAnAllocatingPublisherFinishUnderForcedCollections() throws Exception {
    String out = PreviewGcStress.runChild(PreviewGcStress.currentJava(), List.of(), 3000, 300);
    System.out.println(out);
  }
}
