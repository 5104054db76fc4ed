package io.kvrouter;

import java.util.Objects;
import java.util.concurrent.locks.ReadWriteLock;
import java.util.concurrent.locks.ReentrantReadWriteLock;

/**
 * Live KV event ingestion ({@code kvr_ingest}): one event-loop thread of its own receives the
 * events engines publish and applies them to a {@link Router}, while other threads route. Sources:
 * native stream listeners (TCP, Unix sockets), NATS subjects, NATS JetStream streams, vLLM / SGLang
 * ZMQ publishers; they may be added before or after {@link #start()}. {@link #relayJetStream}
 * republishes what they change into a JetStream stream.
 *
 * <p>Thread-safe. The router is kept alive (natively) until this object is closed, even if the
 * {@code Router} is closed first. {@link #stop()} is final: create a new object to restart.
 */
public final class Ingest extends NativeObject {
  // kvr_ingest_subscribe_nats, kvr_ingest_subscribe_jetstream, kvr_ingest_relay_jetstream and
  // kvr_ingest_sync_replicas may not run concurrently with kvr_ingest_stop: they share the read side (they run concurrently
  // with each other), stop takes the write side.
  private final ReadWriteLock stopLock = new ReentrantReadWriteLock();

  /** A stopped ingest object feeding {@code router}, with default options. */
  public Ingest(Router router) {
    this(router, null);
  }

  /**
   * @param options null = defaults
   */
  public Ingest(Router router, IngestOptions options) {
    super(create(router, options));
  }

  private static NativeResource create(Router router, IngestOptions options) {
    Objects.requireNonNull(router, "router");
    long r = router.acquire();
    try {
      router.resource.retain(); // the native router must outlive the ingest object
      try {
        long ingest = Native.ingestNew(r, options == null ? null : options.encoded());
        return new NativeResource(ingest, Native::ingestFree, router.resource);
      } catch (RuntimeException | Error e) {
        router.resource.release();
        throw e;
      }
    } finally {
      router.release();
    }
  }

  /**
   * Starts the loop thread.
   *
   * @throws KvRouterException {@link Status#FAILED_PRECONDITION} if started or stopped before
   */
  public void start() {
    long h = acquire();
    try {
      Native.ingestStart(h);
    } finally {
      release();
    }
  }

  /**
   * Closes every source and joins the loop thread. Final; idempotent. Called from a replica
   * publisher (see {@link #close()}) it returns at once, and a new daemon thread stops the ingest
   * (joining its loop, which ends once the publisher has returned).
   */
  public void stop() {
    long h = acquire();
    if (ReplicaSink.inPublisher()) {
      try {
        Thread thread =
            new Thread(
                () -> {
                  try {
                    stop(h);
                  } finally {
                    release();
                  }
                },
                "kvr-ingest-stop");
        thread.setDaemon(true);
        thread.start();
      } catch (RuntimeException | Error e) {
        release();
        throw e;
      }
      return;
    }
    try {
      stop(h);
    } finally {
      release();
    }
  }

  private void stop(long h) {
    stopLock.writeLock().lock();
    try {
      Native.ingestStop(h);
    } finally {
      stopLock.writeLock().unlock();
    }
  }

  /**
   * Listens for native event streams on "tcp://HOST:PORT" (port 0 = a free port) or "unix://PATH".
   *
   * @throws KvRouterException {@link Status#UNAVAILABLE} if the address cannot be bound
   */
  public Listener listen(String endpoint) {
    Objects.requireNonNull(endpoint, "endpoint");
    long[] source = new long[1];
    long h = acquire();
    String bound;
    try {
      bound = Native.ingestListen(h, endpoint, source);
    } finally {
      release();
    }
    return new Listener(source[0], bound);
  }

  /**
   * Subscribes to an engine's ZMQ publisher (register the worker with the router too, for routing);
   * returns the source id.
   *
   * @throws KvRouterException {@link Status#INVALID_ARGUMENT} for a block size other than the
   *     router's, a bad endpoint or dp size 0; {@link Status#ALREADY_EXISTS} for a worker id
   *     already subscribed
   */
  public long addEngineWorker(EngineWorker worker) {
    Objects.requireNonNull(worker, "worker");
    long h = acquire();
    try {
      return Native.ingestAddEngineWorker(
          h, worker.scalars, worker.endpoint, worker.topic, worker.replayEndpoint);
    } finally {
      release();
    }
  }

