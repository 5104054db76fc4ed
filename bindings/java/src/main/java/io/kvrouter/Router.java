package io.kvrouter;

import java.nio.ByteOrder;
import java.nio.IntBuffer;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Collections;
import java.util.List;
import java.util.Objects;
import java.util.Optional;
import java.util.concurrent.atomic.AtomicLong;
import java.util.function.LongConsumer;

/**
 * A KV-cache-aware router ({@code kvr_router}): it keeps an index of what every worker rank holds
 * in its KV cache and the load of every rank, and picks the rank that will serve a prompt fastest.
 *
 * <p>Thread-safe: every method may be called from any thread concurrently (the library synchronises
 * internally), except that {@link #close()} waits for calls in progress and makes later calls throw
 * {@link IllegalStateException}. With a queue threshold set, an admitted routing call may block its
 * thread until a worker has room (or its queue timeout passes, or {@link #closeQueue()} or {@link
 * #close()} cancels it).
 *
 * <p>Token ids are {@code int}s holding unsigned 32-bit values; worker ids and hashes are {@code
 * long}s holding unsigned 64-bit values.
 *
 * <p>Every call that takes a prompt's tokens has a {@code ...Hashed} form taking the prompt hashed
 * instead ({@code KVR_REQUEST_PREHASHED}): its local hashes, one per complete block ({@link
 * Hashing#blockHashes(int[], int, HashOptions)} with the router's block size and the prompt's
 * LoRA name, namespace and multimodal hashes), and its length in tokens. Nothing is hashed in the
 * call, and the decision, the booking and the prices are those of the tokens; a hash count other
 * than the complete blocks of {@code numTokens} is {@link Status#INVALID_ARGUMENT}. Of the
 * options, the LoRA name, namespace and multimodal hashes are then unused (they are in the
 * hashes). The hashes are copied for the call (8 bytes per block), never pinned.
 *
 * <pre>{@code
 * try (Router router = new Router(RouterOptions.builder().blockSize(16).build())) {
 *   router.addWorker(WorkerConfig.of(1));
 *   RouteResult r = router.findBestMatch(tokens, RequestOptions.admit("req-1"));
 *   ... dispatch to r.workerId() ...
 *   router.markPrefillCompleted("req-1");
 *   router.freeRequest("req-1");
 * }
 * }</pre>
 */
public final class Router extends NativeObject {
  private final boolean poolView;
  // The native context of the replica publisher installed (0: none), freed once the library no
  // longer calls it. Shared with the free action, which must not reference this object.
  private final AtomicLong replicaContext;
  private final Object replicaLock = new Object();

  /** A router with the library's default options. */
  public Router() {
    this(RouterOptions.defaults());
  }

  /**
   * Creates a router.
   *
   * @throws KvRouterException {@link Status#INVALID_ARGUMENT} naming a bad setting
   */
  public Router(RouterOptions options) {
    this(Native.routerNew(options.encoded()), null, new AtomicLong());
  }

  private Router(long handle, NativeResource parent, AtomicLong replicaContext) {
    super(new NativeResource(handle, freeAction(parent == null, replicaContext), parent));
    this.poolView = parent != null;
    this.replicaContext = replicaContext;
  }

  /** One pool of a {@link DisaggRouter}: the parent owns it and keeps it alive. */
  static Router pool(long handle, NativeResource disagg) {
    return new Router(handle, disagg, new AtomicLong());
  }

  private static LongConsumer freeAction(boolean owned, AtomicLong replicaContext) {
    return handle -> {
      long context = replicaContext.getAndSet(0);
      if (owned) {
        Native.routerFree(handle);
      } else if (context != 0) {
        Native.setReplicaPublisher(handle, null, null); // the pool outlives this handle
      }
      Native.freeReplicaContext(context);
    };
  }

  /** Whether this router is one pool of a {@link DisaggRouter}. */
  public boolean isPool() {
    return poolView;
  }

  // ---- Workers ----

  /**
   * Registers a worker's ranks. May admit queued requests.
   *
   * @throws KvRouterException {@link Status#ALREADY_EXISTS} for a registered id, {@link
   *     Status#INVALID_ARGUMENT} for a block size mismatch or a bad rank range
   */
  public void addWorker(WorkerConfig config) {
    Objects.requireNonNull(config, "config");
    long h = acquire();
    try {
      Native.addWorker(h, config.encoded());
    } finally {
      release();
    }
  }

  /** Registers worker {@code workerId} with the defaults (one rank). */
  public void addWorker(long workerId) {
    addWorker(WorkerConfig.of(workerId));
  }

  /**
   * Changes a worker's ranks or capacity; ranks that disappear lose their requests and index
   * entries.
   *
   * @throws KvRouterException {@link Status#NOT_FOUND} for an unknown id
   */
  public void updateWorker(WorkerConfig config) {
    Objects.requireNonNull(config, "config");
    long h = acquire();
    try {
      Native.updateWorker(h, config.encoded());
    } finally {
      release();
    }
  }

