package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	kvrouter "github.com/kvrouter/kvrouter/bindings/go"
	"github.com/kvrouter/kvrouter/examples/go/internal/fakeengine"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
)

const blockSize = 16

// setup starts a gateway with a native KV event listener and two fake engines publishing to it,
// all on 127.0.0.1, stopped when the test ends.
func setup(t *testing.T, delay time.Duration) (*gateway, *httptest.Server, map[uint64]*fakeengine.Engine) {
	t.Helper()
	// The engines' URLs are known once they listen, and their event endpoint once the gateway
	// does: the engine servers start first, unstarted handlers get the endpoint after.
	engines := map[uint64]*fakeengine.Engine{}
	servers := map[uint64]*httptest.Server{}
	var specs []workerSpec
	for id := uint64(1); id <= 2; id++ {
		id := id
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { engines[id].ServeHTTP(w, r) }))
		t.Cleanup(srv.Close)
		servers[id] = srv
		specs = append(specs, workerSpec{ID: id, URL: srv.URL})
	}
	g, err := newGateway(config{BlockSize: blockSize, KVListen: "tcp://127.0.0.1:0", Engine: kvrouter.EngineVLLM, Workers: specs})
	if err != nil {
		t.Fatal(err)
	}
	for id := range servers {
		engines[id] = fakeengine.New(id, blockSize, delay, g.kvEndpoint)
	}
	gw := httptest.NewServer(g.handler())
	t.Cleanup(func() {
		gw.Close()
		for _, e := range engines {
			e.Close()
		}
		g.close()
	})
	return g, gw, engines
}

func prompt(n int, base uint32) []uint32 {
	p := make([]uint32, n)
	for i := range p {
		p[i] = base + uint32(i)
	}
	return p
}

