package kvrouter

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// closeDuringCalls runs call(g, i) on goroutines until each gets ErrClosed, and closes once
// they have made about `after` calls between them (closer); every other error fails the test,
// and so does every goroutine ending before those calls (then nothing is closed).
func closeDuringCalls(t testing.TB, goroutines, after int, call func(g, i int) error, closer func() error) {
	t.Helper()
	var calls atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, goroutines)
	for g := 0; g < goroutines; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := 0; ; i++ {
				calls.Add(1)
				err := call(g, i)
				if err == ErrClosed {
					return
				}
				if err != nil {
					errs <- err
					return
				}
			}
		}(g)
	}
	ended := make(chan struct{})
	go func() { wg.Wait(); close(ended) }()
	for calls.Load() < int64(after) {
		select {
		case <-ended: // every goroutine has ended (errors), before Close: none will call again
			close(errs)
			for err := range errs {
				t.Error(err)
			}
			t.Fatalf("every goroutine ended after %d calls, before the %d that Close waits for", calls.Load(), after)
		default:
			runtime.Gosched()
		}
	}
	must(t, closer())
	<-ended
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}

// failRecorder is a testing.TB for a test of a helper: it records failures, and Fatal ends the
// goroutine as testing's does.
type failRecorder struct {
	testing.TB // nil: only the methods below may be called
	mu         sync.Mutex
	failures   []string
}

func (f *failRecorder) Helper() {}
func (f *failRecorder) Error(args ...any) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.failures = append(f.failures, fmt.Sprint(args...))
}
func (f *failRecorder) Errorf(format string, args ...any) { f.Error(fmt.Sprintf(format, args...)) }
func (f *failRecorder) Fatal(args ...any)                 { f.Error(args...); runtime.Goexit() }
func (f *failRecorder) Fatalf(format string, args ...any) {
	f.Errorf(format, args...)
	runtime.Goexit()
}

