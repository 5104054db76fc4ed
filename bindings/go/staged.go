//go:build cgo

package kvrouter

/*
#include "kvrouter.h"
*/
import "C"

import (
	"runtime"
	"time"
)

// RoutingHints say where a request may or should run. Pins by phase: aggregated: WorkerID /
// DPRank; prefill: PrefillWorkerID (else WorkerID) with PrefillDPRank (else DPRank); decode:
// DecodeWorkerID (else WorkerID) with DPRank. A pin without a rank takes the best of the
// worker's ranks. Nil pins mean no pin; the zero value (or nil) is no hint at all. A rank pin
// travels as the ABI's int32_t: one above math.MaxInt32 is refused (ErrInvalidArgument).
type RoutingHints struct {
	Phase           Phase
	WorkerID        *uint64
	PrefillWorkerID *uint64
	DecodeWorkerID  *uint64
	DPRank          *uint32
	PrefillDPRank   *uint32
	// SessionID keeps a conversation on one rank ("" = no session affinity). The binding is
	// made at commit and its TTL slides.
	SessionID   string
	SessionMode SessionMode
	SessionTTL  time.Duration // 0 = the default (300 s)
}

func (h *RoutingHints) toC(a *args) *C.kvr_routing_hints {
	if h == nil {
		return nil
	}
	c := new(C.kvr_routing_hints)
	initRoutingHints(c)
	var m cRoutingHints
	m.load(c) // the defaults: no pins (WorkerNone, rank -1), a 300 s session TTL
	m.Phase = h.Phase
	if h.WorkerID != nil {
		m.WorkerID = *h.WorkerID
	}
	if h.PrefillWorkerID != nil {
		m.PrefillWorkerID = *h.PrefillWorkerID
	}
	if h.DecodeWorkerID != nil {
		m.DecodeWorkerID = *h.DecodeWorkerID
	}
	if h.DPRank != nil {
		m.DPRank = a.rank("RoutingHints.DPRank", *h.DPRank)
	}
	if h.PrefillDPRank != nil {
		m.PrefillDPRank = a.rank("RoutingHints.PrefillDPRank", *h.PrefillDPRank)
	}
	m.SessionMode = h.SessionMode
	if h.SessionTTL != 0 {
		m.SessionTTLSeconds = h.SessionTTL.Seconds()
	}
	m.store(c)
	c.session_id = a.optStr("RoutingHints.SessionID", h.SessionID)
	return c
}

// RouteSignals are the signals of a preview or a plan.
type RouteSignals struct {
	WorkerID              uint64
	DPRank                uint32
	OverlapBlocks         uint32 // leading prompt blocks cached on the rank's device
	PromptBlocks          uint32
	CachedTokens          uint64 // round(effective overlap × block size)
	PotentialDecodeBlocks uint64 // the rank's active blocks + the prompt's new ones
	TotalKVBlocks         uint64 // the worker's KV capacity; 0 = not reported
	Cost                  float64
	PromptTokens          uint64
	Booked                bool // a plan
	Moved                 bool // plan: the previewed (or soft-session) rank was no longer eligible
	Queued                bool // plan: it waited in the admission queue
}

func signalsFromC(c *C.kvr_route_signals) RouteSignals {
	var m cRouteSignals
	m.load(c)
	return signalsFrom(&m)
}

func signalsFrom(m *cRouteSignals) RouteSignals {
	return RouteSignals{
		WorkerID:              m.WorkerID,
		DPRank:                m.DPRank,
		OverlapBlocks:         m.OverlapBlocks,
		PromptBlocks:          m.PromptBlocks,
		CachedTokens:          m.CachedTokens,
		PotentialDecodeBlocks: m.PotentialDecodeBlocks,
		TotalKVBlocks:         m.TotalKVBlocks,
		Cost:                  m.Cost,
		PromptTokens:          m.PromptTokens,
		Booked:                m.Booked != 0,
		Moved:                 m.Moved != 0,
		Queued:                m.Queued != 0,
	}
}

func (s *RouteSignals) mirror() cRouteSignals {
	return cRouteSignals{
		WorkerID:              s.WorkerID,
		DPRank:                s.DPRank,
		OverlapBlocks:         s.OverlapBlocks,
		PromptBlocks:          s.PromptBlocks,
		CachedTokens:          s.CachedTokens,
		PotentialDecodeBlocks: s.PotentialDecodeBlocks,
		TotalKVBlocks:         s.TotalKVBlocks,
		Cost:                  s.Cost,
		PromptTokens:          s.PromptTokens,
		Booked:                boolU32(s.Booked),
		Moved:                 boolU32(s.Moved),
		Queued:                boolU32(s.Queued),
	}
}

func (s *RouteSignals) toC() *C.kvr_route_signals {
	if s == nil {
		return nil
	}
	c := new(C.kvr_route_signals)
	initRouteSignals(c)
	m := s.mirror()
	m.store(c)
	return c
}

// PreviewRoute returns what routing would pick, changing nothing (no admission or queue, no
// booking, no approximate-mode record, no session binding created or refreshed). opts and
// hints may be nil; opts.Admit is ignored.
func (r *Router) PreviewRoute(tokens []uint32, opts *RequestOptions, hints *RoutingHints) (RouteSignals, error) {
	h := r.acquire()
	if h == nil {
		return RouteSignals{}, ErrClosed
	}
	defer r.release()
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
	var cerr *C.kvr_error
	st := C.kvr_preview_route(h, tp, tn, copts, chints, &out, &cerr)
	runtime.KeepAlive(r)
	if err := takeError(st, cerr); err != nil {
		return RouteSignals{}, err
	}
	return signalsFromC(&out), nil
}

