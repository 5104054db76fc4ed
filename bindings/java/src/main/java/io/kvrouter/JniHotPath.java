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
      Native.findBestMatch(router, tokens, direct, offset, length, null, 0, null, 0, out);
    } else {
      Native.findBestMatchSimple(
          router,
          tokens,
          direct,
          offset,
          length,
          null,
          0,
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

  /**
   * {@link #findBestMatch} for a prompt given hashed ({@code options} null or simple as there):
   * the options cross as arguments, with the hashes.
   */
  static RouteResult findBestMatchHashed(
      long router, long[] hashes, long numTokens, RequestOptions options) {
    long[] out = new long[RouteResult.ENCODED_LEN];
    Native.findBestMatchSimple(
        router,
        null,
        null,
        0,
        0,
        hashes,
        numTokens,
        options == null ? 0 : options.simpleFlags(),
        options == null ? null : options.requestId,
        options == null ? 0 : length(options.requestId),
        options == null ? null : options.loraName,
        options == null ? 0 : length(options.loraName),
        options == null ? null : options.cacheNamespace,
        options == null ? 0 : length(options.cacheNamespace),
        out);
    return RouteResult.decode(out, null);
  }

  /** kvr_preview_route. */
  static RouteSignals previewRoute(
      long router, int[] tokens, RequestOptions options, RoutingHints hints) {
    long[] out = new long[Abi.RouteSignals.LEN];
    Native.previewRoute(router, tokens, null, 0, options, hints, out);
    return RouteSignals.decode(out);
  }

  /** kvr_preview_route of a prompt given hashed. */
  static RouteSignals previewRouteHashed(
      long router, long[] hashes, long numTokens, RequestOptions options, RoutingHints hints) {
    long[] out = new long[Abi.RouteSignals.LEN];
    Native.previewRoute(router, null, hashes, numTokens, options, hints, out);
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
