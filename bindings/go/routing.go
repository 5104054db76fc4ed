//go:build cgo

package kvrouter

/*
#include <stdlib.h>
#include "kvrouter.h"
*/
import "C"

import (
	"runtime"
	"time"
	"unsafe"
)

// Ptr returns a pointer to v, for the optional fields of RequestOptions and RoutingHints:
// opts.Temperature = kvrouter.Ptr(0.5).
func Ptr[T any](v T) *T { return &v }

// RequestOptions are per-request settings. The zero value (or nil) is a query-only decision
// with the router's settings. Nil overrides keep the router's setting.
type RequestOptions struct {
	// Admit books the request under RequestID (waiting in the admission queue if the router
	// queues). Without it, FindBestMatch changes nothing.
	Admit bool
	// RequestID is required with Admit, and for AddRequest and PlanRoute.
	RequestID      string
	LoraName       string
	CacheNamespace string
	// MultimodalHashes[i] holds prompt block i's multimodal content hashes (nil = none).
	MultimodalHashes [][]uint64
	// AllowedWorkerIDs restricts the candidates (and bypasses the admission queue); nil = all.
	AllowedWorkerIDs   []uint64
	OverlapScoreCredit *float64
	PrefillLoadScale   *float64
	HostCacheHitWeight *float64
	DiskCacheHitWeight *float64
	Temperature        *float64
	AssumeKVReuse      *bool
	TrackPrefillTokens *bool
	// OverlapScoreCreditDecay and DecodeActiveRequestWeight override the router's
	// RouterOptions fields of the same names (nil or NaN: the router's).
	OverlapScoreCreditDecay   *float64
	DecodeActiveRequestWeight *float64
	PriorityJump              float64 // queue priority boost
	// ExpectedOutputTokens is the expected decode length (used by the WSPT queue policy).
	ExpectedOutputTokens uint32
	// QueueTimeout bounds the wait in the admission queue: 0 waits as long as it takes, a
	// negative value gives up at once (whole milliseconds, rounded up).
	QueueTimeout time.Duration
}

// toC fills a kvr_request_options; nil stays NULL (every default).
func (o *RequestOptions) toC(a *args) *C.kvr_request_options {
	if o == nil {
		return nil
	}
	c := new(C.kvr_request_options)
	o.fill(c, a)
	return c
}

// Initialised structs to copy on the hot path: an _init result depends on nothing but the
// library, so one cgo call at start-up replaces one per routing call.
var (
	initRequestOptions C.kvr_request_options
	initRouteResult    C.kvr_route_result
)

func init() {
	C.kvr_request_options_init(&initRequestOptions)
	C.kvr_route_result_init(&initRouteResult)
}

func (o *RequestOptions) fill(c *C.kvr_request_options, a *args) {
	*c = initRequestOptions
	if o.Admit {
		c.flags |= C.KVR_REQUEST_ADMIT
	}
	c.request_id = a.optStr(o.RequestID)
	c.lora_name = a.optStr(o.LoraName)
	c.cache_namespace = a.optStr(o.CacheNamespace)
	var n int
	c.mm_hashes, c.mm_counts, n = a.mm(o.MultimodalHashes)
	c.mm_num_blocks = C.size_t(n)
	if o.AllowedWorkerIDs != nil {
		c.allowed_worker_ids = a.u64s(o.AllowedWorkerIDs)
		c.num_allowed_worker_ids = C.size_t(len(o.AllowedWorkerIDs))
	}
	setDouble(&c.overlap_score_credit, o.OverlapScoreCredit)
	setDouble(&c.prefill_load_scale, o.PrefillLoadScale)
	setDouble(&c.host_cache_hit_weight, o.HostCacheHitWeight)
	setDouble(&c.disk_cache_hit_weight, o.DiskCacheHitWeight)
	setDouble(&c.temperature, o.Temperature)
	setTri(&c.assume_kv_reuse, o.AssumeKVReuse)
	setTri(&c.track_prefill_tokens, o.TrackPrefillTokens)
	setDouble(&c.overlap_score_credit_decay, o.OverlapScoreCreditDecay)
	setDouble(&c.decode_active_request_weight, o.DecodeActiveRequestWeight)
	c.priority_jump = C.double(o.PriorityJump)
	c.expected_output_tokens = C.uint32_t(o.ExpectedOutputTokens)
	switch {
	case o.QueueTimeout < 0:
		c.queue_timeout_ms = 0
	case o.QueueTimeout > 0:
		c.queue_timeout_ms = C.int64_t((o.QueueTimeout + time.Millisecond - 1) / time.Millisecond)
	}
}

