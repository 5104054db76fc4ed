package io.kvrouter;

import java.nio.IntBuffer;

/**
 * The JNI implementation of {@link HotPath}'s calls: what {@link HotPath} is on JDK 17 to 21, and
 * what the Java 22+ one falls back to for the calls it does not make itself (options or hints
 * beyond the simple ones, no native access for the module, {@code -Dkvrouter.ffm=false}).
 */
final class JniHotPath {
  private JniHotPath() {}

  /**
   * kvr_find_best_match without candidates: {@code options} null (a preview with the library's
   * defaults) or with {@code simpleFlags() >= 0}; the prompt is {@code tokens}, or the {@code
   * length} ints at {@code offset} of the direct {@code direct}.
   */
  static RouteResult findBestMatch(
      long router, int[] tokens, IntBuffer direct, int offset, int length, RequestOptions options) {
    long[] out = new long[RouteResult.ENCODED_LEN];
    if (options == null) {
      Native.findBestMatch(router, tokens, direct, offset, length, null, 0, out);
    } else {
      Native.findBestMatchSimple(
          router,
          tokens,
          direct,
          offset,
          length,
          options.simpleFlags(),
          options.requestId,
          length(options.requestId),
          options.loraName,
          length(options.loraName),
          options.cacheNamespace,
          length(options.cacheNamespace),
          out);
    }
    return RouteResult.decode(out, null);
  }

  /** kvr_preview_route. */
  static RouteSignals previewRoute(
      long router, int[] tokens, RequestOptions options, RoutingHints hints) {
    long[] out = new long[Abi.RouteSignals.LEN];
    Native.previewRoute(router, tokens, options, hints, out);
    return RouteSignals.decode(out);
  }

  static void markPrefillCompleted(long router, String requestId) {
    Native.markPrefillCompleted(router, requestId);
  }

  static void freeRequest(long router, String requestId) {
    Native.freeRequest(router, requestId);
  }

  private static int length(String s) {
    return s == null ? 0 : s.length();
  }
}
