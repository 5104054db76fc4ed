package io.kvrouter;

/**
 * The JNI entry points of libkvrouter_jni (src/main/c/kvrouter_jni.c), one or a few per C function
 * of kvrouter.h. Handles are the C pointers as {@code long}s; every fallible call throws {@link
 * KvRouterException} with the C status. Structs cross as {@code long[]} in the slots of the
 * generated {@link Abi} (kvrouter_jni_abi.h in the glue; doubles as their raw bits, unsigned
 * values as their bit patterns), or as the option objects whose fields the glue reads ({@link
 * RequestOptions}, {@link RoutingHints}, {@link StoredEvent}, {@link RemovedEvent}: their {@code
 * scalars} in the same slots). The glue initialises every struct with its {@code _init} at the
 * size it was compiled with, so fields a Java array does not carry keep the library's defaults.
 *
 * <p>Every call that takes a prompt takes it as {@code tokens}, or, with {@code hashes} non-null,
 * as a prompt given hashed: its local hashes, one per complete block, and {@code numTokens} its
 * length (KVR_REQUEST_PREHASHED: the glue passes the hashes in the request options and no
 * tokens; {@code tokens} and {@code direct} are then null).
 *
 * <p>Nothing here checks that a handle is alive: the public classes do, through {@link
 * NativeObject}.
 */
final class Native {
  private Native() {}

  static {
    NativeLoader.load();
  }

  /** Forces the class (and so the library) to load. */
  static void init() {}

  // ---- Library ----

  /** Looks up the fields the glue reads; called once, right after the library is loaded. */
  static native void initIds();

  static native int version();

  static native String versionString();

  /** KVR_VERSION_NUMBER of the header the glue was compiled against. */
  static native int headerVersion();

  static native String statusStr(int status);

  static native int tierFromMedium(String medium);

  // The library's defaults of one struct (its _init), encoded in the slots of Abi.<Struct>.

  static native long[] routerOptionsDefaults();

  static native long[] workerConfigDefaults();

  static native long[] requestOptionsDefaults();

  static native long[] routingHintsDefaults();

  static native long[] disaggOptionsDefaults();

  static native long[] ingestOptionsDefaults();

  static native long[] engineWorkerDefaults();

  static native long[] jetstreamSourceDefaults();

  static native long[] storedEventDefaults();

  static native long[] removedEventDefaults();

  // ---- Hashing ----

  static native long[] computeBlockHashes(
      int[] tokens,
      int blockSize,
      boolean eagle,
      String loraName,
      String cacheNamespace,
      long[] mmHashes,
      int[] mmCounts);

  static native long[] computeSequenceHashes(long[] localHashes);

  // ---- Router ----

  static native long routerNew(long[] options);

  static native void routerFree(long router);

  static native void addWorker(long router, long[] config);

  static native void updateWorker(long router, long[] config);

  static native void removeWorker(long router, long workerId);

  static native void applyStored(long router, StoredEvent event);

  static native void applyRemoved(long router, RemovedEvent event);

  static native void applyCleared(long router, long workerId, int dpRank, long eventId);

  static native void applyEventBatch(long router, byte[] data, int offset, int length);

  /**
   * Installs a replica publisher (sink null: none) and returns its native context, to be freed with
   * {@link #freeReplicaContext} once replaced, cleared or the router freed.
   */
  static native long setReplicaPublisher(long router, String replicaId, ReplicaSink sink);

  static native void freeReplicaContext(long context);

  static native void applyReplicaEvent(long router, byte[] data, int offset, int length);

  static native void replicaHeartbeat(long router, int intervalMs);

  /** Returns how many replicas were dropped. */
  static native long expireReplicas(long router, double timeoutSeconds);

  /**
   * Fills {@code out} ({@link RouteResult#ENCODED_LEN}: Abi.RouteResult's slots, then the candidate
   * count); returns the candidates (Abi.Candidate.LEN slots each) or null.
   */
  static native long[] findBestMatch(
      long router,
      int[] tokens,
      java.nio.IntBuffer direct,
      int offset,
      int length,
      long[] hashes,
      long numTokens,
      RequestOptions options,
      int maxCandidates,
      long[] out);

  /**
   * findBestMatch for options that set nothing but the flags and the strings (RequestOptions
   * .simpleFlags() >= 0), passed as arguments; no candidates. The prompt is {@code tokens}, or with
   * {@code direct} non-null the {@code length} ints at {@code offset} of that direct IntBuffer.
   * Each string comes with its length() (0 for null), which saves the glue a JNI call.
   */
  static native void findBestMatchSimple(
      long router,
      int[] tokens,
      java.nio.IntBuffer direct,
      int offset,
      int length,
      long[] hashes,
      long numTokens,
      int flags,
      String requestId,
      int requestIdLength,
      String loraName,
      int loraNameLength,
      String cacheNamespace,
      int cacheNamespaceLength,
      long[] out);

  /**
   * For the overhead benchmark only (OverheadBenchmark, in the tests): runs {@code iters} calls of
   * kind {@code op} (0 preview, 1 admit + free, 2 mark + free) from a loop in C on the router, over
   * {@code nq} prompts of {@code qlen} tokens and {@code nids} NUL-terminated ids of {@code stride}
   * bytes each (both copied before the clock starts), and returns the loop's time in ns (-1 if a
   * call failed).
   */
  static native long benchChunk(
      long router, int op, int[] tokens, int nq, int qlen, byte[] ids, int stride, int nids,
      int iters);

