package kvrouter

import (
	"reflect"
	"testing"
)

// fillGrowing retries a call that says its buffer was too small, but not forever: an answer
// that keeps growing between the calls (workers added while a per-rank query runs) used to be
// retried for as long as it grew. No library call can be made to grow on cue without a hook in
// the library, so a fake call stands in for it.
func TestFillGrowingIsBounded(t *testing.T) {
	// A short hint: one retry with exactly what the call asked for.
	n, caps, err := fillGrowingFake(16, func(int) int { return 40 })
	must(t, err)
	if n != 40 || !reflect.DeepEqual(caps, []int{16, 40}) {
		t.Errorf("a short hint: %d filled, %d calls, rooms %v...", n, len(caps), caps[:min(len(caps), 5)])
	}
	// An answer growing a little between calls: the second retry leaves headroom. (The fake
	// stops growing after 1,000 calls, so that a loop retrying with no headroom ends.)
	n, caps, err = fillGrowingFake(16, func(call int) int { return 20 + min(call, 1000) })
	must(t, err)
	if n != 23 || !reflect.DeepEqual(caps, []int{16, 21, 22 + 22/4 + 16}) {
		t.Errorf("a slowly growing answer: %d filled, %d calls, rooms %v...", n, len(caps), caps[:min(len(caps), 5)])
	}
	// An answer that outgrows every buffer (doubling per call, more than the headroom):
	// growRetries retries, then ErrBufferTooSmall. (The fake stops growing after 12 calls, so
	// that an unbounded loop ends, and fails here.)
	n, caps, err = fillGrowingFake(16, func(call int) int { return 10 << min(call, 12) })
	wantStatus(t, err, ErrBufferTooSmall)
	if n != 0 || len(caps) != 1+growRetries {
		t.Errorf("an answer growing without end: %d filled after %d calls, want an error after %d", n, len(caps), 1+growRetries)
	}
}

// wantStatus fails unless err carries code (errors.Is).
func wantStatus(t *testing.T, err error, code Status) {
	t.Helper()
	if StatusOf(err) != code {
		t.Fatalf("got %v, want %v", err, code)
	}
}