func post(ctx context.Context, t *testing.T, url string, req map[string]any) *http.Response {
	t.Helper()
	body, _ := json.Marshal(req)
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/completions", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(hr)
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

// complete sends a completion and reads its whole answer; it returns the worker it went to,
// the tokens the router said were cached there, and the body.
func complete(t *testing.T, url string, p []uint32, stream bool) (worker uint64, cached uint64, body string) {
	t.Helper()
	resp := post(context.Background(), t, url, map[string]any{"prompt": p, "max_tokens": 4, "stream": stream, "model": "m"})
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	worker, _ = strconv.ParseUint(resp.Header.Get("X-Kvrouter-Worker"), 10, 64)
	cached, _ = strconv.ParseUint(resp.Header.Get("X-Kvrouter-Cached-Tokens"), 10, 64)
	return worker, cached, string(b)
}

// waitFor polls cond until it holds (the test's own deadline bounds it).
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for !cond() {
		if d, ok := t.Deadline(); ok && time.Until(d) < 5*time.Second {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func metrics(t *testing.T, g *gateway) kvrouter.Metrics {
	t.Helper()
	m, err := g.router.Metrics()
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func storedOK(t *testing.T, g *gateway) uint64 {
	return metrics(t, g).Events[kvrouter.EventStored][kvrouter.EventOK]
}

// idle reports a router with no booked request and no load left on any rank.
func idle(t *testing.T, g *gateway, p []uint32) bool {
	if metrics(t, g).RequestsActive != 0 {
		return false
	}
	loads, err := g.router.PotentialLoads(p, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range loads {
		if l.ActivePrefillTokens != 0 || l.ActiveBlocks != 0 {
			return false
		}
	}
	return true
}

// Requests land on a worker; once that engine's KV events have arrived, a request sharing the
// prefix lands on the worker holding it, with its cached tokens; loads return to zero.
func TestRoutingFollowsTheEnginesCaches(t *testing.T) {
	g, gw, engines := setup(t, time.Millisecond)
	a, b := prompt(64, 1000), prompt(64, 50000) // 4 blocks each, sharing nothing

	// Prompt a's request is held open (streaming, first token read) while b is routed: b goes
	// to the other, unloaded worker.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	slow := post(ctx, t, gw.URL, map[string]any{"prompt": a, "max_tokens": 1000, "stream": true})
	defer slow.Body.Close()
	wa, _ := strconv.ParseUint(slow.Header.Get("X-Kvrouter-Worker"), 10, 64)
	if _, err := bufio.NewReader(slow.Body).ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	wb, cachedB, _ := complete(t, gw.URL, b, false)
	if wa == 0 || wb == 0 || wa == wb {
		t.Fatalf("a on worker %d, b on %d while a was busy: want two different workers", wa, wb)
	}
	if cachedB != 0 {
		t.Errorf("b: %d tokens cached before any event", cachedB)
	}
	cancel()
	slow.Body.Close()
	waitFor(t, "both prompts' stored events", func() bool { return storedOK(t, g) >= 2 })
	waitFor(t, "the loads to return to zero", func() bool { return idle(t, g, a) })

	// Each prompt's continuation now goes where its prefix is cached, whatever the order.
	for _, c := range []struct {
		p    []uint32
		want uint64
	}{{append(b[:48:48], prompt(40, 7000)...), wb}, {append(a[:64:64], prompt(20, 9000)...), wa}, {b, wb}} {
		w, cached, _ := complete(t, gw.URL, c.p, true)
		if w != c.want {
			t.Errorf("a prompt sharing worker %d's prefix went to worker %d", c.want, w)
		}
		if cached < 48 {
			t.Errorf("worker %d: %d tokens cached, want the shared prefix's (48 or 64)", w, cached)
		}
	}
	waitFor(t, "the loads to return to zero after completion", func() bool { return idle(t, g, a) })
	total := 0
	for _, e := range engines {
		total += e.Stats().Requests
	}
	if total != 5 {
		t.Errorf("the engines saw %d requests, want 5", total)
	}
}

// Streaming: the client gets the engine's events and [DONE]; without streaming, one JSON
// answer with the generated text. A client that goes away mid-stream frees its booking and
// cancels the engine's request.
func TestStreamingAndDisconnect(t *testing.T) {
	g, gw, engines := setup(t, 2*time.Millisecond)
	p := prompt(40, 3000)
	_, _, body := complete(t, gw.URL, p, true)
	if !strings.Contains(body, `"text":" t3"`) || !strings.HasSuffix(body, "data: [DONE]\n\n") {
		t.Errorf("streamed body:\n%s", body)
	}
	_, _, body = complete(t, gw.URL, p, false)
	var answer struct {
		Choices []struct {
			Text         string `json:"text"`
			FinishReason string `json:"finish_reason"`
		} `json:"choices"`
	}
	if err := json.Unmarshal([]byte(body), &answer); err != nil || len(answer.Choices) != 1 ||
		answer.Choices[0].Text != " t0 t1 t2 t3" || answer.Choices[0].FinishReason != "length" {
		t.Errorf("non-streamed answer %q (%v)", body, err)
	}
	waitFor(t, "the loads to return to zero", func() bool { return idle(t, g, p) })

	// A long generation, left after its first token.
	ctx, cancel := context.WithCancel(context.Background())
	resp := post(ctx, t, gw.URL, map[string]any{"prompt": prompt(80, 20000), "max_tokens": 100000, "stream": true})
	worker, _ := strconv.ParseUint(resp.Header.Get("X-Kvrouter-Worker"), 10, 64)
	if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	if m := metrics(t, g); m.RequestsActive != 1 {
		t.Fatalf("%d requests active mid-stream, want 1", m.RequestsActive)
	}
	// Its first token is out: its prompt is no longer prefill load, its blocks are decode load.
	loads, err := g.router.PotentialLoads(p, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range loads {
		if l.WorkerID == worker && (l.ActivePrefillTokens != 0 || l.ActiveBlocks == 0) {
			t.Errorf("worker %d mid-stream: %d prefill tokens, %d blocks; want 0 and some", worker, l.ActivePrefillTokens, l.ActiveBlocks)
		}
	}
	cancel()
	resp.Body.Close()
	waitFor(t, "the abandoned request to be freed", func() bool { return idle(t, g, p) })
	waitFor(t, "the engine's request to be cancelled", func() bool { return engines[worker].Stats().Cancelled == 1 })
}

// /metrics serves the router's and the ingest's metrics under the library's names and the
// gateway's counters, and passes promlint; /health answers; bad requests are refused.
func TestMetricsHealthAndErrors(t *testing.T) {
	g, gw, _ := setup(t, time.Millisecond)
	complete(t, gw.URL, prompt(48, 100), true)
	waitFor(t, "the stored event", func() bool { return storedOK(t, g) >= 1 })

	resp, err := http.Get(gw.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	text, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{
		"kvrouter_decisions_total 1", `kvrouter_kv_events_total{kind="stored",outcome="ok"} 1`, "kvrouter_workers 2",
		`kvrouter_worker_active_prefill_tokens{dp_rank="0",worker_id="1"}`, "kvrouter_requests_active",
		"kvrouter_gateway_requests_total 1", "kvrouter_gateway_completed_total 1", "kvrouter_gateway_first_token_seconds_count 1",
		"kvrouter_decision_duration_seconds_count 1", `kvrouter_ingest_events_applied_total{endpoint="` + g.kvEndpoint + `",kind="listener",source_id="1"} 1`,
	} {
		if !bytes.Contains(text, []byte(want)) {
			t.Errorf("/metrics has no %q:\n%s", want, text)
		}
	}
	problems, err := promlint.New(bytes.NewReader(text)).Lint()
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("/metrics: promlint: %s: %s", p.Metric, p.Text)
	}

	resp, err = http.Get(gw.URL + "/health")
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("/health: %v %v", resp, err)
	}
	resp.Body.Close()
	for _, body := range []string{`{"prompt": "text"}`, `{"prompt": []}`, `{"prompt": [1, -2]}`, `not json`, `{"prompt": [1], "stream": "yes"}`} {
		resp, err := http.Post(gw.URL+"/v1/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadRequest {
			t.Errorf("%s: status %d, want 400", body, resp.StatusCode)
		}
	}
	if m := metrics(t, g); m.Decisions != 1 || m.RequestsActive != 0 {
		t.Errorf("after refused requests: %d decisions, %d active", m.Decisions, m.RequestsActive)
	}
}

// An engine that cannot be reached is a 502; one that refuses the request has its answer passed
// on; one that ends its stream before [DONE] is a 502 for a non-streamed request. Each frees the
// booking and counts as an engine error.
func TestEngineFailures(t *testing.T) {
	dead := httptest.NewServer(http.NotFoundHandler())
	deadURL := dead.URL
	dead.Close()
	refusing := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, `{"error":{"message":"prompt too long"}}`, http.StatusBadRequest)
	}))
	defer refusing.Close()
	cut := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, `data: {"choices":[{"index":0,"text":" t0","finish_reason":null}]}`+"\n\n")
	}))
	defer cut.Close()
	for i, c := range []struct {
		url    string
		stream bool
		status int
	}{{deadURL, true, http.StatusBadGateway}, {refusing.URL, false, http.StatusBadRequest}, {cut.URL, false, http.StatusBadGateway}} {
		g, err := newGateway(config{BlockSize: blockSize, Workers: []workerSpec{{ID: 7, URL: c.url}}})
		if err != nil {
			t.Fatal(err)
		}
		gw := httptest.NewServer(g.handler())
		resp := post(context.Background(), t, gw.URL, map[string]any{"prompt": prompt(20, 1), "stream": c.stream})
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != c.status {
			t.Errorf("case %d: status %d (%s), want %d", i, resp.StatusCode, body, c.status)
		}
		if m := metrics(t, g); m.RequestsActive != 0 {
			t.Errorf("case %d: %d requests active after the engine failed", i, m.RequestsActive)
		}
		if n := testutil.ToFloat64(g.engineErrors); n != 1 {
			t.Errorf("case %d: %v engine errors counted, want 1", i, n)
		}
		gw.Close()
		g.close()
	}
}

