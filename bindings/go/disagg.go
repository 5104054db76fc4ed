//go:build cgo

package kvrouter

/*
#include "kvrouter.h"
*/
import "C"

import (
	"runtime"
	"unsafe"
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
// ratio 1.0, prefill busy 1.0, no decode-busy signal). With a library this package does not
// accept (CheckVersion) it returns the zero value (NewDisagg then returns the version error).
func DefaultDisaggOptions() DisaggOptions {
	if CheckVersion() != nil {
		return DisaggOptions{}
	}
	var c C.kvr_disagg_options
	initDisaggOptions(&c)
	var m cDisaggOptions
	m.load(&c)
	return disaggOptionsFrom(&m)
}

func (o *DisaggOptions) mirror() cDisaggOptions {
	return cDisaggOptions{
		Policy:                o.Policy,
		Enforce:               boolU32(o.Enforce),
		MaxLocalPrefillTokens: o.MaxLocalPrefillTokens,
		MaxLocalPrefillRatio:  o.MaxLocalPrefillRatio,
		PrefillBusyThreshold:  o.PrefillBusyThreshold,
		DecodeBusyThreshold:   o.DecodeBusyThreshold,
	}
}

// disaggOptionsFrom is mirror's inverse.
func disaggOptionsFrom(m *cDisaggOptions) DisaggOptions {
	return DisaggOptions{
		Policy:                m.Policy,
		Enforce:               m.Enforce != 0,
		MaxLocalPrefillTokens: m.MaxLocalPrefillTokens,
		MaxLocalPrefillRatio:  m.MaxLocalPrefillRatio,
		PrefillBusyThreshold:  m.PrefillBusyThreshold,
		DecodeBusyThreshold:   m.DecodeBusyThreshold,
	}
}

func (o *DisaggOptions) toC() *C.kvr_disagg_options {
	if o == nil {
		return nil
	}
	c := new(C.kvr_disagg_options)
	initDisaggOptions(c)
	m := o.mirror()
	m.store(c)
	return c
}

// Disagg holds a prefill pool and a decode pool, each a full Router (PrefillRouter,
// DecodeRouter: add workers, apply KV events, mark and free requests there). Like a Router it
// is internally synchronised, Close included.
type Disagg struct {
	// The pool Routers point back at the Disagg (keeping it alive); the Disagg does not point
	// at them, so no cycle keeps its finalizer from running. ptr counts the calls in flight on
	// the Disagg and its pools, and the open Ingests feeding either pool.
	ptr handlePtr
	// The pools' replica publish callbacks, released with the pools (Close, or the finalizer).
	prefillReplica, decodeReplica replicaSlot
}

// NewDisagg creates both pools. prefill and decode are each pool's router options and opts
// the disaggregation policy; nil means the defaults.
func NewDisagg(prefill, decode *RouterOptions, opts *DisaggOptions) (*Disagg, error) {
	if err := CheckVersion(); err != nil {
		return nil, err
	}
	var out *C.kvr_disagg
	var cerr *C.kvr_error
	st := C.kvr_disagg_new(prefill.toC(), decode.toC(), opts.toC(), &out, &cerr)
	if err := takeError(st, cerr); err != nil {
		return nil, err
	}
	d := &Disagg{}
	d.ptr.open(unsafe.Pointer(out))
	runtime.SetFinalizer(d, (*Disagg).Close)
	return d, nil
}

// Close frees both pools, and releases their replica publish callbacks; idempotent. Their
// Routers then return ErrClosed. Like Router.Close it may run concurrently with other calls (on
// the Disagg or its pools: the pools are freed when the last call in flight returns), first
// closes both pools' admission queues (their waiters return ErrCancelled), and refuses while an
// Ingest feeds a pool. Called from a replica publisher it refuses, as Router.Close.
func (d *Disagg) Close() error {
	if d == nil {
		return nil
	}
	if err := refuseInPublishCallback("Close"); err != nil {
		return err
	}
	h := d.acquire()
	if h == nil {
		return nil // closed before
	}
	defer d.release() // frees the pools unless a call is in flight
	closed, fed := d.ptr.close()
	if fed {
		return newError(ErrFailedPrecondition, "an Ingest feeding a pool of this Disagg is open: close it first")
	}
	if closed {
		closeQueue(C.kvr_disagg_prefill_router(h))
		closeQueue(C.kvr_disagg_decode_router(h))
	}
	return nil
}

// free frees both pools, closed and with no call in flight, and releases their replica
// publish callbacks.
func (d *Disagg) free() {
	runtime.SetFinalizer(d, nil)
	C.kvr_disagg_free((*C.kvr_disagg)(d.ptr.p))
	d.prefillReplica.release()
	d.decodeReplica.release()
}

// PrefillRouter returns the prefill pool's router, which belongs to d: its Close does nothing,
// and after d.Close its methods return ErrClosed. Nil after d.Close.
func (d *Disagg) PrefillRouter() *Router {
	return d.pool(&d.prefillReplica, func(p *C.kvr_disagg) *C.kvr_router { return C.kvr_disagg_prefill_router(p) })
}

// DecodeRouter returns the decode pool's router (as PrefillRouter).
func (d *Disagg) DecodeRouter() *Router {
	return d.pool(&d.decodeReplica, func(p *C.kvr_disagg) *C.kvr_router { return C.kvr_disagg_decode_router(p) })
}

func (d *Disagg) pool(replica *replicaSlot, get func(*C.kvr_disagg) *C.kvr_router) *Router {
	h := d.acquire()
	if h == nil {
		return nil
	}
	defer d.release()
	r := &Router{owner: d, replica: replica}
	r.ptr.p = unsafe.Pointer(get(h)) // not opened: d.ptr counts the pool's calls
	runtime.KeepAlive(d)
	return r
}

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
	h := d.acquire()
	if h == nil {
		return PrefillResult{}, ErrClosed
	}
	defer d.release()
	tp, tn, err := promptArg(tokens, opts)
	if err != nil {
		return PrefillResult{}, err
	}
	var a args
	defer a.release()
	copts, chints := opts.toC(&a), hints.toC(&a)
	if err := a.err(); err != nil {
		return PrefillResult{}, err
	}
	var out C.kvr_prefill_result
	initPrefillResult(&out)
	var cerr *C.kvr_error
	st := C.kvr_disagg_route_prefill(h, tp, tn, copts, chints, &out, &cerr)
	runtime.KeepAlive(d)
	if err := takeError(st, cerr); err != nil {
		return PrefillResult{}, err
	}
	var m cPrefillResult
	m.load(&out)
	return prefillResultFrom(&m), nil
}

