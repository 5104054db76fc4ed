//go:build cgo

package kvrouter

/*
#include "kvrouter.h"
*/
import "C"

import (
	"runtime"
	"sync/atomic"
	"unsafe"
)

// DisaggPolicy is when a disaggregated deployment prefills locally instead (KVR_DISAGG_*).
type DisaggPolicy uint32

const (
	// DisaggAlways: always prefill remotely (when prefill workers exist).
	DisaggAlways DisaggPolicy = C.KVR_DISAGG_ALWAYS
	// DisaggISLBounding: prefill locally when the uncached prompt is short.
	DisaggISLBounding DisaggPolicy = C.KVR_DISAGG_ISL_BOUNDING
	// DisaggPrefillLoad: prefill locally when the chosen prefill worker is busy.
	DisaggPrefillLoad DisaggPolicy = C.KVR_DISAGG_PREFILL_LOAD
	// DisaggISLOrLoad: either condition.
	DisaggISLOrLoad DisaggPolicy = C.KVR_DISAGG_ISL_OR_LOAD
)

// DisaggOptions configure conditional disaggregation. Start from DefaultDisaggOptions.
type DisaggOptions struct {
	Policy DisaggPolicy
	// Enforce: with no prefill workers, RoutePrefill fails (ErrFailedPrecondition) instead of
	// running the request aggregated on the decode pool.
	Enforce bool
	// ISL bounding: local when prompt − cached (on the decode worker) <= MaxLocalPrefillTokens
	// and (prompt − cached) / prompt <= MaxLocalPrefillRatio.
	MaxLocalPrefillTokens uint64
	MaxLocalPrefillRatio  float64
	// Prefill load: busy when the chosen prefill rank's prefill tokens exceed this ×
	// its max_num_batched_tokens.
	PrefillBusyThreshold float64
	// The decode-busy guard: never prefill locally on a decode rank whose decode blocks exceed
	// this fraction of its total_kv_blocks. Negative, or unknown capacity, = never locally.
	DecodeBusyThreshold float64
}

// DefaultDisaggOptions returns kvr_disagg_options_init's defaults (always remote; 512 tokens,
// ratio 1.0, prefill busy 1.0, no decode-busy signal).
func DefaultDisaggOptions() DisaggOptions {
	var c C.kvr_disagg_options
	C.kvr_disagg_options_init(&c)
	return DisaggOptions{
		Policy:                DisaggPolicy(c.policy),
		Enforce:               c.enforce != 0,
		MaxLocalPrefillTokens: uint64(c.max_local_prefill_tokens),
		MaxLocalPrefillRatio:  float64(c.max_local_prefill_ratio),
		PrefillBusyThreshold:  float64(c.prefill_busy_threshold),
		DecodeBusyThreshold:   float64(c.decode_busy_threshold),
	}
}

func (o *DisaggOptions) toC() *C.kvr_disagg_options {
	if o == nil {
		return nil
	}
	c := new(C.kvr_disagg_options)
	C.kvr_disagg_options_init(c)
	c.policy = C.uint32_t(o.Policy)
	c.enforce = boolU32(o.Enforce)
	c.max_local_prefill_tokens = C.uint64_t(o.MaxLocalPrefillTokens)
	c.max_local_prefill_ratio = C.double(o.MaxLocalPrefillRatio)
	c.prefill_busy_threshold = C.double(o.PrefillBusyThreshold)
	c.decode_busy_threshold = C.double(o.DecodeBusyThreshold)
	return c
}

// Disagg holds a prefill pool and a decode pool, each a full Router (PrefillRouter,
// DecodeRouter: add workers, apply KV events, mark and free requests there). Like a Router it
// is internally synchronised, except Close.
type Disagg struct {
	// The pool Routers point back at the Disagg (keeping it alive); the Disagg does not point
	// at them, so no cycle keeps its finalizer from running.
	ptr     handlePtr
	ingests atomic.Int32 // open Ingests feeding either pool
}

// NewDisagg creates both pools. prefill and decode are each pool's router options and opts
// the disaggregation policy; nil means the defaults.
func NewDisagg(prefill, decode *RouterOptions, opts *DisaggOptions) (*Disagg, error) {
	var out *C.kvr_disagg
	var cerr *C.kvr_error
	st := C.kvr_disagg_new(prefill.toC(), decode.toC(), opts.toC(), &out, &cerr)
	if err := takeError(st, cerr); err != nil {
		return nil, err
	}
	d := &Disagg{}
	d.ptr.store(unsafe.Pointer(out))
	runtime.SetFinalizer(d, (*Disagg).Close)
	return d, nil
}

// Close frees both pools; idempotent. Their Routers then return ErrClosed. Like Router.Close
// it must not run concurrently with other calls, and refuses while an Ingest feeds a pool.
func (d *Disagg) Close() error {
	if d == nil {
		return nil
	}
	if d.ingests.Load() > 0 {
		return newError(ErrFailedPrecondition, "an Ingest feeding a pool of this Disagg is open: close it first")
	}
	if p := (*C.kvr_disagg)(d.ptr.swap(nil)); p != nil {
		runtime.SetFinalizer(d, nil)
		C.kvr_disagg_free(p)
	}
	return nil
}

