package io.kvrouter;

/**
 * What the glue calls for every booking change to publish (its method is looked up by name): a
 * {@link ReplicaPublisher} behind a wall no exception crosses, since the caller is C code holding
 * the router's lock.
 */
final class ReplicaSink {
  private final ReplicaPublisher publisher;

  ReplicaSink(ReplicaPublisher publisher) {
    this.publisher = publisher;
  }

  /** Called by the JNI glue; never throws. */
  void publish(byte[] change) {
    try {
      publisher.publish(change);
    } catch (Throwable t) {
      try {
        Thread thread = Thread.currentThread();
        thread.getUncaughtExceptionHandler().uncaughtException(thread, t);
      } catch (Throwable ignored) {
        // nothing more can be done here
      }
    }
  }
}