  /**
   * Unsubscribes from an engine worker; {@code clearIndex} also drops its index entries.
   *
   * @throws KvRouterException {@link Status#NOT_FOUND} for an unknown id
   */
  public void removeEngineWorker(long workerId, boolean clearIndex) {
    long h = acquire();
    try {
      Native.ingestRemoveEngineWorker(h, workerId, clearIndex);
    } finally {
      release();
    }
  }

  /**
   * Subscribes to {@code subject} (wildcards {@code *} and {@code >}) on the NATS server at {@code
   * url}; each message is one native EventBatch. After {@link #start()} it returns once the server
   * has the subscription. Returns the source id.
   *
   * @throws KvRouterException {@link Status#UNAVAILABLE} if the first connection fails
   */
  public long subscribeNats(String url, String subject) {
    Objects.requireNonNull(url, "url");
    Objects.requireNonNull(subject, "subject");
    long h = acquire();
    try {
      stopLock.readLock().lock();
      try {
        return Native.ingestSubscribeNats(h, url, subject);
      } finally {
        stopLock.readLock().unlock();
      }
    } finally {
      release();
    }
  }

  /**
   * Consumes a NATS JetStream stream (see {@link JetStreamSource}): each message is applied, then
   * acknowledged; {@link IngestStats#streamSequence()} of the source is the last stream sequence
   * applied. Connects and sets up the consumer on the calling thread; the connection then
   * reconnects forever and the consumer continues where it was. Returns the source id.
   *
   * @throws KvRouterException {@link Status#INVALID_ARGUMENT} for an empty url, stream or subject,
   *     a bad name or bad limits; {@link Status#NOT_FOUND} if the stream does not exist (without
   *     {@link JetStreamSource.Builder#createStream}); {@link Status#UNAVAILABLE} if the server
   *     cannot be reached or refuses
   */
  public long subscribeJetStream(JetStreamSource source) {
    Objects.requireNonNull(source, "source");
    long h = acquire();
    try {
      stopLock.readLock().lock();
      try {
        return Native.ingestSubscribeJetStream(
            h, source.scalars, source.url, source.stream, source.subject, source.durable);
      } finally {
        stopLock.readLock().unlock();
      }
    } finally {
      release();
    }
  }

  /**
   * The JetStream relay: republishes every change this ingest's other sources make to the
   * router's index into {@code target}'s stream, each as a native EventBatch on subject {@code
   * <subject>.<worker id>} ({@code target}'s subject is a prefix, without wildcards); a router
   * consuming that stream ({@link #subscribeJetStream} on {@code <subject>.>}) then holds what
   * this router's index holds of those workers. Not relayed: what a JetStream source consumed,
   * and events applied on the router directly. {@link JetStreamSource.Builder#createStream}
   * creates the stream on {@code <subject>.>}; the durable name, start sequence and resume flag
   * must be unset. One relay per ingest object; it lasts until {@link #stop()}. Its {@link
   * IngestStats}: {@code messages} the changes handed to the relay, {@code eventsApplied} those
   * the stream acknowledged, {@code published} the messages acknowledged, {@code streamSequence}
   * the last message's stream sequence, {@code missedMessages} the changes dropped while the
   * server was away (sent again by a resync; {@code stateUnknown} is 1 until then): it has caught
   * up when {@code messages == eventsApplied + missedMessages} and {@code stateUnknown == 0}.
   * Returns the source id.
   *
   * @throws KvRouterException {@link Status#INVALID_ARGUMENT} for an empty url, stream or subject,
   *     a bad name or bad limits, or a durable name, start sequence or resume flag; {@link
   *     Status#FAILED_PRECONDITION} for a second relay; {@link Status#NOT_FOUND} if the stream
   *     does not exist (without {@link JetStreamSource.Builder#createStream}); {@link
   *     Status#UNAVAILABLE} if the server cannot be reached or refuses
   */
  public long relayJetStream(JetStreamSource target) {
    Objects.requireNonNull(target, "target");
    long h = acquire();
    try {
      stopLock.readLock().lock();
      try {
        return Native.ingestRelayJetStream(
            h, target.scalars, target.url, target.stream, target.subject, target.durable);
      } finally {
        stopLock.readLock().unlock();
      }
    } finally {
      release();
    }
  }

