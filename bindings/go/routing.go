//go:build cgo

package kvrouter

/*
#include <stdlib.h>
#include <string.h>
#include "kvrouter.h"

// The hot calls go through these shims so that a call costs one cgo crossing and no Go heap
// allocation: Go passes strings as (bytes, length) straight from its own memory (no C.CString,
// no malloc for the common case), passes the options by value (its pointer fields NULL: the
// shim sets them, so no Go pointer sits in Go memory handed to C and nothing needs pinning),
// and gets the status, the error object and the result back by value, not through pointers to
// Go memory (which would escape to the heap).

// KVRGO_STRINGS is the stack room for a call's NUL-terminated strings; longer ones are malloc'ed.
#define KVRGO_STRINGS 256

// kvrgo_cstrs copies up to three Go strings (p NULL = absent, left NULL) into NUL-terminated
// memory: stack (KVRGO_STRINGS bytes) when they fit, else one malloc'ed block returned in *heap
// for the caller to free. Returns 0 when that malloc fails.
static int kvrgo_cstrs(char *stack, char **heap, const char *p[3], const size_t n[3],
                       const char *out[3]) {
  size_t total = 0;
  for (int i = 0; i < 3; ++i) total += p[i] ? n[i] + 1 : 0;
  char *base = stack;
  *heap = NULL;
  if (total > KVRGO_STRINGS) {
    base = *heap = (char *)malloc(total);
    if (base == NULL) return 0;
  }
  for (int i = 0; i < 3; ++i) {
    out[i] = NULL;
    if (p[i] == NULL) continue;
    memcpy(base, p[i], n[i]);
    base[n[i]] = 0;
    out[i] = base;
    base += n[i] + 1;
  }
  return 1;
}

typedef struct {
  kvr_status status;
  kvr_error *error;
  size_t total;
  kvr_route_result result;
} kvrgo_find_out;

// The pointer arguments of kvr_request_options beside the value fields in opts.
typedef struct {
  const uint64_t *allowed_worker_ids;
  const uint64_t *mm_hashes;
  const size_t *mm_counts;
} kvrgo_opt_ptrs;

static kvrgo_find_out kvrgo_find_impl(kvr_router *h, const uint32_t *tokens, size_t num_tokens,
                                      int has_opts, kvr_request_options *opts, const char *id,
                                      size_t id_n, const char *lora, size_t lora_n,
                                      const char *ns, size_t ns_n, const uint64_t *allowed,
                                      const uint64_t *mm, const size_t *mm_counts,
                                      const uint64_t *hashes, kvr_candidate *cands,
                                      size_t cap) {
  kvrgo_find_out out;
  out.error = NULL;
  out.total = 0;
  kvr_route_result_init(&out.result, sizeof out.result);
  char stack[KVRGO_STRINGS], *heap = NULL;
  if (has_opts) {
    const char *p[3] = {id, lora, ns}, *s[3];
    const size_t n[3] = {id_n, lora_n, ns_n};
    if (!kvrgo_cstrs(stack, &heap, p, n, s)) {
      out.status = KVR_RESOURCE_EXHAUSTED;
      return out;
    }
    opts->request_id = s[0];
    opts->lora_name = s[1];
    opts->cache_namespace = s[2];
    opts->allowed_worker_ids = allowed;
    opts->mm_hashes = mm;
    opts->mm_counts = mm_counts;
    opts->local_hashes = hashes;
  }
  out.status = kvr_find_best_match(h, tokens, num_tokens, has_opts ? opts : NULL, &out.result,
                                   cands, cap, &out.total, &out.error);
  free(heap);
  return out;
}

// kvrgo_find: kvr_find_best_match for any options (it may admit, so may call back into Go
// through a replica publisher). kvrgo_find_query: the same for a query-only call (no
// KVR_REQUEST_ADMIT), which never calls back.
static kvrgo_find_out kvrgo_find(kvr_router *h, const uint32_t *tokens, size_t num_tokens,
                                 int has_opts, kvr_request_options opts, const char *id,
                                 size_t id_n, const char *lora, size_t lora_n, const char *ns,
                                 size_t ns_n, const uint64_t *allowed, const uint64_t *mm,
                                 const size_t *mm_counts, const uint64_t *hashes,
                                 kvr_candidate *cands, size_t cap) {
  return kvrgo_find_impl(h, tokens, num_tokens, has_opts, &opts, id, id_n, lora, lora_n, ns,
                         ns_n, allowed, mm, mm_counts, hashes, cands, cap);
}

static kvrgo_find_out kvrgo_find_query(kvr_router *h, const uint32_t *tokens, size_t num_tokens,
                                       int has_opts, kvr_request_options opts, const char *lora,
                                       size_t lora_n, const char *ns, size_t ns_n,
                                       const uint64_t *allowed, const uint64_t *mm,
                                       const size_t *mm_counts, const uint64_t *hashes,
                                       kvr_candidate *cands, size_t cap) {
  opts.flags &= ~(uint32_t)KVR_REQUEST_ADMIT;
  return kvrgo_find_impl(h, tokens, num_tokens, has_opts, &opts, NULL, 0, lora, lora_n, ns, ns_n,
                         allowed, mm, mm_counts, hashes, cands, cap);
}

// kvrgo_find_plain: a query-only kvr_find_best_match without options (never calls back).
static kvrgo_find_out kvrgo_find_plain(kvr_router *h, const uint32_t *tokens, size_t num_tokens,
                                       kvr_candidate *cands, size_t cap) {
  kvrgo_find_out out;
  out.error = NULL;
  out.total = 0;
  kvr_route_result_init(&out.result, sizeof out.result);
  out.status = kvr_find_best_match(h, tokens, num_tokens, NULL, &out.result, cands, cap,
                                   &out.total, &out.error);
  return out;
}

// kvrgo_find_simple: kvr_find_best_match with options that set nothing but flags and the
// strings (the common admitted call: an id, perhaps a LoRA), so that their value fields need
// not cross by value.
static kvrgo_find_out kvrgo_find_simple(kvr_router *h, const uint32_t *tokens,
                                        size_t num_tokens, uint32_t flags, const char *id,
                                        size_t id_n, const char *lora, size_t lora_n,
                                        const char *ns, size_t ns_n, kvr_candidate *cands,
                                        size_t cap) {
  kvr_request_options opts;
  kvr_request_options_init(&opts, sizeof opts);
  opts.flags = flags;
  return kvrgo_find_impl(h, tokens, num_tokens, 1, &opts, id, id_n, lora, lora_n, ns, ns_n, NULL,
                         NULL, NULL, NULL, cands, cap);
}

typedef struct {
  kvr_status status;
  int freed;          // KVRGO_ABORT's answer
  uint32_t dp_rank;   // KVRGO_SESSION_BINDING's answer
  uint64_t worker_id; // KVRGO_SESSION_BINDING's answer
  kvr_error *error;
} kvrgo_status;

enum {
  KVRGO_MARK_PREFILL,
  KVRGO_RECORD_OUTPUT,
  KVRGO_FREE,
  KVRGO_COMMIT,
  KVRGO_ABORT,
  KVRGO_SESSION_BINDING,
  KVRGO_CLOSE_SESSION
};

// kvrgo_id_call runs one of the calls taking the router and a request id (op: KVRGO_*).
static kvrgo_status kvrgo_id_call(kvr_router *h, int op, const char *id, size_t id_n,
                                  uint64_t arg) {
  kvrgo_status out = {KVR_OK, 0, 0, 0, NULL};
  char stack[KVRGO_STRINGS], *heap = NULL;
  const char *p[3] = {id, NULL, NULL}, *s[3];
  const size_t n[3] = {id_n, 0, 0};
  if (!kvrgo_cstrs(stack, &heap, p, n, s)) {
    out.status = KVR_RESOURCE_EXHAUSTED;
    return out;
  }
  switch (op) {
    case KVRGO_MARK_PREFILL:
      out.status = kvr_router_mark_prefill_completed(h, s[0], &out.error);
      break;
    case KVRGO_RECORD_OUTPUT:
      out.status = kvr_router_record_output(h, s[0], arg, &out.error);
      break;
    case KVRGO_COMMIT:
      out.status = kvr_commit_route(h, s[0], &out.error);
      break;
    case KVRGO_ABORT:
      out.status = kvr_abort_route(h, s[0], &out.freed, &out.error);
      break;
    case KVRGO_SESSION_BINDING:
      out.status = kvr_router_session_binding(h, s[0], &out.worker_id, &out.dp_rank, &out.error);
      break;
    case KVRGO_CLOSE_SESSION:
      out.status = kvr_router_close_session(h, s[0], &out.error);
      break;
    default:
      out.status = kvr_router_free_request(h, s[0], &out.error);
  }
  free(heap);
  return out;
}
*/
import "C"

