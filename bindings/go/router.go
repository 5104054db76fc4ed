//go:build cgo

package kvrouter

/*
#include "kvrouter.h"
*/
import "C"

import (
	"runtime"
	"sync/atomic"
	"time"
	"unsafe"
)

// RouterOptions are the router-wide settings (Dynamo's KvRouterConfig). Start from
// DefaultRouterOptions: a zero field means zero here, not "default".
type RouterOptions struct {
	BlockSize          uint32 // tokens per KV block; every worker must match
	Approximate        bool   // no KV events: record routing decisions instead
	NoKVReuse          bool   // assume_kv_reuse = false
	NoPrefillTracking  bool   // track_prefill_tokens = false
	Eagle              bool   // the model uses eagle block windows
	EntropySeed        bool   // seed the random source from the OS instead of RandomSeed
	TrackOutputBlocks  bool   // Router.RecordOutput grows a request's blocks as it generates
	QueuePolicy        QueuePolicy
	OverlapScoreCredit float64
	PrefillLoadScale   float64
	HostCacheHitWeight float64
	DiskCacheHitWeight float64 // disk and external tiers
	Temperature        float64 // 0: argmin with a random tie-break; > 0: softmax
	// Queue when every rank's prefill tokens exceed QueueThreshold × max_num_batched_tokens;
	// negative = never queue.
	QueueThreshold         float64
	ApproxTTL              time.Duration // approximate mode: how long a recorded block lives
	ApproxMaxBlocks        uint64        // approximate mode: the index budget
	ApproxPruneTargetRatio float64       // approximate mode: prune to this fraction of the budget
	RequestExpiry          time.Duration // a booked request older than this is dropped
	RandomSeed             uint64
	// OverlapScoreCreditDecay (Dynamo's newer cost; 0 = off) discounts a device hit on a rank
	// whose prefill backlog exceeds the least loaded candidate's: the device credit is
	// multiplied by 1 / (1 + decay × excess prefill blocks / prompt blocks).
	OverlapScoreCreditDecay float64
	// DecodeActiveRequestWeight (0 = off) adds weight × active requests to each rank's cost.
	DecodeActiveRequestWeight float64
	// IndexShards is the number of trees the KV index splits the workers over, 1..64 (default
	// 1). Events of workers in different trees apply in parallel, so several goroutines applying
	// events scale; every lookup walks every tree (on the Mooncake trace 2 trees cost 1.4x a
	// lookup, 4 cost 2.3x). As with the other fields, 0 is passed on and refused
	// (ErrInvalidArgument), not read as the default.
	IndexShards uint32
	// CostFunction is how a candidate rank is priced: CostCredit (the default, Dynamo's credit
	// form) or CostPredictedTTFT, the seconds until this prompt's first token: (the rank's
	// prefill tokens in flight + the prompt's uncached tokens) / the prefill rate, learnt from
	// the time between booking and MarkPrefillCompleted of every request (one rate for the
	// fleet), plus TTFTMissWeight × the
	// uncached tokens' own time. The credit-form weights do not apply to it, and it needs
	// prefill tracking (NoPrefillTracking is refused).
	CostFunction CostFunction
	// PrefillTokensPerSecond (CostPredictedTTFT) is the prefill rate assumed before the first
	// completion; 0 (the default) = unknown: every rank equally fast until one completes.
	PrefillTokensPerSecond float64
	// TTFTMissWeight (CostPredictedTTFT; default 3, finite, >= 0) weighs the uncached tokens'
	// own time: the delay a miss adds for the requests that will queue behind it.
	TTFTMissWeight float64
}

// DefaultRouterOptions returns every default of kvr_router_options_init (block size 16,
// credits 1.0 / 1.0 / 0.75 / 0.25, temperature 0, no queue, one index tree, ...). With a
// library this package does not accept (CheckVersion) it returns the zero value, which
// NewRouter then refuses with the version error.
func DefaultRouterOptions() RouterOptions {
	if CheckVersion() != nil {
		return RouterOptions{}
	}
	var c C.kvr_router_options
	initRouterOptions(&c)
	var m cRouterOptions
	m.load(&c)
	return routerOptionsFrom(&m)
}

