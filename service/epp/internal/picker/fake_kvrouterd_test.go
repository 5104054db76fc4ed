package picker_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/service/epp/internal/picker"
)

// call is one request the fake kvrouterd received.
type call struct {
	Op      string // "route", "prefill", "free", "workers"
	ID      string // the request id (percent-decoded from the path, or the route body's)
	RawPath string // the path as sent, still percent-encoded
	Route   *picker.RouteRequest
}

// fakeKvrouterd serves the parts of docs/kvrouterd.md the picker uses, and records the calls.
type fakeKvrouterd struct {
	*httptest.Server

	mu          sync.Mutex
	calls       []call
	routeStatus int               // when set, route answers this status with the contract's error body
	addresses   map[uint64]string // worker id -> address; GET /v1/workers lists them
	noAddress   bool              // decisions carry "address": null
	replayed    bool              // decisions say "replayed": true
}

func newFakeKvrouterd(t *testing.T) *fakeKvrouterd {
	f := &fakeKvrouterd{addresses: map[uint64]string{1: "10.0.0.1:8000", 2: "10.0.0.2:8000", 3: "10.0.0.3:8000"}}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/route", f.route)
	mux.HandleFunc("POST /v1/requests/{id}/prefill_completed", func(w http.ResponseWriter, r *http.Request) {
		f.record(call{Op: "prefill", ID: r.PathValue("id"), RawPath: r.URL.EscapedPath()})
		writeJSON(w, 200, map[string]any{"request_id": r.PathValue("id")})
	})
	mux.HandleFunc("DELETE /v1/requests/{id}", func(w http.ResponseWriter, r *http.Request) {
		f.record(call{Op: "free", ID: r.PathValue("id"), RawPath: r.URL.EscapedPath()})
		writeJSON(w, 200, map[string]any{"request_id": r.PathValue("id"), "freed": true})
	})
	mux.HandleFunc("GET /v1/workers", func(w http.ResponseWriter, r *http.Request) {
		f.record(call{Op: "workers"})
		f.mu.Lock()
		defer f.mu.Unlock()
		var workers []map[string]any
		for id, address := range f.addresses {
			workers = append(workers, map[string]any{"worker_id": id, "address": address, "dp_start": 0, "dp_size": 1})
		}
		writeJSON(w, 200, map[string]any{"workers": workers})
	})
	f.Server = httptest.NewServer(mux)
	t.Cleanup(f.Close)
	return f
}

// route decides like a router restricted to allowed_worker_ids: the first allowed worker,
// or worker 1.
func (f *fakeKvrouterd) route(w http.ResponseWriter, r *http.Request) {
	var req picker.RouteRequest
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
		writeJSON(w, 400, apiError("INVALID_ARGUMENT", err.Error()))
		return
	}
	f.record(call{Op: "route", ID: req.RequestID, Route: &req})
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.routeStatus != 0 {
		writeJSON(w, f.routeStatus, apiError("UNAVAILABLE", fmt.Sprintf("fake says %d", f.routeStatus)))
		return
	}
	worker := uint64(1)
	if len(req.AllowedWorkerIDs) > 0 {
		worker = req.AllowedWorkerIDs[0]
	}
	var address any = f.addresses[worker]
	if f.noAddress {
		address = nil
	}
	writeJSON(w, 200, map[string]any{
		"request_id": req.RequestID, "worker_id": worker, "dp_rank": 0, "address": address,
		"prompt_tokens": len(req.TokenIDs), "prompt_blocks": 1, "overlap_blocks": 0,
		"cached_tokens": 0, "cost": 1.5, "booked": true, "queued": false, "moved": false,
		"replayed": f.replayed,
	})
}

func apiError(status, message string) map[string]any {
	return map[string]any{"error": map[string]any{"status": status, "message": message}}
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func (f *fakeKvrouterd) record(c call) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, c)
}

func (f *fakeKvrouterd) set(change func(f *fakeKvrouterd)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	change(f)
}

// ops returns the recorded operations in order, e.g. ["route", "prefill", "free"].
func (f *fakeKvrouterd) ops() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var ops []string
	for _, c := range f.calls {
		ops = append(ops, c.Op)
	}
	return ops
}

// callsOf returns the recorded calls of op, or every call when op is "".
func (f *fakeKvrouterd) callsOf(op string) []call {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []call
	for _, c := range f.calls {
		if op == "" || c.Op == op {
			out = append(out, c)
		}
	}
	return out
}

// waitOps waits until the recorded operations are want (calls made after the stream's last
// answer, like the free of a cut stream, land a little later), then checks that no more come.
func (f *fakeKvrouterd) waitOps(t *testing.T, want ...string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for len(f.ops()) < len(want) && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	time.Sleep(50 * time.Millisecond) // a duplicate call would show up by now
	if got := f.ops(); !slices.Equal(got, want) {
		t.Fatalf("kvrouterd calls = %q, want %q", got, want)
	}
}