// closeDuringCalls fails, rather than waiting for ever, when every goroutine has ended before
// the calls it waits for: here each gets an error at its first call. (Before, it spun for ever.)
func TestCloseDuringCallsEndsWhenTheCallsDo(t *testing.T) {
	rec := new(failRecorder)
	done := make(chan struct{})
	closed := false
	go func() {
		defer close(done)
		closeDuringCalls(rec, 4, 1000, func(g, i int) error { return ErrInvalidArgument },
			func() error { closed = true; return nil })
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("closeDuringCalls still waits 10 s after every goroutine ended")
	}
	if closed {
		t.Error("closeDuringCalls closed, with every goroutine ended")
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if len(rec.failures) < 2 || !strings.Contains(strings.Join(rec.failures, "\n"), ErrInvalidArgument.Error()) {
		t.Errorf("closeDuringCalls reported %q; want the goroutines' errors and the early end", rec.failures)
	}
}

// routingCall is one of a mix of routing calls (book and free, per-rank queries, previews,
// metrics, events) on r, for closeDuringCalls.
func routingCall(r *Router, p []uint32, g, i int) error {
	id := strconv.Itoa(g) + "-" + strconv.Itoa(i)
	var err error
	switch i % 6 {
	case 0, 1:
		_, err = r.FindBestMatch(p, &RequestOptions{Admit: true, RequestID: id})
		if err == nil {
			err = r.FreeRequest(id)
		}
	case 2:
		_, err = r.OverlapScores(p, nil)
	case 3:
		_, err = r.PreviewRoute(p, nil, nil)
	case 4:
		_, err = r.MetricsPrometheus()
	case 5:
		err = r.ApplyStored(storedPrefix(uint64(g%4+1), p, 1+i%4))
		if errors.Is(err, ErrNotFound) {
			err = nil
		}
	}
	return err
}

// Close while many goroutines route, book, free and read the router: every call returns its
// answer or ErrClosed, none runs on the freed router, and the router is freed once the last
// call in flight has returned. (Before, Close freed the C router under the calls that had
// loaded its handle: a use after free, which crashed this test.) The same for a Disagg closed
// while its pool routers route.
func TestCloseWhileRouting(t *testing.T) {
	p := prompt(64, 1)
	for round := 0; round < 30; round++ {
		opts := DefaultRouterOptions()
		opts.BlockSize = bs
		r, err := NewRouter(&opts)
		must(t, err)
		for w := 1; w <= 4; w++ {
			must(t, r.AddWorker(WorkerConfig{WorkerID: uint64(w)}))
		}
		closeDuringCalls(t, 8, 20+round*10, func(g, i int) error { return routingCall(r, p, g, i) }, r.Close)
		if _, err := r.FindBestMatch(p, nil); err != ErrClosed {
			t.Fatalf("after Close: %v", err)
		}
		if !r.ptr.closed() {
			t.Fatalf("round %d: every call has returned, but the router is not freed (state %#x)", round, r.ptr.state.Load())
		}
	}
	for round := 0; round < 10; round++ {
		d, err := NewDisagg(nil, nil, nil)
		must(t, err)
		pools := []*Router{d.PrefillRouter(), d.DecodeRouter()}
		for _, pool := range pools {
			for w := 1; w <= 4; w++ {
				must(t, pool.AddWorker(WorkerConfig{WorkerID: uint64(w)}))
			}
		}
		closeDuringCalls(t, 8, 20+round*10, func(g, i int) error {
			if i%7 == 6 {
				_, err := d.RoutePrefill(p, &RequestOptions{RequestID: "p" + strconv.Itoa(g)}, nil)
				if err == nil {
					err = pools[0].FreeRequest("p" + strconv.Itoa(g))
				}
				return err
			}
			return routingCall(pools[g%2], p, g, i)
		}, d.Close)
		if d.PrefillRouter() != nil || !d.ptr.closed() {
			t.Fatalf("round %d: the Disagg is not freed (state %#x)", round, d.ptr.state.Load())
		}
	}
}

// An Ingest closed while other goroutines read it is freed when the last call returns, and
// then no longer holds its router open.
func TestIngestCloseWhileInUse(t *testing.T) {
	for round := 0; round < 10; round++ {
		r := newTestRouter(t, 1)
		in, err := NewIngest(r, nil)
		must(t, err)
		must(t, in.Start())
		closeDuringCalls(t, 4, 20+round*10, func(g, i int) error {
			if i%2 == 0 {
				_, err := in.Stats(0)
				return err
			}
			_, err := in.MetricsPrometheus()
			return err
		}, in.Close)
		if !in.ptr.closed() {
			t.Fatalf("round %d: the Ingest is not freed (state %#x)", round, in.ptr.state.Load())
		}
		must(t, r.Close())
		if !r.ptr.closed() {
			t.Fatalf("round %d: the router is not freed (state %#x)", round, r.ptr.state.Load())
		}
	}
}

// NewIngest racing Router.Close: either the Ingest is made and Close refuses, or Close
// closes the router and NewIngest returns ErrClosed; never an Ingest on a freed router.
func TestNewIngestRacesClose(t *testing.T) {
	made, refused := 0, 0
	for round := 0; round < 200; round++ {
		r, err := NewRouter(nil)
		must(t, err)
		var in *Ingest
		var newErr, closeErr error
		var wg sync.WaitGroup
		wg.Add(2)
		go func() { defer wg.Done(); in, newErr = NewIngest(r, nil) }()
		go func() { defer wg.Done(); closeErr = r.Close() }()
		wg.Wait()
		switch {
		case newErr == nil && StatusOf(closeErr) == ErrFailedPrecondition:
			made++
			must(t, in.Close())
			must(t, r.Close())
		case newErr == ErrClosed && closeErr == nil:
			refused++
		default:
			t.Fatalf("round %d: NewIngest %v, Close %v", round, newErr, closeErr)
		}
		if !r.ptr.closed() {
			t.Fatalf("round %d: the router is not freed (state %#x)", round, r.ptr.state.Load())
		}
	}
	t.Logf("%d Ingests made first, %d refused", made, refused)
}

// newQueueingRouter returns a router that queues (QueueThreshold 0) with one worker of 16
// batched tokens, and a prompt booked there as "busy": every later request asking to be
// admitted waits in the queue until "busy" is freed or its prefill completes.
func newQueueingRouter(t *testing.T) (*Router, []uint32) {
	t.Helper()
	opts := DefaultRouterOptions()
	opts.BlockSize = bs
	opts.QueueThreshold = 0
	r, err := NewRouter(&opts)
	must(t, err)
	must(t, r.AddWorker(WorkerConfig{WorkerID: 1, MaxNumBatchedTokens: 16}))
	p := prompt(64, 4)
	_, err = r.FindBestMatch(p, &RequestOptions{Admit: true, RequestID: "busy"})
	must(t, err)
	return r, p
}

// startWaiter starts a FindBestMatch that waits in r's queue (no QueueTimeout) under id, and
// returns once the router counts it waiting; its error comes on the channel.
func startWaiter(t *testing.T, r *Router, p []uint32, id string) <-chan error {
	t.Helper()
	done := make(chan error, 1)
	go func() {
		_, err := r.FindBestMatch(p, &RequestOptions{Admit: true, RequestID: id})
		done <- err
	}()
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(time.Millisecond) {
		m, err := r.Metrics()
		must(t, err)
		if m.QueuePending == 1 {
			return done
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s is not waiting in the queue after a minute", id)
		}
	}
}

// waitErr returns what done delivers, failing the test if nothing comes within 10 s (a call
// still blocked in the queue).
func waitErr(t *testing.T, what string, done <-chan error) error {
	t.Helper()
	select {
	case err := <-done:
		return err
	case <-time.After(10 * time.Second):
		t.Fatalf("%s is still blocked in the admission queue 10 s later", what)
		return nil
	}
}

// Close while a request waits in the admission queue with no timeout: the waiter returns
// ErrCancelled at once, and the router is freed when it has returned. (Before, Close left it
// waiting for good: no FreeRequest can admit it after Close, so its goroutine stayed blocked
// and the router allocated.) The same for a Disagg's pools.
func TestCloseCancelsQueueWaiters(t *testing.T) {
	r, p := newQueueingRouter(t)
	done := startWaiter(t, r, p, "waiting")
	must(t, r.Close())
	if err := waitErr(t, "a request waiting at Close", done); !errors.Is(err, ErrCancelled) {
		t.Fatalf("the waiter got %v, want ErrCancelled", err)
	}
	if !r.ptr.closed() {
		t.Fatalf("the waiter has returned, but the router is not freed (state %#x)", r.ptr.state.Load())
	}

	opts := DefaultRouterOptions()
	opts.BlockSize = bs
	opts.QueueThreshold = 0
	d, err := NewDisagg(&opts, &opts, nil)
	must(t, err)
	dec := d.DecodeRouter()
	must(t, dec.AddWorker(WorkerConfig{WorkerID: 1, MaxNumBatchedTokens: 16}))
	_, err = d.RouteDecode(p, &RequestOptions{RequestID: "busy"}, nil, false)
	must(t, err)
	done = startWaiter(t, dec, p, "waiting")
	must(t, d.Close())
	if err := waitErr(t, "a decode request waiting at Disagg.Close", done); !errors.Is(err, ErrCancelled) {
		t.Fatalf("the Disagg's waiter got %v, want ErrCancelled", err)
	}
	if !d.ptr.closed() {
		t.Fatalf("the waiter has returned, but the Disagg is not freed (state %#x)", d.ptr.state.Load())
	}
}

// CloseQueue cancels the waiters and every later request that would wait, and nothing else:
// previews, admissions at once and frees go on.
func TestCloseQueue(t *testing.T) {
	r, p := newQueueingRouter(t)
	defer r.Close()
	done := startWaiter(t, r, p, "waiting")
	n, err := r.CloseQueue()
	must(t, err)
	if n != 1 {
		t.Errorf("CloseQueue cancelled %d requests, want 1", n)
	}
	if err := waitErr(t, "a request waiting at CloseQueue", done); !errors.Is(err, ErrCancelled) {
		t.Fatalf("the waiter got %v, want ErrCancelled", err)
	}
	// A request that would wait is cancelled at once, without a timeout.
	_, err = r.FindBestMatch(p, &RequestOptions{Admit: true, RequestID: "later"})
	if !errors.Is(err, ErrCancelled) {
		t.Fatalf("a request that would wait after CloseQueue: %v, want ErrCancelled", err)
	}
	if n, err := r.CloseQueue(); err != nil || n != 0 {
		t.Errorf("CloseQueue again: %d, %v; want 0, nil", n, err)
	}
	res, err := r.PreviewRoute(p, nil, nil)
	must(t, err)
	if res.WorkerID != 1 {
		t.Errorf("preview after CloseQueue: %+v", res)
	}
	// Freed, the worker admits at once again: that is still routed and booked.
	must(t, r.FreeRequest("busy"))
	res2, err := r.FindBestMatch(p, &RequestOptions{Admit: true, RequestID: "now"})
	must(t, err)
	if !res2.Booked || res2.Queued {
		t.Errorf("a request admitted at once after CloseQueue: %+v", res2)
	}
	must(t, r.FreeRequest("now"))
	m, err := r.Metrics()
	must(t, err)
	if m.QueuePending != 0 || m.RequestsActive != 0 {
		t.Errorf("after the frees: %d waiting, %d active", m.QueuePending, m.RequestsActive)
	}
	must(t, r.Close())
	if _, err := r.CloseQueue(); err != ErrClosed {
		t.Errorf("CloseQueue after Close: %v, want ErrClosed", err)
	}
}

// Close an Ingest while other goroutines scrape it (Stats, MetricsPrometheus): by the time
// Close returns the ingest is stopped, so its listener's port can be bound again at once and
// Router.Close succeeds; both are freed once the last scrape has returned, the router after
// the ingest. (Before, Close left the stop to the free, which the scrape in flight deferred:
// the listener stayed bound and Router.Close refused for an Ingest already closed.)
func TestIngestCloseStopsAtOnce(t *testing.T) {
	for round := 0; round < 20; round++ {
		r := newTestRouter(t, 1)
		in, err := NewIngest(r, nil)
		must(t, err)
		must(t, in.Start())
		_, bound, err := in.Listen("tcp://127.0.0.1:0")
		must(t, err)
		addr := strings.TrimPrefix(bound, "tcp://")
		closeDuringCalls(t, 4, 20+round*10, func(g, i int) error {
			if (g+i)%2 == 0 {
				_, err := in.Stats(0)
				return err
			}
			_, err := in.MetricsPrometheus()
			return err
		}, func() error {
			must(t, in.Close())
			l, err := net.Listen("tcp", addr)
			if err != nil {
				return fmt.Errorf("round %d: the ingest's listener is still bound after Close: %w", round, err)
			}
			l.Close()
			return r.Close()
		})
		if !in.ptr.closed() || !r.ptr.closed() {
			t.Fatalf("round %d: every call has returned, but the Ingest (state %#x) or the router (state %#x) is not freed",
				round, in.ptr.state.Load(), r.ptr.state.Load())
		}
	}
}

// A replica publisher running on an Ingest's own loop thread (its replica heartbeats, the
// publisher SetReplicaPublisher put in place of SyncReplicas') closes that Ingest: Close stops
// it from there (kvr_ingest_stop does not wait on its own thread) and its release is the last,
// but the free, which joins the loop thread, runs on a goroutine of its own; the router, closed
// meanwhile, is freed after it. (Before, the free ran on the loop thread, joining itself: the
// program aborted.) The scenario runs in a child process, this test binary run again, so that
// an abort fails this test only.
func TestIngestClosedFromItsLoopThread(t *testing.T) {
	const childEnv = "KVR_TEST_CLOSE_ON_LOOP_NATS"
	if url := os.Getenv(childEnv); url != "" {
		opts := DefaultRouterOptions()
		opts.BlockSize = bs
		r, err := NewRouter(&opts)
		must(t, err)
		in, err := NewIngest(r, &IngestOptions{ReplicaHeartbeat: 10 * time.Millisecond})
		must(t, err)
		must(t, in.Start())
		_, err = in.SyncReplicas(url, "kvrouter.replicas", "gateway-a")
		must(t, err)
		var armed atomic.Bool
		closed := make(chan error, 1)
		must(t, r.SetReplicaPublisher("gateway-a", func([]byte) {
			if armed.CompareAndSwap(true, false) {
				closed <- in.Close()
			}
		}))
		armed.Store(true) // from now on only the loop calls the publisher: its heartbeats
		select {
		case err := <-closed:
			must(t, err)
		case <-time.After(time.Minute):
			t.Fatal("no heartbeat reached the publisher in a minute")
		}
		// Close from the publisher is asynchronous: the router is refused while the Ingest still
		// feeds it, and closes once that goroutine has stopped it.
		for deadline := time.Now().Add(time.Minute); ; time.Sleep(time.Millisecond) {
			err := r.Close()
			if err == nil {
				break
			}
			if !errors.Is(err, ErrFailedPrecondition) || time.Now().After(deadline) {
				t.Fatalf("Router.Close after the Ingest's Close from its publisher: %v", err)
			}
		}
		for deadline := time.Now().Add(time.Minute); !r.ptr.closed(); time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("the router is not freed a minute after its Ingest's Close (state %#x, the Ingest's %#x)",
					r.ptr.state.Load(), in.ptr.state.Load())
			}
		}
		return
	}
	url := "nats://" + startNATSServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute) // a hang fails
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestIngestClosedFromItsLoopThread$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), childEnv+"="+url)
	out, err := cmd.CombinedOutput()
	if err != nil || !bytes.Contains(out, []byte("--- PASS: TestIngestClosedFromItsLoopThread")) {
		t.Fatalf("the child ended with %v; its output:\n%s", err, out)
	}
}

