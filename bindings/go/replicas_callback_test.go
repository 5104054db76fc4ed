//go:build cgo

package kvrouter

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// callRecovering runs call and returns what it panicked with (nil if it returned).
func callRecovering(call func()) (recovered any) {
	defer func() { recovered = recover() }()
	call()
	return nil
}

// within runs call on another goroutine and fails the test if it has not returned after a
// generous deadline (a call blocked on a lock that is never released).
func within(t *testing.T, what string, call func() error) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- call() }()
	select {
	case err := <-done:
		must(t, err)
	case <-time.After(2 * time.Minute):
		t.Fatalf("%s did not return within 2 minutes: a lock is still held", what)
	}
}

// A publisher that panics, called under the router's lock from an admitted FindBestMatch: the
// panic reaches FindBestMatch's caller once the library has returned, so the lock is released
// and the router keeps working (here: the next call, FreeRequest, returns).
func TestReplicaPublisherPanicReachesTheCaller(t *testing.T) {
	opts := DefaultRouterOptions()
	opts.BlockSize = bs
	r, err := NewRouter(&opts)
	must(t, err)
	must(t, r.AddWorker(WorkerConfig{WorkerID: 1}))
	var armed atomic.Bool
	var published atomic.Int32
	must(t, r.SetReplicaPublisher("gateway-a", func([]byte) {
		if armed.CompareAndSwap(true, false) {
			panic("publisher failed")
		}
		published.Add(1)
	}))
	armed.Store(true)
	got := callRecovering(func() {
		r.FindBestMatch(prompt(64, 0), &RequestOptions{RequestID: "r1", Admit: true})
	})
	if got != "publisher failed" {
		t.Errorf("FindBestMatch's caller recovered %v, want the publisher's panic", got)
	}
	before := published.Load()
	// Without the recovery in the callback the panic unwinds through the library's frames,
	// skipping its lock guard: this call then blocks for ever (the router is leaked, not
	// closed, so that the test ends).
	within(t, "FreeRequest after the publisher's panic", func() error { return r.FreeRequest("r1") })
	if published.Load() != before+1 {
		t.Errorf("the free published %d changes, want 1", published.Load()-before)
	}
	if n := publishPanics.pending.Load(); n != 0 {
		t.Errorf("%d recovered panics left waiting for their caller", n)
	}
	must(t, r.Close())
}

// A publisher installed by SetReplicaPublisher runs inside it (the announcement: Reset,
// bookings, SyncRequest), and a replaced one too (its farewell): their panics reach the caller
// of SetReplicaPublisher, after the new callback is recorded as the one the library holds.
func TestReplicaPublisherPanicInSetReplicaPublisher(t *testing.T) {
	r := newTestRouter(t, 1)
	var calls atomic.Int32
	got := callRecovering(func() {
		r.SetReplicaPublisher("gateway-a", func([]byte) {
			if calls.Add(1) == 1 {
				panic("announcement failed")
			}
		})
	})
	if got != "announcement failed" {
		t.Fatalf("SetReplicaPublisher's caller recovered %v, want the announcement's panic", got)
	}
	// The library kept the callback: the next booking reaches it.
	before := calls.Load()
	must(t, r.AddRequest(prompt(32, 0), 1, 0, &RequestOptions{RequestID: "r1"}))
	if calls.Load() != before+1 {
		t.Errorf("the booking reached the installed publisher %d times, want 1", calls.Load()-before)
	}
	// A farewell that panics: the replacement is installed all the same.
	var leaving atomic.Bool
	must(t, r.SetReplicaPublisher("gateway-a", func([]byte) {
		if leaving.Load() {
			panic(fmt.Errorf("farewell failed"))
		}
	}))
	leaving.Store(true)
	var second atomic.Int32
	got = callRecovering(func() {
		r.SetReplicaPublisher("gateway-b", func([]byte) { second.Add(1) })
	})
	if err, _ := got.(error); err == nil || err.Error() != "farewell failed" {
		t.Fatalf("SetReplicaPublisher's caller recovered %v, want the farewell's panic", got)
	}
	before = second.Load()
	must(t, r.FreeRequest("r1"))
	if second.Load() != before+1 {
		t.Errorf("the free reached the new publisher %d times, want 1", second.Load()-before)
	}
	if n := publishPanics.pending.Load(); n != 0 {
		t.Errorf("%d recovered panics left waiting for their caller", n)
	}
}