func setDouble(dst *C.double, v *float64) {
	if v != nil {
		*dst = C.double(*v)
	}
}

func setTri(dst *C.int32_t, v *bool) {
	if v != nil {
		*dst = 0
		if *v {
			*dst = 1
		}
	}
}

// RouteResult is the decision for one request.
type RouteResult struct {
	WorkerID               uint64
	DPRank                 uint32
	PromptBlocks           uint32  // complete blocks in the prompt
	DeviceOverlapBlocks    uint32  // leading blocks cached on the chosen rank's device
	EffectiveOverlapBlocks float64 // device + tier-weighted lower-tier hits
	CachedTokens           uint64  // round(EffectiveOverlapBlocks × block size)
	PromptTokens           uint64
	Cost                   float64 // the chosen rank's cost
	Booked                 bool    // the request is now active on the chosen rank
	Queued                 bool    // it waited in the admission queue first
}

// Candidate is one candidate rank with every term of its cost:
// Cost = prefill_load_scale·max(0, RawPrefillBlocks − Credit) + DecodeBlocks + RequestCost,
// where Credit = overlap_score_credit·CreditDecay·DeviceBlocks + the lower tiers' weighted hits.
type Candidate struct {
	WorkerID               uint64
	DPRank                 uint32
	DeviceBlocks           uint32
	HostBlocks             uint32
	DiskBlocks             uint32
	ExternalBlocks         uint32
	Chosen                 bool // the rank picked
	EffectiveOverlapBlocks float64
	CachedTokens           uint64
	ActivePrefillTokens    uint64
	ActiveBlocks           uint64
	NewBlocks              uint64
	RawPrefillBlocks       float64
	Credit                 float64
	PrefillCost            float64
	DecodeBlocks           uint64
	Cost                   float64
	Probability            float64 // the chance this rank had of being picked
	// CreditDecay is the factor the device credit was multiplied by (1 = no decay; below 1 on
	// a rank with a longer prefill backlog when OverlapScoreCreditDecay > 0).
	CreditDecay    float64
	ActiveRequests uint64  // requests in flight on the rank
	RequestCost    float64 // DecodeActiveRequestWeight × ActiveRequests (part of Cost)
}

// FindBestMatch picks the worker rank for a prompt. Without opts.Admit it is query-only and
// changes nothing; with it the request is booked under opts.RequestID, after waiting in the
// admission queue if the router queues (the goroutine blocks in C; see QueueTimeout).
// Errors: ErrInvalidArgument, ErrAlreadyExists (request id active or waiting), ErrUnavailable
// (no eligible worker), ErrDeadlineExceeded (queue timeout), ErrCancelled (freed while
// queued).
func (r *Router) FindBestMatch(tokens []uint32, opts *RequestOptions) (RouteResult, error) {
	res, _, err := r.findBestMatch(tokens, opts, nil)
	return res, err
}

// FindBestMatchCandidates is FindBestMatch that also explains the decision: it fills
// candidates[:min(len(candidates), total)] with the candidates' cost breakdowns and returns the
// total number of candidates. A decision is never refused for lack of room: the list is
// truncated instead.
func (r *Router) FindBestMatchCandidates(tokens []uint32, opts *RequestOptions, candidates []Candidate) (RouteResult, int, error) {
	return r.findBestMatch(tokens, opts, candidates)
}

// findCall holds everything a kvr_find_best_match call passes by address, so that the call
// allocates once on the Go heap instead of once per out-parameter.
type findCall struct {
	opts  C.kvr_request_options
	out   C.kvr_route_result
	total C.size_t
	cerr  *C.kvr_error
}