// Router.Close and CloseQueue take the router's lock, which a replica publisher runs under:
// called from one they refuse (before, the publisher's thread blocked for good, and every
// call on the router with it).
func TestCloseFromAPublisherIsRefused(t *testing.T) {
	r := newTestRouter(t, 1)
	inside := make(chan error, 2)
	routeCallingFromThePublisher(t, r, func() {
		inside <- r.Close()
		_, err := r.CloseQueue()
		inside <- err
	})
	for _, call := range []string{"Close", "CloseQueue"} {
		if err := <-inside; !errors.Is(err, ErrFailedPrecondition) {
			t.Errorf("%s from the publisher: %v, want ErrFailedPrecondition", call, err)
		}
	}
	must(t, r.Close())
}

// SetReplicaPublisher takes the router's replica slot lock, then the router's lock in C: from a
// replica publisher it returns ErrFailedPrecondition before taking either (the library refuses a
// call into the router whose lock the publisher holds). "announcement": the publisher clears
// itself during its own announcement, inside SetReplicaPublisher on the same goroutine (before:
// it waited for the slot lock its own goroutine held); "routing": from a routing call's
// publisher (the library refused it before too); "cross": another goroutine's
// SetReplicaPublisher holds the slot lock, waiting in C for the router's lock the publisher's
// goroutine holds (before: the publisher waited for the slot lock, a deadlock). Each runs in a
// child process, this test binary run again, killed after a minute, so that a deadlock fails
// this test only.
func TestSetReplicaPublisherFromAPublisherIsRefused(t *testing.T) {
	const childEnv = "KVR_TEST_SET_PUBLISHER_IN_PUBLISHER"
	if mode := os.Getenv(childEnv); mode != "" {
		setReplicaPublisherInPublisher(t, mode)
		return
	}
	for _, mode := range []string{"announcement", "routing", "cross"} {
		mode := mode // go 1.21: one variable for every iteration
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute) // a hang fails
			defer cancel()
			cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestSetReplicaPublisherFromAPublisherIsRefused$",
				"-test.count=1", "-test.v")
			cmd.Env = append(os.Environ(), childEnv+"="+mode)
			out, err := cmd.CombinedOutput()
			if ctx.Err() != nil {
				t.Fatalf("the child still ran after a minute (a deadlock); its output:\n%s", out)
			}
			if err != nil || !bytes.Contains(out, []byte("--- PASS: TestSetReplicaPublisherFromAPublisherIsRefused")) {
				t.Fatalf("the child ended with %v; its output:\n%s", err, out)
			}
		})
	}
}