  /**
   * Drops the worker's ranks, active requests and index entries.
   *
   * @throws KvRouterException {@link Status#NOT_FOUND} for an unknown id
   */
  public void removeWorker(long workerId) {
    long h = acquire();
    try {
      Native.removeWorker(h, workerId);
    } finally {
      release();
    }
  }

  // ---- KV events ----

  /**
   * Applies a stored event. A rejected part is reported ({@link Status#NOT_FOUND}: unknown parent
   * or block; {@link Status#INVALID_ARGUMENT}: broken sequence or incomplete block) and counted,
   * while the part Dynamo applies despite it is applied.
   *
   * @throws KvRouterException as above; {@link Status#FAILED_PRECONDITION} in approximate mode
   */
  public void applyStored(StoredEvent event) {
    Objects.requireNonNull(event, "event");
    long h = acquire();
    try {
      Native.applyStored(h, event);
    } finally {
      release();
    }
  }

  /** Applies a removed event (as {@link #applyStored}). */
  public void applyRemoved(RemovedEvent event) {
    Objects.requireNonNull(event, "event");
    long h = acquire();
    try {
      Native.applyRemoved(h, event);
    } finally {
      release();
    }
  }

  /**
   * The rank (workerId, dpRank) lost every block; the worker's other ranks keep theirs (each
   * rank has a cache of its own). {@link #removeWorker} forgets every rank.
   */
  public void applyCleared(long workerId, int dpRank, long eventId) {
    long h = acquire();
    try {
      Native.applyCleared(h, workerId, dpRank, eventId);
    } finally {
      release();
    }
  }

  /**
   * Applies a FlatBuffers EventBatch (schema/kv_events.fbs), verified first: a bad buffer applies
   * nothing. Events rejected by the index do not stop the others; the first rejection is thrown
   * after all were applied.
   *
   * @throws KvRouterException {@link Status#INVALID_ARGUMENT} for bytes that are not a valid
   *     EventBatch
   */
  public void applyEventBatch(byte[] batch) {
    applyEventBatch(batch, 0, batch.length);
  }

  /** Applies the EventBatch in {@code batch[offset, offset + length)}. */
  public void applyEventBatch(byte[] batch, int offset, int length) {
    Objects.checkFromIndexSize(offset, length, batch.length);
    long h = acquire();
    try {
      Native.applyEventBatch(h, batch, offset, length);
    } finally {
      release();
    }
  }

  // ---- Router replicas ----

  /**
   * Publishes this router's booking changes (booked, prefill completed, freed) through {@code
   * publisher} under the name {@code replicaId}, for the other replicas' {@link
   * #applyReplicaEvent(byte[])}: each replica then counts the others' requests as load. The id must
   * be unique among the live replicas and must not contain U+001F. {@code publisher} null stops
   * publishing; once this returns, the previous publisher is not called again.
   *
   * <p>Before this returns, on the calling thread, the new publisher receives first a Reset, then
   * an Added change for every booking this router holds (its own, not the other replicas'), then
   * a SyncRequest (both with an empty request id): the peers drop whatever they held from this
   * replica id (a restarted replica's stale bookings) and answer through their own publishers
   * with a Reset and their bookings (at once, or with their next heartbeat if they beat every 2 s
   * or less and announced them within that interval: joins close together share one
   * announcement), so a joining replica converges within a heartbeat interval. Expiry and worker
   * removal are not published, as every replica does those itself.
   *
   * <p>A publisher replaced (or cleared with null) first receives a farewell Reset, so the peers
   * drop what they hold from its replica id.
   *
   * <p>The publisher is held until replaced, cleared or the router closed (so one that refers to
   * this router keeps it reachable: close it).
   *
   * <p>Not from a replica publisher (of any router: one replacing or clearing itself, during its
   * announcement or later, or another): there it throws before taking the binding's lock around
   * the swap of publishers, which a thread waiting for the router's lock the publisher holds may
   * hold. Call it once the publisher has returned.
   *
   * @throws KvRouterException {@link Status#INVALID_ARGUMENT} for a null or empty id, or one
   *     containing U+001F (the publisher in place then stays, and nothing is published); {@link
   *     Status#FAILED_PRECONDITION} called from a replica publisher (the publisher in place stays)
   */
  public void setReplicaPublisher(String replicaId, ReplicaPublisher publisher) {
    ReplicaSink.refuseInPublisher("Router.setReplicaPublisher()");
    ReplicaSink sink = publisher == null ? null : new ReplicaSink(publisher);
    long h = acquire();
    try {
      // Only the swap of contexts is serialised (the C call itself is concurrent): the
      // context freed must be the one the library has just stopped calling.
      synchronized (replicaLock) {
        long context = Native.setReplicaPublisher(h, replicaId, sink);
        Native.freeReplicaContext(replicaContext.getAndSet(context));
      }
    } finally {
      release();
    }
  }