func prefillResultFrom(m *cPrefillResult) PrefillResult {
	return PrefillResult{
		Remote:        m.Remote != 0,
		Reason:        m.Reason,
		WorkerID:      m.WorkerID,
		DPRank:        m.DPRank,
		BootstrapRoom: m.BootstrapRoom,
		CachedTokens:  m.CachedTokens,
	}
}

// RouteDecode selects and books the decode rank (opts.RequestID required). After a remote
// prefill the decode overrides are forced (overlap credit 0, no KV reuse, no prefill
// tracking); every other override is kept. Decode pins from hints apply.
func (d *Disagg) RouteDecode(tokens []uint32, opts *RequestOptions, hints *RoutingHints, remotePrefill bool) (RouteSignals, error) {
	h := d.acquire()
	if h == nil {
		return RouteSignals{}, ErrClosed
	}
	defer d.release()
	tp, tn, err := promptArg(tokens, opts)
	if err != nil {
		return RouteSignals{}, err
	}
	var a args
	defer a.release()
	copts, chints := opts.toC(&a), hints.toC(&a)
	if err := a.err(); err != nil {
		return RouteSignals{}, err
	}
	var out C.kvr_route_signals
	initRouteSignals(&out)
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
	h := d.acquire()
	if h == nil {
		return false, ErrClosed
	}
	defer d.release()
	tp, tn, err := promptArg(tokens, opts)
	if err != nil {
		return false, err
	}
	var a args
	defer a.release()
	copts := opts.toC(&a)
	if err := a.err(); err != nil {
		return false, err
	}
	var busy C.int
	var cerr *C.kvr_error
	st := C.kvr_disagg_prefill_worker_busy(h, tp, tn, copts, C.double(threshold), &busy, &cerr)
	runtime.KeepAlive(d)
	if err := takeError(st, cerr); err != nil {
		return false, err
	}
	return busy != 0, nil
}

// acquire returns the C object for one call (on the Disagg or a pool), to give back with
// release (deferred), or nil once closed.
func (d *Disagg) acquire() *C.kvr_disagg {
	if d == nil {
		return nil
	}
	return (*C.kvr_disagg)(d.ptr.acquire())
}

// release ends a call begun by acquire, freeing the pools if they were closed meanwhile and
// this was the last call in flight.
func (d *Disagg) release() {
	if d.ptr.release() {
		d.free()
	}
}
