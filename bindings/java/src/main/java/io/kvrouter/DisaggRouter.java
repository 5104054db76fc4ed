package io.kvrouter;

import java.util.Objects;

/**
 * Disaggregated prefill and decode ({@code kvr_disagg}): a prefill pool and a decode pool, each a
 * full {@link Router} ({@link #prefillRouter()}, {@link #decodeRouter()}) to add workers, apply KV
 * events, and mark and free requests on.
 *
 * <p>Thread-safe like {@link Router}. Closing it closes both pools' admission queues (a routing
 * call waiting in one, here or on a pool router, throws {@link KvRouterException} with {@link
 * Status#CANCELLED}: see {@link Router#closeQueue()}), then closes both pool routers; a pool
 * router (or an {@link Ingest} on one) still open keeps the native object alive until it is closed
 * too.
 *
 * <p>Each call also has a {@code ...Hashed} form for a prompt given hashed, as {@link Router}'s:
 * its local hashes (the pools' block size) and its length in tokens, which the policies read
 * (the prompt's length, for instance, bounds a local prefill).
 */
public final class DisaggRouter extends NativeObject {
  private final Router prefill;
  private final Router decode;

  /** Both pools with the library's default router options, and default disagg options. */
  public DisaggRouter() {
    this(null, null, null);
  }

  /**
   * @param prefill the prefill pool's router options (null = defaults)
   * @param decode the decode pool's router options (null = defaults)
   * @param options null = defaults
   */
  public DisaggRouter(RouterOptions prefill, RouterOptions decode, DisaggOptions options) {
    super(
        new NativeResource(
            Native.disaggNew(
                prefill == null ? null : prefill.encoded(),
                decode == null ? null : decode.encoded(),
                options == null ? null : options.encoded()),
            Native::disaggFree,
            null));
    this.prefill = view(Native.disaggPrefillRouter(resource.handle));
    this.decode = view(Native.disaggDecodeRouter(resource.handle));
  }

  private Router view(long handle) {
    resource.retain();
    return Router.pool(handle, resource);
  }

  /**
   * The prefill pool (owned by this object: closing it closes the handle and the pool's admission
   * queue, so that a call waiting there through it returns: later prefill routes that would wait
   * are then cancelled).
   */
  public Router prefillRouter() {
    return prefill;
  }

  /**
   * The decode pool (owned by this object: closing it closes the handle and the pool's admission
   * queue, as {@link #prefillRouter()}).
   */
  public Router decodeRouter() {
    return decode;
  }

  /**
   * Decides where the prompt is prefilled and, when remote, selects and books a prefill rank under
   * the request id (free it on {@link #prefillRouter()} when the prefill ends). Prefill pins from
   * {@code hints} apply.
   *
   * @param options must carry the request id
   * @throws KvRouterException {@link Status#FAILED_PRECONDITION} with {@code enforce} and no
   *     prefill workers
   */
  public PrefillResult routePrefill(int[] tokens, RequestOptions options, RoutingHints hints) {
    Objects.requireNonNull(tokens, "tokens");
    Objects.requireNonNull(options, "options");
    long[] out = new long[Abi.PrefillResult.LEN];
    long h = acquire();
    try {
      Native.disaggRoutePrefill(h, tokens, null, 0, options, hints, out);
    } finally {
      release();
    }
    return PrefillResult.decode(out);
  }

  /**
   * As {@link #routePrefill(int[], RequestOptions, RoutingHints)}, for a prompt given hashed (see
   * {@link Router}): {@code localHashes} its blocks' local hashes, {@code numTokens} its length.
   *
   * @throws KvRouterException {@link Status#INVALID_ARGUMENT} unless {@code localHashes} has one
   *     hash per complete block of {@code numTokens} tokens
   */
  public PrefillResult routePrefillHashed(
      long[] localHashes, long numTokens, RequestOptions options, RoutingHints hints) {
    Router.checkHashed(localHashes, numTokens);
    Objects.requireNonNull(options, "options");
    long[] out = new long[Abi.PrefillResult.LEN];
    long h = acquire();
    try {
      Native.disaggRoutePrefill(h, null, localHashes, numTokens, options, hints, out);
    } finally {
      release();
    }
    return PrefillResult.decode(out);
  }

