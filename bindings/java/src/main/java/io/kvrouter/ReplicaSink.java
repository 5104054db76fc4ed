package io.kvrouter;

/**
 * What the glue calls for every booking change to publish (its method is looked up by name): a
 * {@link ReplicaPublisher} behind a wall no exception crosses, since the caller is C code holding
 * the router's lock.
 */
final class ReplicaSink {
  // How many publishers the current thread is running (nested or not): inside one, the thread
  // holds the lock of the router publishing, and may be an Ingest's own loop thread (its
  // heartbeats, a replica change it applied), so what the publisher calls must not close an
  // admission queue (which takes that lock), nor wait for the calls in progress on a router (its
  // own among them), nor set a replica publisher (Router.setReplicaPublisher's lock may be held
  // by a thread waiting for the router's lock), nor stop or free an ingest object, which joins
  // its loop thread (perhaps this very one: std::terminate; or one waiting for that lock). Set
  // here for both back ends: the FFM downcalls' publishers come through the JNI glue's callback
  // too.
  private static final ThreadLocal<int[]> DEPTH = ThreadLocal.withInitial(() -> new int[1]);

  private final ReplicaPublisher publisher;

  ReplicaSink(ReplicaPublisher publisher) {
    this.publisher = publisher;
  }

  /** Whether the current thread is running a replica publisher. */
  static boolean inPublisher() {
    return DEPTH.get()[0] > 0;
  }

  /**
   * Refuses {@code call} (one that closes an admission queue or sets a replica publisher, taking
   * the router's lock a publisher runs under) from inside a publisher.
   *
   * @throws KvRouterException {@link Status#FAILED_PRECONDITION} inside a publisher
   */
  static void refuseInPublisher(String call) {
    if (inPublisher()) {
      throw new KvRouterException(
          Status.FAILED_PRECONDITION.code(),
          call
              + " called from a replica publisher, which runs under the router's lock that it"
              + " takes: call it after the publisher returns");
    }
  }

  /** Called by the JNI glue; never throws. */
  void publish(byte[] change) {
    int[] depth = DEPTH.get();
    depth[0]++;
    try {
      publisher.publish(change);
    } catch (Throwable t) {
      try {
        Thread thread = Thread.currentThread();
        thread.getUncaughtExceptionHandler().uncaughtException(thread, t);
      } catch (Throwable ignored) {
        // nothing more can be done here
      }
    } finally {
      depth[0]--;
    }
  }
}
