package io.kvrouter;

/**
 * The JNI entry points of libkvrouter_jni (src/main/c/kvrouter_jni.c), one or a few per C function
 * of kvrouter.h. Handles are the C pointers as {@code long}s; every fallible call throws {@link
 * KvRouterException} with the C status. Structs cross as {@code long[]} in the layouts below
 * (doubles as their raw bits, unsigned values as their bit patterns), or as the option objects
 * whose fields the glue reads ({@link RequestOptions}, {@link RoutingHints}, {@link StoredEvent},
 * {@link RemovedEvent}).
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

  // ---- Layouts (must match kvrouter_jni.c) ----

  static final int DEFAULTS_ROUTER_OPTIONS = 0;
  static final int DEFAULTS_WORKER_CONFIG = 1;
  static final int DEFAULTS_REQUEST_OPTIONS = 2;
  static final int DEFAULTS_ROUTING_HINTS = 3;
  static final int DEFAULTS_DISAGG_OPTIONS = 4;
  static final int DEFAULTS_INGEST_OPTIONS = 5;
  static final int DEFAULTS_ENGINE_WORKER = 6;
  static final int DEFAULTS_STORED_EVENT = 7;
  static final int DEFAULTS_REMOVED_EVENT = 8;

  static final int ROUTER_OPTIONS_LEN = 16;
  static final int WORKER_CONFIG_LEN = 6;
  static final int REQUEST_OPTIONS_LEN = 13;
  static final int ROUTING_HINTS_LEN = 8;
  static final int DISAGG_OPTIONS_LEN = 6;
  static final int INGEST_OPTIONS_LEN = 2;
  static final int ENGINE_WORKER_LEN = 6;
  static final int STORED_EVENT_LEN = 6;
  static final int REMOVED_EVENT_LEN = 4;
  static final int ROUTE_RESULT_LEN = 11;
  static final int CANDIDATE_LEN = 21;
  static final int OVERLAP_LEN = 9;
  static final int POTENTIAL_LOAD_LEN = 7;
  static final int ROUTE_SIGNALS_LEN = 12;
  static final int PREFILL_RESULT_LEN = 6;
  static final int METRICS_LEN = 27;
  static final int INGEST_STATS_LEN = 22;


  // ---- Library ----

  /** Looks up the fields the glue reads; called once, right after the library is loaded. */
  static native void initIds();

  static native int version();

  static native String versionString();

  /** KVR_VERSION_NUMBER of the header the glue was compiled against. */
  static native int headerVersion();


  static native String statusStr(int status);

  static native int tierFromMedium(String medium);

  /** Fills {@code out} with the defaults of one struct (DEFAULTS_*), from its _init function. */
  static native void defaults(int which, long[] out);

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

  /** Fills {@code out} (ROUTE_RESULT_LEN); returns the candidates (CANDIDATE_LEN each) or null. */
  static native long[] findBestMatch(
      long router, int[] tokens, RequestOptions options, int maxCandidates, long[] out);

  static native long[] overlapScores(long router, int[] tokens, RequestOptions options);

  static native long[] potentialLoads(long router, int[] tokens, RequestOptions options);

  static native void addRequest(
      long router, int[] tokens, long workerId, int dpRank, RequestOptions options);

  static native void markPrefillCompleted(long router, String requestId);

  static native void recordOutput(long router, String requestId, long outputTokens);

  static native void freeRequest(long router, String requestId);

  static native byte[] snapshot(long router);

  static native void restore(long router, byte[] data, int offset, int length);

  static native long[] metrics(long router);

  static native String metricsPrometheus(long router);

  static native void previewRoute(
      long router, int[] tokens, RequestOptions options, RoutingHints hints, long[] out);

  static native void planRoute(
      long router,
      int[] tokens,
      RequestOptions options,
      RoutingHints hints,
      long[] previewed,
      long[] out);

  static native void commitRoute(long router, String requestId);

  static native boolean abortRoute(long router, String requestId);

  static native void setPlanDeadline(long router, double seconds);

  static native long expirePlans(long router);

  /** {worker_id, dp_rank}, or null when the session is unbound or expired (KVR_NOT_FOUND). */
  static native long[] sessionBinding(long router, String sessionId);

  static native void closeSession(long router, String sessionId);

  static native long reclaimSessions(long router);

  static native long stateDigest(long router);

  // ---- Disaggregated prefill / decode ----

  static native long disaggNew(long[] prefill, long[] decode, long[] options);

  static native void disaggFree(long disagg);

  static native long disaggPrefillRouter(long disagg);

  static native long disaggDecodeRouter(long disagg);

  static native void disaggRoutePrefill(
      long disagg, int[] tokens, RequestOptions options, RoutingHints hints, long[] out);

  static native void disaggRouteDecode(
      long disagg,
      int[] tokens,
      RequestOptions options,
      RoutingHints hints,
      boolean remotePrefill,
      long[] out);

  static native boolean disaggPrefillWorkerBusy(
      long disagg, int[] tokens, RequestOptions options, double threshold);

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

  static native long ingestSyncReplicas(long ingest, String url, String subject, String replicaId);

  static native long[] ingestStats(long ingest, long sourceId);

  static native String ingestSourceEndpoint(long ingest, long sourceId);

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

  static long[] defaults(int which, int length) {
    long[] out = new long[length];
    defaults(which, out);
    return out;
  }
}
