//go:build cgo

package kvrouter

import (
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

// A bus of the test's own: what replica a publishes, copied, applied to b by hand.
func TestReplicaPublisherCarriesBookings(t *testing.T) {
	a := newTestRouter(t, 2)
	b := newTestRouter(t, 2)
	var mu sync.Mutex
	var bus [][]byte
	must(t, a.SetReplicaPublisher("gateway-a", func(data []byte) {
		mu.Lock()
		bus = append(bus, append([]byte(nil), data...))
		mu.Unlock()
	}))
	deliver := func() {
		mu.Lock()
		defer mu.Unlock()
		for _, m := range bus {
			must(t, b.ApplyReplicaEvent(m))
		}
		bus = nil
	}
	// Joining, a announces itself: a Reset and a SyncRequest (it books nothing yet).
	if len(bus) != 2 {
		t.Fatalf("published %d changes on joining, want 2", len(bus))
	}
	deliver()
	must(t, a.AddRequest(prompt(64, 0), 1, 0, &RequestOptions{RequestID: "r1"}))
	if len(bus) != 1 {
		t.Fatalf("published %d changes, want 1", len(bus))
	}
	booking := bus[0]
	deliver()
	m, err := b.Metrics()
	must(t, err)
	if m.ReplicaRequestsActive != 1 || m.RequestsActive != 1 || m.ReplicaChangesApplied != 3 {
		t.Errorf("after a's booking, b's metrics %+v", m)
	}
	// The same booking twice, garbage, and a's own change echoed back.
	wantCode(t, b.ApplyReplicaEvent(booking), ErrAlreadyExists)
	wantCode(t, b.ApplyReplicaEvent([]byte("not a change")), ErrInvalidArgument)
	must(t, a.ApplyReplicaEvent(booking))
	if m, _ := a.Metrics(); m.RequestsActive != 1 || m.ReplicaRequestsActive != 0 {
		t.Errorf("an echo changed a: %+v", m)
	}

	must(t, a.FreeRequest("r1"))
	deliver()
	m, err = b.Metrics()
	must(t, err)
	if m.RequestsActive != 0 || m.ReplicaChangesRejected != 2 {
		t.Errorf("after a's free, b's metrics %+v", m)
	}

	// nil stops publishing, after a farewell (peers drop what they hold from a), and releases
	// the callback.
	must(t, a.SetReplicaPublisher("", nil))
	if len(bus) != 1 {
		t.Errorf("stopping published %d messages, want the farewell alone", len(bus))
	}
	must(t, a.AddRequest(prompt(16, 0), 1, 0, &RequestOptions{RequestID: "r2"}))
	if len(bus) != 1 {
		t.Errorf("published after stopping: %d", len(bus)-1)
	}
	if a.replica.handle != 0 {
		t.Error("the stopped callback is still held")
	}
	wantCode(t, a.SetReplicaPublisher("", func([]byte) {}), ErrInvalidArgument)
}

func TestReplicaPublisherIsReleasedWithTheRouter(t *testing.T) {
	opts := DefaultRouterOptions()
	r, err := NewRouter(&opts)
	must(t, err)
	must(t, r.SetReplicaPublisher("x", func([]byte) {}))
	must(t, r.Close())
	if r.replica.handle != 0 {
		t.Error("a closed router's callback is still held")
	}
	if err := r.SetReplicaPublisher("x", func([]byte) {}); err != ErrClosed {
		t.Errorf("SetReplicaPublisher after Close: %v", err)
	}
	if err := r.ApplyReplicaEvent([]byte{1}); err != ErrClosed {
		t.Errorf("ApplyReplicaEvent after Close: %v", err)
	}
}

// Two replicas over a real nats-server: each one's bookings become load at the other.
func TestSyncReplicasOverNATS(t *testing.T) {
	url := "nats://" + startNATSServer(t)
	replica := func(id string) (*Router, *Ingest, uint64) {
		r := newTestRouter(t, 2)
		// No heartbeats: a router that beats may answer b's join with its next heartbeat (a
		// second later), and every message is counted below.
		in, err := NewIngest(r, &IngestOptions{ReplayTimeout: time.Second, ReplicaHeartbeat: -1})
		must(t, err)
		t.Cleanup(func() { in.Close() })
		must(t, in.Start())
		src, err := in.SyncReplicas(url, "kvrouter.replicas", id)
		must(t, err)
		return r, in, src
	}
	a, ain, asrc := replica("gateway-a")
	b, bin, bsrc := replica("gateway-b")
	_, err := ain.SyncReplicas(url, "other", "again")
	wantCode(t, err, ErrFailedPrecondition)

	waitReplicas := func(r *Router, n uint64) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			m, err := r.Metrics()
			must(t, err)
			if m.ReplicaRequestsActive == n {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("replica requests %d, want %d", m.ReplicaRequestsActive, n)
			}
			time.Sleep(2 * time.Millisecond)
		}
	}
	must(t, a.AddRequest(prompt(64, 0), 1, 0, &RequestOptions{RequestID: "r1"}))
	waitReplicas(b, 1)
	must(t, b.AddRequest(prompt(32, 500), 2, 0, &RequestOptions{RequestID: "r2"}))
	waitReplicas(a, 1)
	must(t, a.FreeRequest("r1"))
	waitReplicas(b, 0)
	as, err := ain.Stats(asrc)
	must(t, err)
	bs, err := bin.Stats(bsrc)
	must(t, err)
	// Besides the bookings: each published a Reset and a SyncRequest on joining, and a answered
	// b's SyncRequest (a Reset, plus Added r1 if it was booked by then: a race).
	if as.Published < 5 || as.Published > 6 || bs.Published != 3 ||
		as.PublishFailures+bs.PublishFailures != 0 {
		t.Errorf("published: a %+v, b %+v", as, bs)
	}
	if bs.EventsApplied != as.Published-2 || as.EventsApplied != bs.Published {
		t.Errorf("applied: a %d, b %d", as.EventsApplied, bs.EventsApplied)
	}
	if as.BookingsTrimmed+bs.BookingsTrimmed != 0 { // short bookings, 1 MiB messages
		t.Errorf("trimmed: a %d, b %d", as.BookingsTrimmed, bs.BookingsTrimmed)
	}
}