func (r *Router) findBestMatch(tokens []uint32, opts *RequestOptions, candidates []Candidate) (RouteResult, int, error) {
	h := r.handle()
	if h == nil {
		return RouteResult{}, 0, ErrClosed
	}
	var a args
	defer a.release()
	call := new(findCall)
	var copts *C.kvr_request_options
	if opts != nil {
		opts.fill(&call.opts, &a)
		copts = &call.opts
	}
	tp, tn := tokensPtr(tokens)
	call.out = initRouteResult
	var cands []C.kvr_candidate
	var candsPtr *C.kvr_candidate
	if len(candidates) > 0 {
		cands = make([]C.kvr_candidate, len(candidates))
		candsPtr = &cands[0]
	}
	st := C.kvr_find_best_match(h, tp, tn, copts, &call.out, candsPtr, C.size_t(len(cands)), &call.total, &call.cerr)
	runtime.KeepAlive(r)
	if err := takeError(st, call.cerr); err != nil {
		return RouteResult{}, 0, err
	}
	total, out := int(call.total), &call.out
	for i := 0; i < len(cands) && i < total; i++ {
		candidates[i] = candidateFromC(&cands[i])
	}
	return RouteResult{
		WorkerID:               uint64(out.worker_id),
		DPRank:                 uint32(out.dp_rank),
		PromptBlocks:           uint32(out.prompt_blocks),
		DeviceOverlapBlocks:    uint32(out.device_overlap_blocks),
		EffectiveOverlapBlocks: float64(out.effective_overlap_blocks),
		CachedTokens:           uint64(out.cached_tokens),
		PromptTokens:           uint64(out.prompt_tokens),
		Cost:                   float64(out.cost),
		Booked:                 out.booked != 0,
		Queued:                 out.queued != 0,
	}, total, nil
}

func candidateFromC(c *C.kvr_candidate) Candidate {
	return Candidate{
		WorkerID:               uint64(c.worker_id),
		DPRank:                 uint32(c.dp_rank),
		DeviceBlocks:           uint32(c.device_blocks),
		HostBlocks:             uint32(c.host_blocks),
		DiskBlocks:             uint32(c.disk_blocks),
		ExternalBlocks:         uint32(c.external_blocks),
		Chosen:                 c.chosen != 0,
		EffectiveOverlapBlocks: float64(c.effective_overlap_blocks),
		CachedTokens:           uint64(c.cached_tokens),
		ActivePrefillTokens:    uint64(c.active_prefill_tokens),
		ActiveBlocks:           uint64(c.active_blocks),
		NewBlocks:              uint64(c.new_blocks),
		RawPrefillBlocks:       float64(c.raw_prefill_blocks),
		Credit:                 float64(c.credit),
		PrefillCost:            float64(c.prefill_cost),
		DecodeBlocks:           uint64(c.decode_blocks),
		Cost:                   float64(c.cost),
		Probability:            float64(c.probability),
		CreditDecay:            float64(c.credit_decay),
		ActiveRequests:         uint64(c.active_requests),
		RequestCost:            float64(c.request_cost),
	}
}

// Overlap is what one rank holds of a prompt's prefix, per tier.
type Overlap struct {
	WorkerID               uint64
	DPRank                 uint32
	DeviceBlocks           uint32
	HostBlocks             uint32
	DiskBlocks             uint32
	ExternalBlocks         uint32
	EffectiveOverlapBlocks float64
	CachedTokens           uint64
	TreeSize               uint64 // blocks the rank holds in the index
}

// initialResults is the first buffer size of the array calls; a larger answer is retried
// with the size the library asks for.
const initialResults = 16

// OverlapScores returns, per rank holding at least the prompt's first block, how much of the
// prompt's prefix it holds.
func (r *Router) OverlapScores(tokens []uint32, opts *RequestOptions) ([]Overlap, error) {
	return r.overlapScores(tokens, opts, initialResults)
}

func (r *Router) overlapScores(tokens []uint32, opts *RequestOptions, capHint int) ([]Overlap, error) {
	h := r.handle()
	if h == nil {
		return nil, ErrClosed
	}
	var a args
	defer a.release()
	copts := opts.toC(&a)
	tp, tn := tokensPtr(tokens)
	defer runtime.KeepAlive(r)
	buf, err := fillGrowing(capHint, func(p *C.kvr_overlap, cap C.size_t, n *C.size_t, cerr **C.kvr_error) C.kvr_status {
		return C.kvr_router_overlap_scores(h, tp, tn, copts, p, cap, n, cerr)
	})
	if err != nil {
		return nil, err
	}
	out := make([]Overlap, len(buf))
	for i := range out {
		c := &buf[i]
		out[i] = Overlap{
			WorkerID:               uint64(c.worker_id),
			DPRank:                 uint32(c.dp_rank),
			DeviceBlocks:           uint32(c.device_blocks),
			HostBlocks:             uint32(c.host_blocks),
			DiskBlocks:             uint32(c.disk_blocks),
			ExternalBlocks:         uint32(c.external_blocks),
			EffectiveOverlapBlocks: float64(c.effective_overlap_blocks),
			CachedTokens:           uint64(c.cached_tokens),
			TreeSize:               uint64(c.tree_size),
		}
	}
	return out, nil
}

