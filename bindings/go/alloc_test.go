//go:build cgo

package kvrouter

import "testing"

// The hot calls allocate nothing on the Go heap per call (allocation counts are exact, unlike
// times: a regression test for the binding's overhead, issue 16). Query-only calls with no
// options, an admitted call with a request id, a prehashed prompt, and the id-taking calls are
// covered.
func TestHotCallsDoNotAllocate(t *testing.T) {
	r, prompts, _, ids := overheadFleet(t)
	i := 0
	check := func(name string, f func()) {
		t.Helper()
		f() // warm up (first-call set-up is not per call)
		if n := testing.AllocsPerRun(200, f); n != 0 {
			t.Errorf("%s: %v allocations per call, want 0", name, n)
		}
	}
	check("FindBestMatch (preview)", func() {
		i++
		if _, err := r.FindBestMatch(prompts[i%len(prompts)], nil); err != nil {
			t.Fatal(err)
		}
	})
	opts := &RequestOptions{Admit: true}
	check("FindBestMatch (admit) + FreeRequest", func() {
		i++
		opts.RequestID = ids[i%len(ids)]
		if _, err := r.FindBestMatch(prompts[i%len(prompts)], opts); err != nil {
			t.Fatal(err)
		}
		if err := r.FreeRequest(opts.RequestID); err != nil {
			t.Fatal(err)
		}
	})
	// A prompt given as its local hashes (hashed once, outside the loop) crosses with the
	// options by value, its hashes as a direct argument: nothing to pin, nothing allocated.
	hashed := make([]*RequestOptions, len(prompts))
	for q, p := range prompts {
		hashes, err := ComputeBlockHashes(p, bs, nil)
		must(t, err)
		hashed[q] = &RequestOptions{Prehashed: &PrehashedPrompt{LocalHashes: hashes, NumTokens: uint64(len(p))}}
	}
	check("FindBestMatch (prehashed)", func() {
		i++
		if _, err := r.FindBestMatch(nil, hashed[i%len(hashed)]); err != nil {
			t.Fatal(err)
		}
	})
	check("MarkPrefillCompleted + FreeRequest", func() {
		i++
		if err := r.MarkPrefillCompleted(ids[i%len(ids)]); err != nil {
			t.Fatal(err)
		}
		if err := r.FreeRequest(ids[i%len(ids)]); err != nil {
			t.Fatal(err)
		}
	})
}