  /**
   * Applies a booking change another replica published: its bookings count as load here, and its
   * frees and prefill completions may admit requests waiting here. A Reset replaces every
   * booking held here from its replica id by those announced after it (kept until they have
   * come: docs/replicas.md); a SyncRequest makes this router answer, through its own {@link
   * #setReplicaPublisher publisher} if it has one, with a Reset and an Added change for every
   * booking of its own: on the calling thread, or, for a join while this router beats every 2 s or
   * less and announced its bookings within its interval, with its next heartbeat (on that
   * heartbeat's thread; past one and a half intervals without one, on the thread of its next
   * change, replica change applied or {@link #expireReplicas} call). Changes with this router's own
   * replica id are ignored.
   *
   * @throws KvRouterException {@link Status#INVALID_ARGUMENT} for bytes that are not a change (or
   *     whose origin is empty or contains U+001F), {@link Status#NOT_FOUND} for a worker rank this
   *     router does not know, {@link Status#ALREADY_EXISTS} for a booking applied twice (nothing
   *     changes then)
   */
  public void applyReplicaEvent(byte[] change) {
    applyReplicaEvent(change, 0, change.length);
  }

  public void applyReplicaEvent(byte[] change, int offset, int length) {
    Objects.checkFromIndexSize(offset, length, change.length);
    long h = acquire();
    try {
      Native.applyReplicaEvent(h, change, offset, length);
    } finally {
      release();
    }
  }

  /**
   * Publishes a heartbeat through this router's {@link #setReplicaPublisher publisher}, on the
   * calling thread (after an announcement of every booking if one is due: a lost change's repair,
   * or the answer to joins), promising the next within {@code intervalMs}: a peer that has heard
   * one from this replica (or a change published after it: each carries the interval) drops its
   * bookings there ({@link #expireReplicas}) once it falls silent. Over a bus of your own, call it
   * every interval; {@link Ingest#syncReplicas} does it on a timer, the first at once ({@link
   * IngestOptions#replicaHeartbeatMs()}).
   *
   * @throws KvRouterException {@link Status#INVALID_ARGUMENT} unless {@code intervalMs} is in
   *     1..3,600,000, {@link Status#FAILED_PRECONDITION} if the router has no replica publisher
   */
  public void replicaHeartbeat(int intervalMs) {
    long h = acquire();
    try {
      Native.replicaHeartbeat(h, intervalMs);
    } finally {
      release();
    }
  }

  /**
   * Drops the bookings held from every replica that has sent heartbeats and has been heard from
   * (any change) no later than {@code timeout} ago on the router's clock (or three of its own
   * heartbeat intervals, if longer); the freed capacity may admit waiting requests. A replica
   * that never sent a heartbeat keeps its bookings until the request expiry; one dropped but
   * heard again is asked (if this router publishes) to announce its bookings again. It may
   * publish this router's own bookings, answering joins whose heartbeat did not come: a caller
   * beating by hand calls it on a timer too. {@link Ingest#syncReplicas} does it on a timer
   * ({@link IngestOptions#replicaTimeoutMs()}).
   *
   * @return how many replicas were dropped (counted in {@link Metrics#replicasExpired()})
   * @throws KvRouterException {@link Status#INVALID_ARGUMENT} unless {@code timeout} is positive
   */
  public int expireReplicas(Duration timeout) {
    Objects.requireNonNull(timeout, "timeout");
    long h = acquire();
    try {
      return (int) Native.expireReplicas(h, timeout.toNanos() / 1e9);
    } finally {
      release();
    }
  }

  // ---- Routing ----

  /** Picks the rank for a prompt, changing nothing (a preview with default options). */
  public RouteResult findBestMatch(int[] tokens) {
    return findBestMatch(tokens, null, 0);
  }

  /**
   * Picks the rank for a prompt. Without {@link RequestOptions.Builder#admit(boolean)} it is a
   * preview; with it the request is booked under its id, after waiting in the admission queue if
   * the router queues.
   *
   * @param options null = defaults (a preview)
   * @throws KvRouterException {@link Status#ALREADY_EXISTS} (request id active or waiting), {@link
   *     Status#UNAVAILABLE} (no eligible worker), {@link Status#DEADLINE_EXCEEDED} (queue timeout),
   *     {@link Status#CANCELLED} (freed while queued, or the queue closed: {@link #closeQueue()},
   *     {@link #close()}), {@link Status#INVALID_ARGUMENT}
   */
  public RouteResult findBestMatch(int[] tokens, RequestOptions options) {
    return findBestMatch(tokens, options, 0);
  }

  /**
   * As {@link #findBestMatch(int[], RequestOptions)}, with the cost breakdown of up to {@code
   * maxCandidates} candidates ({@link RouteResult#totalCandidates()} says how many there were).
   */
  public RouteResult findBestMatch(int[] tokens, RequestOptions options, int maxCandidates) {
    Objects.requireNonNull(tokens, "tokens");
    return route(tokens, null, 0, tokens.length, options, maxCandidates);
  }

