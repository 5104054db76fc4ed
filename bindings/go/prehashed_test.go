//go:build cgo

package kvrouter

import (
	"cmp"
	"errors"
	"slices"
	"testing"
)

// A prompt given as its local hashes (RequestOptions.Prehashed, KVR_REQUEST_PREHASHED) is
// routed, previewed, planned, booked and priced as its tokens are, through every call taking a
// prompt; a hash count that is not the prompt's complete blocks, and tokens beside the hashes,
// are refused.

// prehashedOf hashes p as the test routers do (block size bs, the base model).
func prehashedOf(t *testing.T, p []uint32) *PrehashedPrompt {
	t.Helper()
	hashes, err := ComputeBlockHashes(p, bs, nil)
	must(t, err)
	return &PrehashedPrompt{LocalHashes: hashes, NumTokens: uint64(len(p))}
}

// byWorker orders per-rank rows by worker id (the library returns them in no particular order).
func byWorker[T any](rows []T, id func(T) uint64) []T {
	slices.SortFunc(rows, func(a, b T) int { return cmp.Compare(id(a), id(b)) })
	return rows
}

func overlapWorker(o Overlap) uint64    { return o.WorkerID }
func loadWorker(l PotentialLoad) uint64 { return l.WorkerID }

// Worker 2 caches the prompt's first two blocks: the hashed prompt gets the decision (worker,
// overlap, cached and prompt tokens, blocks, cost, every candidate), the preview, the overlaps
// and the potential loads of its tokens, with and without other options.
func TestPrehashedPromptRoutesAsItsTokens(t *testing.T) {
	r := newTestRouter(t, 3)
	p := prompt(4*bs+5, 100) // a partial last block, which has no hash
	must(t, r.ApplyStored(storedPrefix(2, p, 2)))
	hashed := prehashedOf(t, p)
	if len(hashed.LocalHashes) != 4 {
		t.Fatalf("%d hashes for 4 complete blocks", len(hashed.LocalHashes))
	}

	for _, c := range []struct {
		name   string
		tokens *RequestOptions // the options routing the tokens (nil: none)
		hashed RequestOptions  // the same with the prompt's hashes
	}{
		{"no options", nil, RequestOptions{Prehashed: hashed}},
		{"overrides", &RequestOptions{OverlapScoreCredit: Ptr(0.5), AllowedWorkerIDs: []uint64{1, 2, 3}},
			RequestOptions{OverlapScoreCredit: Ptr(0.5), AllowedWorkerIDs: []uint64{1, 2, 3}, Prehashed: hashed}},
	} {
		byTokens, byHashes := make([]Candidate, 4), make([]Candidate, 4)
		want, nWant, err := r.FindBestMatchCandidates(p, c.tokens, byTokens)
		must(t, err)
		got, nGot, err := r.FindBestMatchCandidates(nil, &c.hashed, byHashes)
		must(t, err)
		if got != want || nGot != nWant || !slices.Equal(byHashes, byTokens) {
			t.Errorf("%s: from hashes %+v (%d candidates %+v), from tokens %+v (%d %+v)",
				c.name, got, nGot, byHashes[:nGot], want, nWant, byTokens[:nWant])
		}
		if got.WorkerID != 2 || got.DeviceOverlapBlocks != 2 || got.CachedTokens != 2*bs ||
			got.PromptTokens != uint64(len(p)) || got.PromptBlocks != 4 || nGot != 3 || got.Booked {
			t.Errorf("%s: decision from hashes %+v, want worker 2 with 2 blocks cached of 4", c.name, got)
		}

		preview, err := r.PreviewRoute(p, c.tokens, nil)
		must(t, err)
		hashedPreview, err := r.PreviewRoute(nil, &c.hashed, nil)
		must(t, err)
		if hashedPreview != preview || hashedPreview.WorkerID != 2 || hashedPreview.OverlapBlocks != 2 {
			t.Errorf("%s: preview from hashes %+v, from tokens %+v", c.name, hashedPreview, preview)
		}

		overlaps, err := r.OverlapScores(p, c.tokens)
		must(t, err)
		hashedOverlaps, err := r.OverlapScores(nil, &c.hashed)
		must(t, err)
		overlaps, hashedOverlaps = byWorker(overlaps, overlapWorker), byWorker(hashedOverlaps, overlapWorker)
		if !slices.Equal(hashedOverlaps, overlaps) || len(overlaps) != 1 || overlaps[0].DeviceBlocks != 2 {
			t.Errorf("%s: overlaps from hashes %+v, from tokens %+v", c.name, hashedOverlaps, overlaps)
		}

		loads, err := r.PotentialLoads(p, c.tokens)
		must(t, err)
		hashedLoads, err := r.PotentialLoads(nil, &c.hashed)
		must(t, err)
		loads, hashedLoads = byWorker(loads, loadWorker), byWorker(hashedLoads, loadWorker)
		if !slices.Equal(hashedLoads, loads) || len(loads) != 3 {
			t.Errorf("%s: potential loads from hashes %+v, from tokens %+v", c.name, hashedLoads, loads)
		}
	}

	// The hashes carry the LoRA (and namespace, multimodal content): the options' own are not
	// read. The LoRA's hashes miss worker 2's base-model blocks as its tokens do; the base
	// hashes hit them whatever LoraName says.
	lora, err := ComputeBlockHashes(p, bs, &HashOptions{LoraName: "adapter"})
	must(t, err)
	want, err := r.FindBestMatch(p, &RequestOptions{LoraName: "adapter"})
	must(t, err)
	got, err := r.FindBestMatch(nil, &RequestOptions{Prehashed: &PrehashedPrompt{LocalHashes: lora, NumTokens: uint64(len(p))}})
	must(t, err)
	if got.DeviceOverlapBlocks != 0 || got.CachedTokens != want.CachedTokens || got.PromptBlocks != want.PromptBlocks {
		t.Errorf("LoRA hashes: %+v, its tokens: %+v", got, want)
	}
	got, err = r.FindBestMatch(nil, &RequestOptions{LoraName: "adapter", Prehashed: hashed})
	must(t, err)
	if got.WorkerID != 2 || got.DeviceOverlapBlocks != 2 {
		t.Errorf("base hashes with a LoraName: %+v, want worker 2's 2 blocks", got)
	}

	// A prompt shorter than a block has no hash, and needs none.
	got, err = r.FindBestMatch(nil, &RequestOptions{Prehashed: &PrehashedPrompt{NumTokens: bs - 1}})
	must(t, err)
	if got.PromptTokens != bs-1 || got.PromptBlocks != 0 || got.DeviceOverlapBlocks != 0 {
		t.Errorf("a prompt of %d tokens, no hashes: %+v", bs-1, got)
	}
}

