package kvrouter

import (
	"fmt"
	"math"
	"testing"
)

// The predicted-TTFT cost (RouterOptions.CostFunction = CostPredictedTTFT, its per-request
// overrides) and the router's clock driven by hand (Router.SetTime).

func TestPredictedTTFTOptions(t *testing.T) {
	d := DefaultRouterOptions()
	if d.CostFunction != CostCredit || d.TTFTMissWeight != 3 || d.PrefillTokensPerSecond != 0 {
		t.Errorf("defaults: cost %v, miss weight %v, rate %v", d.CostFunction, d.TTFTMissWeight, d.PrefillTokensPerSecond)
	}
	if s := CostPredictedTTFT.String(); s != "KVR_COST_PREDICTED_TTFT" {
		t.Errorf("CostPredictedTTFT.String() = %q", s)
	}
	for name, bad := range map[string]func(*RouterOptions){
		"negative miss weight":  func(o *RouterOptions) { o.TTFTMissWeight = -1 },
		"infinite miss weight":  func(o *RouterOptions) { o.TTFTMissWeight = math.Inf(1) },
		"unknown cost function": func(o *RouterOptions) { o.CostFunction = 9 },
		"without prefill tracking": func(o *RouterOptions) {
			o.CostFunction = CostPredictedTTFT
			o.NoPrefillTracking = true
		},
	} {
		o := DefaultRouterOptions()
		bad(&o)
		if _, err := NewRouter(&o); err == nil {
			t.Errorf("%s: NewRouter accepted it", name)
		} else {
			wantCode(t, err, ErrInvalidArgument)
		}
	}
	r := newTestRouter(t, 1)
	p := prompt(32, 1)
	_, err := r.FindBestMatch(p, &RequestOptions{TTFTMissWeight: Ptr(-1.0)})
	wantCode(t, err, ErrInvalidArgument)
	_, err = r.FindBestMatch(p, &RequestOptions{CostFunction: Ptr(CostFunction(7))})
	wantCode(t, err, ErrInvalidArgument)
	_, err = r.FindBestMatch(p, &RequestOptions{CostFunction: Ptr(CostFunction(math.MaxUint32))})
	wantCode(t, err, ErrInvalidArgument)
	_, err = r.FindBestMatch(p, &RequestOptions{CostFunction: Ptr(CostPredictedTTFT), TTFTMissWeight: Ptr(math.NaN())})
	must(t, err)
	// Time never goes back.
	must(t, r.SetTime(5_000_000_000))
	must(t, r.SetTime(5_000_000_000))
	wantCode(t, r.SetTime(4_999_999_999), ErrInvalidArgument)
	must(t, r.Close())
	if err := r.SetTime(6_000_000_000); err != ErrClosed {
		t.Errorf("SetTime after Close: %v, want ErrClosed", err)
	}
}

// Every request's prefill completes 100 ms after its booking on the router's clock: the fleet's
// rate is learnt as 560 / 0.1 = 5,600 tokens per second, one rate for every rank. A fresh 512-token
// prompt is then priced in seconds at that rate, (backlog + 512) / rate + 3 × 512 / rate, so
// worker 1, with a 512-token backlog, is avoided; the credit form, asked for this request only,
// prices blocks again.
func TestPredictedTTFTPricesSecondsAtTheLearntRate(t *testing.T) {
	const (
		workers = 4
		warmLen = 560
		prefill = 512
		rate    = warmLen / 0.1
	)
	opts := DefaultRouterOptions()
	opts.BlockSize = bs
	opts.RandomSeed = 7
	opts.CostFunction = CostPredictedTTFT
	r, err := NewRouter(&opts)
	must(t, err)
	t.Cleanup(func() { r.Close() })
	for id := 1; id <= workers; id++ {
		must(t, r.AddWorker(WorkerConfig{WorkerID: uint64(id)}))
	}
	now := int64(5_000_000_000)
	must(t, r.SetTime(now))
	warm := prompt(warmLen, 1)
	for i := 0; i < 4; i++ {
		for id := uint64(1); id <= workers; id++ {
			name := fmt.Sprintf("warm-%d-%d", id, i)
			must(t, r.AddRequest(warm, id, 0, &RequestOptions{RequestID: name}))
			now += 100_000_000
			must(t, r.SetTime(now))
			must(t, r.MarkPrefillCompleted(name))
			must(t, r.FreeRequest(name))
		}
	}
	must(t, r.AddRequest(prompt(prefill, 100_000), 1, 0, &RequestOptions{RequestID: "backlog"}))
	fresh := prompt(prefill, 500_000) // cached nowhere
	res, got := candidatesByWorker(t, r, fresh, nil)
	if res.WorkerID == 1 || len(got) != workers {
		t.Fatalf("predicted TTFT: worker %d of %d candidates, want one other than worker 1: %+v", res.WorkerID, len(got), got)
	}
	for id, c := range got {
		// (backlog + 512) / rate + 3 × 512 / rate: 0.457 s behind worker 1's backlog, 0.366 s.
		backlog := 0.0
		if id == 1 {
			backlog = prefill
		}
		if want := (backlog + 4*prefill) / rate; math.Abs(c.Cost-want) >= 1e-9 {
			t.Errorf("worker %d: cost %v, want %v", id, c.Cost, want)
		}
	}
	// The credit form, asked for this request only, prices blocks: 512 / 16 + 32 new = 64.
	res, err = r.FindBestMatch(fresh, &RequestOptions{CostFunction: Ptr(CostCredit)})
	must(t, err)
	if res.Cost != 64 {
		t.Errorf("credit form: cost %v, want 64", res.Cost)
	}
	// Time never goes back.
	wantCode(t, r.SetTime(now-1), ErrInvalidArgument)
}
