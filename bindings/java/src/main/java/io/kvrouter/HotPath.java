package io.kvrouter;

import java.nio.IntBuffer;

/**
 * The hot calls of {@link Router}, made once the router is acquired: routing without candidates
 * with default or {@link RequestOptions#simpleFlags() simple} options (a preview, or an admission
 * under an id with perhaps a LoRA name and a namespace), preview route, both for a prompt given as
 * tokens or hashed, mark prefill completed, free. This is the base class, for JDK 17 to 21: it
 * makes them through JNI ({@link JniHotPath}). The jar also carries a java.lang.foreign
 * implementation of the same class for JDK 22 and newer (META-INF/versions/22/io/kvrouter/
 * HotPath.class, from src/main/java22), which such a JVM loads instead (a multi-release jar). Both
 * have the same methods and behave alike, exceptions included.
 */
final class HotPath {
  private HotPath() {}

  /** Which implementation serves the hot calls: {@code "jni"} here. */
  static String kind() {
    return "jni";
  }

  /**
   * kvr_find_best_match without candidates: {@code options} null (a preview with the library's
   * defaults) or with {@code simpleFlags() >= 0}; the prompt is {@code tokens}, or the {@code
   * length} ints at {@code offset} of the direct {@code direct}.
   */
  static RouteResult findBestMatch(
      long router, int[] tokens, IntBuffer direct, int offset, int length, RequestOptions options) {
    return JniHotPath.findBestMatch(router, tokens, direct, offset, length, options);
  }

  /**
   * {@link #findBestMatch} for a prompt given hashed: {@code hashes} its local hashes, {@code
   * numTokens} its length (KVR_REQUEST_PREHASHED); the same options.
   */
  static RouteResult findBestMatchHashed(
      long router, long[] hashes, long numTokens, RequestOptions options) {
    return JniHotPath.findBestMatchHashed(router, hashes, numTokens, options);
  }

  /** kvr_preview_route. */
  static RouteSignals previewRoute(
      long router, int[] tokens, RequestOptions options, RoutingHints hints) {
    return JniHotPath.previewRoute(router, tokens, options, hints);
  }

  /** kvr_preview_route of a prompt given hashed. */
  static RouteSignals previewRouteHashed(
      long router, long[] hashes, long numTokens, RequestOptions options, RoutingHints hints) {
    return JniHotPath.previewRouteHashed(router, hashes, numTokens, options, hints);
  }

  static void markPrefillCompleted(long router, String requestId) {
    JniHotPath.markPrefillCompleted(router, requestId);
  }

  static void freeRequest(long router, String requestId) {
    JniHotPath.freeRequest(router, requestId);
  }
}
