package io.kvrouter;

/**
 * Receives this router's booking changes, to carry to every other replica ({@link
 * Router#setReplicaPublisher}); each is an encoded FlatBuffers SequenceChange for {@link
 * Router#applyReplicaEvent(byte[])} at the other end.
 *
 * <p>Called on the thread that made the change, under the router's internal lock, in the order of
 * the changes: it must be quick (queue the bytes or hand them to an asynchronous client) and must
 * not call into any router (this one would deadlock; a bus delivering synchronously to another
 * router could deadlock when that router's own changes come back). Its first calls, on the
 * thread installing it and before {@link Router#setReplicaPublisher} returns, announce the router
 * (Reset, an Added change per booking, SyncRequest); a SyncRequest another replica sent makes the
 * thread applying it call it (Reset and the bookings), or, for a join answered with the next
 * heartbeat, the thread of that heartbeat (past its due time, of the next local change, replica
 * change applied or expiry call). The array is the receiver's to keep. A {@link
 * RuntimeException} or {@link Error} it throws goes to the thread's uncaught-exception handler; the
 * routing call that made the change is not affected.
 *
 * <p>It may close or stop an {@link Ingest}, even the one whose loop thread runs it (its
 * heartbeats): that is done on a new thread once it has returned ({@link Ingest#close()}). {@link
 * Router#close()}, {@link Router#closeQueue()}, {@link DisaggRouter#close()} and {@link
 * Router#setReplicaPublisher} (on any router: this publisher replacing or clearing itself too)
 * throw {@link KvRouterException} with {@link Status#FAILED_PRECONDITION} there.
 */
@FunctionalInterface
public interface ReplicaPublisher {
  void publish(byte[] change);
}