// The -worker flag's forms, and a ZMQ event source per worker (vLLM's publisher; subscribing
// needs no publisher to be up yet).
func TestWorkerFlag(t *testing.T) {
	w, err := parseWorker("id=3,url=http://h:8000/,zmq=tcp://127.0.0.1:5557,dp=2,replay=tcp://127.0.0.1:5558,topic=kv-events")
	if err != nil || w != (workerSpec{ID: 3, URL: "http://h:8000", ZMQ: "tcp://127.0.0.1:5557", DP: 2, Replay: "tcp://127.0.0.1:5558", Topic: "kv-events"}) {
		t.Fatalf("%+v %v", w, err)
	}
	for _, bad := range []string{"url=http://h", "id=1", "id=x,url=http://h", "id=1,url=http://h,dp=0", "id=1,url=http://h,port=3", "id"} {
		if _, err := parseWorker(bad); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
	g, err := newGateway(config{BlockSize: blockSize, Engine: kvrouter.EngineVLLM, Workers: []workerSpec{w, {ID: 4, URL: "http://h2"}}})
	if err != nil {
		t.Fatal(err)
	}
	defer g.close()
	if m := metrics(t, g); m.Workers != 2 {
		t.Errorf("%d workers, want 2", m.Workers)
	}
	loads, err := g.router.PotentialLoads(prompt(16, 1), nil)
	if err != nil || len(loads) != 3 {
		t.Errorf("%d ranks (%v), want 3 (worker 3's two and worker 4's one)", len(loads), err)
	}
	if _, err := g.ingest.SourceEndpoint(1); err != nil {
		t.Errorf("worker 3's ZMQ source: %v", err)
	}
	if _, err := newGateway(config{BlockSize: blockSize, Workers: []workerSpec{{ID: 1, URL: "u"}, {ID: 1, URL: "v"}}}); err == nil {
		t.Error("a worker given twice: no error")
	}
}
