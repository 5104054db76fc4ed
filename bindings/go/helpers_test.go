package kvrouter

import (
	"errors"
	"testing"
)

const bs = 16 // block size of every test router

// newTestRouter returns a router (default options, block size 16, seeded) with workers
// 1..workers registered, closed when the test ends.
func newTestRouter(t testing.TB, workers int) *Router {
	t.Helper()
	opts := DefaultRouterOptions()
	opts.BlockSize = bs
	opts.RandomSeed = 7
	r, err := NewRouter(&opts)
	if err != nil {
		t.Fatalf("NewRouter: %v", err)
	}
	t.Cleanup(func() { r.Close() })
	for id := 1; id <= workers; id++ {
		if err := r.AddWorker(WorkerConfig{WorkerID: uint64(id)}); err != nil {
			t.Fatalf("AddWorker(%d): %v", id, err)
		}
	}
	return r
}

// prompt returns n tokens base, base+1, ...
func prompt(n int, base uint32) []uint32 {
	p := make([]uint32, n)
	for i := range p {
		p[i] = base + uint32(i)
	}
	return p
}

// storedPrefix is the stored event of the first `blocks` blocks of tokens on a worker, with
// engine hashes derived from the worker id and the block index.
func storedPrefix(worker uint64, tokens []uint32, blocks int) *StoredEvent {
	hashes := make([]uint64, blocks)
	for i := range hashes {
		hashes[i] = worker<<32 | uint64(i+1)
	}
	return &StoredEvent{WorkerID: worker, BlockHashes: hashes, TokenIDs: tokens[:blocks*bs]}
}

// wantCode fails unless err is a kvrouter *Error with the given code and a message.
func wantCode(t testing.TB, err error, code Status) {
	t.Helper()
	if err == nil {
		t.Fatalf("got no error, want %v", code)
	}
	var e *Error
	if !errors.As(err, &e) {
		t.Fatalf("got %T %v, want a *kvrouter.Error", err, err)
	}
	if e.Code() != code || !errors.Is(err, code) || StatusOf(err) != code {
		t.Fatalf("got %v (code %d), want %v", err, int(e.Code()), code)
	}
	if e.Message() == "" {
		t.Fatalf("error %v has no message", err)
	}
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// sendStored publishes one batch of stored events to the ingest listener at bound.
func sendStored(t *testing.T, bound string, events ...*StoredEvent) {
	t.Helper()
	pub, err := ConnectPublisher(bound)
	must(t, err)
	defer pub.Close()
	b, err := NewEventBatch()
	must(t, err)
	defer b.Close()
	for _, e := range events {
		must(t, b.AddStored(e))
	}
	must(t, pub.Send(b))
}