  /**
   * As {@link #findBestMatch(int[], RequestOptions)}, for a prompt in a direct {@link IntBuffer}
   * in native byte order (for example {@code
   * ByteBuffer.allocateDirect(4 * n).order(ByteOrder.nativeOrder()).asIntBuffer()}): its remaining
   * ints, read in place. An {@code int[]} prompt has to be copied, for a preview too (every
   * decision takes the router's admission lock, which a thread booking a request holds while it
   * calls a replica publisher back in Java, and an admitted call may wait in the admission queue,
   * so the array cannot be pinned meanwhile); a direct buffer never is, whatever the call. The
   * buffer's position is not changed.
   *
   * @throws IllegalArgumentException for a heap buffer or one not in native byte order
   */
  public RouteResult findBestMatch(IntBuffer tokens, RequestOptions options) {
    return findBestMatch(tokens, options, 0);
  }

  /** As {@link #findBestMatch(IntBuffer, RequestOptions)}, with up to {@code maxCandidates}. */
  public RouteResult findBestMatch(IntBuffer tokens, RequestOptions options, int maxCandidates) {
    Objects.requireNonNull(tokens, "tokens");
    if (!tokens.isDirect() || tokens.order() != ByteOrder.nativeOrder()) {
      throw new IllegalArgumentException("tokens must be a direct IntBuffer in native byte order");
    }
    return route(null, tokens, tokens.position(), tokens.remaining(), options, maxCandidates);
  }

  private RouteResult route(
      int[] tokens,
      IntBuffer direct,
      int offset,
      int length,
      RequestOptions options,
      int maxCandidates) {
    if (maxCandidates < 0) throw new IllegalArgumentException("maxCandidates < 0");
    if (maxCandidates == 0 && (options == null || options.simpleFlags() >= 0)) {
      // The usual calls: a preview, or an admission with an id (LoRA, namespace).
      long h = acquire();
      try {
        return HotPath.findBestMatch(h, tokens, direct, offset, length, options);
      } finally {
        release();
      }
    }
    long[] out = new long[RouteResult.ENCODED_LEN];
    long h = acquire();
    long[] candidates;
    try {
      candidates =
          Native.findBestMatch(
              h, tokens, direct, offset, length, null, 0, options, maxCandidates, out);
    } finally {
      release();
    }
    return RouteResult.decode(out, candidates);
  }

  /**
   * As {@link #findBestMatch(int[], RequestOptions)}, for a prompt given hashed (see the class
   * comment): {@code localHashes} its blocks' local hashes, {@code numTokens} its length. A
   * gateway that hashes its prompts itself (outside any lock, with {@link Hashing}), or once for
   * several routers, hands over a hash per block instead of every token.
   *
   * @throws KvRouterException {@link Status#INVALID_ARGUMENT} unless {@code localHashes} has one
   *     hash per complete block of {@code numTokens} tokens; otherwise as {@link
   *     #findBestMatch(int[], RequestOptions)}
   * @throws IllegalArgumentException for a negative {@code numTokens}
   */
  public RouteResult findBestMatchHashed(
      long[] localHashes, long numTokens, RequestOptions options) {
    return findBestMatchHashed(localHashes, numTokens, options, 0);
  }

  /**
   * As {@link #findBestMatchHashed(long[], long, RequestOptions)}, with the cost breakdown of up
   * to {@code maxCandidates} candidates.
   */
  public RouteResult findBestMatchHashed(
      long[] localHashes, long numTokens, RequestOptions options, int maxCandidates) {
    checkHashed(localHashes, numTokens);
    if (maxCandidates < 0) throw new IllegalArgumentException("maxCandidates < 0");
    if (maxCandidates == 0 && (options == null || options.simpleFlags() >= 0)) {
      long h = acquire();
      try {
        return HotPath.findBestMatchHashed(h, localHashes, numTokens, options);
      } finally {
        release();
      }
    }
    long[] out = new long[RouteResult.ENCODED_LEN];
    long h = acquire();
    long[] candidates;
    try {
      candidates =
          Native.findBestMatch(
              h, null, null, 0, 0, localHashes, numTokens, options, maxCandidates, out);
    } finally {
      release();
    }
    return RouteResult.decode(out, candidates);
  }

  /** A prompt given hashed: its hashes, and its length in tokens. */
  static void checkHashed(long[] localHashes, long numTokens) {
    Objects.requireNonNull(localHashes, "localHashes");
    if (numTokens < 0) throw new IllegalArgumentException("numTokens < 0");
  }

  /** Per rank holding at least the prompt's first block: what it holds, per tier. */
  public List<Overlap> overlapScores(int[] tokens) {
    return overlapScores(tokens, null);
  }