// A panic is re-raised on the goroutine whose call ran the callback, never on another one
// calling the same router at the same time.
func TestReplicaPublisherPanicStaysWithItsGoroutine(t *testing.T) {
	r := newTestRouter(t, 2)
	// A change names its request: the publisher fails those of the "boom-" requests alone.
	must(t, r.SetReplicaPublisher("gateway-a", func(data []byte) {
		if bytes.Contains(data, []byte("boom-")) {
			panic("boom")
		}
	}))
	const n = 2000
	var wg sync.WaitGroup
	errs := make(chan string, 4*n)
	wg.Add(2)
	go func() {
		defer wg.Done()
		for i := 0; i < n; i++ {
			id := fmt.Sprint("boom-", i)
			if got := callRecovering(func() { r.AddRequest(prompt(32, 0), 1, 0, &RequestOptions{RequestID: id}) }); got != "boom" {
				errs <- fmt.Sprintf("AddRequest(%s) recovered %v, want boom", id, got)
			}
			if got := callRecovering(func() { r.FreeRequest(id) }); got != "boom" {
				errs <- fmt.Sprintf("FreeRequest(%s) recovered %v, want boom", id, got)
			}
		}
	}()
	go func() {
		defer wg.Done()
		for i := 0; i < n; i++ {
			id := fmt.Sprint("calm-", i)
			if got := callRecovering(func() {
				if err := r.AddRequest(prompt(32, 500), 2, 0, &RequestOptions{RequestID: id}); err != nil {
					errs <- err.Error()
				}
				if err := r.FreeRequest(id); err != nil {
					errs <- err.Error()
				}
			}); got != nil {
				errs <- fmt.Sprintf("%s: another goroutine's panic surfaced here: %v", id, got)
			}
		}
	}()
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
	if m, err := r.Metrics(); err != nil || m.RequestsActive != 0 {
		t.Errorf("after every free: %+v, %v", m, err)
	}
	if n := publishPanics.pending.Load(); n != 0 {
		t.Errorf("%d recovered panics left waiting for their caller", n)
	}
}

// Two goroutines replacing the publisher at once: the callback the library holds at the end
// must still be alive in Go (its handle not deleted), and be the last one installed.
func TestReplicaPublisherSetConcurrently(t *testing.T) {
	// Closed only if the test passes: a callback's panic unwinding through the library would
	// leave its lock held, and Close would block.
	r, err := NewRouter(nil)
	must(t, err)
	must(t, r.AddWorker(WorkerConfig{WorkerID: 1}))
	const n = 5000
	var last [2]atomic.Int64 // per setter: the number of its publisher last installed
	var called atomic.Int64  // which publisher the booking reached: setter<<32 | number
	var wg sync.WaitGroup
	errs := make(chan string, 2)
	for s := int64(0); s < 2; s++ {
		wg.Add(1)
		s := s
		go func() {
			defer wg.Done()
			for i := int64(0); i < n; i++ {
				me := s<<32 | i
				var err error
				if got := callRecovering(func() {
					err = r.SetReplicaPublisher(fmt.Sprint("setter-", s), func([]byte) { called.Store(me) })
				}); got != nil || err != nil {
					errs <- fmt.Sprintf("setter %d, publisher %d: panic %v, error %v", s, i, got, err)
					return
				}
				last[s].Store(i)
			}
		}()
	}
	within(t, "the setters", func() error { wg.Wait(); return nil })
	close(errs)
	for e := range errs {
		t.Fatal(e)
	}
	called.Store(-1)
	within(t, "the booking", func() error {
		if got := callRecovering(func() {
			err = r.AddRequest(prompt(32, 0), 1, 0, &RequestOptions{RequestID: "r1"})
		}); got != nil {
			return fmt.Errorf("the booking panicked: %v", got)
		}
		return err
	})
	c := called.Load()
	if c < 0 || c&(1<<32-1) != n-1 || last[c>>32].Load() != n-1 {
		t.Errorf("the booking reached publisher %d of setter %d, want the last (%d) of either", c&(1<<32-1), c>>32, n-1)
	}
	must(t, r.Close())
}