// A request booked from its hashes (admitted, planned and committed, or added on a rank chosen
// elsewhere) weighs on its rank exactly as one booked from its tokens, and is freed.
func TestPrehashedBookingShowsInLoadsAndIsFreed(t *testing.T) {
	r := newTestRouter(t, 3)
	p := prompt(4*bs+5, 100)
	must(t, r.ApplyStored(storedPrefix(2, p, 2)))
	hashed := prehashedOf(t, p)
	loadsNow := func() []PotentialLoad {
		t.Helper()
		loads, err := r.PotentialLoads(p, nil)
		must(t, err)
		return byWorker(loads, loadWorker)
	}
	idle := loadsNow()
	for _, l := range idle {
		if l.ActiveRequests != 0 || l.ActiveBlocks != 0 {
			t.Fatalf("idle loads %+v", idle)
		}
	}

	type booking struct {
		name string
		book func(id string, tokens []uint32, prehashed *PrehashedPrompt) error
	}
	for _, b := range []booking{
		{"FindBestMatch (admit)", func(id string, tokens []uint32, prehashed *PrehashedPrompt) error {
			res, err := r.FindBestMatch(tokens, &RequestOptions{Admit: true, RequestID: id, Prehashed: prehashed})
			if err == nil && (!res.Booked || res.WorkerID != 2) {
				t.Errorf("admitted %+v", res)
			}
			return err
		}},
		{"PlanRoute + CommitRoute", func(id string, tokens []uint32, prehashed *PrehashedPrompt) error {
			plan, err := r.PlanRoute(tokens, &RequestOptions{RequestID: id, Prehashed: prehashed}, nil, nil)
			if err != nil {
				return err
			}
			if !plan.Booked || plan.WorkerID != 2 || plan.PromptTokens != uint64(len(p)) {
				t.Errorf("plan %+v", plan)
			}
			return r.CommitRoute(id)
		}},
		{"AddRequest on worker 3", func(id string, tokens []uint32, prehashed *PrehashedPrompt) error {
			return r.AddRequest(tokens, 3, 0, &RequestOptions{RequestID: id, Prehashed: prehashed})
		}},
	} {
		must(t, b.book("from-tokens", p, nil))
		fromTokens := loadsNow()
		must(t, r.FreeRequest("from-tokens"))
		must(t, b.book("from-hashes", nil, hashed))
		fromHashes := loadsNow()
		// The per-rank queries from hashes see the booking too.
		viaHashes, err := r.PotentialLoads(nil, &RequestOptions{Prehashed: hashed})
		must(t, err)
		must(t, r.FreeRequest("from-hashes"))
		if !slices.Equal(fromHashes, fromTokens) || !slices.Equal(byWorker(viaHashes, loadWorker), fromTokens) {
			t.Errorf("%s: loads booked from hashes %+v (queried by hashes %+v), from tokens %+v",
				b.name, fromHashes, viaHashes, fromTokens)
		}
		booked := 0
		for i, l := range fromHashes {
			if l.ActiveRequests == 0 {
				continue
			}
			booked++
			if l.ActiveRequests != 1 || l.ActiveBlocks == 0 || l.ActiveBlocks == idle[i].ActiveBlocks {
				t.Errorf("%s: the booked rank's load %+v", b.name, l)
			}
			if l.WorkerID == 2 && l.ActivePrefillTokens != uint64(len(p)-2*bs) {
				t.Errorf("%s: %d prefill tokens booked on worker 2, want the %d uncached", b.name,
					l.ActivePrefillTokens, len(p)-2*bs)
			}
		}
		if booked != 1 {
			t.Errorf("%s: %d ranks carry the booking: %+v", b.name, booked, fromHashes)
		}
		if after := loadsNow(); !slices.Equal(after, idle) {
			t.Errorf("%s: loads after the frees %+v, want the idle %+v", b.name, after, idle)
		}
	}
	m, err := r.Metrics()
	must(t, err)
	if m.RequestsActive != 0 {
		t.Errorf("%d requests active after the frees", m.RequestsActive)
	}
}