  /** As {@link #overlapScores(int[])}, with the request's salts (LoRA, namespace, ...). */
  public List<Overlap> overlapScores(int[] tokens, RequestOptions options) {
    Objects.requireNonNull(tokens, "tokens");
    long h = acquire();
    long[] a;
    try {
      a = Native.overlapScores(h, tokens, null, 0, options);
    } finally {
      release();
    }
    return overlapsOf(a);
  }

  /**
   * As {@link #overlapScores(int[], RequestOptions)}, for a prompt already hashed: {@code
   * localHashes} are its blocks' local hashes ({@link Hashing}; what engines' KV events and
   * Dynamo's {@code find_matches} take). Of {@code options} only the cost overrides apply.
   */
  public List<Overlap> overlapScoresHashed(long[] localHashes, RequestOptions options) {
    Objects.requireNonNull(localHashes, "localHashes");
    long h = acquire();
    long[] a;
    try {
      a = Native.overlapScoresHashed(h, localHashes, options);
    } finally {
      release();
    }
    return overlapsOf(a);
  }

  /**
   * As {@link #overlapScores(int[], RequestOptions)}, for a prompt given hashed (see the class
   * comment) of {@code numTokens} tokens: {@code kvr_router_overlap_scores} with {@code
   * KVR_REQUEST_PREHASHED}, which, unlike {@link #overlapScoresHashed(long[], RequestOptions)},
   * checks the hashes against the prompt's length and takes every option.
   *
   * @throws KvRouterException {@link Status#INVALID_ARGUMENT} unless {@code localHashes} has one
   *     hash per complete block of {@code numTokens} tokens
   */
  public List<Overlap> overlapScoresHashed(
      long[] localHashes, long numTokens, RequestOptions options) {
    checkHashed(localHashes, numTokens);
    long h = acquire();
    long[] a;
    try {
      a = Native.overlapScores(h, null, localHashes, numTokens, options);
    } finally {
      release();
    }
    return overlapsOf(a);
  }

  /**
   * The index walk alone, Dynamo's {@code find_matches} contract ({@code
   * kvr_router_find_matches}): per rank holding at least the first of {@code localHashes} ({@link
   * Hashing}), in no particular order, the leading blocks it holds per tier and its tree size.
   * Each row has the tiers and tree size of that rank's {@link #overlapScoresHashed} row, without
   * the cost model's figures, and costs less to get: the call for a caller that scores ranks
   * itself. An empty array matches no rank.
   */
  public List<Match> findMatches(long[] localHashes) {
    Objects.requireNonNull(localHashes, "localHashes");
    long h = acquire();
    long[] a;
    try {
      a = Native.findMatches(h, localHashes);
    } finally {
      release();
    }
    ArrayList<Match> list = new ArrayList<>(a.length / Abi.Match.LEN);
    for (int i = 0; i < a.length; i += Abi.Match.LEN) list.add(Match.decode(a, i));
    return Collections.unmodifiableList(list);
  }

  private static List<Overlap> overlapsOf(long[] a) {
    ArrayList<Overlap> list = new ArrayList<>(a.length / Abi.Overlap.LEN);
    for (int i = 0; i < a.length; i += Abi.Overlap.LEN) list.add(Overlap.decode(a, i));
    return Collections.unmodifiableList(list);
  }

  /** The load each registered rank would carry with this prompt. */
  public List<PotentialLoad> potentialLoads(int[] tokens) {
    return potentialLoads(tokens, null);
  }

  public List<PotentialLoad> potentialLoads(int[] tokens, RequestOptions options) {
    Objects.requireNonNull(tokens, "tokens");
    long h = acquire();
    long[] a;
    try {
      a = Native.potentialLoads(h, tokens, null, 0, options);
    } finally {
      release();
    }
    return loadsOf(a);
  }

  /**
   * As {@link #potentialLoads(int[], RequestOptions)}, for a prompt given hashed (see the class
   * comment) of {@code numTokens} tokens.
   *
   * @throws KvRouterException {@link Status#INVALID_ARGUMENT} unless {@code localHashes} has one
   *     hash per complete block of {@code numTokens} tokens
   */
  public List<PotentialLoad> potentialLoadsHashed(
      long[] localHashes, long numTokens, RequestOptions options) {
    checkHashed(localHashes, numTokens);
    long h = acquire();
    long[] a;
    try {
      a = Native.potentialLoads(h, null, localHashes, numTokens, options);
    } finally {
      release();
    }
    return loadsOf(a);
  }

  private static List<PotentialLoad> loadsOf(long[] a) {
    ArrayList<PotentialLoad> list = new ArrayList<>(a.length / Abi.PotentialLoad.LEN);
    for (int i = 0; i < a.length; i += Abi.PotentialLoad.LEN) {
      list.add(PotentialLoad.decode(a, i));
    }
    return Collections.unmodifiableList(list);
  }

  // ---- Request lifecycle ----

