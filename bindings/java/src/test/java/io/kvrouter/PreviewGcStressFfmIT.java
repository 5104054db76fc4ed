package io.kvrouter;

import static org.junit.jupiter.api.Assertions.assertTrue;

import java.util.List;
import org.junit.jupiter.api.Test;

/**
 * {@link PreviewGcStressTest} on the FFM path (JDK 22+, the jar's META-INF/versions/22): previews
 * used to be critical downcalls, which never leave the Java thread state, so a safepoint waited
 * for a preview that waited for the lock held by a publisher parked at that safepoint, and the
 * whole JVM stopped. The child must finish, and on the FFM path.
 */
class PreviewGcStressFfmIT {
  @Test
  void previewsBookingsAndAnAllocatingPublisherFinishUnderForcedCollections() throws Exception {
    String out = PreviewGcStress.runChild(PreviewGcStress.currentJava(), List.of(), 3000, 300);
    System.out.println(out);
    assertTrue(out.contains("path ffm"), out);
  }
}
