package kvrouter

import (
	"math"
	"strconv"
	"testing"
)

// Dynamo's newer cost knobs (overlap_score_credit_decay, decode_active_request_weight) and
// output-block tracking (TrackOutputBlocks, RecordOutput).

func TestNewerCostDefaults(t *testing.T) {
	d := DefaultRouterOptions()
	if d.OverlapScoreCreditDecay != 0 || d.DecodeActiveRequestWeight != 0 || d.TrackOutputBlocks {
		t.Errorf("defaults: %+v", d)
	}
	for _, bad := range []func(*RouterOptions){
		func(o *RouterOptions) { o.OverlapScoreCreditDecay = -1 },
		func(o *RouterOptions) { o.DecodeActiveRequestWeight = -0.5 },
		func(o *RouterOptions) { o.DecodeActiveRequestWeight = math.Inf(1) },
	} {
		o := DefaultRouterOptions()
		bad(&o)
		_, err := NewRouter(&o)
		wantCode(t, err, ErrInvalidArgument)
	}
	r := newTestRouter(t, 1)
	p := prompt(32, 1)
	_, err := r.FindBestMatch(p, &RequestOptions{OverlapScoreCreditDecay: Ptr(-1.0)})
	wantCode(t, err, ErrInvalidArgument)
	_, err = r.FindBestMatch(p, &RequestOptions{DecodeActiveRequestWeight: Ptr(-1.0)})
	wantCode(t, err, ErrInvalidArgument)
	// Off by default: no decay, no request cost, but the active requests are reported.
	must(t, r.AddRequest(prompt(32, 500), 1, 0, &RequestOptions{RequestID: "x"}))
	cands := make([]Candidate, 1)
	_, _, err = r.FindBestMatchCandidates(p, nil, cands)
	must(t, err)
	if c := cands[0]; c.CreditDecay != 1 || c.RequestCost != 0 || c.ActiveRequests != 1 {
		t.Errorf("candidate %+v", c)
	}
}

// routerWith is newTestRouter with the newer cost knobs set.
func routerWith(t *testing.T, workers int, decay, weight float64) *Router {
	t.Helper()
	opts := DefaultRouterOptions()
	opts.BlockSize = bs
	opts.RandomSeed = 7
	opts.OverlapScoreCreditDecay = decay
	opts.DecodeActiveRequestWeight = weight
	r, err := NewRouter(&opts)
	must(t, err)
	t.Cleanup(func() { r.Close() })
	for id := 1; id <= workers; id++ {
		must(t, r.AddWorker(WorkerConfig{WorkerID: uint64(id)}))
	}
	return r
}

// candidatesByWorker routes p (query-only) and returns the candidates by worker id.
func candidatesByWorker(t *testing.T, r *Router, p []uint32, opts *RequestOptions) (RouteResult, map[uint64]Candidate) {
	t.Helper()
	buf := make([]Candidate, 8)
	res, n, err := r.FindBestMatchCandidates(p, opts, buf)
	must(t, err)
	out := map[uint64]Candidate{}
	for _, c := range buf[:n] {
		out[c.WorkerID] = c
	}
	return res, out
}