// setReplicaPublisherInPublisher is TestSetReplicaPublisherFromAPublisherIsRefused's child.
func setReplicaPublisherInPublisher(t *testing.T, mode string) {
	r := newTestRouter(t, 1)
	wantRefused := func(err error) {
		t.Helper()
		if !errors.Is(err, ErrFailedPrecondition) {
			t.Fatalf("SetReplicaPublisher from the publisher: %v, want ErrFailedPrecondition", err)
		}
	}
	switch mode {
	case "announcement":
		var calls atomic.Int32
		inside := make(chan error, 1)
		must(t, r.SetReplicaPublisher("gateway-a", func([]byte) {
			if calls.Add(1) == 1 { // the announcement's Reset
				inside <- r.SetReplicaPublisher("gateway-a", nil)
			}
		}))
		wantRefused(<-inside)
		before := calls.Load()
		_, err := r.FindBestMatch(prompt(64, 0), &RequestOptions{RequestID: "r1", Admit: true})
		must(t, err)
		if calls.Load() == before {
			t.Fatal("the publisher was not kept")
		}
		must(t, r.SetReplicaPublisher("gateway-a", nil)) // after the publisher it goes through
		before = calls.Load()                            // the farewell counted
		_, err = r.FindBestMatch(prompt(64, 1000), &RequestOptions{RequestID: "r2", Admit: true})
		must(t, err)
		if calls.Load() != before {
			t.Fatal("a publisher cleared is still called")
		}
	case "routing":
		inside := make(chan error, 1)
		routeCallingFromThePublisher(t, r, func() { inside <- r.SetReplicaPublisher("gateway-b", nil) })
		wantRefused(<-inside)
	case "cross":
		inside := make(chan error, 1)
		other := make(chan error, 1)
		routeCallingFromThePublisher(t, r, func() {
			go func() { other <- r.SetReplicaPublisher("gateway-b", nil) }()
			time.Sleep(500 * time.Millisecond) // it now holds the slot lock, waiting for the router's
			inside <- r.SetReplicaPublisher("gateway-c", nil)
		})
		wantRefused(<-inside)
		select {
		case err := <-other:
			must(t, err)
		case <-time.After(30 * time.Second):
			t.Fatal("the other goroutine's SetReplicaPublisher still waits")
		}
	default:
		t.Fatalf("unknown mode %q", mode)
	}
	must(t, r.Close())
}

