//go:build cgo

package kvrouter

/*
#include <stdint.h>
#include "kvrouter.h"

// The Go callback (replicas_export.go) takes a non-const pointer: cgo exports cannot say const.
extern void kvrGoReplicaPublish(void* user_data, void* data, size_t size);

static void kvr_go_replica_publish(void* user_data, const void* data, size_t size) {
  kvrGoReplicaPublish(user_data, (void*)data, size);
}

// The handle travels as an integer so that Go never turns an integer into a pointer.
static kvr_status kvr_go_set_replica_publisher(kvr_router* router, const char* replica_id,
                                               uintptr_t handle, kvr_error** err) {
  if (handle == 0) return kvr_router_set_replica_publisher(router, NULL, NULL, NULL, err);
  return kvr_router_set_replica_publisher(router, replica_id, kvr_go_replica_publish,
                                          (void*)handle, err);
}
*/
import "C"

import (
	"runtime"
	"runtime/cgo"
	"sync"
	"time"
)

// replicaSlot is the Go side of one C router's replica publisher: the handle of the callback
// the library holds, and a lock that makes installing a callback in the library and recording
// its handle here one step (two setters racing would otherwise leave the library holding a
// handle Go had deleted). A Router owns its slot; a Disagg owns its pools' (PrefillRouter and
// DecodeRouter return a new *Router per call, all sharing the pool's slot), so a callback is
// released when the C router that calls it is freed (Close, or the finalizer), and nothing
// but that owner keeps the slot alive.
type replicaSlot struct {
	mu     sync.Mutex
	handle cgo.Handle // 0: no callback
}

// release drops the callback of a C router that has been freed (which no longer calls it).
func (s *replicaSlot) release() {
	s.mu.Lock()
	old := s.handle
	s.handle = 0
	s.mu.Unlock()
	if old != 0 {
		old.Delete()
	}
}

// SetReplicaPublisher makes the router hand every change to its own bookings (booked, prefill
// completed, freed) to publish, encoded, for the other router replicas, which apply them with
// ApplyReplicaEvent: a request booked at one replica is then load at all of them (see
// docs/replicas.md). replicaID names this replica: unique among the live replicas, without
// byte 0x1F. publish first receives a Reset, the router's current bookings and a SyncRequest,
// so peers drop what they held from this id and answer with their own bookings (at once, or
// with their next heartbeat if they beat every 2 s or less: joins close together share one
// answer). publish runs
// synchronously on the goroutine (or library thread) that made the change (an announcement
// that falls due: the one beating, expiring or applying a replica change), under the router's
// lock, in order: it must be quick (send to a channel or an asynchronous client), must not
// call any router (a call into its own router, which would wait for that lock for ever, returns
// ErrFailedPrecondition from a 0.2.1 library; so do Close, CloseQueue and SetReplicaPublisher
// itself, on any router), and must copy data to keep it. nil stops publishing. A callback replaced
// (or stopped by nil) first receives a farewell Reset, so peers drop what they hold from its
// id; once this returns, the previous callback is not running and will not run again.
// Ingest.SyncReplicas does all of this over NATS. Like the other methods it may run
// concurrently with any call, Close included (begun after Close, it returns ErrClosed), and
// with itself: calls on one router (or pool) take effect one at a time, the last one's
// callback staying. The callback is released when it is
// replaced or stopped, or when the router is freed (Close, or the finalizer of a Router never
// closed; for a pool router, its Disagg's). A callback that refers to its router (or Disagg)
// keeps it from being collected: close that one.
//
// A panic in publish does not unwind through the library (that would leave the router's lock
// held, and every later call on the router blocked). When publish ran inside a call made from
// Go (this one, for the announcement and the farewell; FindBestMatch, AddRequest, FreeRequest,
// ApplyReplicaEvent, ...), the panic is recovered there and raised again, with the same value,
// on that goroutine when the library returns: the change was made (a booking is held, a free
// done) and peers may have missed it; of several panics in one call, the first is raised.
// When publish ran on a library thread, with no goroutine waiting for it (an Ingest's loop:
// a SyncRequest or heartbeat it handles), the panic is not recovered: as any panic no goroutine
// recovers, it ends the program, with its stack. publish must not call runtime.Goexit
// (t.FailNow), which cannot be stopped before the library's frames.
//
// Called from a replica publisher (of any router: publish replacing or clearing itself, during
// its announcement or later, or another's), it returns ErrFailedPrecondition, the publisher in
// place staying, before it takes the lock that serialises the setters of this router: that lock
// may be held by the publisher's own goroutine (its announcement runs inside this call) or by
// a goroutine waiting for the router's lock the publisher holds. Set it once publish returned.
func (r *Router) SetReplicaPublisher(replicaID string, publish func(data []byte)) error {
	if err := refuseInPublishCallback("SetReplicaPublisher"); err != nil {
		return err
	}
	h := r.acquire()
	if h == nil {
		return ErrClosed
	}
	defer r.release()
	defer runtime.KeepAlive(r)
	var a args
	defer a.release()
	id := a.str("replicaID", replicaID)
	if err := a.err(); err != nil {
		return err
	}
	var handle cgo.Handle
	if publish != nil {
		handle = cgo.NewHandle(publish)
	}
	slot := r.replica
	slot.mu.Lock()
	var cerr *C.kvr_error
	st := C.kvr_go_set_replica_publisher(h, id, C.uintptr_t(handle), &cerr)
	err := errorOf(st, cerr)
	previous := handle // refused: the library kept its callback and never saw this one
	if err == nil {
		previous, slot.handle = slot.handle, handle
	}
	slot.mu.Unlock()
	if previous != 0 {
		previous.Delete() // the library no longer calls it
	}
	raisePublishPanic() // of the announcement or the farewell, now that the handles are in order
	return err
}

