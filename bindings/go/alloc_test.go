//go:build cgo

package kvrouter

import "testing"

// The hot calls allocate nothing on the Go heap per call (allocation counts are exact, unlike
// times: a regression test for the binding's overhead, issue 16). Query-only calls with no
// options, an admitted call with a request id, and the id-taking calls are covered.
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