// The request weight adds weight × active requests to a rank's cost, and so can flip the choice:
// worker 1 holds the prompt and three decoding requests of it (their blocks shared, their
// prefill done); worker 2 is idle. Costs without the weight: 4 (worker 1) vs 8 (worker 2).
func TestDecodeActiveRequestWeight(t *testing.T) {
	setup := func(r *Router) []uint32 {
		p := prompt(64, 1)
		must(t, r.ApplyStored(storedPrefix(1, p, 4)))
		for i := 0; i < 3; i++ {
			id := "dec-" + strconv.Itoa(i)
			must(t, r.AddRequest(p, 1, 0, &RequestOptions{RequestID: id}))
			must(t, r.MarkPrefillCompleted(id))
		}
		return p
	}
	plain := newTestRouter(t, 2)
	p := setup(plain)
	res, base := candidatesByWorker(t, plain, p, nil)
	if res.WorkerID != 1 || base[1].Cost != 4 || base[2].Cost != 8 {
		t.Fatalf("without weight: %+v, candidates %+v", res, base)
	}
	if base[1].ActiveRequests != 3 || base[2].ActiveRequests != 0 || base[1].RequestCost != 0 {
		t.Errorf("without weight: candidates %+v", base)
	}
	checkWeighted := func(what string, res RouteResult, got map[uint64]Candidate, w float64) {
		t.Helper()
		for id, c := range got {
			if want := w * float64(c.ActiveRequests); c.RequestCost != want {
				t.Errorf("%s: worker %d RequestCost %v, want %v", what, id, c.RequestCost, want)
			}
			if want := base[id].Cost + w*float64(c.ActiveRequests); math.Abs(c.Cost-want) > 1e-9 {
				t.Errorf("%s: worker %d cost %v, want %v", what, id, c.Cost, want)
			}
		}
		if res.WorkerID != 2 || !got[2].Chosen {
			t.Errorf("%s: %+v, want worker 2 (worker 1 costs 4 + 3w = %v)", what, res, 4+3*w)
		}
	}
	// A per-request override on a router without the weight.
	res, got := candidatesByWorker(t, plain, p, &RequestOptions{DecodeActiveRequestWeight: Ptr(2.0)})
	checkWeighted("override 2", res, got, 2)

	// The router's own weight; an unset or NaN override keeps it, an explicit 0 turns it off.
	weighted := routerWith(t, 2, 0, 2)
	setup(weighted)
	for name, opts := range map[string]*RequestOptions{
		"nil options":  nil,
		"unset":        {},
		"NaN override": {DecodeActiveRequestWeight: Ptr(math.NaN())},
	} {
		res, got := candidatesByWorker(t, weighted, p, opts)
		checkWeighted("router weight, "+name, res, got, 2)
	}
	res, got = candidatesByWorker(t, weighted, p, &RequestOptions{DecodeActiveRequestWeight: Ptr(0.0)})
	if res.WorkerID != 1 || got[1].RequestCost != 0 || got[1].Cost != 4 {
		t.Errorf("override 0: %+v, candidates %+v", res, got)
	}
}

// The credit decay discounts a device hit on a rank with a longer prefill backlog: worker 1
// holds the prompt's 4 blocks but has a 64-token prefill in flight (4 blocks beyond idle
// worker 2's), so with decay 1 its device credit is multiplied by 1 / (1 + 1·4/4) = 0.5.
func TestOverlapScoreCreditDecay(t *testing.T) {
	setup := func(r *Router) []uint32 {
		p := prompt(64, 1)
		must(t, r.ApplyStored(storedPrefix(1, p, 4)))
		must(t, r.AddRequest(prompt(64, 90000), 1, 0, &RequestOptions{RequestID: "backlog"}))
		return p
	}
	check := func(what string, got map[uint64]Candidate, decay float64) {
		t.Helper()
		c1, c2 := got[1], got[2]
		want := 1 / (1 + decay*4.0/4.0)
		if math.Abs(c1.CreditDecay-want) > 1e-12 || math.Abs(c1.Credit-4*want) > 1e-12 ||
			c1.ActivePrefillTokens != 64 || c1.DeviceBlocks != 4 {
			t.Errorf("%s: worker 1 %+v, want CreditDecay %v, Credit %v", what, c1, want, 4*want)
		}
		if c2.CreditDecay != 1 || c2.Credit != 0 {
			t.Errorf("%s: worker 2 (least loaded, no hit) %+v", what, c2)
		}
		if want := math.Max(0, c1.RawPrefillBlocks-c1.Credit); math.Abs(c1.PrefillCost-want) > 1e-12 {
			t.Errorf("%s: worker 1 prefill cost %v, want %v", what, c1.PrefillCost, want)
		}
	}
	decaying := routerWith(t, 2, 1, 0)
	p := setup(decaying)
	for name, opts := range map[string]*RequestOptions{
		"nil options":  nil,
		"unset":        {},
		"NaN override": {OverlapScoreCreditDecay: Ptr(math.NaN())},
	} {
		_, got := candidatesByWorker(t, decaying, p, opts)
		check("router decay 1, "+name, got, 1)
	}
	_, got := candidatesByWorker(t, decaying, p, &RequestOptions{OverlapScoreCreditDecay: Ptr(3.0)})
	check("override 3", got, 3)
	_, got = candidatesByWorker(t, decaying, p, &RequestOptions{OverlapScoreCreditDecay: Ptr(0.0)})
	check("override 0", got, 0)
	// Without prefill tracking there is no backlog to discount by.
	_, got = candidatesByWorker(t, decaying, p, &RequestOptions{TrackPrefillTokens: Ptr(false)})
	if got[1].CreditDecay != 1 {
		t.Errorf("no prefill tracking: worker 1 %+v", got[1])
	}

	plain := newTestRouter(t, 2)
	setup(plain)
	_, got = candidatesByWorker(t, plain, p, nil)
	check("router without decay", got, 0)
	_, got = candidatesByWorker(t, plain, p, &RequestOptions{OverlapScoreCreditDecay: Ptr(1.0)})
	check("override 1", got, 1)
}