// PlanRoute books the request (opts.RequestID required) as a plan, keeping previewed's rank
// (previewed may be nil) while it is still a candidate; it waits in the admission queue like
// FindBestMatch. Idempotent: planning an id with a live plan returns that plan.
// ErrAlreadyExists for an id already active without a plan.
func (r *Router) PlanRoute(tokens []uint32, opts *RequestOptions, hints *RoutingHints, previewed *RouteSignals) (RouteSignals, error) {
	h := r.acquire()
	if h == nil {
		return RouteSignals{}, ErrClosed
	}
	defer r.release()
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
	var cerr *C.kvr_error
	st := C.kvr_plan_route(h, tp, tn, copts, chints, previewed.toC(), &out, &cerr)
	runtime.KeepAlive(r)
	if err := takeError(st, cerr); err != nil {
		return RouteSignals{}, err
	}
	return signalsFromC(&out), nil
}

// CommitRoute says the plan was dispatched: approximate mode records the decision and the
// session is bound. Idempotent. ErrNotFound: no plan (never made, aborted, freed or past its
// deadline); ErrFailedPrecondition: its worker was removed (plan again).
func (r *Router) CommitRoute(requestID string) error {
	_, err := r.callID(idCommit, "requestID", requestID, 0)
	return err
}

// AbortRoute frees the plan, its booking or its queue place; freed says whether anything was.
// Idempotent: an unknown id is no error.
func (r *Router) AbortRoute(requestID string) (freed bool, err error) {
	answer, err := r.callID(idAbort, "requestID", requestID, 0)
	return answer.freed, err
}

// SetPlanDeadline sets how long a plan may wait for CommitRoute or AbortRoute before it is
// dropped with its booking (default 30 s; applies to plans made afterwards).
// ErrInvalidArgument unless > 0.
func (r *Router) SetPlanDeadline(d time.Duration) error {
	h := r.acquire()
	if h == nil {
		return ErrClosed
	}
	defer r.release()
	var cerr *C.kvr_error
	st := C.kvr_router_set_plan_deadline(h, C.double(d.Seconds()), &cerr)
	runtime.KeepAlive(r)
	return takeError(st, cerr)
}

// ExpirePlans drops the plans past their deadline now and returns how many.
func (r *Router) ExpirePlans() (int, error) {
	h := r.acquire()
	if h == nil {
		return 0, ErrClosed
	}
	defer r.release()
	var n C.size_t
	var cerr *C.kvr_error
	st := C.kvr_router_expire_plans(h, &n, &cerr)
	runtime.KeepAlive(r)
	return int(n), takeError(st, cerr)
}

// SessionBinding returns the rank a live session is bound to, without refreshing it.
// ErrNotFound if unbound or expired.
func (r *Router) SessionBinding(sessionID string) (workerID uint64, dpRank uint32, err error) {
	answer, err := r.callID(idSession, "sessionID", sessionID, 0)
	if err != nil {
		return 0, 0, err
	}
	return answer.workerID, answer.dpRank, nil
}

// CloseSession unbinds a session (no error if unbound).
func (r *Router) CloseSession(sessionID string) error {
	_, err := r.callID(idCloseSession, "sessionID", sessionID, 0)
	return err
}

// ReclaimSessions drops expired session bindings now and returns how many.
func (r *Router) ReclaimSessions() (int, error) {
	h := r.acquire()
	if h == nil {
		return 0, ErrClosed
	}
	defer r.release()
	var n C.size_t
	var cerr *C.kvr_error
	st := C.kvr_router_reclaim_sessions(h, &n, &cerr)
	runtime.KeepAlive(r)
	return int(n), takeError(st, cerr)
}

// StateDigest returns a digest of all routing state (index, active requests, queue, plans,
// sessions): equal digests mean nothing changed. Stable within one process only.
func (r *Router) StateDigest() (uint64, error) { return r.digest(false) }

// IndexDigest returns a digest of the KV index alone: which worker and rank holds which block,
// on which tier, under which prefix. Unlike StateDigest it is equal across processes and
// machines running the same library version when their indexes hold the same blocks, so
// replicas can compare their views; bookings, the queue, plans and sessions do not enter it
// (except in approximate mode, where the index is the routing decisions recorded when admitted
// or committed). It may change between library versions.
func (r *Router) IndexDigest() (uint64, error) { return r.digest(true) }

// digest is StateDigest, or IndexDigest when indexOnly.
func (r *Router) digest(indexOnly bool) (uint64, error) {
	h := r.acquire()
	if h == nil {
		return 0, ErrClosed
	}
	defer r.release()
	var d C.uint64_t
	var cerr *C.kvr_error
	var st C.kvr_status
	if indexOnly {
		st = C.kvr_router_index_digest(h, &d, &cerr)
	} else {
		st = C.kvr_router_state_digest(h, &d, &cerr)
	}
	runtime.KeepAlive(r)
	if err := takeError(st, cerr); err != nil {
		return 0, err
	}
	return uint64(d), nil
}