// Over a server whose messages are at most 4 KiB (the least SyncReplicas accepts; the default
// is 1 MiB), a booking of 1,000 blocks (8 KB of block ids) goes with its leading block ids and
// is counted in BookingsTrimmed; a short booking, and a free (no block ids), are not.
func TestSyncReplicasCountsTrimmedBookings(t *testing.T) {
	config := filepath.Join(t.TempDir(), "nats.conf")
	must(t, os.WriteFile(config, []byte("max_payload: 4096\n"), 0o600))
	url := "nats://" + startNATSServerWith(t, false, "-c", config)
	r := newTestRouter(t, 1)
	in := newIngest(t, r)
	must(t, in.Start())
	src, err := in.SyncReplicas(url, "kvrouter.replicas", "gateway-a")
	must(t, err)
	must(t, r.AddRequest(prompt(4*bs, 0), 1, 0, &RequestOptions{RequestID: "short"}))
	must(t, r.AddRequest(prompt(1000*bs, 100000), 1, 0, &RequestOptions{RequestID: "long"}))
	must(t, r.FreeRequest("long"))
	s, err := in.Stats(src)
	must(t, err)
	if s.BookingsTrimmed != 1 || s.PublishFailures != 0 {
		t.Errorf("a 1,000-block booking over 4 KiB messages: stats %+v, want 1 trimmed, no failure", s)
	}
	total, err := in.Stats(0)
	must(t, err)
	if total.BookingsTrimmed != 1 {
		t.Errorf("source 0 counts %d trimmed bookings, want 1", total.BookingsTrimmed)
	}
}

