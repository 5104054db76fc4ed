package kvrouter

import (
	"errors"
	"math"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestPreviewPlanCommitAbort(t *testing.T) {
	r := newTestRouter(t, 3)
	p := prompt(48, 9)
	must(t, r.ApplyStored(storedPrefix(3, p, 2)))
	before, err := r.StateDigest()
	must(t, err)
	var preview RouteSignals
	for i := 0; i < 100; i++ {
		preview, err = r.PreviewRoute(p, &RequestOptions{Admit: true, RequestID: "r1"}, nil)
		must(t, err)
	}
	if preview.WorkerID != 3 || preview.OverlapBlocks != 2 || preview.PromptBlocks != 3 ||
		preview.CachedTokens != 32 || preview.Booked || preview.PromptTokens != 48 {
		t.Fatalf("preview %+v", preview)
	}
	if after, _ := r.StateDigest(); after != before {
		t.Fatal("a preview changed the routing state")
	}
	plan, err := r.PlanRoute(p, &RequestOptions{RequestID: "r1"}, nil, &preview)
	must(t, err)
	if !plan.Booked || plan.Moved || plan.WorkerID != 3 {
		t.Fatalf("plan %+v", plan)
	}
	planned, _ := r.StateDigest()
	if planned == before {
		t.Fatal("a plan left the digest unchanged")
	}
	again, err := r.PlanRoute(p, &RequestOptions{RequestID: "r1"}, nil, nil)
	must(t, err)
	if again.WorkerID != plan.WorkerID { // idempotent: the live plan
		t.Errorf("re-plan %+v", again)
	}
	must(t, r.CommitRoute("r1"))
	must(t, r.CommitRoute("r1")) // idempotent
	wantCode(t, r.CommitRoute("never-planned"), ErrNotFound)
	_, err = r.PlanRoute(p, &RequestOptions{RequestID: "r1"}, nil, nil)
	wantCode(t, err, ErrAlreadyExists) // active without a plan
	_, err = r.PlanRoute(p, nil, nil, nil)
	wantCode(t, err, ErrInvalidArgument) // no request id

	// A plan that is aborted frees its booking.
	_, err = r.PlanRoute(p, &RequestOptions{RequestID: "r2"}, nil, nil)
	must(t, err)
	freed, err := r.AbortRoute("r2")
	must(t, err)
	if !freed {
		t.Error("abort freed nothing")
	}
	freed, err = r.AbortRoute("r2")
	if err != nil || freed {
		t.Errorf("second abort: %v %v", freed, err)
	}
	wantCode(t, r.CommitRoute("r2"), ErrNotFound)

	// The moved flag: the previewed rank is gone.
	stale := preview
	stale.WorkerID = 3
	must(t, r.RemoveWorker(3))
	moved, err := r.PlanRoute(p, &RequestOptions{RequestID: "r3"}, nil, &stale)
	must(t, err)
	if !moved.Moved || moved.WorkerID == 3 {
		t.Errorf("plan after removal %+v", moved)
	}
	m, err := r.Metrics()
	must(t, err)
	if m.RequestsActive != 1 { // r3 (planned); r1 went with worker 3
		t.Errorf("RequestsActive %d", m.RequestsActive)
	}
}

// Replicas compare index digests: two routers holding the same blocks agree, and a booking
// moves the state digest but not the index digest.
func TestIndexDigest(t *testing.T) {
	a := newTestRouter(t, 2)
	b := newTestRouter(t, 2)
	p := prompt(48, 3)
	must(t, a.ApplyStored(storedPrefix(1, p, 3)))
	must(t, a.ApplyStored(storedPrefix(2, p, 1)))
	must(t, b.ApplyStored(storedPrefix(2, p, 1))) // the other order
	must(t, b.ApplyStored(storedPrefix(1, p, 3)))
	da, err := a.IndexDigest()
	must(t, err)
	if db, _ := b.IndexDigest(); db != da {
		t.Fatalf("index digests %x and %x of the same blocks", da, db)
	}

	state, err := a.StateDigest()
	must(t, err)
	_, err = a.FindBestMatch(p, &RequestOptions{Admit: true, RequestID: "booked"})
	must(t, err)
	if after, _ := a.StateDigest(); after == state {
		t.Error("a booking left the state digest unchanged")
	}
	if after, _ := a.IndexDigest(); after != da {
		t.Error("a booking changed the index digest")
	}

	must(t, b.Close())
	if _, err := b.IndexDigest(); err != ErrClosed {
		t.Errorf("IndexDigest after Close: %v", err)
	}
}

func TestPlanDeadline(t *testing.T) {
	r := newTestRouter(t, 2)
	p := prompt(32, 1)
	wantCode(t, r.SetPlanDeadline(0), ErrInvalidArgument)
	wantCode(t, r.SetPlanDeadline(-time.Second), ErrInvalidArgument)
	must(t, r.SetTime(0)) // time passes when the test says: a stalled test sees no expiry early
	must(t, r.SetPlanDeadline(time.Millisecond))
	_, err := r.PlanRoute(p, &RequestOptions{RequestID: "late"}, nil, nil)
	must(t, err)
	must(t, r.SetTime(int64(20*time.Millisecond)))
	n, err := r.ExpirePlans()
	must(t, err)
	if n != 1 {
		t.Fatalf("expired %d plans, want 1", n)
	}
	wantCode(t, r.CommitRoute("late"), ErrNotFound)
	must(t, r.SetPlanDeadline(time.Hour))
	_, err = r.PlanRoute(p, &RequestOptions{RequestID: "ok"}, nil, nil)
	must(t, err)
	if n, _ := r.ExpirePlans(); n != 0 {
		t.Errorf("expired %d fresh plans", n)
	}
	must(t, r.CommitRoute("ok"))
}

// A request whose FreeRequest was lost ("busy", never freed) holds the only worker, and with a
// queue threshold every later request waits behind it. ExpireRequests leaves it alone until it
// is older than RequestExpiry (the default); then it drops it and admits the waiter, with no
// routing call coming meanwhile to do it.
func TestExpireRequestsAdmitsTheWaiterOfALostRequest(t *testing.T) {
	r, p := newQueueingRouter(t)
	defer r.Close()
	must(t, r.SetTime(0)) // the router's time goes on from "busy"'s booking, by hand from now
	done := startWaiter(t, r, p, "waiting")
	n, err := r.ExpireRequests()
	must(t, err)
	if n != 0 {
		t.Fatalf("ExpireRequests dropped %d requests before their expiry, want 0", n)
	}
	must(t, r.SetTime(int64(DefaultRouterOptions().RequestExpiry+time.Second)))
	n, err = r.ExpireRequests()
	must(t, err)
	if n != 1 {
		t.Fatalf("ExpireRequests dropped %d requests past their expiry, want 1", n)
	}
	if err := waitErr(t, "the request waiting behind the lost one", done); err != nil {
		t.Fatalf("the waiter got %v, want it admitted", err)
	}
	m, err := r.Metrics()
	must(t, err)
	if m.RequestsActive != 1 || m.QueuePending != 0 {
		t.Fatalf("after the expiry: %d active (want the waiter's alone), %d waiting", m.RequestsActive, m.QueuePending)
	}
	if n, err := r.ExpireRequests(); err != nil || n != 0 {
		t.Errorf("ExpireRequests again: %d, %v; want 0, nil", n, err)
	}
	// "busy"'s load is gone: once the waiter is freed, the worker admits at once, and the lost
	// request's id is free to book again (no ErrAlreadyExists).
	must(t, r.FreeRequest("waiting"))
	res, err := r.FindBestMatch(p, &RequestOptions{Admit: true, RequestID: "busy"})
	must(t, err)
	if !res.Booked || res.Queued {
		t.Errorf("\"busy\" booked again after its expiry: %+v", res)
	}
	must(t, r.Close())
	if _, err := r.ExpireRequests(); err != ErrClosed {
		t.Errorf("ExpireRequests after Close: %v, want ErrClosed", err)
	}
}

// ExpireRequests from a replica publisher, which runs under the router's lock, is refused by
// the library (ErrFailedPrecondition), as every call on its own router is.
func TestExpireRequestsFromAPublisherIsRefused(t *testing.T) {
	r := newTestRouter(t, 1)
	inside := make(chan error, 1)
	routeCallingFromThePublisher(t, r, func() {
		_, err := r.ExpireRequests()
		inside <- err
	})
	if err := <-inside; !errors.Is(err, ErrFailedPrecondition) {
		t.Errorf("ExpireRequests from the publisher: %v, want ErrFailedPrecondition", err)
	}
	if _, err := r.ExpireRequests(); err != nil {
		t.Errorf("ExpireRequests after the publisher returned: %v", err)
	}
}

func TestPinsAndSessions(t *testing.T) {
	r := newTestRouter(t, 3)
	must(t, r.UpdateWorker(WorkerConfig{WorkerID: 2, DPSize: 2}))
	p := prompt(48, 1)
	must(t, r.ApplyStored(storedPrefix(1, p, 3)))

	s, err := r.PreviewRoute(p, nil, &RoutingHints{WorkerID: Ptr(uint64(2)), DPRank: Ptr(uint32(1))})
	must(t, err)
	if s.WorkerID != 2 || s.DPRank != 1 {
		t.Errorf("pinned preview %+v", s)
	}
	_, err = r.PreviewRoute(p, nil, &RoutingHints{WorkerID: Ptr(uint64(99))})
	wantCode(t, err, ErrNotFound)
	_, err = r.PreviewRoute(p, nil, &RoutingHints{WorkerID: Ptr(uint64(2)), DPRank: Ptr(uint32(7))})
	wantCode(t, err, ErrNotFound)
	_, err = r.PreviewRoute(p, &RequestOptions{AllowedWorkerIDs: []uint64{1}}, &RoutingHints{WorkerID: Ptr(uint64(2))})
	wantCode(t, err, ErrInvalidArgument)
	// Phase pins: a decode-phase request follows DecodeWorkerID.
	s, err = r.PreviewRoute(p, nil, &RoutingHints{Phase: PhaseDecode, DecodeWorkerID: Ptr(uint64(3)), PrefillWorkerID: Ptr(uint64(2))})
	must(t, err)
	if s.WorkerID != 3 {
		t.Errorf("decode pin %+v", s)
	}
	s, err = r.PreviewRoute(p, nil, &RoutingHints{Phase: PhasePrefill, PrefillWorkerID: Ptr(uint64(2)), PrefillDPRank: Ptr(uint32(1))})
	must(t, err)
	if s.WorkerID != 2 || s.DPRank != 1 {
		t.Errorf("prefill pin %+v", s)
	}

	// A session is bound at commit, to the pinned rank, and then followed without the pin.
	hints := &RoutingHints{SessionID: "conv-1", WorkerID: Ptr(uint64(3))}
	_, _, err = r.SessionBinding("conv-1")
	wantCode(t, err, ErrNotFound)
	_, err = r.PlanRoute(p, &RequestOptions{RequestID: "t1"}, hints, nil)
	must(t, err)
	_, _, err = r.SessionBinding("conv-1")
	wantCode(t, err, ErrNotFound) // a plan does not bind
	must(t, r.CommitRoute("t1"))
	w, d, err := r.SessionBinding("conv-1")
	must(t, err)
	if w != 3 || d != 0 {
		t.Fatalf("bound to %d/%d, want 3/0", w, d)
	}
	s, err = r.PreviewRoute(p, nil, &RoutingHints{SessionID: "conv-1"})
	must(t, err)
	if s.WorkerID != 3 { // worker 1 holds the prefix, but the session is hard-bound to 3
		t.Errorf("session preview %+v", s)
	}
	must(t, r.CloseSession("conv-1"))
	must(t, r.CloseSession("conv-1"))
	_, _, err = r.SessionBinding("conv-1")
	wantCode(t, err, ErrNotFound)

	// A short TTL expires; reclaiming drops it. Time passes when the test says.
	must(t, r.SetTime(0))
	short := &RoutingHints{SessionID: "conv-2", SessionMode: SessionSoft, SessionTTL: 250 * time.Millisecond}
	_, err = r.FindBestMatch(p, &RequestOptions{Admit: true, RequestID: "t2"})
	must(t, err)
	_, err = r.PlanRoute(p, &RequestOptions{RequestID: "t3"}, short, nil)
	must(t, err)
	must(t, r.CommitRoute("t3"))
	if _, _, err := r.SessionBinding("conv-2"); err != nil {
		t.Fatal(err)
	}
	must(t, r.SetTime(int64(400*time.Millisecond)))
	_, _, err = r.SessionBinding("conv-2")
	wantCode(t, err, ErrNotFound)
	n, err := r.ReclaimSessions()
	must(t, err)
	if n != 1 {
		t.Errorf("reclaimed %d sessions, want 1", n)
	}
}

// A rank pin travels as int32_t, where negative means "no pin": a rank above math.MaxInt32
// wrapped to a negative and ran unpinned. It is refused; MaxInt32 itself reaches the library
// (an unregistered rank: ErrNotFound).
func TestRankPinsOutOfRange(t *testing.T) {
	r := newTestRouter(t, 2)
	must(t, r.UpdateWorker(WorkerConfig{WorkerID: 2, DPSize: 2}))
	p := prompt(48, 1)
	for _, rank := range []uint32{math.MaxInt32 + 1, math.MaxUint32} {
		_, err := r.PreviewRoute(p, nil, &RoutingHints{WorkerID: Ptr(uint64(2)), DPRank: Ptr(rank)})
		wantCode(t, err, ErrInvalidArgument)
		if !strings.Contains(err.Error(), "RoutingHints.DPRank") {
			t.Errorf("DPRank %d: %v does not name the field", rank, err)
		}
		_, err = r.PlanRoute(p, &RequestOptions{RequestID: "a"}, &RoutingHints{Phase: PhasePrefill,
			PrefillWorkerID: Ptr(uint64(2)), PrefillDPRank: Ptr(rank)}, nil)
		wantCode(t, err, ErrInvalidArgument)
		if !strings.Contains(err.Error(), "RoutingHints.PrefillDPRank") {
			t.Errorf("PrefillDPRank %d: %v does not name the field", rank, err)
		}
	}
	_, err := r.PreviewRoute(p, nil, &RoutingHints{WorkerID: Ptr(uint64(2)), DPRank: Ptr(uint32(math.MaxInt32))})
	wantCode(t, err, ErrNotFound)
	if m, _ := r.Metrics(); m.RequestsActive != 0 {
		t.Errorf("a refused plan booked: %d active", m.RequestsActive)
	}
}

func TestDisagg(t *testing.T) {
	opts := DefaultRouterOptions()
	opts.BlockSize = bs
	d, err := NewDisagg(&opts, &opts, nil)
	must(t, err)
	defer d.Close()
	pre, dec := d.PrefillRouter(), d.DecodeRouter()
	p := prompt(64, 1)

	// No prefill workers: aggregated on the decode pool.
	must(t, dec.AddWorker(WorkerConfig{WorkerID: 10}))
	must(t, dec.AddWorker(WorkerConfig{WorkerID: 11}))
	where, err := d.RoutePrefill(p, &RequestOptions{RequestID: "a"}, nil)
	must(t, err)
	if where.Remote || where.Reason != PrefillNoPrefillWorkers || where.BootstrapRoom != -1 {
		t.Errorf("no prefill pool: %+v", where)
	}
	busy, err := d.PrefillWorkerBusy(p, nil, 1.0)
	must(t, err)
	if !busy {
		t.Error("an empty prefill pool counts as busy")
	}

	must(t, pre.AddWorker(WorkerConfig{WorkerID: 1, MaxNumBatchedTokens: 100}))
	must(t, pre.AddWorker(WorkerConfig{WorkerID: 2, MaxNumBatchedTokens: 100}))
	must(t, pre.ApplyStored(storedPrefix(2, p, 3)))
	where, err = d.RoutePrefill(p, &RequestOptions{RequestID: "b"}, nil)
	must(t, err)
	if !where.Remote || where.Reason != PrefillRemote || where.WorkerID != 2 || where.BootstrapRoom < 0 || where.CachedTokens != 48 {
		t.Fatalf("remote prefill %+v", where)
	}
	sig, err := d.RouteDecode(p, &RequestOptions{RequestID: "b"}, nil, true)
	must(t, err)
	if !sig.Booked || (sig.WorkerID != 10 && sig.WorkerID != 11) {
		t.Errorf("decode %+v", sig)
	}
	// A fresh 64-token prompt goes to idle worker 1 (worker 2 prefills "b"): 64 prefill
	// tokens against 100 batched tokens.
	for _, c := range []struct {
		threshold float64
		want      bool
	}{{0.9, false}, {0.5, true}} {
		busy, err = d.PrefillWorkerBusy(prompt(64, 5000), nil, c.threshold)
		must(t, err)
		if busy != c.want {
			t.Errorf("PrefillWorkerBusy(threshold %v) = %v", c.threshold, busy)
		}
	}
	must(t, pre.FreeRequest("b"))
	must(t, dec.FreeRequest("b"))
	pm, _ := pre.Metrics()
	dm, _ := dec.Metrics()
	if pm.RequestsActive != 0 || dm.RequestsActive != 0 || pm.Workers != 2 || dm.Workers != 2 {
		t.Errorf("pools after free: %+v / %+v", pm, dm)
	}
	// A pool router is not closed by its own Close, and dies with the Disagg.
	must(t, pre.Close())
	if _, err := pre.Metrics(); err != nil {
		t.Fatalf("pool router closed by its own Close: %v", err)
	}
	must(t, d.Close())
	must(t, d.Close())
	if _, err := pre.Metrics(); !errors.Is(err, ErrClosed) {
		t.Errorf("pool router after Disagg.Close: %v", err)
	}
	if d.DecodeRouter() != nil {
		t.Error("DecodeRouter after Close")
	}
	if _, err := d.RoutePrefill(p, nil, nil); !errors.Is(err, ErrClosed) {
		t.Errorf("RoutePrefill after Close: %v", err)
	}

	// Enforced disaggregation refuses to run without prefill workers; ISL bounding prefills a
	// short uncached prompt locally.
	do := DefaultDisaggOptions()
	if do.Policy != DisaggAlways || do.MaxLocalPrefillTokens != 512 || do.DecodeBusyThreshold >= 0 {
		t.Errorf("disagg defaults %+v", do)
	}
	do.Enforce = true
	e, err := NewDisagg(nil, nil, &do)
	must(t, err)
	defer e.Close()
	must(t, e.DecodeRouter().AddWorker(WorkerConfig{WorkerID: 1}))
	_, err = e.RoutePrefill(p, &RequestOptions{RequestID: "x"}, nil)
	wantCode(t, err, ErrFailedPrecondition)

	do = DefaultDisaggOptions()
	do.Policy = DisaggISLBounding
	do.DecodeBusyThreshold = 0.9
	f, err := NewDisagg(nil, nil, &do)
	must(t, err)
	defer f.Close()
	must(t, f.PrefillRouter().AddWorker(WorkerConfig{WorkerID: 1}))
	must(t, f.DecodeRouter().AddWorker(WorkerConfig{WorkerID: 2, TotalKVBlocks: 1000}))
	where, err = f.RoutePrefill(p, &RequestOptions{RequestID: "y"}, nil)
	must(t, err)
	if where.Remote || where.Reason != PrefillShortISL {
		t.Errorf("ISL bounding: %+v", where)
	}
	sig, err = f.RouteDecode(p, &RequestOptions{RequestID: "y"}, nil, false)
	must(t, err)
	if sig.WorkerID != 2 || sig.TotalKVBlocks != 1000 {
		t.Errorf("local decode %+v", sig)
	}
}

func TestCloseIsIdempotentAndSafe(t *testing.T) {
	r, err := NewRouter(nil)
	must(t, err)
	must(t, r.Close())
	must(t, r.Close())
	if _, err := r.FindBestMatch(prompt(16, 1), nil); !errors.Is(err, ErrClosed) || !errors.Is(err, ErrFailedPrecondition) {
		t.Errorf("FindBestMatch after Close: %v", err)
	}
	if err := r.AddWorker(WorkerConfig{WorkerID: 1}); err != ErrClosed {
		t.Errorf("AddWorker after Close: %v", err)
	}
	if _, err := NewIngest(r, nil); err != ErrClosed {
		t.Errorf("NewIngest on a closed router: %v", err)
	}
	var nilRouter *Router
	if err := nilRouter.Close(); err != nil {
		t.Error(err)
	}
	if _, err := nilRouter.Metrics(); err != ErrClosed {
		t.Error(err)
	}

	// Many goroutines closing the same handles at once: exactly one free each.
	for i := 0; i < 20; i++ {
		r, err := NewRouter(nil)
		must(t, err)
		d, err := NewDisagg(nil, nil, nil)
		must(t, err)
		var wg sync.WaitGroup
		for g := 0; g < 4; g++ {
			wg.Add(1)
			go func() { defer wg.Done(); r.Close(); d.Close() }()
		}
		wg.Wait()
	}

	b, err := NewEventBatch()
	must(t, err)
	must(t, b.Close())
	must(t, b.Close())
	if b.Len() != 0 || b.AddCleared(1, 0, 0) != ErrClosed {
		t.Error("EventBatch after Close")
	}
	if _, err := b.Encode(); err != ErrClosed {
		t.Error(err)
	}
	b.Clear()

	// Forgotten handles are freed by their finalizers (this must not crash).
	for i := 0; i < 50; i++ {
		r, _ := NewRouter(nil)
		_ = r.AddWorker(WorkerConfig{WorkerID: 1})
		b, _ := NewEventBatch()
		_ = b.AddCleared(1, 0, 0)
		d, _ := NewDisagg(nil, nil, nil)
		_ = d.PrefillRouter()
	}
	runtime.GC()
	runtime.GC()
}

// Many goroutines route, book, free, apply events and read metrics on one router at once.
func TestConcurrentUse(t *testing.T) {
	const goroutines, iterations, workers = 16, 200, 8
	r := newTestRouter(t, workers)
	shared := prompt(256, 1)
	var wg sync.WaitGroup
	errs := make(chan error, goroutines)
	for g := 0; g < goroutines; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			mine := prompt(128, uint32(1_000_000*(g+1)))
			for i := 0; i < iterations; i++ {
				id := "g" + strconv.Itoa(g) + "-" + strconv.Itoa(i)
				res, err := r.FindBestMatch(shared, &RequestOptions{Admit: true, RequestID: id})
				if err != nil {
					errs <- err
					return
				}
				if res.WorkerID < 1 || res.WorkerID > workers || !res.Booked {
					errs <- newError(ErrInternal, "bad decision")
					return
				}
				if err := r.MarkPrefillCompleted(id); err != nil {
					errs <- err
					return
				}
				switch i % 4 {
				case 0:
					ev := storedPrefix(uint64(g%workers+1), mine, 1+i%8)
					ev.BlockHashes = append([]uint64(nil), ev.BlockHashes...)
					for k := range ev.BlockHashes {
						ev.BlockHashes[k] |= uint64(g) << 48
					}
					if err := r.ApplyStored(ev); err != nil && !errors.Is(err, ErrNotFound) {
						errs <- err
						return
					}
				case 1:
					if _, err := r.OverlapScores(shared, nil); err != nil {
						errs <- err
						return
					}
				case 2:
					if _, err := r.MetricsPrometheus(); err != nil {
						errs <- err
						return
					}
				case 3:
					if _, err := r.PreviewRoute(mine, nil, nil); err != nil {
						errs <- err
						return
					}
				}
				if err := r.FreeRequest(id); err != nil {
					errs <- err
					return
				}
			}
		}(g)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	m, err := r.Metrics()
	must(t, err)
	if m.RequestsActive != 0 || m.Decisions != goroutines*iterations {
		t.Errorf("after the storm: %+v", m)
	}
}