// The disaggregated router reads a hashed prompt's length as its tokens': 128 uncached tokens
// over MaxLocalPrefillTokens go to the prefill pool (a length read as 0 would prefill locally),
// on the rank caching the prefix, and the decode pool books it as the tokens.
func TestPrehashedPromptInDisagg(t *testing.T) {
	ro := DefaultRouterOptions()
	ro.BlockSize = bs
	ro.RandomSeed = 7
	do := DefaultDisaggOptions()
	do.Policy = DisaggISLBounding
	do.MaxLocalPrefillTokens = 16
	d, err := NewDisagg(&ro, &ro, &do)
	must(t, err)
	defer d.Close()
	pre, dec := d.PrefillRouter(), d.DecodeRouter()
	p := prompt(8*bs, 1)
	must(t, pre.AddWorker(WorkerConfig{WorkerID: 1, MaxNumBatchedTokens: 1000}))
	must(t, pre.AddWorker(WorkerConfig{WorkerID: 2, MaxNumBatchedTokens: 1000}))
	must(t, pre.ApplyStored(storedPrefix(2, p, 3)))
	must(t, dec.AddWorker(WorkerConfig{WorkerID: 10, TotalKVBlocks: 1000}))
	hashed := prehashedOf(t, p)

	type answer struct {
		prefill PrefillResult
		decode  RouteSignals
		busy    bool
	}
	route := func(id string, tokens []uint32, prehashed *PrehashedPrompt) answer {
		t.Helper()
		opts := &RequestOptions{RequestID: id, Prehashed: prehashed}
		busy, err := d.PrefillWorkerBusy(tokens, opts, 0.05)
		must(t, err)
		where, err := d.RoutePrefill(tokens, opts, nil)
		must(t, err)
		sig, err := d.RouteDecode(tokens, opts, nil, where.Remote)
		must(t, err)
		must(t, pre.FreeRequest(id))
		must(t, dec.FreeRequest(id))
		where.BootstrapRoom = 0 // random
		return answer{where, sig, busy}
	}
	fromTokens := route("t", p, nil)
	fromHashes := route("h", nil, hashed)
	if fromHashes != fromTokens {
		t.Errorf("from hashes %+v, from tokens %+v", fromHashes, fromTokens)
	}
	if w := fromHashes.prefill; !w.Remote || w.Reason != PrefillRemote || w.WorkerID != 2 || w.CachedTokens != 3*bs {
		t.Errorf("prefill of the hashed prompt %+v, want remote on worker 2", w)
	}
	if s := fromHashes.decode; s.WorkerID != 10 || !s.Booked || s.PromptTokens != uint64(len(p)) || s.PromptBlocks != 8 {
		t.Errorf("decode of the hashed prompt %+v", s)
	}
	// 80 uncached tokens on idle worker 2 against 0.05 × 1000 batched tokens.
	if !fromHashes.busy {
		t.Error("PrefillWorkerBusy from hashes: not busy")
	}
}