// RecordOutput grows the request's rank by one unshared block each time prompt + output
// crosses a block boundary, until the request is freed.
func TestRecordOutput(t *testing.T) {
	opts := DefaultRouterOptions()
	opts.BlockSize = bs
	opts.TrackOutputBlocks = true
	r, err := NewRouter(&opts)
	must(t, err)
	t.Cleanup(func() { r.Close() })
	must(t, r.AddWorker(WorkerConfig{WorkerID: 1}))
	must(t, r.AddWorker(WorkerConfig{WorkerID: 2}))
	p := prompt(64, 1) // 4 blocks
	res, err := r.FindBestMatch(p, &RequestOptions{Admit: true, RequestID: "gen"})
	must(t, err)
	if !res.Booked {
		t.Fatalf("not booked: %+v", res)
	}
	load := func() PotentialLoad {
		t.Helper()
		loads, err := r.PotentialLoads(p, nil)
		must(t, err)
		for _, l := range loads {
			if l.WorkerID == res.WorkerID {
				return l
			}
		}
		t.Fatalf("worker %d missing from %+v", res.WorkerID, loads)
		return PotentialLoad{}
	}
	wantBlocks := func(what string, n uint64) {
		t.Helper()
		if l := load(); l.ActiveBlocks != n || l.PotentialDecodeBlocks != n || l.ActiveRequests != 1 {
			t.Errorf("%s: load %+v, want %d active blocks", what, l, n)
		}
	}
	wantBlocks("booked", 4)
	for _, step := range []struct {
		tokens uint64
		blocks uint64
	}{
		{0, 4},
		{1, 5},    // 65 tokens: a fifth block
		{16, 5},   // 80: still five
		{17, 6},   // 81: six
		{40, 7},   // 104: seven
		{40, 7},   // cumulative, not added up
		{100, 11}, // 164
	} {
		must(t, r.RecordOutput("gen", step.tokens))
		wantBlocks("output "+strconv.FormatUint(step.tokens, 10), step.blocks)
	}
	// The output blocks weigh on the rank's cost.
	_, got := candidatesByWorker(t, r, p, nil)
	if c := got[res.WorkerID]; c.ActiveBlocks != 11 || c.DecodeBlocks != 11 {
		t.Errorf("candidate %+v, want 11 active blocks", c)
	}
	must(t, r.RecordOutput("never-seen", 100)) // an unknown id is no error
	must(t, r.FreeRequest("gen"))
	if l := load(); l.ActiveBlocks != 0 || l.ActiveRequests != 0 {
		t.Errorf("after free: %+v", l)
	}

	// A router that does not track output refuses.
	plain := newTestRouter(t, 1)
	must(t, plain.AddRequest(p, 1, 0, &RequestOptions{RequestID: "gen"}))
	wantCode(t, plain.RecordOutput("gen", 32), ErrFailedPrecondition)
	loads, err := plain.PotentialLoads(p, nil)
	must(t, err)
	if loads[0].ActiveBlocks != 4 {
		t.Errorf("refused output still counted: %+v", loads[0])
	}
	r.Close()
	if err := r.RecordOutput("gen", 1); err != ErrClosed {
		t.Errorf("after Close: %v", err)
	}
}