// mirror converts the options to kvr_router_options' fields (flags from the booleans,
// durations in seconds).
func (o *RouterOptions) mirror() cRouterOptions {
	return cRouterOptions{
		BlockSize: o.BlockSize,
		Flags: flagIf(o.Approximate, C.KVR_ROUTER_APPROXIMATE) |
			flagIf(o.NoKVReuse, C.KVR_ROUTER_NO_KV_REUSE) |
			flagIf(o.NoPrefillTracking, C.KVR_ROUTER_NO_PREFILL_TRACKING) |
			flagIf(o.Eagle, C.KVR_ROUTER_EAGLE) |
			flagIf(o.EntropySeed, C.KVR_ROUTER_ENTROPY_SEED) |
			flagIf(o.TrackOutputBlocks, C.KVR_ROUTER_TRACK_OUTPUT_BLOCKS),
		QueuePolicy:               o.QueuePolicy,
		OverlapScoreCredit:        o.OverlapScoreCredit,
		PrefillLoadScale:          o.PrefillLoadScale,
		HostCacheHitWeight:        o.HostCacheHitWeight,
		DiskCacheHitWeight:        o.DiskCacheHitWeight,
		Temperature:               o.Temperature,
		QueueThreshold:            o.QueueThreshold,
		ApproxTTLSeconds:          o.ApproxTTL.Seconds(),
		ApproxMaxBlocks:           o.ApproxMaxBlocks,
		ApproxPruneTargetRatio:    o.ApproxPruneTargetRatio,
		RequestExpirySeconds:      o.RequestExpiry.Seconds(),
		RandomSeed:                o.RandomSeed,
		OverlapScoreCreditDecay:   o.OverlapScoreCreditDecay,
		DecodeActiveRequestWeight: o.DecodeActiveRequestWeight,
		IndexShards:               o.IndexShards,
		CostFunction:              o.CostFunction,
		PrefillTokensPerSecond:    o.PrefillTokensPerSecond,
		TTFTMissWeight:            o.TTFTMissWeight,
	}
}

// routerOptionsFrom is mirror's inverse.
func routerOptionsFrom(m *cRouterOptions) RouterOptions {
	return RouterOptions{
		BlockSize:                 m.BlockSize,
		Approximate:               m.Flags&C.KVR_ROUTER_APPROXIMATE != 0,
		NoKVReuse:                 m.Flags&C.KVR_ROUTER_NO_KV_REUSE != 0,
		NoPrefillTracking:         m.Flags&C.KVR_ROUTER_NO_PREFILL_TRACKING != 0,
		Eagle:                     m.Flags&C.KVR_ROUTER_EAGLE != 0,
		EntropySeed:               m.Flags&C.KVR_ROUTER_ENTROPY_SEED != 0,
		TrackOutputBlocks:         m.Flags&C.KVR_ROUTER_TRACK_OUTPUT_BLOCKS != 0,
		QueuePolicy:               m.QueuePolicy,
		OverlapScoreCredit:        m.OverlapScoreCredit,
		PrefillLoadScale:          m.PrefillLoadScale,
		HostCacheHitWeight:        m.HostCacheHitWeight,
		DiskCacheHitWeight:        m.DiskCacheHitWeight,
		Temperature:               m.Temperature,
		QueueThreshold:            m.QueueThreshold,
		ApproxTTL:                 seconds(m.ApproxTTLSeconds),
		ApproxMaxBlocks:           m.ApproxMaxBlocks,
		ApproxPruneTargetRatio:    m.ApproxPruneTargetRatio,
		RequestExpiry:             seconds(m.RequestExpirySeconds),
		RandomSeed:                m.RandomSeed,
		OverlapScoreCreditDecay:   m.OverlapScoreCreditDecay,
		DecodeActiveRequestWeight: m.DecodeActiveRequestWeight,
		IndexShards:               m.IndexShards,
		CostFunction:              m.CostFunction,
		PrefillTokensPerSecond:    m.PrefillTokensPerSecond,
		TTFTMissWeight:            m.TTFTMissWeight,
	}
}

// toC returns an initialised kvr_router_options holding o; nil stays NULL (every default).
func (o *RouterOptions) toC() *C.kvr_router_options {
	if o == nil {
		return nil
	}
	c := new(C.kvr_router_options)
	initRouterOptions(c)
	m := o.mirror()
	m.store(c)
	return c
}