// A hash count that is not the prompt's complete blocks (too few, none, one too many) and
// tokens beside the hashes are ErrInvalidArgument at every call taking a prompt, and book
// nothing.
func TestPrehashedPromptRefusals(t *testing.T) {
	r := newTestRouter(t, 2)
	d, err := NewDisagg(nil, nil, nil)
	must(t, err)
	defer d.Close()
	must(t, d.PrefillRouter().AddWorker(WorkerConfig{WorkerID: 1}))
	must(t, d.DecodeRouter().AddWorker(WorkerConfig{WorkerID: 2}))
	p := prompt(4*bs+5, 100)
	hashed := prehashedOf(t, p) // block size 16: the pools' default too

	calls := map[string]func(tokens []uint32, prehashed *PrehashedPrompt) error{
		"FindBestMatch": func(tokens []uint32, prehashed *PrehashedPrompt) error {
			_, err := r.FindBestMatch(tokens, &RequestOptions{Prehashed: prehashed})
			return err
		},
		"FindBestMatch (admit)": func(tokens []uint32, prehashed *PrehashedPrompt) error {
			_, err := r.FindBestMatch(tokens, &RequestOptions{Admit: true, RequestID: "x", Prehashed: prehashed})
			return err
		},
		"PreviewRoute": func(tokens []uint32, prehashed *PrehashedPrompt) error {
			_, err := r.PreviewRoute(tokens, &RequestOptions{Prehashed: prehashed}, nil)
			return err
		},
		"PlanRoute": func(tokens []uint32, prehashed *PrehashedPrompt) error {
			_, err := r.PlanRoute(tokens, &RequestOptions{RequestID: "x", Prehashed: prehashed}, nil, nil)
			return err
		},
		"AddRequest": func(tokens []uint32, prehashed *PrehashedPrompt) error {
			return r.AddRequest(tokens, 1, 0, &RequestOptions{RequestID: "x", Prehashed: prehashed})
		},
		"OverlapScores": func(tokens []uint32, prehashed *PrehashedPrompt) error {
			_, err := r.OverlapScores(tokens, &RequestOptions{Prehashed: prehashed})
			return err
		},
		"PotentialLoads": func(tokens []uint32, prehashed *PrehashedPrompt) error {
			_, err := r.PotentialLoads(tokens, &RequestOptions{Prehashed: prehashed})
			return err
		},
		"Disagg.RoutePrefill": func(tokens []uint32, prehashed *PrehashedPrompt) error {
			_, err := d.RoutePrefill(tokens, &RequestOptions{RequestID: "x", Prehashed: prehashed}, nil)
			return err
		},
		"Disagg.RouteDecode": func(tokens []uint32, prehashed *PrehashedPrompt) error {
			_, err := d.RouteDecode(tokens, &RequestOptions{RequestID: "x", Prehashed: prehashed}, nil, false)
			return err
		},
		"Disagg.PrefillWorkerBusy": func(tokens []uint32, prehashed *PrehashedPrompt) error {
			_, err := d.PrefillWorkerBusy(tokens, &RequestOptions{Prehashed: prehashed}, 1)
			return err
		},
	}
	n := uint64(len(p))
	for name, call := range calls {
		for _, bad := range []struct {
			what      string
			tokens    []uint32
			prehashed *PrehashedPrompt
		}{
			{"a block longer than its hashes", nil, &PrehashedPrompt{LocalHashes: hashed.LocalHashes, NumTokens: n + bs}},
			{"one hash too many", nil, &PrehashedPrompt{LocalHashes: append(hashed.LocalHashes[:4:4], 9), NumTokens: n}},
			{"no hashes", nil, &PrehashedPrompt{NumTokens: n}},
			{"tokens beside the hashes", p, hashed},
		} {
			err := call(bad.tokens, bad.prehashed)
			var e *Error
			if !errors.As(err, &e) || e.Code() != ErrInvalidArgument || e.Message() == "" {
				t.Errorf("%s with %s: %v, want ErrInvalidArgument", name, bad.what, err)
			}
		}
		for _, router := range []*Router{r, d.PrefillRouter(), d.DecodeRouter()} {
			m, err := router.Metrics()
			must(t, err)
			if m.RequestsActive != 0 || m.QueuePending != 0 {
				t.Errorf("%s: %d requests active, %d queued after the refusals", name, m.RequestsActive, m.QueuePending)
			}
		}
		// The same call with its hashes alone, or its tokens alone, is accepted (the refusals
		// above are the prompt's).
		must(t, call(nil, hashed))
		_, _ = r.AbortRoute("x")
		must(t, r.FreeRequest("x"))
		must(t, d.PrefillRouter().FreeRequest("x"))
		must(t, d.DecodeRouter().FreeRequest("x"))
		must(t, call(p, nil))
		_, _ = r.AbortRoute("x")
		must(t, r.FreeRequest("x"))
		must(t, d.PrefillRouter().FreeRequest("x"))
		must(t, d.DecodeRouter().FreeRequest("x"))
	}
}