// A publisher set on a pool router of a Disagg is released when the Disagg is closed, and
// one set on a Router that is never closed when the Router is collected: neither keeps its
// owner, nor its closure, alive.
func TestReplicaPublisherIsReleasedWithItsOwner(t *testing.T) {
	// sentinel is big enough to have an allocation (and a finalizer) of its own.
	type sentinel struct{ _ [64]byte }
	watch := func() (*sentinel, <-chan struct{}) {
		s, freed := new(sentinel), make(chan struct{})
		runtime.SetFinalizer(s, func(*sentinel) { close(freed) })
		return s, freed
	}
	collected := func(t *testing.T, freed <-chan struct{}) {
		t.Helper()
		for deadline := time.Now().Add(time.Minute); ; {
			runtime.GC()
			select {
			case <-freed:
				return
			default:
			}
			if time.Now().After(deadline) {
				t.Fatal("the publisher's closure is still alive after a minute of garbage collections")
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	t.Run("DisaggClosed", func(t *testing.T) {
		freed := func() <-chan struct{} {
			d, err := NewDisagg(nil, nil, nil)
			must(t, err)
			s, freed := watch()
			must(t, d.PrefillRouter().SetReplicaPublisher("prefill", func([]byte) { runtime.KeepAlive(s) }))
			must(t, d.DecodeRouter().SetReplicaPublisher("decode", func([]byte) {}))
			must(t, d.Close())
			return freed
		}()
		collected(t, freed)
	})
	t.Run("DisaggDropped", func(t *testing.T) {
		freed := func() <-chan struct{} {
			d, err := NewDisagg(nil, nil, nil)
			must(t, err)
			s, freed := watch()
			must(t, d.DecodeRouter().SetReplicaPublisher("decode", func([]byte) { runtime.KeepAlive(s) }))
			return freed
		}()
		collected(t, freed)
	})
	t.Run("RouterDropped", func(t *testing.T) {
		freed := func() <-chan struct{} {
			r, err := NewRouter(nil)
			must(t, err)
			s, freed := watch()
			must(t, r.SetReplicaPublisher("gateway-a", func([]byte) { runtime.KeepAlive(s) }))
			return freed
		}()
		collected(t, freed)
	})
}

// A publisher that panics on a thread of the library's (an Ingest's loop: here the heartbeat
// of a NATS replica sync whose publisher SetReplicaPublisher replaced), with no goroutine
// waiting for it: the panic is not recovered, and ends the program as any other would. The
// program is this test binary run again, in a child process.
func TestReplicaPublisherPanicOnALibraryThreadEndsTheProgram(t *testing.T) {
	const childEnv = "KVR_TEST_PUBLISH_PANIC_NATS"
	if url := os.Getenv(childEnv); url != "" {
		r := newTestRouter(t, 1)
		in, err := NewIngest(r, &IngestOptions{ReplicaHeartbeat: 10 * time.Millisecond})
		must(t, err)
		defer in.Close()
		must(t, in.Start())
		_, err = in.SyncReplicas(url, "kvrouter.replicas", "gateway-a")
		must(t, err)
		var armed atomic.Bool
		must(t, r.SetReplicaPublisher("gateway-a", func([]byte) {
			if armed.Load() {
				panic("publisher failed on a library thread")
			}
		}))
		armed.Store(true) // from now on only the loop calls the publisher: its heartbeats
		time.Sleep(time.Minute)
		t.Fatal("the program survived a minute of heartbeats through a publisher that panics")
	}
	url := "nats://" + startNATSServer(t)
	cmd := exec.Command(os.Args[0], "-test.run=^TestReplicaPublisherPanicOnALibraryThreadEndsTheProgram$", "-test.count=1")
	cmd.Env = append(os.Environ(), childEnv+"="+url)
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 2 ||
		!bytes.Contains(out, []byte("panic: publisher failed on a library thread")) ||
		!bytes.Contains(out, []byte("kvrGoReplicaPublish")) {
		t.Fatalf("the child ended with %v, want exit status 2 from the publisher's panic; its output:\n%s", err, out)
	}
}