// Router is a KV-cache-aware router (kvr_router). It is internally synchronised: every method
// may be called from any number of goroutines at once, Close included (see Close).
type Router struct {
	// ptr is the C router, with the calls in flight and the open Ingests feeding it; for a pool
	// router only the C router (its Disagg's ptr counts for it).
	ptr handlePtr
	// owner is set for the pool routers of a Disagg: they belong to it, Close does nothing, and
	// they are closed with it.
	owner *Disagg
	// replica holds the replica publish callback (SetReplicaPublisher): the Router's own, or
	// for a pool router its Disagg's for that pool, shared by every *Router of the pool.
	replica *replicaSlot
	// rows is how many rows the last per-rank query returned: the next one starts with room
	// for as many, as the library walks the index before it can say a buffer was short.
	rows atomic.Int32
}

// fed returns the handle that counts the open Ingests feeding this router, which Close
// checks: its own, or its Disagg's for a pool router.
func (r *Router) fed() *handlePtr {
	if r.owner != nil {
		return &r.owner.ptr
	}
	return &r.ptr
}

// NewRouter creates a router. opts nil means DefaultRouterOptions().
func NewRouter(opts *RouterOptions) (*Router, error) {
	if err := CheckVersion(); err != nil {
		return nil, err
	}
	var cerr *C.kvr_error
	var out *C.kvr_router
	if err := takeError(C.kvr_router_new(opts.toC(), &out, &cerr), cerr); err != nil {
		return nil, err
	}
	r := &Router{replica: new(replicaSlot)}
	r.ptr.open(unsafe.Pointer(out))
	runtime.SetFinalizer(r, (*Router).Close)
	return r, nil
}

// SetTime drives the router's clock by hand from now on, for simulations and tests in which
// time passes at their own pace: everything the router times (request expiry, plan deadlines,
// session bindings, approximate-mode TTLs, queue order, the prefill rates of CostPredictedTTFT)
// then sees nanos (nanoseconds from any origin) plus a fixed offset chosen at the first call,
// so that the router's time continues from where it was: only differences matter. Until the
// first call the router reads the process's monotonic clock. ErrInvalidArgument if nanos is
// earlier than the last time set, or would take the router's time past +-2^62 ns (146 years).
func (r *Router) SetTime(nanos int64) error {
	h := r.acquire()
	if h == nil {
		return ErrClosed
	}
	defer r.release()
	var cerr *C.kvr_error
	st := C.kvr_router_set_time(h, C.int64_t(nanos), &cerr)
	runtime.KeepAlive(r)
	return takeError(st, cerr)
}

// Close destroys the router. It is idempotent, and may run concurrently with other calls on the
// router: every call begun after it returns ErrClosed, and the calls begun before it finish on
// the router, which is freed when the last of them returns (at once if none is in flight).
// It closes the admission queue (as CloseQueue) before that: a request waiting there (which no
// FreeRequest could admit after Close) returns ErrCancelled at once, and so does a call in
// flight that would start waiting; one admitted at once is still routed. Close refuses
// (ErrFailedPrecondition, the router staying open and its queue too) while an Ingest feeding it
// is open. For a Disagg's pool router it does nothing (close the Disagg instead). Called from a
// replica publisher, which runs under the router's lock that closing the queue takes, it
// refuses (ErrFailedPrecondition) rather than block that thread, and the router with it.
func (r *Router) Close() error {
	if r == nil || r.owner != nil {
		return nil
	}
	if err := refuseInPublishCallback("Close"); err != nil {
		return err
	}
	h := r.acquire()
	if h == nil {
		return nil // closed before
	}
	defer r.release() // frees the router unless a call is in flight
	closed, fed := r.ptr.close()
	if fed {
		return newError(ErrFailedPrecondition, "an Ingest feeding this router is open: close it first")
	}
	if closed {
		closeQueue(h) // closed first: no call begun later can start waiting
	}
	return nil
}

// CloseQueue closes the router's admission queue, for a shutdown: every request waiting in it
// is cancelled (its FindBestMatch, or other routing call that waits, returns ErrCancelled), and
// from now on a request that would wait is ErrCancelled at once. A request admitted at once is
// still routed and booked, and FreeRequest and every other call work as before. It returns how
// many requests were waiting. It is final (the queue stays closed) and idempotent, and may run
// concurrently with any call. A gateway draining before its shutdown calls it to release the
// goroutines blocked in the queue while it goes on routing what it can place at once and
// freeing what ends; Close does it too. On a Disagg's pool router it closes that pool's queue.
//
// Called from a replica publisher it refuses (ErrFailedPrecondition), as Close.
func (r *Router) CloseQueue() (cancelled uint64, err error) {
	if err := refuseInPublishCallback("CloseQueue"); err != nil {
		return 0, err
	}
	h := r.acquire()
	if h == nil {
		return 0, ErrClosed
	}
	defer r.release()
	n, err := closeQueue(h)
	runtime.KeepAlive(r)
	return n, err
}