  /**
   * Books a request on a rank chosen elsewhere.
   *
   * @param options must carry the request id
   * @throws KvRouterException {@link Status#NOT_FOUND} for an unregistered rank, {@link
   *     Status#ALREADY_EXISTS} for an active id
   */
  public void addRequest(int[] tokens, long workerId, int dpRank, RequestOptions options) {
    Objects.requireNonNull(tokens, "tokens");
    Objects.requireNonNull(options, "options");
    long h = acquire();
    try {
      Native.addRequest(h, tokens, null, 0, workerId, dpRank, options);
    } finally {
      release();
    }
  }

  /**
   * As {@link #addRequest(int[], long, int, RequestOptions)}, for a prompt given hashed (see the
   * class comment) of {@code numTokens} tokens: the booking weighs on the rank as one made from
   * the tokens.
   *
   * @throws KvRouterException {@link Status#INVALID_ARGUMENT} unless {@code localHashes} has one
   *     hash per complete block of {@code numTokens} tokens
   */
  public void addRequestHashed(
      long[] localHashes, long numTokens, long workerId, int dpRank, RequestOptions options) {
    checkHashed(localHashes, numTokens);
    Objects.requireNonNull(options, "options");
    long h = acquire();
    try {
      Native.addRequest(h, null, localHashes, numTokens, workerId, dpRank, options);
    } finally {
      release();
    }
  }

  /** The request produced its first token. Idempotent; may admit queued requests. */
  public void markPrefillCompleted(String requestId) {
    Objects.requireNonNull(requestId, "requestId");
    long h = acquire();
    try {
      HotPath.markPrefillCompleted(h, requestId);
    } finally {
      release();
    }
  }

  /**
   * The request has generated {@code outputTokens} tokens so far (cumulative: call as the stream
   * goes, e.g. once per block's worth). Its rank then holds one more, unshared, block each time
   * prompt + output crosses a block boundary, until the request is freed, so long generations
   * weigh on their rank's cost. Not published to router replicas. An unknown id is no error.
   *
   * @throws IllegalArgumentException for a negative count
   * @throws KvRouterException {@link Status#FAILED_PRECONDITION} unless the router was created
   *     with {@link RouterOptions.Builder#trackOutputBlocks(boolean)}
   */
  public void recordOutput(String requestId, long outputTokens) {
    Objects.requireNonNull(requestId, "requestId");
    if (outputTokens < 0) throw new IllegalArgumentException("outputTokens < 0");
    long h = acquire();
    try {
      Native.recordOutput(h, requestId, outputTokens);
    } finally {
      release();
    }
  }

  /** The request ended (finished, cancelled or failed). Idempotent; may admit queued ones. */
  public void freeRequest(String requestId) {
    Objects.requireNonNull(requestId, "requestId");
    long h = acquire();
    try {
      HotPath.freeRequest(h, requestId);
    } finally {
      release();
    }
  }

  /**
   * For a shutdown: closes the admission queue for good ({@code kvr_router_close_queue}). Every
   * request waiting in it is cancelled (its routing call, blocked on another thread, throws {@link
   * KvRouterException} with {@link Status#CANCELLED}), and from now on a request that would wait
   * is cancelled at once; one admitted at once is still routed and booked, and previews, frees and
   * every other call work as before. {@link #close()} does this first, so that it never waits for
   * good for a call blocked in the queue; call it yourself to stop the queue before closing (for
   * example while requests in flight drain). Idempotent.
   *
   * @return how many requests were waiting (0 once closed)
   * @throws KvRouterException {@link Status#FAILED_PRECONDITION} called from a replica publisher,
   *     which runs under the router's lock that closing the queue takes
   */
  public long closeQueue() {
    ReplicaSink.refuseInPublisher("Router.closeQueue()");
    long h = acquire();
    try {
      return Native.closeQueue(h);
    } finally {
      release();
    }
  }

  /**
   * Drops every request booked longer than {@link RouterOptions#requestExpirySeconds()} ago (its
   * {@link #freeRequest} was lost: a crashed client, a missed event) and every plan past its
   * deadline, then admits the queued requests that now fit ({@code kvr_router_expire_requests}).
   * The router has no timer thread: a routing call that books does this at most once per
   * min(30 s, the expiry), and nothing does while no call comes, so with a queue threshold a lost
   * request can keep the queue waiting until one does. Call it on a timer (every second, say).
   *
   * @return how many requests were dropped
   * @throws KvRouterException {@link Status#FAILED_PRECONDITION} called from a replica publisher
   *     (as every call on its own router)
   */
  public long expireRequests() {
    long h = acquire();
    try {
      return Native.expireRequests(h);
    } finally {
      release();
    }
  }

  // ---- Snapshot ----

  /** The whole KV index as a FlatBuffers IndexSnapshot. */
  public byte[] snapshot() {
    long h = acquire();
    try {
      return Native.snapshot(h);
    } finally {
      release();
    }
  }