  /**
   * Router replica sync over NATS: publishes this ingest's router's booking changes on {@code
   * subject} as {@code replicaId} (unique among the live replicas, without U+001F) and applies the
   * changes the other replicas publish there, so their requests count as load here. As with
   * {@link Router#setReplicaPublisher}, it first publishes a Reset, an Added change for every
   * booking the router holds and a SyncRequest, and it answers the SyncRequest of a replica that
   * joins later with a Reset and its bookings: {@link IngestStats#published()} counts those
   * messages too. One per ingest object. It replaces the router's publisher (a {@link
   * Router#setReplicaPublisher} callback, or another ingest object's sync), and a later one
   * replaces it in turn; when this ingest stops, its sync stops publishing unless it was
   * replaced. Returns the source id.
   *
   * @throws KvRouterException {@link Status#INVALID_ARGUMENT} for an empty id or one containing
   *     U+001F, {@link Status#UNAVAILABLE} if the first connection fails or the server does not
   *     confirm the subscription (nothing is left behind then), {@link
   *     Status#FAILED_PRECONDITION} for a second sync or a server whose max_payload is under
   *     4 KiB (a booking longer than a server's max_payload goes with its leading block ids,
   *     counted in {@link IngestStats#bookingsTrimmed()})
   */
  public long syncReplicas(String url, String subject, String replicaId) {
    Objects.requireNonNull(url, "url");
    Objects.requireNonNull(subject, "subject");
    Objects.requireNonNull(replicaId, "replicaId");
    long h = acquire();
    try {
      stopLock.readLock().lock();
      try {
        return Native.ingestSyncReplicas(h, url, subject, replicaId);
      } finally {
        stopLock.readLock().unlock();
      }
    } finally {
      release();
    }
  }

  /**
   * Where a source is: a listener's bound endpoint (with its real port), an engine worker's
   * endpoint, a NATS server's url; kept after the source is removed.
   *
   * @throws KvRouterException {@link Status#NOT_FOUND} for an unknown id
   */
  public String sourceEndpoint(long sourceId) {
    long h = acquire();
    try {
      return Native.ingestSourceEndpoint(h, sourceId);
    } finally {
      release();
    }
  }

  /** The counters summed over every source (removed ones included). */
  public IngestStats stats() {
    return stats(0);
  }

  /**
   * The counters of one source.
   *
   * @throws KvRouterException {@link Status#NOT_FOUND} for an unknown id
   */
  public IngestStats stats(long sourceId) {
    long h = acquire();
    try {
      return new IngestStats(Native.ingestStats(h, sourceId));
    } finally {
      release();
    }
  }

  /**
   * Every source's counters in Prometheus text exposition format ({@code kvrouter_ingest_*}, one
   * series per source labelled {@code source_id}, {@code kind} and {@code endpoint}; removed
   * sources included). The names differ from {@link Router#metricsPrometheus()}'s, so a /metrics
   * page may serve both texts one after the other.
   */
  public String metricsPrometheus() {
    long h = acquire();
    try {
      return Native.ingestMetricsPrometheus(h);
    } finally {
      release();
    }
  }

  /**
   * Stops if needed, closes every source and frees the object; then releases the router. Waits
   * for the calls in progress on other threads first; later calls throw {@link
   * IllegalStateException}.
   *
   * <p>Called from a replica publisher ({@link Router#setReplicaPublisher}: on this ingest's own
   * loop thread, for its heartbeats, or on a thread whose router call holds the router's lock),
   * it is asynchronous: the object is closed at once (a later {@code close()} does nothing, other
   * calls throw {@link IllegalStateException}), and a new daemon thread waits for the calls in
   * progress, then stops and frees it, once the publisher has returned. Freeing it on the
   * publisher's thread would join that very loop thread (the process aborted) or one waiting for
   * the lock the publisher holds.
   */
  @Override
  public void close() {
    if (ReplicaSink.inPublisher()) {
      closeOnAnotherThread("kvr-ingest-close");
      return;
    }
    super.close();
  }
}
