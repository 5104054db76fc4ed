package kvrouter

import (
	"math"
	"reflect"
	"testing"
	"time"
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

// Durations become whole milliseconds rounded up, without overflowing near math.MaxInt64
// (adding a millisecond first wrapped to a negative count), and a uint32_t field of
// milliseconds takes at most its range instead of wrapping to a short timeout.
func TestDurationsToMillis(t *testing.T) {
	for _, c := range []struct {
		d    time.Duration
		want int64
	}{
		{1, 1}, {time.Millisecond, 1}, {time.Millisecond + 1, 2}, {1500 * time.Microsecond, 2},
		{math.MaxInt64, math.MaxInt64/int64(time.Millisecond) + 1},
		{math.MaxInt64 - math.MaxInt64%time.Millisecond, math.MaxInt64 / int64(time.Millisecond)},
	} {
		if got := ceilMillis(c.d); got != c.want {
			t.Errorf("ceilMillis(%d) = %d, want %d", int64(c.d), got, c.want)
		}
	}
	// QueueTimeout is an int64_t of milliseconds: the longest duration is a long wait, not a
	// negative one.
	q := loaded((&RequestOptions{QueueTimeout: math.MaxInt64}).toC(new(args)), (*cRequestOptions).load)
	if q.QueueTimeoutMs != math.MaxInt64/int64(time.Millisecond)+1 {
		t.Errorf("QueueTimeout MaxInt64: %d ms", q.QueueTimeoutMs)
	}
	// ReplayTimeout is a uint32_t of milliseconds: 50 days wrapped to about 7 hours.
	for _, d := range []time.Duration{50 * 24 * time.Hour, math.MaxInt64} {
		m := loaded((&IngestOptions{ReplayTimeout: d}).toC(), (*cIngestOptions).load)
		if m.ReplayTimeoutMs != math.MaxUint32 {
			t.Errorf("ReplayTimeout %v: %d ms, want %d", d, m.ReplayTimeoutMs, uint32(math.MaxUint32))
		}
	}
	m := loaded((&IngestOptions{ReplayTimeout: 1500 * time.Microsecond}).toC(), (*cIngestOptions).load)
	if m.ReplayTimeoutMs != 2 {
		t.Errorf("ReplayTimeout 1.5 ms: %d ms", m.ReplayTimeoutMs)
	}
	// The longest replay timeout is one the library takes.
	r := newTestRouter(t, 1)
	in, err := NewIngest(r, &IngestOptions{ReplayTimeout: math.MaxInt64})
	must(t, err)
	must(t, in.Close())
}