  /**
   * Loads a snapshot into a router whose index is empty. Of two restores at once, one loads
   * its snapshot and the other finds the index not empty.
   *
   * @throws KvRouterException {@link Status#FAILED_PRECONDITION} for a non-empty index or in
   *     approximate mode; {@link Status#INVALID_ARGUMENT} for a bad snapshot or one of another
   *     block size (nothing changes)
   */
  public void restore(byte[] snapshot) {
    restore(snapshot, 0, snapshot.length);
  }

  public void restore(byte[] snapshot, int offset, int length) {
    Objects.checkFromIndexSize(offset, length, snapshot.length);
    long h = acquire();
    try {
      Native.restore(h, snapshot, offset, length);
    } finally {
      release();
    }
  }

  // ---- Metrics ----

  public Metrics metrics() {
    long h = acquire();
    try {
      return new Metrics(Native.metrics(h));
    } finally {
      release();
    }
  }

  /** The metrics, with per-worker load gauges, in Prometheus text exposition format. */
  public String metricsPrometheus() {
    long h = acquire();
    try {
      return Native.metricsPrometheus(h);
    } finally {
      release();
    }
  }

  // ---- Staged routing ----

  /**
   * What routing would pick, changing nothing (no admission, booking, approximate-mode record or
   * session binding). Errors as {@link #findBestMatch}, plus the pin errors.
   *
   * @param options null = defaults; admission is ignored
   * @param hints null = none
   */
  public RouteSignals previewRoute(int[] tokens, RequestOptions options, RoutingHints hints) {
    Objects.requireNonNull(tokens, "tokens");
    long h = acquire();
    try {
      return HotPath.previewRoute(h, tokens, options, hints);
    } finally {
      release();
    }
  }

  /**
   * As {@link #previewRoute(int[], RequestOptions, RoutingHints)}, for a prompt given hashed (see
   * the class comment) of {@code numTokens} tokens. A preview takes the router's admission lock,
   * so an {@code int[]} prompt is copied for it (8,192 tokens: 32 KiB); hashed, only its hashes
   * are (4 KiB in blocks of 16), and the hashing ran before, in place, outside any lock.
   *
   * @throws KvRouterException {@link Status#INVALID_ARGUMENT} unless {@code localHashes} has one
   *     hash per complete block of {@code numTokens} tokens
   */
  public RouteSignals previewRouteHashed(
      long[] localHashes, long numTokens, RequestOptions options, RoutingHints hints) {
    checkHashed(localHashes, numTokens);
    long h = acquire();
    try {
      return HotPath.previewRouteHashed(h, localHashes, numTokens, options, hints);
    } finally {
      release();
    }
  }

  /**
   * Books the request as a plan, keeping {@code previewed}'s rank while it is still a candidate.
   * Idempotent for an id with a live plan.
   *
   * @param options must carry the request id
   * @param previewed a preview's signals, or null
   * @throws KvRouterException {@link Status#ALREADY_EXISTS} for an id active without a plan
   */
  public RouteSignals planRoute(
      int[] tokens, RequestOptions options, RoutingHints hints, RouteSignals previewed) {
    Objects.requireNonNull(tokens, "tokens");
    Objects.requireNonNull(options, "options");
    long[] prev = previewed == null ? null : previewed.encode();
    long[] out = new long[Abi.RouteSignals.LEN];
    long h = acquire();
    try {
      Native.planRoute(h, tokens, null, 0, options, hints, prev, out);
    } finally {
      release();
    }
    return RouteSignals.decode(out);
  }

  /**
   * As {@link #planRoute(int[], RequestOptions, RoutingHints, RouteSignals)}, for a prompt given
   * hashed (see the class comment) of {@code numTokens} tokens.
   *
   * @throws KvRouterException {@link Status#INVALID_ARGUMENT} unless {@code localHashes} has one
   *     hash per complete block of {@code numTokens} tokens
   */
  public RouteSignals planRouteHashed(
      long[] localHashes,
      long numTokens,
      RequestOptions options,
      RoutingHints hints,
      RouteSignals previewed) {
    checkHashed(localHashes, numTokens);
    Objects.requireNonNull(options, "options");
    long[] prev = previewed == null ? null : previewed.encode();
    long[] out = new long[Abi.RouteSignals.LEN];
    long h = acquire();
    try {
      Native.planRoute(h, null, localHashes, numTokens, options, hints, prev, out);
    } finally {
      release();
    }
    return RouteSignals.decode(out);
  }

  /**
   * The plan was dispatched (approximate mode records it, the session is bound). Idempotent.
   *
   * @throws KvRouterException {@link Status#NOT_FOUND}: no live plan; {@link
   *     Status#FAILED_PRECONDITION}: its worker was removed (plan again)
   */
  public void commitRoute(String requestId) {
    Objects.requireNonNull(requestId, "requestId");
    long h = acquire();
    try {
      Native.commitRoute(h, requestId);
    } finally {
      release();
    }
  }

