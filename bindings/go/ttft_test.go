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

// Worker 1 prefills ten times as fast as the others (its requests complete in 10 ms of the
// router's clock, theirs in 100 ms): with a 512-token backlog it still gives a fresh 512-token
// prompt its first token soonest, which the predicted-TTFT cost sees and the credit form does not.
func TestPredictedTTFTFollowsTheCalibratedRates(t *testing.T) {
	const workers = 4
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
	warm := prompt(512, 1)
	for i := 0; i < 16; i++ {
		for id := uint64(1); id <= workers; id++ {
			name := fmt.Sprintf("warm-%d-%d", id, i)
			must(t, r.AddRequest(warm, id, 0, &RequestOptions{RequestID: name}))
			if id == 1 {
				now += 10_000_000
			} else {
				now += 100_000_000
			}
			must(t, r.SetTime(now))
			must(t, r.MarkPrefillCompleted(name))
			must(t, r.FreeRequest(name))
		}
	}
	must(t, r.AddRequest(prompt(512, 100_000), 1, 0, &RequestOptions{RequestID: "backlog"}))
	fresh := prompt(512, 500_000) // cached nowhere
	res, got := candidatesByWorker(t, r, fresh, nil)
	if res.WorkerID != 1 || len(got) != workers {
		t.Fatalf("predicted TTFT: worker %d of %d candidates, want worker 1: %+v", res.WorkerID, len(got), got)
	}
	for id, c := range got {
		// Seconds: (backlog + 3 × 512 tokens) at thousands of tokens per second.
		if !(c.Cost > 0 && c.Cost < 1) {
			t.Errorf("worker %d: cost %v, want seconds in (0, 1)", id, c.Cost)
		}
	}
	// The credit form, asked for this request only, avoids worker 1's backlog.
	res, err = r.FindBestMatch(fresh, &RequestOptions{CostFunction: Ptr(CostCredit)})
	must(t, err)
	if res.WorkerID == 1 {
		t.Errorf("credit form: routed to worker 1, whose backlog it should avoid")
	}
}
