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

// QueuePolicy orders the admission queue (KVR_QUEUE_*).
type QueuePolicy uint32

const (
	QueueFCFS QueuePolicy = C.KVR_QUEUE_FCFS // first come, first served
	QueueLCFS QueuePolicy = C.KVR_QUEUE_LCFS // last come, first served
	QueueWSPT QueuePolicy = C.KVR_QUEUE_WSPT // weighted shortest processing time
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
}

// DefaultRouterOptions returns every default of kvr_router_options_init (block size 16,
// credits 1.0 / 1.0 / 0.75 / 0.25, temperature 0, no queue, ...).
func DefaultRouterOptions() RouterOptions {
	var c C.kvr_router_options
	C.kvr_router_options_init(&c)
	return RouterOptions{
		BlockSize:              uint32(c.block_size),
		Approximate:            c.flags&C.KVR_ROUTER_APPROXIMATE != 0,
		NoKVReuse:              c.flags&C.KVR_ROUTER_NO_KV_REUSE != 0,
		NoPrefillTracking:      c.flags&C.KVR_ROUTER_NO_PREFILL_TRACKING != 0,
		Eagle:                  c.flags&C.KVR_ROUTER_EAGLE != 0,
		EntropySeed:            c.flags&C.KVR_ROUTER_ENTROPY_SEED != 0,
		TrackOutputBlocks:      c.flags&C.KVR_ROUTER_TRACK_OUTPUT_BLOCKS != 0,
		QueuePolicy:            QueuePolicy(c.queue_policy),
		OverlapScoreCredit:     float64(c.overlap_score_credit),
		PrefillLoadScale:       float64(c.prefill_load_scale),
		HostCacheHitWeight:     float64(c.host_cache_hit_weight),
		DiskCacheHitWeight:     float64(c.disk_cache_hit_weight),
		Temperature:            float64(c.temperature),
		QueueThreshold:         float64(c.queue_threshold),
		ApproxTTL:              seconds(float64(c.approx_ttl_seconds)),
		ApproxMaxBlocks:        uint64(c.approx_max_blocks),
		ApproxPruneTargetRatio: float64(c.approx_prune_target_ratio),
		RequestExpiry:          seconds(float64(c.request_expiry_seconds)),
		RandomSeed:             uint64(c.random_seed),

		OverlapScoreCreditDecay:   float64(c.overlap_score_credit_decay),
		DecodeActiveRequestWeight: float64(c.decode_active_request_weight),
	}
}

func (o *RouterOptions) toC() *C.kvr_router_options {
	if o == nil {
		return nil
	}
	c := new(C.kvr_router_options)
	C.kvr_router_options_init(c)
	c.block_size = C.uint32_t(o.BlockSize)
	c.flags = 0
	if o.Approximate {
		c.flags |= C.KVR_ROUTER_APPROXIMATE
	}
	if o.NoKVReuse {
		c.flags |= C.KVR_ROUTER_NO_KV_REUSE
	}
	if o.NoPrefillTracking {
		c.flags |= C.KVR_ROUTER_NO_PREFILL_TRACKING
	}
	if o.Eagle {
		c.flags |= C.KVR_ROUTER_EAGLE
	}
	if o.EntropySeed {
		c.flags |= C.KVR_ROUTER_ENTROPY_SEED
	}
	if o.TrackOutputBlocks {
		c.flags |= C.KVR_ROUTER_TRACK_OUTPUT_BLOCKS
	}
	c.queue_policy = C.uint32_t(o.QueuePolicy)
	c.overlap_score_credit = C.double(o.OverlapScoreCredit)
	c.prefill_load_scale = C.double(o.PrefillLoadScale)
	c.host_cache_hit_weight = C.double(o.HostCacheHitWeight)
	c.disk_cache_hit_weight = C.double(o.DiskCacheHitWeight)
	c.temperature = C.double(o.Temperature)
	c.queue_threshold = C.double(o.QueueThreshold)
	c.approx_ttl_seconds = C.double(o.ApproxTTL.Seconds())
	c.approx_max_blocks = C.uint64_t(o.ApproxMaxBlocks)
	c.approx_prune_target_ratio = C.double(o.ApproxPruneTargetRatio)
	c.request_expiry_seconds = C.double(o.RequestExpiry.Seconds())
	c.random_seed = C.uint64_t(o.RandomSeed)
	c.overlap_score_credit_decay = C.double(o.OverlapScoreCreditDecay)
	c.decode_active_request_weight = C.double(o.DecodeActiveRequestWeight)
	return c
}