  /**
   * For the Java 22+ path of the hot calls (META-INF/versions/22/io/kvrouter/HotPath): the
   * addresses of the C functions it calls and the sizes and offsets of the structs it uses, as
   * the glue was compiled (the order of that class's T_* constants).
   */
  static native long[] ffmTable();

  /**
   * Throws the {@link KvRouterException} a JNI call would for {@code status} and the error object
   * {@code err} (a {@code kvr_error*}, or 0), and frees the error object.
   */
  static native void throwStatus(int status, long err);

  static native long[] overlapScores(
      long router, int[] tokens, long[] hashes, long numTokens, RequestOptions options);

  static native long[] overlapScoresHashed(long router, long[] localHashes, RequestOptions options);

  /** kvr_router_find_matches: Abi.Match.LEN slots per rank. */
  static native long[] findMatches(long router, long[] localHashes);

  static native long[] potentialLoads(
      long router, int[] tokens, long[] hashes, long numTokens, RequestOptions options);

  static native void addRequest(
      long router,
      int[] tokens,
      long[] hashes,
      long numTokens,
      long workerId,
      int dpRank,
      RequestOptions options);

  static native void markPrefillCompleted(long router, String requestId);

  static native void recordOutput(long router, String requestId, long outputTokens);

  static native void freeRequest(long router, String requestId);

  /** kvr_router_close_queue: how many requests were waiting. */
  static native long closeQueue(long router);

  /** kvr_router_expire_requests: how many requests were dropped. */
  static native long expireRequests(long router);

  static native byte[] snapshot(long router);

  static native void restore(long router, byte[] data, int offset, int length);

  static native long[] metrics(long router);

  static native String metricsPrometheus(long router);

  static native void previewRoute(
      long router,
      int[] tokens,
      long[] hashes,
      long numTokens,
      RequestOptions options,
      RoutingHints hints,
      long[] out);

  static native void planRoute(
      long router,
      int[] tokens,
      long[] hashes,
      long numTokens,
      RequestOptions options,
      RoutingHints hints,
      long[] previewed,
      long[] out);

  static native void commitRoute(long router, String requestId);

  static native boolean abortRoute(long router, String requestId);

  static native void setPlanDeadline(long router, double seconds);

  static native void setTime(long router, long nanos);

  static native long expirePlans(long router);

  /** {worker_id, dp_rank}, or null when the session is unbound or expired (KVR_NOT_FOUND). */
  static native long[] sessionBinding(long router, String sessionId);

  static native void closeSession(long router, String sessionId);

  static native long reclaimSessions(long router);

  static native long stateDigest(long router);

  static native long indexDigest(long router);

  // ---- Disaggregated prefill / decode ----

  static native long disaggNew(long[] prefill, long[] decode, long[] options);

  static native void disaggFree(long disagg);

  static native long disaggPrefillRouter(long disagg);

  static native long disaggDecodeRouter(long disagg);

  static native void disaggRoutePrefill(
      long disagg,
      int[] tokens,
      long[] hashes,
      long numTokens,
      RequestOptions options,
      RoutingHints hints,
      long[] out);

  static native void disaggRouteDecode(
      long disagg,
      int[] tokens,
      long[] hashes,
      long numTokens,
      RequestOptions options,
      RoutingHints hints,
      boolean remotePrefill,
      long[] out);

  static native boolean disaggPrefillWorkerBusy(
      long disagg,
      int[] tokens,
      long[] hashes,
      long numTokens,
      RequestOptions options,
      double threshold);

  // ---- Event batches ----

  static native long eventBatchNew();

  static native void eventBatchFree(long batch);

  static native void eventBatchAddStored(long batch, StoredEvent event);

  static native void eventBatchAddRemoved(long batch, RemovedEvent event);

  static native void eventBatchAddCleared(long batch, long workerId, int dpRank, long eventId);

  static native long eventBatchSize(long batch);

  static native byte[] eventBatchEncode(long batch);

  static native void eventBatchClear(long batch);

  static native void eventBatchSetPublishTime(long batch, long unixNanos);

  // ---- Ingest ----

  static native long ingestNew(long router, long[] options);

  static native void ingestStart(long ingest);

  static native void ingestStop(long ingest);

  static native void ingestFree(long ingest);

  /** Returns the bound endpoint; {@code sourceId[0]} receives the source id. */
  static native String ingestListen(long ingest, String endpoint, long[] sourceId);

  static native long ingestAddEngineWorker(
      long ingest, long[] scalars, String endpoint, String topic, String replayEndpoint);

  static native void ingestRemoveEngineWorker(long ingest, long workerId, boolean clearIndex);

  static native long ingestSubscribeNats(long ingest, String url, String subject);

  static native long ingestSubscribeJetStream(
      long ingest, long[] scalars, String url, String stream, String subject, String durable);

  static native long ingestRelayJetStream(
      long ingest, long[] scalars, String url, String stream, String subject, String durable);

  static native long ingestSyncReplicas(long ingest, String url, String subject, String replicaId);

  static native long[] ingestStats(long ingest, long sourceId);

  static native String ingestSourceEndpoint(long ingest, long sourceId);

  static native String ingestMetricsPrometheus(long ingest);

  // ---- Publisher ----

  static native long publisherConnect(String endpoint);

  static native void publisherSend(long publisher, long batch);

  static native void publisherSendEncoded(long publisher, byte[] data, int offset, int length);

  static native void publisherFree(long publisher);

  // ---- Helpers ----

  static long bits(double value) {
    return Double.doubleToRawLongBits(value);
  }

  static double dbl(long bits) {
    return Double.longBitsToDouble(bits);
  }
}