import (
	"math"
	"runtime"
	"time"
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
	// AllowedWorkerIDs restricts the candidates to these workers (and bypasses the admission
	// queue). nil allows every worker; an empty non-nil list ([]uint64{}) allows none, so a
	// call that has to pick a worker fails with ErrUnavailable and books nothing (a gateway
	// that filtered a tenant's workers down to none must not route on anyone's).
	//
	// Pitfall: a filter that starts from `var ids []uint64` and appends the matching workers
	// leaves ids nil when none matched, and nil allows every worker. Start it from
	// `ids := []uint64{}` (or make([]uint64, 0, n)) so that "none matched" allows none.
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
	// CostFunction and TTFTMissWeight override the router's RouterOptions fields of the same
	// names (nil, or a NaN weight: the router's). An unknown CostFunction is refused
	// (ErrInvalidArgument).
	CostFunction   *CostFunction
	TTFTMissWeight *float64
	PriorityJump   float64 // queue priority boost
	// ExpectedOutputTokens is the expected decode length (used by the WSPT queue policy).
	ExpectedOutputTokens uint32
	// QueueTimeout bounds the wait in the admission queue: 0 waits as long as it takes, a
	// negative value gives up at once (whole milliseconds, rounded up).
	QueueTimeout time.Duration
	// Prehashed gives the prompt as its local block hashes instead of its tokens
	// (KVR_REQUEST_PREHASHED): every call taking tokens and these options (routing, previews,
	// plans, AddRequest, OverlapScores, PotentialLoads, the Disagg calls) then takes nil tokens
	// (ErrInvalidArgument otherwise) and hashes nothing. The decision, booking and prices are
	// those of the tokens hashed. LoraName, CacheNamespace and MultimodalHashes are not read:
	// they are in the hashes already. nil: the prompt is the call's tokens.
	Prehashed *PrehashedPrompt
}