// ApplyReplicaEvent applies one change another replica published (the bytes its
// SetReplicaPublisher callback received): its bookings count as load here, and its frees may
// admit requests waiting in this router's queue. Changes from this router's own replica id are
// ignored. ErrInvalidArgument for bytes that are not a change, ErrNotFound for a worker rank
// this router does not know, ErrAlreadyExists for a booking applied twice; nothing changes then.
func (r *Router) ApplyReplicaEvent(data []byte) error {
	h := r.acquire()
	if h == nil {
		return ErrClosed
	}
	defer r.release()
	p, n := bytesPtr(data)
	var cerr *C.kvr_error
	st := C.kvr_router_apply_replica_event(h, p, n, &cerr)
	runtime.KeepAlive(r)
	runtime.KeepAlive(data)
	return takeError(st, cerr)
}

// ReplicaHeartbeat publishes a heartbeat through the router's replica publisher (after an
// announcement of every booking if one is due: a lost change's repair, or joins' answer), promising
// the next within intervalMs (1..3,600,000; else ErrInvalidArgument): a peer that has heard one
// from this replica (or a change published after it: each carries the interval) drops its bookings
// there (ExpireReplicas) once it falls silent. Over a bus of your own, call it every interval;
// Ingest.SyncReplicas does it on a timer, the first at once (IngestOptions.ReplicaHeartbeat).
// ErrFailedPrecondition if the router has no publisher (SetReplicaPublisher).
func (r *Router) ReplicaHeartbeat(intervalMs uint32) error {
	h := r.acquire()
	if h == nil {
		return ErrClosed
	}
	defer r.release()
	var cerr *C.kvr_error
	st := C.kvr_router_replica_heartbeat(h, C.uint32_t(intervalMs), &cerr)
	runtime.KeepAlive(r)
	return takeError(st, cerr)
}

// ExpireReplicas drops the bookings held from every replica that has sent heartbeats and has
// been heard from (any change) no later than timeout ago on the router's clock (or three of
// its own heartbeat intervals, if longer), and returns how many replicas it dropped (counted in
// Metrics.ReplicasExpired); the freed capacity may admit queued requests. A replica that never
// sent a heartbeat keeps its bookings until the request expiry; one dropped but heard again is
// asked (if this router publishes) to announce its bookings again. It may publish this router's
// own bookings, answering joins whose heartbeat did not come: a caller beating by hand calls it
// on a timer too. ErrInvalidArgument unless timeout > 0. Ingest.SyncReplicas does it on a
// timer (IngestOptions.ReplicaTimeout).
func (r *Router) ExpireReplicas(timeout time.Duration) (int, error) {
	h := r.acquire()
	if h == nil {
		return 0, ErrClosed
	}
	defer r.release()
	var n C.size_t
	var cerr *C.kvr_error
	st := C.kvr_router_expire_replicas(h, C.double(timeout.Seconds()), &n, &cerr)
	runtime.KeepAlive(r)
	return int(n), takeError(st, cerr)
}

// SyncReplicas syncs the router's bookings with the other router replicas over NATS: every
// change to its own bookings is published on subject as replicaID, and the changes the others
// publish there are applied (see Router.SetReplicaPublisher for the rules). The source's
// IngestStats count changes received, applied, rejected (RejectBadFlatBuffers, RejectIndex),
// Published, PublishFailures and BookingsTrimmed (publications of a booking longer than the
// server's max_payload, sent with its leading block ids). One per Ingest and router
// (ErrFailedPrecondition for a second, and for a server whose max_payload is under 4 KiB); it
// ends when the Ingest stops. ErrUnavailable if the first connection fails.
func (in *Ingest) SyncReplicas(url, subject, replicaID string) (uint64, error) {
	in.natsMu.RLock()
	defer in.natsMu.RUnlock()
	return in.addSource(func(a *args) sourceCall {
		u, s, r := a.str("url", url), a.str("subject", subject), a.str("replicaID", replicaID)
		return func(h *C.kvr_ingest, id *C.uint64_t, cerr **C.kvr_error) C.kvr_status {
			return C.kvr_ingest_sync_replicas(h, u, s, r, id, cerr)
		}
	})
}