  /**
   * Selects and books the decode rank. After a remote prefill the decode overrides are forced
   * (overlap credit 0, no KV reuse, no prefill tracking), every other override kept.
   */
  public RouteSignals routeDecode(
      int[] tokens, RequestOptions options, RoutingHints hints, boolean remotePrefill) {
    Objects.requireNonNull(tokens, "tokens");
    Objects.requireNonNull(options, "options");
    long[] out = new long[Abi.RouteSignals.LEN];
    long h = acquire();
    try {
      Native.disaggRouteDecode(h, tokens, null, 0, options, hints, remotePrefill, out);
    } finally {
      release();
    }
    return RouteSignals.decode(out);
  }

  /**
   * As {@link #routeDecode(int[], RequestOptions, RoutingHints, boolean)}, for a prompt given
   * hashed (see {@link Router}) of {@code numTokens} tokens.
   *
   * @throws KvRouterException {@link Status#INVALID_ARGUMENT} unless {@code localHashes} has one
   *     hash per complete block of {@code numTokens} tokens
   */
  public RouteSignals routeDecodeHashed(
      long[] localHashes,
      long numTokens,
      RequestOptions options,
      RoutingHints hints,
      boolean remotePrefill) {
    Router.checkHashed(localHashes, numTokens);
    Objects.requireNonNull(options, "options");
    long[] out = new long[Abi.RouteSignals.LEN];
    long h = acquire();
    try {
      Native.disaggRouteDecode(
          h, null, localHashes, numTokens, options, hints, remotePrefill, out);
    } finally {
      release();
    }
    return RouteSignals.decode(out);
  }

  /**
   * Advisory: would the prefill rank chosen now carry more than {@code threshold} ×
   * max_num_batched_tokens prefill tokens? No eligible prefill rank counts as busy.
   */
  public boolean prefillWorkerBusy(int[] tokens, RequestOptions options, double threshold) {
    Objects.requireNonNull(tokens, "tokens");
    long h = acquire();
    try {
      return Native.disaggPrefillWorkerBusy(h, tokens, null, 0, options, threshold);
    } finally {
      release();
    }
  }

  /**
   * As {@link #prefillWorkerBusy(int[], RequestOptions, double)}, for a prompt given hashed (see
   * {@link Router}) of {@code numTokens} tokens.
   *
   * @throws KvRouterException {@link Status#INVALID_ARGUMENT} unless {@code localHashes} has one
   *     hash per complete block of {@code numTokens} tokens
   */
  public boolean prefillWorkerBusyHashed(
      long[] localHashes, long numTokens, RequestOptions options, double threshold) {
    Router.checkHashed(localHashes, numTokens);
    long h = acquire();
    try {
      return Native.disaggPrefillWorkerBusy(
          h, null, localHashes, numTokens, options, threshold);
    } finally {
      release();
    }
  }

  /**
   * Closes both pools' admission queues, waits for the calls in progress, closes both pool routers
   * and frees the native object once nothing else holds it (see the class comment). Idempotent.
   *
   * @throws KvRouterException {@link Status#FAILED_PRECONDITION} called from a replica publisher
   *     (as {@link Router#close()}; the object staying open)
   */
  @Override
  public void close() {
    if (!isClosed()) ReplicaSink.refuseInPublisher("DisaggRouter.close()");
    super.close();
  }

  /**
   * Closes both pools' admission queues first (as {@link Router#close()} does), so that a routing
   * call waiting in one, through this object or a pool router, is cancelled instead of keeping
   * {@link #close()} waiting.
   */
  @Override
  void closing() {
    try {
      Native.closeQueue(prefill.resource.handle);
    } finally {
      Native.closeQueue(decode.resource.handle);
    }
  }

  @Override
  void beforeFree() {
    try {
      prefill.close();
    } finally {
      decode.close(); // even if the prefill pool's close threw
    }
  }
}