// PrehashedPrompt is a prompt a caller hashed itself (a gateway that hashes once for several
// routers, or whose tokenizer service hands it hashes): RequestOptions.Prehashed.
type PrehashedPrompt struct {
	// LocalHashes holds one hash per complete block of the prompt: ComputeBlockHashes of its
	// tokens with the router's block size and the request's HashOptions (LoRA, namespace,
	// multimodal hashes, eagle windows). ErrInvalidArgument unless it has exactly one per
	// complete block of NumTokens tokens (none for a prompt shorter than a block). It is only
	// borrowed for the call.
	LocalHashes []uint64
	// NumTokens is the prompt's length in tokens (partial last block included).
	NumTokens uint64
}

// promptArg is a call's prompt as C takes it: the tokens or, with opts.Prehashed, NULL and the
// prompt's length (its hashes travel in the options). Tokens beside hashes are refused here,
// before C would refuse them.
func promptArg(tokens []uint32, opts *RequestOptions) (*C.uint32_t, C.size_t, error) {
	if opts == nil || opts.Prehashed == nil {
		tp, tn := tokensPtr(tokens)
		return tp, tn, nil
	}
	if len(tokens) > 0 {
		return nil, 0, newError(ErrInvalidArgument,
			"the prompt is given either as tokens or as RequestOptions.Prehashed, not both: tokens must be nil")
	}
	return nil, C.size_t(opts.Prehashed.NumTokens), nil
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
// library, so one cgo call per struct at start-up (initTemplates) replaces one per routing call.
// requestDefaults holds requestTemplate's fields, the base of every request's mirror.
var (
	requestTemplate     C.kvr_request_options
	requestDefaults     cRequestOptions
	routeResultTemplate C.kvr_route_result
)

// initTemplates fills the templates; the version check calls it once the library is accepted.
// The init helpers fill locals, copied afterwards: cgo's pointer check refuses a pointer into a
// global of a struct type with pointer fields passed as a plain pointer argument (it cannot tell
// the object's size there, so assumes it holds Go pointers), which is what the helpers pass.
func initTemplates() {
	var opts C.kvr_request_options
	initRequestOptions(&opts)
	requestTemplate = opts
	requestDefaults.load(&opts)
	var res C.kvr_route_result
	initRouteResult(&res)
	routeResultTemplate = res
}

// mirror converts the options to kvr_request_options' value fields, starting from the
// library's defaults (NaN overrides, -1 tri-states, no queue timeout). Counts of the pointer
// fields are set by fill.
func (o *RequestOptions) mirror() cRequestOptions {
	m := requestDefaults
	m.Flags |= flagIf(o.Admit, C.KVR_REQUEST_ADMIT)
	setDouble(&m.OverlapScoreCredit, o.OverlapScoreCredit)
	setDouble(&m.PrefillLoadScale, o.PrefillLoadScale)
	setDouble(&m.HostCacheHitWeight, o.HostCacheHitWeight)
	setDouble(&m.DiskCacheHitWeight, o.DiskCacheHitWeight)
	setDouble(&m.Temperature, o.Temperature)
	setTri(&m.AssumeKVReuse, o.AssumeKVReuse)
	setTri(&m.TrackPrefillTokens, o.TrackPrefillTokens)
	setDouble(&m.OverlapScoreCreditDecay, o.OverlapScoreCreditDecay)
	setDouble(&m.DecodeActiveRequestWeight, o.DecodeActiveRequestWeight)
	if o.CostFunction != nil {
		// Past int32 it would wrap to a negative (the router's): pass it on to be refused.
		m.CostFunction = int32(min(*o.CostFunction, math.MaxInt32))
	}
	setDouble(&m.TTFTMissWeight, o.TTFTMissWeight)
	m.PriorityJump = o.PriorityJump
	m.ExpectedOutputTokens = o.ExpectedOutputTokens
	switch {
	case o.QueueTimeout < 0:
		m.QueueTimeoutMs = 0
	case o.QueueTimeout > 0:
		m.QueueTimeoutMs = ceilMillis(o.QueueTimeout)
	}
	return m
}

// fill sets c (any memory: it is overwritten with the initialised template) to o.
func (o *RequestOptions) fill(c *C.kvr_request_options, a *args) {
	o.fillValues(c)
	c.mm_hashes, c.mm_counts, _ = a.mm(o.MultimodalHashes)
	c.allowed_worker_ids = a.u64s(o.AllowedWorkerIDs)
	c.request_id = a.optStr("RequestOptions.RequestID", o.RequestID)
	c.lora_name = a.optStr("RequestOptions.LoraName", o.LoraName)
	c.cache_namespace = a.optStr("RequestOptions.CacheNamespace", o.CacheNamespace)
	if o.Prehashed != nil {
		c.local_hashes = a.u64s(o.Prehashed.LocalHashes)
	}
}

// simple says o sets nothing but Admit and the strings (kvrgo_find_simple's case, which
// passes no allow-list: so AllowedWorkerIDs must be nil, not merely empty).
func (o *RequestOptions) simple() bool {
	return o.MultimodalHashes == nil && o.AllowedWorkerIDs == nil && o.OverlapScoreCredit == nil &&
		o.PrefillLoadScale == nil && o.HostCacheHitWeight == nil && o.DiskCacheHitWeight == nil &&
		o.Temperature == nil && o.AssumeKVReuse == nil && o.TrackPrefillTokens == nil &&
		o.OverlapScoreCreditDecay == nil && o.DecodeActiveRequestWeight == nil &&
		o.CostFunction == nil && o.TTFTMissWeight == nil && o.PriorityJump == 0 &&
		o.ExpectedOutputTokens == 0 && o.QueueTimeout == 0 && o.Prehashed == nil
}

// fillValues sets c to the initialised template with o's value fields, the arrays' counts
// included; its pointer fields stay NULL.
func (o *RequestOptions) fillValues(c *C.kvr_request_options) {
	*c = requestTemplate
	m := o.mirror()
	m.MmNumBlocks = uint64(len(o.MultimodalHashes))
	m.NumAllowedWorkerIDs = uint64(len(o.AllowedWorkerIDs))
	if o.AllowedWorkerIDs != nil && len(o.AllowedWorkerIDs) == 0 {
		// An empty list allows no worker; without the flag the library reads it as every
		// worker, which only nil means here. (Only then: a non-empty list means the same
		// without it, and so works with a 0.2 library from before the flag.)
		m.Flags |= C.KVR_REQUEST_ALLOW_LIST
	}
	if o.Prehashed != nil {
		m.Flags |= C.KVR_REQUEST_PREHASHED
		m.NumLocalHashes = uint64(len(o.Prehashed.LocalHashes))
	}
	m.store(c)
}

func setDouble(dst *float64, v *float64) {
	if v != nil {
		*dst = *v
	}
}

func setTri(dst *int32, v *bool) {
	if v != nil {
		*dst = int32(boolU32(*v))
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
// queued, or the queue closed: CloseQueue, Close).
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

func (r *Router) findBestMatch(tokens []uint32, opts *RequestOptions, candidates []Candidate) (RouteResult, int, error) {
	h := r.acquire()
	if h == nil {
		return RouteResult{}, 0, ErrClosed
	}
	defer r.release()
	tp, tn, err := promptArg(tokens, opts)
	if err != nil {
		return RouteResult{}, 0, err
	}
	var cands []C.kvr_candidate
	var candsPtr *C.kvr_candidate
	if len(candidates) > 0 {
		cands = make([]C.kvr_candidate, len(candidates))
		candsPtr = &cands[0]
	}
	var out C.kvrgo_find_out
	if opts == nil {
		out = C.kvrgo_find_plain(h, tp, tn, candsPtr, C.size_t(len(cands)))
	} else {
		// The strings go to the shims as Go bytes (the fields fill copies for the other calls),
		// refused if they hold a NUL byte. A query ignores the request id, but one that C could
		// not read whole is refused all the same, as every other call refuses it.
		var check argCheck
		id, idN := check.view("RequestOptions.RequestID", opts.RequestID)
		lora, loraN := check.view("RequestOptions.LoraName", opts.LoraName)
		ns, nsN := check.view("RequestOptions.CacheNamespace", opts.CacheNamespace)
		if err := check.err(); err != nil {
			return RouteResult{}, 0, err
		}
		if opts.simple() {
			out = C.kvrgo_find_simple(h, tp, tn, C.uint32_t(flagIf(opts.Admit, C.KVR_REQUEST_ADMIT)),
				id, idN, lora, loraN, ns, nsN, candsPtr, C.size_t(len(cands)))
		} else {
			var copts C.kvr_request_options
			opts.fillValues(&copts)
			mm, mmCounts := flattenMM(opts.MultimodalHashes)
			allowed := u64Ptr(opts.AllowedWorkerIDs)
			var hashes *C.uint64_t
			if opts.Prehashed != nil {
				hashes = u64Ptr(opts.Prehashed.LocalHashes)
			}
			if opts.Admit {
				out = C.kvrgo_find(h, tp, tn, 1, copts, id, idN, lora, loraN, ns, nsN, allowed,
					u64Ptr(mm), sizePtr(mmCounts), hashes, candsPtr, C.size_t(len(cands)))
			} else {
				out = C.kvrgo_find_query(h, tp, tn, 1, copts, lora, loraN, ns, nsN, allowed,
					u64Ptr(mm), sizePtr(mmCounts), hashes, candsPtr, C.size_t(len(cands)))
			}
		}
		runtime.KeepAlive(opts)
	}
	runtime.KeepAlive(r)
	runtime.KeepAlive(tokens)
	if err := takeError(out.status, out.error); err != nil {
		return RouteResult{}, 0, err
	}
	total := int(out.total)
	for i := 0; i < len(cands) && i < total; i++ {
		var m cCandidate
		m.load(&cands[i])
		candidates[i] = candidateFrom(&m)
	}
	var m cRouteResult
	m.load(&out.result)
	return routeResultFrom(&m), total, nil
}

func routeResultFrom(m *cRouteResult) RouteResult {
	return RouteResult{
		WorkerID:               m.WorkerID,
		DPRank:                 m.DPRank,
		PromptBlocks:           m.PromptBlocks,
		DeviceOverlapBlocks:    m.DeviceOverlapBlocks,
		EffectiveOverlapBlocks: m.EffectiveOverlapBlocks,
		CachedTokens:           m.CachedTokens,
		PromptTokens:           m.PromptTokens,
		Cost:                   m.Cost,
		Booked:                 m.Booked != 0,
		Queued:                 m.Queued != 0,
	}
}

func candidateFrom(m *cCandidate) Candidate {
	return Candidate{
		WorkerID:               m.WorkerID,
		DPRank:                 m.DPRank,
		DeviceBlocks:           m.DeviceBlocks,
		HostBlocks:             m.HostBlocks,
		DiskBlocks:             m.DiskBlocks,
		ExternalBlocks:         m.ExternalBlocks,
		Chosen:                 m.Chosen != 0,
		EffectiveOverlapBlocks: m.EffectiveOverlapBlocks,
		CachedTokens:           m.CachedTokens,
		ActivePrefillTokens:    m.ActivePrefillTokens,
		ActiveBlocks:           m.ActiveBlocks,
		NewBlocks:              m.NewBlocks,
		RawPrefillBlocks:       m.RawPrefillBlocks,
		Credit:                 m.Credit,
		PrefillCost:            m.PrefillCost,
		DecodeBlocks:           m.DecodeBlocks,
		Cost:                   m.Cost,
		Probability:            m.Probability,
		CreditDecay:            m.CreditDecay,
		ActiveRequests:         m.ActiveRequests,
		RequestCost:            m.RequestCost,
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

// rowsHint is the buffer size a per-rank query starts with: the last one's answer, at least
// initialResults.
func (r *Router) rowsHint() int {
	return max(initialResults, int(r.rows.Load()))
}

// OverlapScores returns, per rank holding at least the prompt's first block, how much of the
// prompt's prefix it holds.
func (r *Router) OverlapScores(tokens []uint32, opts *RequestOptions) ([]Overlap, error) {
	return r.overlapScores(tokens, opts, r.rowsHint())
}

// OverlapScoresOfHashes is OverlapScores for a prompt already hashed: localHashes are its blocks'
// local hashes (ComputeBlockHashes; what engines' KV events and Dynamo's find_matches take). Of
// opts only the cost overrides apply (kvr_router_overlap_scores_hashed).
func (r *Router) OverlapScoresOfHashes(localHashes []uint64, opts *RequestOptions) ([]Overlap, error) {
	h := r.acquire()
	if h == nil {
		return nil, ErrClosed
	}
	defer r.release()
	var a args
	defer a.release()
	copts := opts.toC(&a)
	if err := a.err(); err != nil {
		return nil, err
	}
	hp := u64Ptr(localHashes)
	defer runtime.KeepAlive(r)
	defer runtime.KeepAlive(localHashes)
	buf, err := fillGrowing(r.rowsHint(), func(p *C.kvr_overlap, cap C.size_t, n *C.size_t, cerr **C.kvr_error) C.kvr_status {
		return C.kvr_router_overlap_scores_hashed(h, hp, C.size_t(len(localHashes)), copts, p, cap, n, cerr)
	})
	if err != nil {
		return nil, err
	}
	r.rows.Store(int32(len(buf)))
	return overlapsFrom(buf), nil
}

func (r *Router) overlapScores(tokens []uint32, opts *RequestOptions, capHint int) ([]Overlap, error) {
	h := r.acquire()
	if h == nil {
		return nil, ErrClosed
	}
	defer r.release()
	tp, tn, err := promptArg(tokens, opts)
	if err != nil {
		return nil, err
	}
	var a args
	defer a.release()
	copts := opts.toC(&a)
	if err := a.err(); err != nil {
		return nil, err
	}
	defer runtime.KeepAlive(r)
	buf, err := fillGrowing(capHint, func(p *C.kvr_overlap, cap C.size_t, n *C.size_t, cerr **C.kvr_error) C.kvr_status {
		return C.kvr_router_overlap_scores(h, tp, tn, copts, p, cap, n, cerr)
	})
	if err != nil {
		return nil, err
	}
	r.rows.Store(int32(len(buf)))
	return overlapsFrom(buf), nil
}

// overlapsFrom reads the library's rows through the generated mirror.
func overlapsFrom(buf []C.kvr_overlap) []Overlap {
	out := make([]Overlap, len(buf))
	for i := range out {
		var m cOverlap
		m.load(&buf[i])
		out[i] = Overlap(m)
	}
	return out
}

// Match is what one rank holds of a hashed prompt's prefix, per tier, each tier continuing
// where the previous one stops: the index walk alone, without the cost model's figures of an
// Overlap (kvr_match).
type Match struct {
	WorkerID       uint64
	DPRank         uint32
	DeviceBlocks   uint32 // leading blocks on the device (Dynamo's find_matches depth)
	HostBlocks     uint32
	DiskBlocks     uint32
	ExternalBlocks uint32
	TreeSize       uint64 // blocks the rank holds in the index
}

// FindMatches returns, per rank holding at least the first of localHashes (ComputeBlockHashes),
// in no particular order, the leading blocks it holds per tier: Dynamo's find_matches contract
// (kvr_router_find_matches). Each row has the tiers and tree size of OverlapScoresOfHashes' row
// for that rank, without the cost model's figures, and costs less to get: the call for a
// caller that scores ranks itself. No hashes match no rank.
func (r *Router) FindMatches(localHashes []uint64) ([]Match, error) {
	return r.findMatches(localHashes, r.rowsHint())
}

func (r *Router) findMatches(localHashes []uint64, capHint int) ([]Match, error) {
	h := r.acquire()
	if h == nil {
		return nil, ErrClosed
	}
	defer r.release()
	hp := u64Ptr(localHashes)
	defer runtime.KeepAlive(r)
	defer runtime.KeepAlive(localHashes)
	buf, err := fillGrowing(capHint, func(p *C.kvr_match, cap C.size_t, n *C.size_t, cerr **C.kvr_error) C.kvr_status {
		return C.kvr_router_find_matches(h, hp, C.size_t(len(localHashes)), p, cap, n, cerr)
	})
	if err != nil {
		return nil, err
	}
	r.rows.Store(int32(len(buf)))
	out := make([]Match, len(buf))
	for i := range out {
		var m cMatch
		m.load(&buf[i])
		out[i] = Match(m)
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
	return r.potentialLoads(tokens, opts, r.rowsHint())
}

func (r *Router) potentialLoads(tokens []uint32, opts *RequestOptions, capHint int) ([]PotentialLoad, error) {
	h := r.acquire()
	if h == nil {
		return nil, ErrClosed
	}
	defer r.release()
	tp, tn, err := promptArg(tokens, opts)
	if err != nil {
		return nil, err
	}
	var a args
	defer a.release()
	copts := opts.toC(&a)
	if err := a.err(); err != nil {
		return nil, err
	}
	defer runtime.KeepAlive(r)
	buf, err := fillGrowing(capHint, func(p *C.kvr_potential_load, cap C.size_t, n *C.size_t, cerr **C.kvr_error) C.kvr_status {
		return C.kvr_router_potential_loads(h, tp, tn, copts, p, cap, n, cerr)
	})
	if err != nil {
		return nil, err
	}
	r.rows.Store(int32(len(buf)))
	out := make([]PotentialLoad, len(buf))
	for i := range out {
		var m cPotentialLoad
		m.load(&buf[i])
		out[i] = PotentialLoad(m)
	}
	return out, nil
}

// AddRequest books a request on a rank chosen elsewhere (opts.RequestID required).
// ErrNotFound for an unregistered rank, ErrAlreadyExists for an active id.
func (r *Router) AddRequest(tokens []uint32, workerID uint64, dpRank uint32, opts *RequestOptions) error {
	h := r.acquire()
	if h == nil {
		return ErrClosed
	}
	defer r.release()
	tp, tn, err := promptArg(tokens, opts)
	if err != nil {
		return err
	}
	var a args
	defer a.release()
	copts := opts.toC(&a)
	if err := a.err(); err != nil {
		return err
	}
	var cerr *C.kvr_error
	st := C.kvr_router_add_request(h, tp, tn, C.uint64_t(workerID), C.uint32_t(dpRank), copts, &cerr)
	runtime.KeepAlive(r)
	return takeError(st, cerr)
}

// MarkPrefillCompleted says the request produced its first token. Idempotent: an unknown id
// is no error. It may admit queued requests.
func (r *Router) MarkPrefillCompleted(requestID string) error {
	_, err := r.callID(idMarkPrefill, "requestID", requestID, 0)
	return err
}

// RecordOutput says the request has generated outputTokens tokens so far (cumulative: call it
// as the stream goes, e.g. once per block's worth). Its rank then holds one more, unshared,
// block each time prompt + output crosses a block boundary, until the request is freed, so
// long generations weigh on their rank's cost (not published to router replicas). It returns
// ErrFailedPrecondition unless the router was created with RouterOptions.TrackOutputBlocks;
// an unknown id is no error.
func (r *Router) RecordOutput(requestID string, outputTokens uint64) error {
	_, err := r.callID(idRecordOutput, "requestID", requestID, outputTokens)
	return err
}

// FreeRequest says the request ended (finished, cancelled or failed). Idempotent: an unknown
// id is no error. It may admit queued requests.
func (r *Router) FreeRequest(requestID string) error {
	_, err := r.callID(idFree, "requestID", requestID, 0)
	return err
}

// ExpireRequests drops every request booked longer than RouterOptions.RequestExpiry ago (its
// FreeRequest was lost: a crashed client, a missed event) and every plan past its deadline, then
// admits the queued requests that now fit, and returns how many requests were dropped. The
// router has no timer: a routing call that books does this at most once per min(30 s,
// RequestExpiry), and nothing does while no call comes, so with a QueueThreshold a lost request
// can keep the queue waiting until one does. Call it on a timer (every second, say). From a
// replica publisher it returns ErrFailedPrecondition, as every call on the router does. Needs
// libkvrouter 0.2.1 or later.
func (r *Router) ExpireRequests() (int, error) {
	h := r.acquire()
	if h == nil {
		return 0, ErrClosed
	}
	defer r.release()
	var n C.size_t
	var cerr *C.kvr_error
	st := C.kvr_router_expire_requests(h, &n, &cerr)
	runtime.KeepAlive(r)
	return int(n), takeError(st, cerr)
}

// The calls of callID.
const (
	idMarkPrefill  = C.KVRGO_MARK_PREFILL
	idRecordOutput = C.KVRGO_RECORD_OUTPUT
	idFree         = C.KVRGO_FREE
	idCommit       = C.KVRGO_COMMIT
	idAbort        = C.KVRGO_ABORT
	idSession      = C.KVRGO_SESSION_BINDING
	idCloseSession = C.KVRGO_CLOSE_SESSION
)

// idAnswer is what a call of callID answers beside its error.
type idAnswer struct {
	freed    bool // idAbort
	workerID uint64
	dpRank   uint32 // idSession
}

// callID runs a call taking the router and one request (or session) id (op: id*), the
// argument named field (refused if it holds a NUL byte).
func (r *Router) callID(op int, field, id string, arg uint64) (idAnswer, error) {
	h := r.acquire()
	if h == nil {
		return idAnswer{}, ErrClosed
	}
	defer r.release()
	var check argCheck
	p, n := check.view(field, id)
	if err := check.err(); err != nil {
		return idAnswer{}, err
	}
	if p == nil {
		p = &emptyCString[0] // "" is passed as "" (not NULL: a request id is required)
	}
	out := C.kvrgo_id_call(h, C.int(op), p, n, C.uint64_t(arg))
	runtime.KeepAlive(r)
	runtime.KeepAlive(id)
	answer := idAnswer{freed: out.freed != 0, workerID: uint64(out.worker_id), dpRank: uint32(out.dp_rank)}
	return answer, takeError(out.status, out.error)
}