// refuseInPublishCallback refuses a call that takes the router's lock (closing its queue,
// setting its replica publisher) when made from inside a replica publisher, which holds that
// lock: it would block for good (SetReplicaPublisher on a lock of its own first, see there).
func refuseInPublishCallback(call string) error {
	if !inPublishCallback() {
		return nil
	}
	return newError(ErrFailedPrecondition, call+" called from a replica publisher, which runs "+
		"under the router's lock: call it after the publisher returns")
}

// closeQueue calls kvr_router_close_queue on h (held by the caller).
func closeQueue(h *C.kvr_router) (uint64, error) {
	var n C.uint64_t
	var cerr *C.kvr_error
	st := C.kvr_router_close_queue(h, &n, &cerr)
	return uint64(n), takeError(st, cerr)
}

// free frees the C router, closed and with no call in flight, and releases its replica publish
// callback (which the library no longer calls).
func (r *Router) free() {
	runtime.SetFinalizer(r, nil)
	C.kvr_router_free((*C.kvr_router)(r.ptr.p))
	r.replica.release()
}

// acquire returns the C router for one call, to give back with release (deferred), or nil once
// it (or its owning Disagg) is closed.
func (r *Router) acquire() *C.kvr_router {
	if r == nil {
		return nil
	}
	if r.owner != nil {
		if r.owner.acquire() == nil {
			return nil
		}
		return (*C.kvr_router)(r.ptr.p)
	}
	return (*C.kvr_router)(r.ptr.acquire())
}

// release ends a call begun by acquire, freeing the router (or its Disagg) if it was closed
// meanwhile and this was the last call in flight.
func (r *Router) release() {
	if r.owner != nil {
		r.owner.release()
	} else if r.ptr.release() {
		r.free()
	}
}

// WorkerConfig registers a worker and its data-parallel ranks. The zero value is worker 0
// with one rank at 0, the router's block size and no capacity reported.
type WorkerConfig struct {
	WorkerID            uint64
	BlockSize           uint32 // 0 = the router's; otherwise must equal it
	DPStart             uint32 // first data-parallel rank
	DPSize              uint32 // number of ranks; 0 = 1
	TotalKVBlocks       uint64 // 0 = not reported
	MaxNumBatchedTokens uint64 // 0 = not reported (the queue uses 10,000,000)
}

func (w *WorkerConfig) toC() *C.kvr_worker_config {
	c := new(C.kvr_worker_config)
	initWorkerConfig(c)
	var m cWorkerConfig
	m.load(c) // the defaults (one rank)
	m.BlockSize = w.BlockSize
	m.WorkerID = w.WorkerID
	m.DPStart = w.DPStart
	if w.DPSize != 0 {
		m.DPSize = w.DPSize
	}
	m.TotalKVBlocks = w.TotalKVBlocks
	m.MaxNumBatchedTokens = w.MaxNumBatchedTokens
	m.store(c)
	return c
}

// AddWorker registers a worker: ErrAlreadyExists for a registered id, ErrInvalidArgument for
// a block size mismatch or a bad rank range. It may admit queued requests.
func (r *Router) AddWorker(w WorkerConfig) error {
	h := r.acquire()
	if h == nil {
		return ErrClosed
	}
	defer r.release()
	var cerr *C.kvr_error
	st := C.kvr_router_add_worker(h, w.toC(), &cerr)
	runtime.KeepAlive(r)
	return takeError(st, cerr)
}

// UpdateWorker changes a registered worker (ErrNotFound for an unknown id). Ranks that
// disappear lose their requests and index entries.
func (r *Router) UpdateWorker(w WorkerConfig) error {
	h := r.acquire()
	if h == nil {
		return ErrClosed
	}
	defer r.release()
	var cerr *C.kvr_error
	st := C.kvr_router_update_worker(h, w.toC(), &cerr)
	runtime.KeepAlive(r)
	return takeError(st, cerr)
}

// RemoveWorker drops the worker's ranks, active requests and index entries (ErrNotFound for an
// unknown id).
func (r *Router) RemoveWorker(workerID uint64) error {
	h := r.acquire()
	if h == nil {
		return ErrClosed
	}
	defer r.release()
	var cerr *C.kvr_error
	st := C.kvr_router_remove_worker(h, C.uint64_t(workerID), &cerr)
	runtime.KeepAlive(r)
	return takeError(st, cerr)
}