// A router that already holds bookings announces them when it starts publishing, so a peer
// learns them at once; a replica id with byte 0x1F is refused.
func TestReplicaPublisherAnnouncesExistingBookings(t *testing.T) {
	a := newTestRouter(t, 2)
	b := newTestRouter(t, 2)
	must(t, a.AddRequest(prompt(64, 0), 1, 0, &RequestOptions{RequestID: "early-1"}))
	must(t, a.AddRequest(prompt(32, 900), 2, 0, &RequestOptions{RequestID: "early-2"}))
	var bus [][]byte
	must(t, a.SetReplicaPublisher("gateway-a", func(data []byte) {
		bus = append(bus, append([]byte(nil), data...))
	}))
	if len(bus) != 4 { // Reset, Added ×2, SyncRequest
		t.Fatalf("published %d changes on joining, want 4", len(bus))
	}
	for _, m := range bus {
		must(t, b.ApplyReplicaEvent(m))
	}
	if m, _ := b.Metrics(); m.ReplicaRequestsActive != 2 {
		t.Errorf("b learned %d of a's bookings, want 2", m.ReplicaRequestsActive)
	}
	wantCode(t, a.SetReplicaPublisher("bad\x1fid", func([]byte) {}), ErrInvalidArgument)
}

// Liveness over a bus of the test's own: a's heartbeat makes it a live replica at b; on b's
// clock, driven by hand, ExpireReplicas keeps it while it is within the timeout and drops it
// (with its booking) once it is past it.
func TestReplicaHeartbeatAndExpiry(t *testing.T) {
	a := newTestRouter(t, 2)
	b := newTestRouter(t, 2)
	var bus [][]byte
	// The publisher runs synchronously on this goroutine: no lock needed.
	must(t, a.SetReplicaPublisher("gateway-a", func(data []byte) {
		bus = append(bus, append([]byte(nil), data...))
	}))
	deliver := func() {
		for _, m := range bus {
			must(t, b.ApplyReplicaEvent(m))
		}
		bus = nil
	}
	must(t, b.SetTime(0))
	deliver() // a's Reset and SyncRequest
	must(t, a.AddRequest(prompt(64, 0), 1, 0, &RequestOptions{RequestID: "r1"}))
	must(t, a.ReplicaHeartbeat(1000))
	if len(bus) != 2 {
		t.Fatalf("published %d changes for a booking and a heartbeat, want 2", len(bus))
	}
	deliver()
	m, err := b.Metrics()
	must(t, err)
	// The router counts a heartbeat as an applied change, as it counts a Reset or a SyncRequest.
	if m.ReplicasLive != 1 || m.ReplicasExpired != 0 || m.ReplicaRequestsActive != 1 || m.ReplicaChangesApplied != 4 {
		t.Fatalf("after a's heartbeat, b's metrics %+v", m)
	}

	// 9 s of silence is within a 10 s timeout (and three 1 s intervals are less).
	must(t, b.SetTime(9_000_000_000))
	n, err := b.ExpireReplicas(10 * time.Second)
	must(t, err)
	if n != 0 {
		t.Fatalf("ExpireReplicas after 9 s of silence dropped %d replicas, want 0", n)
	}
	must(t, b.SetTime(11_000_000_000))
	n, err = b.ExpireReplicas(10 * time.Second)
	must(t, err)
	if n != 1 {
		t.Fatalf("ExpireReplicas after 11 s of silence dropped %d replicas, want 1", n)
	}
	m, err = b.Metrics()
	must(t, err)
	if m.ReplicasLive != 0 || m.ReplicasExpired != 1 || m.ReplicaRequestsActive != 0 || m.RequestsActive != 0 {
		t.Errorf("after expiry, b's metrics %+v", m)
	}
	// Nothing is left to drop; a's own booking is untouched.
	if n, err := b.ExpireReplicas(10 * time.Second); err != nil || n != 0 {
		t.Errorf("ExpireReplicas again: %d, %v", n, err)
	}
	if m, _ := a.Metrics(); m.RequestsActive != 1 {
		t.Errorf("a's metrics %+v", m)
	}

	wantCode(t, a.ReplicaHeartbeat(0), ErrInvalidArgument)
	wantCode(t, b.ReplicaHeartbeat(1000), ErrFailedPrecondition) // b has no publisher
	_, err = b.ExpireReplicas(0)
	wantCode(t, err, ErrInvalidArgument)
	if len(bus) != 0 {
		t.Errorf("refused heartbeats published %d changes", len(bus))
	}
	must(t, a.Close())
	if err := a.ReplicaHeartbeat(1000); err != ErrClosed {
		t.Errorf("ReplicaHeartbeat after Close: %v", err)
	}
	if _, err := a.ExpireReplicas(time.Second); err != ErrClosed {
		t.Errorf("ExpireReplicas after Close: %v", err)
	}
}