// PrefillRouter returns the prefill pool's router, which belongs to d: its Close does nothing,
// and after d.Close its methods return ErrClosed. Nil after d.Close.
func (d *Disagg) PrefillRouter() *Router {
	return d.pool(func(p *C.kvr_disagg) *C.kvr_router { return C.kvr_disagg_prefill_router(p) })
}

// DecodeRouter returns the decode pool's router (as PrefillRouter).
func (d *Disagg) DecodeRouter() *Router {
	return d.pool(func(p *C.kvr_disagg) *C.kvr_router { return C.kvr_disagg_decode_router(p) })
}

func (d *Disagg) pool(get func(*C.kvr_disagg) *C.kvr_router) *Router {
	h := d.handle()
	if h == nil {
		return nil
	}
	r := &Router{owner: d}
	r.ptr.store(unsafe.Pointer(get(h)))
	runtime.KeepAlive(d)
	return r
}

// PrefillReason says why a prefill is remote or local (KVR_PREFILL_*).
type PrefillReason uint32

const (
	PrefillRemote           PrefillReason = C.KVR_PREFILL_REMOTE             // booked on a prefill worker
	PrefillNoPrefillWorkers PrefillReason = C.KVR_PREFILL_NO_PREFILL_WORKERS // empty prefill pool: aggregated on decode
	PrefillShortISL         PrefillReason = C.KVR_PREFILL_SHORT_ISL          // policy: the uncached prompt is short
	PrefillWorkerBusy       PrefillReason = C.KVR_PREFILL_WORKER_BUSY        // policy: the prefill pool is busy
)

// PrefillResult says where a prompt is prefilled.
type PrefillResult struct {
	// Remote: prefill on WorkerID / DPRank with BootstrapRoom (booked on the prefill pool:
	// free it there when the prefill ends). Otherwise prefill on the decode worker.
	Remote        bool
	Reason        PrefillReason
	WorkerID      uint64
	DPRank        uint32
	BootstrapRoom int64 // uniform in [0, MaxInt64]; -1 when not remote
	CachedTokens  uint64
}

// RoutePrefill decides where the prompt is prefilled and, when remote, selects and books a
// prefill rank under opts.RequestID. Prefill pins from hints apply.
func (d *Disagg) RoutePrefill(tokens []uint32, opts *RequestOptions, hints *RoutingHints) (PrefillResult, error) {
	h := d.handle()
	if h == nil {
		return PrefillResult{}, ErrClosed
	}
	var a args
	defer a.release()
	copts, chints := opts.toC(&a), hints.toC(&a)
	tp, tn := tokensPtr(tokens)
	var out C.kvr_prefill_result
	C.kvr_prefill_result_init(&out)
	var cerr *C.kvr_error
	st := C.kvr_disagg_route_prefill(h, tp, tn, copts, chints, &out, &cerr)
	runtime.KeepAlive(d)
	if err := takeError(st, cerr); err != nil {
		return PrefillResult{}, err
	}
	return PrefillResult{
		Remote:        out.remote != 0,
		Reason:        PrefillReason(out.reason),
		WorkerID:      uint64(out.worker_id),
		DPRank:        uint32(out.dp_rank),
		BootstrapRoom: int64(out.bootstrap_room),
		CachedTokens:  uint64(out.cached_tokens),
	}, nil
}

// RouteDecode selects and books the decode rank (opts.RequestID required). After a remote
// prefill the decode overrides are forced (overlap credit 0, no KV reuse, no prefill
// tracking); every other override is kept. Decode pins from hints apply.
func (d *Disagg) RouteDecode(tokens []uint32, opts *RequestOptions, hints *RoutingHints, remotePrefill bool) (RouteSignals, error) {
	h := d.handle()
	if h == nil {
		return RouteSignals{}, ErrClosed
	}
	var a args
	defer a.release()
	copts, chints := opts.toC(&a), hints.toC(&a)
	tp, tn := tokensPtr(tokens)
	var out C.kvr_route_signals
	C.kvr_route_signals_init(&out)
	remote := C.int(0)
	if remotePrefill {
		remote = 1
	}
	var cerr *C.kvr_error
	st := C.kvr_disagg_route_decode(h, tp, tn, copts, chints, remote, &out, &cerr)
	runtime.KeepAlive(d)
	if err := takeError(st, cerr); err != nil {
		return RouteSignals{}, err
	}
	return signalsFromC(&out), nil
}

// PrefillWorkerBusy is advisory: would the prefill rank chosen now (a preview) carry more than
// threshold × max_num_batched_tokens prefill tokens? No eligible rank counts as busy.
func (d *Disagg) PrefillWorkerBusy(tokens []uint32, opts *RequestOptions, threshold float64) (bool, error) {
	h := d.handle()
	if h == nil {
		return false, ErrClosed
	}
	var a args
	defer a.release()
	copts := opts.toC(&a)
	tp, tn := tokensPtr(tokens)
	var busy C.int
	var cerr *C.kvr_error
	st := C.kvr_disagg_prefill_worker_busy(h, tp, tn, copts, C.double(threshold), &busy, &cerr)
	runtime.KeepAlive(d)
	if err := takeError(st, cerr); err != nil {
		return false, err
	}
	return busy != 0, nil
}

func (d *Disagg) handle() *C.kvr_disagg {
	if d == nil {
		return nil
	}
	return (*C.kvr_disagg)(d.ptr.load())
}
