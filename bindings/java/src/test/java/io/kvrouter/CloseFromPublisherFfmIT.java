package io.kvrouter;

import static org.junit.jupiter.api.Assertions.assertTrue;

import org.junit.jupiter.params.ParameterizedTest;
import org.junit.jupiter.params.provider.ValueSource;

/**
 * {@link CloseFromPublisherTest}'s scenarios whose publisher a routing call runs, on the FFM path
 * (JDK 22+, the jar's META-INF/versions/22): a downcall's publisher comes through the same glue
 * callback and {@link ReplicaSink}, which marks the thread. The child must pass, on the FFM path.
 */
class CloseFromPublisherFfmIT {
  @ParameterizedTest
  @ValueSource(
      strings = {
        "routing-close",
        "routing-stop",
        "router-close",
        "router-close-queue",
        "disagg-close",
        "set-publisher-routing",
        "set-publisher-cross"
      })
  void closingFromAPublisherOnTheFfmPath(String mode) {
    String out = CloseFromPublisherTest.run(mode, "");
    assertTrue(out.contains("path ffm"), out);
  }
}