// PotentialLoad is the load one registered rank would carry with a prompt.
type PotentialLoad struct {
	WorkerID               uint64
	DPRank                 uint32
	PotentialPrefillTokens uint64
	PotentialDecodeBlocks  uint64
	ActivePrefillTokens    uint64
	ActiveBlocks           uint64
	ActiveRequests         uint64
}

// PotentialLoads returns the load every registered rank would carry with this prompt.
func (r *Router) PotentialLoads(tokens []uint32, opts *RequestOptions) ([]PotentialLoad, error) {
	return r.potentialLoads(tokens, opts, initialResults)
}

func (r *Router) potentialLoads(tokens []uint32, opts *RequestOptions, capHint int) ([]PotentialLoad, error) {
	h := r.handle()
	if h == nil {
		return nil, ErrClosed
	}
	var a args
	defer a.release()
	copts := opts.toC(&a)
	tp, tn := tokensPtr(tokens)
	defer runtime.KeepAlive(r)
	buf, err := fillGrowing(capHint, func(p *C.kvr_potential_load, cap C.size_t, n *C.size_t, cerr **C.kvr_error) C.kvr_status {
		return C.kvr_router_potential_loads(h, tp, tn, copts, p, cap, n, cerr)
	})
	if err != nil {
		return nil, err
	}
	out := make([]PotentialLoad, len(buf))
	for i := range out {
		c := &buf[i]
		out[i] = PotentialLoad{
			WorkerID:               uint64(c.worker_id),
			DPRank:                 uint32(c.dp_rank),
			PotentialPrefillTokens: uint64(c.potential_prefill_tokens),
			PotentialDecodeBlocks:  uint64(c.potential_decode_blocks),
			ActivePrefillTokens:    uint64(c.active_prefill_tokens),
			ActiveBlocks:           uint64(c.active_blocks),
			ActiveRequests:         uint64(c.active_requests),
		}
	}
	return out, nil
}

// AddRequest books a request on a rank chosen elsewhere (opts.RequestID required).
// ErrNotFound for an unregistered rank, ErrAlreadyExists for an active id.
func (r *Router) AddRequest(tokens []uint32, workerID uint64, dpRank uint32, opts *RequestOptions) error {
	h := r.handle()
	if h == nil {
		return ErrClosed
	}
	var a args
	defer a.release()
	copts := opts.toC(&a)
	tp, tn := tokensPtr(tokens)
	var cerr *C.kvr_error
	st := C.kvr_router_add_request(h, tp, tn, C.uint64_t(workerID), C.uint32_t(dpRank), copts, &cerr)
	runtime.KeepAlive(r)
	return takeError(st, cerr)
}

// MarkPrefillCompleted says the request produced its first token. Idempotent: an unknown id
// is no error. It may admit queued requests.
func (r *Router) MarkPrefillCompleted(requestID string) error {
	return r.callID(requestID, func(h *C.kvr_router, id *C.char, e **C.kvr_error) C.kvr_status {
		return C.kvr_router_mark_prefill_completed(h, id, e)
	})
}

// RecordOutput says the request has generated outputTokens tokens so far (cumulative: call it
// as the stream goes, e.g. once per block's worth). Its rank then holds one more, unshared,
// block each time prompt + output crosses a block boundary, until the request is freed, so
// long generations weigh on their rank's cost (not published to router replicas). It returns
// ErrFailedPrecondition unless the router was created with RouterOptions.TrackOutputBlocks;
// an unknown id is no error.
func (r *Router) RecordOutput(requestID string, outputTokens uint64) error {
	return r.callID(requestID, func(h *C.kvr_router, id *C.char, e **C.kvr_error) C.kvr_status {
		return C.kvr_router_record_output(h, id, C.uint64_t(outputTokens), e)
	})
}

// FreeRequest says the request ended (finished, cancelled or failed). Idempotent: an unknown
// id is no error. It may admit queued requests.
func (r *Router) FreeRequest(requestID string) error {
	return r.callID(requestID, func(h *C.kvr_router, id *C.char, e **C.kvr_error) C.kvr_status {
		return C.kvr_router_free_request(h, id, e)
	})
}

// callID runs a call taking the router and one string.
func (r *Router) callID(id string, call func(*C.kvr_router, *C.char, **C.kvr_error) C.kvr_status) error {
	h := r.handle()
	if h == nil {
		return ErrClosed
	}
	cid := C.CString(id)
	defer C.free(unsafe.Pointer(cid))
	var cerr *C.kvr_error
	st := call(h, cid, &cerr)
	runtime.KeepAlive(r)
	return takeError(st, cerr)
}
