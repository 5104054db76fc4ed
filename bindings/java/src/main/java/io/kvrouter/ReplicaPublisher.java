package io.kvrouter;

/**
 * Receives this router's booking changes, to carry to every other replica ({@link
 * Router#setReplicaPublisher}); each is an encoded FlatBuffers SequenceChange for {@link
 * Router#applyReplicaEvent(byte[])} at the other end.
 *
 * <p>Called on the thread that made the change, under the router's internal lock, in the order of
 * the changes: it must be quick (queue the bytes or hand them to an asynchronous client) and must
 * not call into the router (that would deadlock). The array is the receiver's to keep. A {@link
 * RuntimeException} or {@link Error} it throws goes to the thread's uncaught-exception handler; the
 * routing call that made the change is not affected.
 */
@FunctionalInterface
public interface ReplicaPublisher {
  void publish(byte[] change);
}