  /** Frees the plan, its booking or its queue place; true if anything was freed. */
  public boolean abortRoute(String requestId) {
    Objects.requireNonNull(requestId, "requestId");
    long h = acquire();
    try {
      return Native.abortRoute(h, requestId);
    } finally {
      release();
    }
  }

  /** How long a plan may wait for commit or abort (default 30 s; for later plans). */
  public void setPlanDeadline(Duration deadline) {
    setPlanDeadlineSeconds(deadline.toNanos() / 1e9);
  }

  /**
   * @throws KvRouterException {@link Status#INVALID_ARGUMENT} unless finite and positive
   */
  public void setPlanDeadlineSeconds(double seconds) {
    long h = acquire();
    try {
      Native.setPlanDeadline(h, seconds);
    } finally {
      release();
    }
  }

  /**
   * Drives the router's clock by hand from now on, for simulations and tests in which time passes
   * at their own pace: everything the router times (request expiry, plan deadlines, session
   * bindings, approximate-mode TTLs, queue order, the prefill rates of {@link
   * CostFunction#PREDICTED_TTFT}) then sees {@code nanos} (nanoseconds from any origin) plus a
   * fixed offset chosen at the first call, so that the router's time continues from where it
   * was: only differences matter. Until the first call the router reads the process's monotonic
   * clock.
   *
   * @throws KvRouterException {@link Status#INVALID_ARGUMENT} if {@code nanos} is earlier than
   *     the last time set, or would take the router's time past +-2^62 ns (146 years)
   */
  public void setTime(long nanos) {
    long h = acquire();
    try {
      Native.setTime(h, nanos);
    } finally {
      release();
    }
  }

  /** Drops plans past their deadline now; returns how many. */
  public long expirePlans() {
    long h = acquire();
    try {
      return Native.expirePlans(h);
    } finally {
      release();
    }
  }

  /** The rank a live session is bound to (without refreshing it), or empty. */
  public Optional<WorkerRank> sessionBinding(String sessionId) {
    Objects.requireNonNull(sessionId, "sessionId");
    long h = acquire();
    long[] b;
    try {
      b = Native.sessionBinding(h, sessionId);
    } finally {
      release();
    }
    return b == null ? Optional.empty() : Optional.of(new WorkerRank(b[0], (int) b[1]));
  }

  /** Unbinds a session (no error if unbound). */
  public void closeSession(String sessionId) {
    Objects.requireNonNull(sessionId, "sessionId");
    long h = acquire();
    try {
      Native.closeSession(h, sessionId);
    } finally {
      release();
    }
  }

  /** Drops expired session bindings now; returns how many. */
  public long reclaimSessions() {
    long h = acquire();
    try {
      return Native.reclaimSessions(h);
    } finally {
      release();
    }
  }

  /**
   * A digest of all routing state (index, active requests, queue, plans, sessions): equal digests
   * mean nothing changed. Stable within one process only.
   */
  public long stateDigest() {
    long h = acquire();
    try {
      return Native.stateDigest(h);
    } finally {
      release();
    }
  }

  /**
   * A digest of the KV index alone: which worker and rank holds which block, on which tier, under
   * which prefix. Unlike {@link #stateDigest} it is equal across processes and machines running the
   * same library version when their indexes hold the same blocks, so replicas can compare their
   * views; bookings, the queue, plans and sessions do not enter it (except in approximate mode,
   * where the index is the routing decisions recorded when admitted or committed). It may change
   * between library versions.
   */
  public long indexDigest() {
    long h = acquire();
    try {
      return Native.indexDigest(h);
    } finally {
      release();
    }
  }

  /**
   * Frees the router once calls in progress returned. It first closes the admission queue ({@link
   * #closeQueue()}): a routing call waiting there on another thread, which close would otherwise
   * wait for with no end (without a queue timeout), throws {@link KvRouterException} with {@link
   * Status#CANCELLED} instead, as does one that would start waiting. Calls in progress that do not
   * wait finish as usual. An {@link Ingest} still feeding the router keeps the native router alive
   * until the ingest object is closed too. On a pool of a {@link DisaggRouter}, only this handle is
   * closed, but the pool's admission queue is closed too (its requests can no longer be freed
   * through this binding; the {@code DisaggRouter}'s own routing calls that would wait in that pool
   * are then cancelled).
   *
   * @throws KvRouterException {@link Status#FAILED_PRECONDITION} called from a replica publisher
   *     (the router staying open): closing the queue takes the router's lock, which the publisher
   *     runs under, and close waits for the calls in progress, which may be the publisher's own
   */
  @Override
  public void close() {
    if (!isClosed()) ReplicaSink.refuseInPublisher("Router.close()");
    super.close();
  }

  @Override
  void closing() {
    Native.closeQueue(resource.handle);
  }
}