// Ingest.Stop from a replica publisher (here one a routing call runs, under the router's lock)
// is asynchronous, as Close: it returns at once, and the ingest is stopped soon after (calls
// that add a source are then refused).
func TestIngestStopFromAPublisherIsAsynchronous(t *testing.T) {
	r := newTestRouter(t, 1)
	in, err := NewIngest(r, nil)
	must(t, err)
	must(t, in.Start())
	stopped := make(chan error, 1)
	routeCallingFromThePublisher(t, r, func() { stopped <- in.Stop() })
	must(t, <-stopped)
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(time.Millisecond) {
		_, _, err := in.Listen("tcp://127.0.0.1:0")
		if errors.Is(err, ErrFailedPrecondition) {
			break
		}
		if err != nil || time.Now().After(deadline) {
			t.Fatalf("Listen after the publisher's Stop: %v, want ErrFailedPrecondition once stopped", err)
		}
	}
	must(t, in.Close())
	must(t, r.Close())
}

// routeCallingFromThePublisher books a request on r with a replica publisher that runs inside
// once: on the routing call's goroutine, under the router's lock.
func routeCallingFromThePublisher(t *testing.T, r *Router, inside func()) {
	t.Helper()
	var armed atomic.Bool
	must(t, r.SetReplicaPublisher("gateway-a", func([]byte) {
		if armed.CompareAndSwap(true, false) {
			inside()
		}
	}))
	armed.Store(true)
	within(t, "FindBestMatch whose publisher calls back", func() error {
		_, err := r.FindBestMatch(prompt(64, 0), &RequestOptions{RequestID: "r1", Admit: true})
		return err
	})
}
