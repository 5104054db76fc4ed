package kvrouterprom_test

import (
	"errors"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	kvrouter "github.com/kvrouter/kvrouter/bindings/go"
	"github.com/kvrouter/kvrouter/bindings/go/kvrouterprom"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
)

const bs = 16

func prompt(n int, base uint32) []uint32 {
	p := make([]uint32, n)
	for i := range p {
		p[i] = base + uint32(i)
	}
	return p
}

// busyRouter is a router with every kind of figure its text has: workers (one with two data
// parallel ranks), stored, removed and rejected events, decisions, requests active in prefill
// and in decode, and a rejected event batch.
func busyRouter(t *testing.T) *kvrouter.Router {
	t.Helper()
	opts := kvrouter.DefaultRouterOptions()
	opts.BlockSize = bs
	opts.RandomSeed = 7
	r, err := kvrouter.NewRouter(&opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	must(t, r.AddWorker(kvrouter.WorkerConfig{WorkerID: 1}))
	must(t, r.AddWorker(kvrouter.WorkerConfig{WorkerID: 2, DPSize: 2}))
	p := prompt(96, 1000)
	must(t, r.ApplyStored(&kvrouter.StoredEvent{WorkerID: 2, DPRank: 1, BlockHashes: []uint64{21, 22, 23}, TokenIDs: p[:3*bs]}))
	must(t, r.ApplyStored(&kvrouter.StoredEvent{WorkerID: 1, BlockHashes: []uint64{11, 12}, TokenIDs: prompt(2*bs, 5000)}))
	must(t, r.ApplyRemoved(&kvrouter.RemovedEvent{WorkerID: 1, BlockHashes: []uint64{12}}))
	if err := r.ApplyRemoved(&kvrouter.RemovedEvent{WorkerID: 1, BlockHashes: []uint64{99}}); err == nil {
		t.Fatal("removing an unknown block: no error")
	}
	if err := r.ApplyEventBatch([]byte("not a batch")); err == nil {
		t.Fatal("a garbage batch: no error")
	}
	for i := 0; i < 3; i++ {
		res, err := r.FindBestMatch(p, &kvrouter.RequestOptions{Admit: true, RequestID: fmt.Sprint("req-", i)})
		must(t, err)
		if i == 0 && (res.WorkerID != 2 || res.DPRank != 1) {
			t.Fatalf("first request on %d/%d, want the rank holding its prefix (2/1)", res.WorkerID, res.DPRank)
		}
	}
	must(t, r.MarkPrefillCompleted("req-0"))
	must(t, r.FreeRequest("req-2"))
	if _, err := r.FindBestMatch(prompt(40, 9000), nil); err != nil { // a preview
		t.Fatal(err)
	}
	return r
}

// busyIngest is an ingest feeding r with two sources: a native stream listener that received
// events (one applied, one rejected) and a vLLM ZMQ subscription with no publisher.
func busyIngest(t *testing.T, r *kvrouter.Router) *kvrouter.Ingest {
	t.Helper()
	in, err := kvrouter.NewIngest(r, nil)
	must(t, err)
	t.Cleanup(func() { in.Close() })
	src, bound, err := in.Listen("tcp://127.0.0.1:0")
	must(t, err)
	_, err = in.AddEngineWorker(kvrouter.EngineWorker{Engine: kvrouter.EngineVLLM, Endpoint: "tcp://127.0.0.1:1", WorkerID: 1})
	must(t, err)
	must(t, in.Start())
	pub, err := kvrouter.ConnectPublisher(bound)
	must(t, err)
	defer pub.Close()
	b, err := kvrouter.NewEventBatch()
	must(t, err)
	defer b.Close()
	must(t, b.AddStored(&kvrouter.StoredEvent{WorkerID: 1, BlockHashes: []uint64{31}, TokenIDs: prompt(bs, 7000)}))
	must(t, b.AddStored(&kvrouter.StoredEvent{WorkerID: 1, HasParent: true, ParentHash: 4242, BlockHashes: []uint64{32}, TokenIDs: prompt(bs, 8000)}))
	must(t, b.SetPublishTime(time.Now()))
	must(t, pub.Send(b))
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(2 * time.Millisecond) {
		s, err := in.Stats(src)
		must(t, err)
		if s.EventsApplied == 1 && s.Rejected[kvrouter.RejectIndex] == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the events did not arrive: %+v", s)
		}
	}
	return in
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// The collector serves exactly the library's own text: every family with its help and type,
// every sample with its labels and value.
func TestCollectorMatchesLibraryText(t *testing.T) {
	r := busyRouter(t)
	in := busyIngest(t, r)
	reg := prometheus.NewPedanticRegistry()
	must(t, reg.Register(kvrouterprom.NewCollector(r, in)))
	text, err := r.MetricsPrometheus()
	must(t, err)
	ingestText, err := in.MetricsPrometheus()
	must(t, err)
	must(t, testutil.GatherAndCompare(reg, strings.NewReader(sortedLabels(t, text+ingestText))))

	families, err := reg.Gather()
	must(t, err)
	got := map[string]*dto.MetricFamily{}
	for _, mf := range families {
		got[mf.GetName()] = mf
	}
	for _, name := range []string{"kvrouter_kv_events_total", "kvrouter_decisions_total", "kvrouter_requests_active",
		"kvrouter_workers", "kvrouter_worker_active_prefill_tokens", "kvrouter_worker_active_decode_blocks",
		"kvrouter_decision_duration_seconds", "kvrouter_ingest_messages_total", "kvrouter_ingest_events_applied_total",
		"kvrouter_ingest_rejected_total", "kvrouter_ingest_gaps_total", "kvrouter_ingest_lag_seconds"} {
		if got[name] == nil {
			t.Errorf("no %s among %d families", name, len(families))
		}
	}
	if v := got["kvrouter_workers"].GetMetric()[0].GetGauge().GetValue(); v != 2 {
		t.Errorf("kvrouter_workers %v, want 2", v)
	}
	if v := got["kvrouter_requests_active"].GetMetric()[0].GetGauge().GetValue(); v != 2 {
		t.Errorf("kvrouter_requests_active %v, want 2", v)
	}
	if n := len(got["kvrouter_worker_active_prefill_tokens"].GetMetric()); n != 3 {
		t.Errorf("%d ranks with a prefill gauge, want 3", n)
	}
	if h := got["kvrouter_decision_duration_seconds"].GetMetric()[0].GetHistogram(); h.GetSampleCount() < 1 || len(h.GetBucket()) < 2 {
		t.Errorf("decision latency histogram %v, want the first routing call (one in 16 is timed) in buckets", h)
	}
	if n := len(got["kvrouter_ingest_messages_total"].GetMetric()); n != 2 {
		t.Errorf("%d sources in kvrouter_ingest_messages_total, want 2", n)
	}
	// The figures move with the router: one more decision is one more at the next scrape.
	before := testutil.ToFloat64(metricOf(t, reg, "kvrouter_decisions_total"))
	_, err = r.FindBestMatch(prompt(64, 1000), nil)
	must(t, err)
	if after := testutil.ToFloat64(metricOf(t, reg, "kvrouter_decisions_total")); after != before+1 {
		t.Errorf("kvrouter_decisions_total %v after one more decision, was %v", after, before)
	}
}

// sortedLabels returns text with each sample's labels in name order, as a registry gathers
// them (the library writes worker_id before dp_rank; testutil compares the text as written).
func sortedLabels(t *testing.T, text string) string {
	t.Helper()
	families, err := kvrouterprom.Parse(text)
	must(t, err)
	var out strings.Builder
	for _, mf := range families {
		for _, m := range mf.GetMetric() {
			sort.Slice(m.Label, func(i, j int) bool { return m.Label[i].GetName() < m.Label[j].GetName() })
		}
		_, err := expfmt.MetricFamilyToText(&out, mf)
		must(t, err)
	}
	return out.String()
}

// metricOf re-gathers reg and returns the single sample of an unlabelled family as a
// collector testutil.ToFloat64 accepts.
func metricOf(t *testing.T, reg prometheus.Gatherer, name string) prometheus.Collector {
	t.Helper()
	families, err := reg.Gather()
	must(t, err)
	for _, mf := range families {
		if mf.GetName() == name {
			d := prometheus.NewDesc(name, mf.GetHelp(), nil, nil)
			return constCollector{prometheus.MustNewConstMetric(d, prometheus.UntypedValue, value(mf.GetMetric()[0]))}
		}
	}
	t.Fatalf("no %s", name)
	return nil
}

type constCollector struct{ m prometheus.Metric }

func (c constCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.m.Desc() }
func (c constCollector) Collect(ch chan<- prometheus.Metric) { ch <- c.m }

func value(m *dto.Metric) float64 {
	switch {
	case m.Counter != nil:
		return m.GetCounter().GetValue()
	case m.Gauge != nil:
		return m.GetGauge().GetValue()
	}
	return m.GetUntyped().GetValue()
}

// The "passing promlint": the library's own Prometheus texts, a router's with workers,
// events and decisions and an ingest's with sources that received events, have no problem
// promlint reports, and neither has what the collector serves.
func TestLibraryTextPassesPromlint(t *testing.T) {
	r := busyRouter(t)
	in := busyIngest(t, r)
	text, err := r.MetricsPrometheus()
	must(t, err)
	lint(t, "kvr_router_metrics_prometheus", text)
	ingestText, err := in.MetricsPrometheus()
	must(t, err)
	lint(t, "kvr_ingest_metrics_prometheus", ingestText)

	reg := prometheus.NewRegistry()
	must(t, reg.Register(kvrouterprom.NewCollector(r, in)))
	families, err := reg.Gather()
	must(t, err)
	problems, err := promlint.NewWithMetricFamilies(families).Lint()
	must(t, err)
	for _, p := range problems {
		t.Errorf("collector: %s: %s", p.Metric, p.Text)
	}
}

func lint(t *testing.T, what, text string) {
	t.Helper()
	problems, err := promlint.New(strings.NewReader(text)).Lint()
	if err != nil {
		t.Fatalf("%s: promlint cannot read the text: %v\n%s", what, err, text)
	}
	for _, p := range problems {
		t.Errorf("%s: promlint: %s: %s", what, p.Metric, p.Text)
	}
}

// A closed router makes the scrape fail with its error, not panic or serve stale figures.
func TestCollectorReportsAClosedSource(t *testing.T) {
	r := busyRouter(t)
	reg := prometheus.NewRegistry()
	must(t, reg.Register(kvrouterprom.NewCollector(r)))
	must(t, r.Close())
	_, err := reg.Gather()
	if err == nil || !strings.Contains(err.Error(), "closed") {
		t.Fatalf("Gather after Close: %v, want the closed router's error", err)
	}
}

// Nil sources (an optional ingest left out) are skipped; a TextFunc is a source; a source whose
// text does not parse fails the scrape with the parser's error.
func TestCollectorSources(t *testing.T) {
	var ingest *kvrouter.Ingest // an optional source left out
	text := "# HELP x_total X.\n# TYPE x_total counter\nx_total{a=\"1\"} 3\n"
	reg := prometheus.NewPedanticRegistry()
	must(t, reg.Register(kvrouterprom.NewCollector(nil, ingest, kvrouterprom.TextFunc(func() (string, error) { return text, nil }))))
	must(t, testutil.GatherAndCompare(reg, strings.NewReader(text)))

	bad := prometheus.NewRegistry()
	must(t, bad.Register(kvrouterprom.NewCollector(kvrouterprom.TextFunc(func() (string, error) { return "x{ 1\n", nil }))))
	if _, err := bad.Gather(); err == nil {
		t.Fatal("unparsable text: no error")
	}
	failing := prometheus.NewRegistry()
	boom := errors.New("boom")
	must(t, failing.Register(kvrouterprom.NewCollector(kvrouterprom.TextFunc(func() (string, error) { return "", boom }))))
	if _, err := failing.Gather(); err == nil || !strings.Contains(err.Error(), "boom") {
		t.Fatalf("failing source: %v", err)
	}
}

// Histograms and summaries keep their buckets and quantiles.
func TestCollectorHistogram(t *testing.T) {
	text := `# HELP d_seconds D.
# TYPE d_seconds histogram
d_seconds_bucket{le="0.001"} 1
d_seconds_bucket{le="0.01"} 3
d_seconds_bucket{le="+Inf"} 4
d_seconds_sum 0.5
d_seconds_count 4
# HELP s_seconds S.
# TYPE s_seconds summary
s_seconds{quantile="0.5"} 0.2
s_seconds_sum 1
s_seconds_count 5
`
	reg := prometheus.NewPedanticRegistry()
	must(t, reg.Register(kvrouterprom.NewCollector(kvrouterprom.TextFunc(func() (string, error) { return text, nil }))))
	must(t, testutil.GatherAndCompare(reg, strings.NewReader(text)))
}