func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// Router is a KV-cache-aware router (kvr_router). It is internally synchronised: every method
// may be called from any number of goroutines at once, except Close, which must not run
// concurrently with any other call on the router (nor while an Ingest feeding it is open).
type Router struct {
	ptr handlePtr
	// owner is set for the pool routers of a Disagg: they belong to it, Close does nothing, and
	// they are closed with it.
	owner *Disagg
	// ingests counts the open Ingests feeding this router (for a pool router: its Disagg's).
	ingests atomic.Int32
}

// feeds returns the counter of open Ingests that Close checks.
func (r *Router) feeds() *atomic.Int32 {
	if r.owner != nil {
		return &r.owner.ingests
	}
	return &r.ingests
}

// NewRouter creates a router. opts nil means DefaultRouterOptions().
func NewRouter(opts *RouterOptions) (*Router, error) {
	var cerr *C.kvr_error
	var out *C.kvr_router
	if err := takeError(C.kvr_router_new(opts.toC(), &out, &cerr), cerr); err != nil {
		return nil, err
	}
	r := &Router{}
	r.ptr.store(unsafe.Pointer(out))
	runtime.SetFinalizer(r, (*Router).Close)
	return r, nil
}

// Close destroys the router. It is idempotent; after it every method returns ErrClosed. It
// must not run concurrently with other calls on the router, and refuses (ErrFailedPrecondition,
// the router staying open) while an Ingest feeding it is open. For a Disagg's pool router it does
// nothing (close the Disagg instead).
func (r *Router) Close() error {
	if r == nil || r.owner != nil {
		return nil
	}
	if r.ingests.Load() > 0 {
		return newError(ErrFailedPrecondition, "an Ingest feeding this router is open: close it first")
	}
	if p := (*C.kvr_router)(r.ptr.swap(nil)); p != nil {
		runtime.SetFinalizer(r, nil)
		C.kvr_router_free(p)
		releaseReplicaPublisher(r)
	}
	return nil
}

// handle returns the C router, or nil once it (or its owning Disagg) is closed.
func (r *Router) handle() *C.kvr_router {
	if r == nil {
		return nil
	}
	if r.owner != nil && r.owner.ptr.load() == nil {
		return nil
	}
	return (*C.kvr_router)(r.ptr.load())
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
	C.kvr_worker_config_init(c)
	c.block_size = C.uint32_t(w.BlockSize)
	c.worker_id = C.uint64_t(w.WorkerID)
	c.dp_start = C.uint32_t(w.DPStart)
	if w.DPSize != 0 {
		c.dp_size = C.uint32_t(w.DPSize)
	}
	c.total_kv_blocks = C.uint64_t(w.TotalKVBlocks)
	c.max_num_batched_tokens = C.uint64_t(w.MaxNumBatchedTokens)
	return c
}

// AddWorker registers a worker: ErrAlreadyExists for a registered id, ErrInvalidArgument for
// a block size mismatch or a bad rank range. It may admit queued requests.
func (r *Router) AddWorker(w WorkerConfig) error {
	h := r.handle()
	if h == nil {
		return ErrClosed
	}
	var cerr *C.kvr_error
	st := C.kvr_router_add_worker(h, w.toC(), &cerr)
	runtime.KeepAlive(r)
	return takeError(st, cerr)
}

// UpdateWorker changes a registered worker (ErrNotFound for an unknown id). Ranks that
// disappear lose their requests and index entries.
func (r *Router) UpdateWorker(w WorkerConfig) error {
	h := r.handle()
	if h == nil {
		return ErrClosed
	}
	var cerr *C.kvr_error
	st := C.kvr_router_update_worker(h, w.toC(), &cerr)
	runtime.KeepAlive(r)
	return takeError(st, cerr)
}

// RemoveWorker drops the worker's ranks, active requests and index entries (ErrNotFound for an
// unknown id).
func (r *Router) RemoveWorker(workerID uint64) error {
	h := r.handle()
	if h == nil {
		return ErrClosed
	}
	var cerr *C.kvr_error
	st := C.kvr_router_remove_worker(h, C.uint64_t(workerID), &cerr)
	runtime.KeepAlive(r)
	return takeError(st, cerr)
}
