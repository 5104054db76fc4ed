package kvrouter

import (
	"fmt"
	"strings"
	"testing"
)

// The decision-latency histogram: every routing call and preview is measured, the buckets are
// cumulative under rising bounds, and the Prometheus text has it as a histogram.
func TestDecisionLatencyHistogram(t *testing.T) {
	r := newTestRouter(t, 2)
	p := prompt(64, 1)
	for i := 0; i < 5; i++ {
		_, err := r.FindBestMatch(p, &RequestOptions{Admit: true, RequestID: fmt.Sprint("h", i)})
		must(t, err)
	}
	_, err := r.FindBestMatch(p, nil) // not admitted: a decision all the same
	must(t, err)
	for i := 0; i < 11; i++ { // previews: timed as routing calls, not counted as decisions
		_, err = r.PreviewRoute(p, nil, nil)
		must(t, err)
	}
	m, err := r.Metrics()
	must(t, err)
	h := m.DecisionLatency
	// The library times one routing call in 16, the first included: calls 1 and 17 of 17.
	if m.Decisions != 6 || h.Count != 2 {
		t.Errorf("%d decisions, %d measured (want 6 and 2)", m.Decisions, h.Count)
	}
	for i := range h.Bounds {
		if h.Bounds[i] <= 0 || i > 0 && (h.Bounds[i] <= h.Bounds[i-1] || h.Counts[i] < h.Counts[i-1]) || h.Counts[i] > h.Count {
			t.Fatalf("not a cumulative histogram under rising bounds: %+v", h)
		}
	}
	if h.Sum < 0 {
		t.Errorf("sum %v", h.Sum)
	}
	text, err := r.MetricsPrometheus()
	must(t, err)
	for _, want := range []string{"# TYPE kvrouter_decision_duration_seconds histogram",
		`kvrouter_decision_duration_seconds_bucket{le="+Inf"} ` + fmt.Sprint(h.Count),
		"kvrouter_decision_duration_seconds_count " + fmt.Sprint(h.Count)} {
		if !strings.Contains(text, want) {
			t.Errorf("no %q in\n%s", want, text)
		}
	}
}

// An Ingest's Prometheus text: every source's counters labelled with its id, kind and
// endpoint; the growth path gives the same text; a closed Ingest is ErrClosed.
func TestIngestMetricsPrometheus(t *testing.T) {
	r := newTestRouter(t, 1)
	in := newIngest(t, r)
	src, bound, err := in.Listen("tcp://127.0.0.1:0")
	must(t, err)
	must(t, in.Start())
	sendStored(t, bound, &StoredEvent{WorkerID: 1, BlockHashes: []uint64{7}, TokenIDs: prompt(16, 1)})
	waitStats(t, in, src, func(s IngestStats) bool { return s.EventsApplied == 1 })

	text, err := in.MetricsPrometheus()
	must(t, err)
	labels := fmt.Sprintf(`source_id="%d",kind="listener",endpoint="%s"`, src, bound)
	for _, want := range []string{"# TYPE kvrouter_ingest_", labels} {
		if !strings.Contains(text, want) {
			t.Errorf("no %q in\n%s", want, text)
		}
	}
	if strings.Contains(text, "kvrouter_decisions_total") {
		t.Error("the ingest's text repeats the router's metrics")
	}
	small, err := in.metricsPrometheus(1)
	must(t, err)
	if small != text {
		t.Errorf("grown buffer: other text\n%s\nthen\n%s", text, small)
	}
	must(t, in.Close())
	if _, err := in.MetricsPrometheus(); err != ErrClosed {
		t.Errorf("after Close: %v", err)
	}
	var none *Ingest
	if _, err := none.MetricsPrometheus(); err != ErrClosed {
		t.Errorf("nil Ingest: %v", err)
	}
}

// The counts of what the heap refused (a KV event the index could not apply, a replica change lost) are
// there, 0 on a router that was never short of memory, also after events and a publisher's
// bookings, and in the Prometheus text as counters. So are the sliding-window counts, 0 on a
// router that received no sliding-window events.
func TestRefusedForMemoryCountersAreZeroWithoutARefusal(t *testing.T) {
	r := newTestRouter(t, 2)
	var published int
	must(t, r.SetReplicaPublisher("a", func([]byte) { published++ }))
	_, err := r.FindBestMatch(prompt(64, 1), &RequestOptions{Admit: true, RequestID: "m-1"})
	must(t, err)
	m, err := r.Metrics()
	must(t, err)
	if published == 0 || m.RequestsActive != 1 {
		t.Fatalf("%d published, %d active: the booking did not go through the publisher", published, m.RequestsActive)
	}
	if m.EventsRefusedForMemory != 0 || m.ReplicaChangesUnpublished != 0 {
		t.Errorf("refused for memory: %d events, %d replica changes (want 0 and 0)", m.EventsRefusedForMemory, m.ReplicaChangesUnpublished)
	}
	if m.DecisionsPricedAgain != 0 {
		t.Errorf("%d decisions priced again with one caller (want 0)", m.DecisionsPricedAgain)
	}
	if m.SlidingEventsApplied != 0 || m.SlidingEventsRejected != 0 || m.IndexSlidingBlocks != 0 {
		t.Errorf("sliding windows without sliding-window events: %d applied, %d rejected, %d blocks (want 0, 0 and 0)",
			m.SlidingEventsApplied, m.SlidingEventsRejected, m.IndexSlidingBlocks)
	}
	text, err := r.MetricsPrometheus()
	must(t, err)
	for _, want := range []string{"# TYPE kvrouter_events_refused_for_memory_total counter\n",
		"\nkvrouter_events_refused_for_memory_total 0\n",
		"# TYPE kvrouter_replica_changes_unpublished_total counter\n",
		"\nkvrouter_replica_changes_unpublished_total 0\n",
		"# TYPE kvrouter_decisions_priced_again_total counter\n",
		"\nkvrouter_decisions_priced_again_total 0\n",
		"# TYPE kvrouter_sliding_window_events_applied_total counter\n",
		"\nkvrouter_sliding_window_events_applied_total 0\n",
		"# TYPE kvrouter_sliding_window_events_rejected_total counter\n",
		"\nkvrouter_sliding_window_events_rejected_total 0\n",
		"# TYPE kvrouter_index_sliding_blocks gauge\n",
		"\nkvrouter_index_sliding_blocks 0\n"} {
		if !strings.Contains(text, want) {
			t.Errorf("no %q in\n%s", want, text)
		}
	}
}
