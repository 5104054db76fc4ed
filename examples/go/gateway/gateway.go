package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	kvrouter "github.com/kvrouter/kvrouter/bindings/go"
	"github.com/kvrouter/kvrouter/bindings/go/kvrouterprom"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// workerSpec is one engine behind the gateway (a -worker flag).
type workerSpec struct {
	ID     uint64
	URL    string // the engine's OpenAI-compatible server, e.g. http://10.0.0.5:8000
	ZMQ    string // its ZMQ KV event publisher (rank 0's), or "" (events over -kv-listen, or none)
	Replay string // its ZMQ replay endpoint, or ""
	Topic  string // its KV event topic (vLLM's kv-events-config "topic"), or "" for every message
	DP     uint32 // data-parallel ranks (vLLM --data-parallel-size); 0 = 1
}

// config is the gateway's configuration (the flags).
type config struct {
	BlockSize uint32
	KVListen  string // native event stream listener ("tcp://HOST:PORT", "unix://PATH") or ""
	Engine    kvrouter.Engine
	Workers   []workerSpec
	Verbose   bool
}

// gateway routes OpenAI-style completions to engines with kvrouter.
type gateway struct {
	router     *kvrouter.Router
	ingest     *kvrouter.Ingest
	kvEndpoint string // the bound native listener, or ""
	engines    map[uint64]workerSpec
	client     *http.Client
	nextID     atomic.Uint64
	verbose    bool
	registry   *prometheus.Registry

	requests, completed, disconnects, engineErrors prometheus.Counter
	firstToken                                     prometheus.Histogram
}

func newGateway(cfg config) (*gateway, error) {
	if len(cfg.Workers) == 0 {
		return nil, errors.New("no workers")
	}
	opts := kvrouter.DefaultRouterOptions()
	opts.BlockSize = cfg.BlockSize
	router, err := kvrouter.NewRouter(&opts)
	if err != nil {
		return nil, err
	}
	g := &gateway{router: router, engines: map[uint64]workerSpec{}, verbose: cfg.Verbose,
		client: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}}
	fail := func(err error) (*gateway, error) {
		g.close()
		return nil, err
	}
	g.ingest, err = kvrouter.NewIngest(router, nil)
	if err != nil {
		return fail(err)
	}
	for _, w := range cfg.Workers {
		if _, dup := g.engines[w.ID]; dup {
			return fail(fmt.Errorf("worker %d given twice", w.ID))
		}
		g.engines[w.ID] = w
		if err := router.AddWorker(kvrouter.WorkerConfig{WorkerID: w.ID, DPSize: w.DP}); err != nil {
			return fail(fmt.Errorf("worker %d: %w", w.ID, err))
		}
		if w.ZMQ != "" {
			_, err := g.ingest.AddEngineWorker(kvrouter.EngineWorker{Engine: cfg.Engine, Endpoint: w.ZMQ,
				WorkerID: w.ID, DPSize: w.DP, ReplayEndpoint: w.Replay, Topic: w.Topic})
			if err != nil {
				return fail(fmt.Errorf("worker %d's KV events (%s): %w", w.ID, w.ZMQ, err))
			}
		}
	}
	if cfg.KVListen != "" {
		if _, g.kvEndpoint, err = g.ingest.Listen(cfg.KVListen); err != nil {
			return fail(fmt.Errorf("-kv-listen %s: %w", cfg.KVListen, err))
		}
	}
	if err := g.ingest.Start(); err != nil {
		return fail(err)
	}

	counter := func(name, help string) prometheus.Counter {
		return prometheus.NewCounter(prometheus.CounterOpts{Name: "kvrouter_gateway_" + name, Help: help})
	}
	g.requests = counter("requests_total", "Completion requests received.")
	g.completed = counter("completed_total", "Requests streamed to their end.")
	g.disconnects = counter("disconnects_total", "Requests whose client went away first.")
	g.engineErrors = counter("engine_errors_total", "Requests an engine failed or refused.")
	g.firstToken = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvrouter_gateway_first_token_seconds",
		Help: "Time from a request's arrival to its first token.", Buckets: prometheus.ExponentialBuckets(0.005, 2, 14)})
	g.registry = prometheus.NewRegistry()
	g.registry.MustRegister(kvrouterprom.NewCollector(router, g.ingest),
		g.requests, g.completed, g.disconnects, g.engineErrors, g.firstToken)
	return g, nil
}

// close stops the ingest loop and frees the router (in that order: the router must outlive it).
func (g *gateway) close() {
	if g.ingest != nil {
		g.ingest.Close()
	}
	g.router.Close()
}

func (g *gateway) handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/v1/completions", g.completions)
	mux.Handle("/metrics", promhttp.HandlerFor(g.registry, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError}))
	mux.HandleFunc("/health", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"status":"ok"}`)
	})
	return mux
}

func httpError(w http.ResponseWriter, status int, format string, a ...any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(map[string]any{"error": map[string]any{"message": fmt.Sprintf(format, a...)}})
}

// parsePrompt reads a completion request: its fields (forwarded as they are) and its prompt,
// which must be a list of token ids (a gateway receiving text tokenizes it first: README).
func parsePrompt(body []byte) (map[string]json.RawMessage, []uint32, error) {
	var req map[string]json.RawMessage
	if err := json.Unmarshal(body, &req); err != nil {
		return nil, nil, err
	}
	var prompt []uint32
	if err := json.Unmarshal(req["prompt"], &prompt); err != nil || len(prompt) == 0 {
		return nil, nil, errors.New(`"prompt" must be a non-empty list of token ids`)
	}
	return req, prompt, nil
}

func (g *gateway) completions(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		httpError(w, http.StatusMethodNotAllowed, "POST only")
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, 64<<20))
	if err != nil {
		return
	}
	req, prompt, err := parsePrompt(body)
	if err != nil {
		httpError(w, http.StatusBadRequest, "bad completion request: %v", err)
		return
	}
	var stream bool
	if s, ok := req["stream"]; ok {
		if err := json.Unmarshal(s, &stream); err != nil {
			httpError(w, http.StatusBadRequest, `"stream" must be true or false`)
			return
		}
	}
	g.requests.Inc()
	started := time.Now()
	id := "gw-" + strconv.FormatUint(g.nextID.Add(1), 10)

	// The worker rank holding the longest cached prefix at the lowest load; the request is
	// booked there (its prompt counts as that rank's prefill load) until FreeRequest.
	res, err := g.router.FindBestMatch(prompt, &kvrouter.RequestOptions{Admit: true, RequestID: id})
	if err != nil {
		httpError(w, http.StatusServiceUnavailable, "no worker: %v", err)
		return
	}
	defer g.router.FreeRequest(id) // ended, failed or abandoned: no longer load
	if g.verbose {
		log.Printf("%s: %d tokens -> worker %d rank %d (%d cached)", id, len(prompt), res.WorkerID, res.DPRank, res.CachedTokens)
	}
	engine := g.engines[res.WorkerID]

	req["stream"] = json.RawMessage("true") // always streamed from the engine: the first token marks prefill
	payload, _ := json.Marshal(req)
	// The request's context ends when the client goes away, which cancels the engine's request.
	ereq, err := http.NewRequestWithContext(r.Context(), http.MethodPost, engine.URL+"/v1/completions", bytes.NewReader(payload))
	if err != nil {
		httpError(w, http.StatusInternalServerError, "%v", err)
		return
	}
	ereq.Header.Set("Content-Type", "application/json")
	ereq.Header.Set("X-Request-Id", id)
	if engine.DP > 1 {
		ereq.Header.Set("X-Data-Parallel-Rank", strconv.FormatUint(uint64(res.DPRank), 10))
	}
	eresp, err := g.client.Do(ereq)
	if err != nil {
		if g.gone(r) {
			return
		}
		g.engineErrors.Inc()
		httpError(w, http.StatusBadGateway, "engine %d: %v", res.WorkerID, err)
		return
	}
	defer eresp.Body.Close()
	h := w.Header()
	h.Set("X-Kvrouter-Worker", strconv.FormatUint(res.WorkerID, 10))
	h.Set("X-Kvrouter-Dp-Rank", strconv.FormatUint(uint64(res.DPRank), 10))
	h.Set("X-Kvrouter-Cached-Tokens", strconv.FormatUint(res.CachedTokens, 10))
	h.Set("X-Request-Id", id)
	if eresp.StatusCode != http.StatusOK { // the engine refused it: its answer, as it is
		g.engineErrors.Inc()
		h.Set("Content-Type", eresp.Header.Get("Content-Type"))
		w.WriteHeader(eresp.StatusCode)
		io.Copy(w, eresp.Body)
		return
	}

	var flusher *http.ResponseController
	if stream {
		h.Set("Content-Type", "text/event-stream")
		h.Set("Cache-Control", "no-cache")
		w.WriteHeader(http.StatusOK)
		flusher = http.NewResponseController(w)
		flusher.Flush()
	}
	var text strings.Builder
	var finish, usage json.RawMessage
	model := req["model"]
	first, finished := true, false
	lines := bufio.NewReaderSize(eresp.Body, 64<<10)
	for {
		line, err := lines.ReadBytes('\n')
		if err != nil {
			if g.gone(r) {
				return
			}
			g.engineErrors.Inc() // the engine ended the stream without [DONE]: it failed
			break
		}
		data, ok := bytes.CutPrefix(bytes.TrimRight(line, "\r\n"), []byte("data:"))
		if !ok {
			continue
		}
		data = bytes.TrimSpace(data)
		if first {
			first = false
			g.router.MarkPrefillCompleted(id) // the first token is out: the prompt is no longer prefill load
			g.firstToken.Observe(time.Since(started).Seconds())
		}
		done := bytes.Equal(data, []byte("[DONE]"))
		if stream {
			_, err := fmt.Fprintf(w, "data: %s\n\n", data)
			if err == nil {
				err = flusher.Flush()
			}
			if err != nil { // the client is gone (its context is cancelled too)
				g.disconnects.Inc()
				return
			}
		} else if !done {
			var chunk struct {
				Choices []struct {
					Text         string          `json:"text"`
					FinishReason json.RawMessage `json:"finish_reason"`
				} `json:"choices"`
				Model json.RawMessage `json:"model"`
				Usage json.RawMessage `json:"usage"`
			}
			if json.Unmarshal(data, &chunk) == nil {
				for _, c := range chunk.Choices {
					text.WriteString(c.Text)
					if len(c.FinishReason) > 0 && string(c.FinishReason) != "null" {
						finish = c.FinishReason
					}
				}
				if len(chunk.Usage) > 0 && string(chunk.Usage) != "null" {
					usage = chunk.Usage
				}
				if len(chunk.Model) > 0 {
					model = chunk.Model
				}
			}
		}
		if done {
			finished = true
			g.completed.Inc()
			break
		}
	}
	if stream {
		return
	}
	if !finished {
		httpError(w, http.StatusBadGateway, "engine %d ended its stream early", res.WorkerID)
		return
	}
	if finish == nil {
		finish = json.RawMessage("null")
	}
	if model == nil {
		model = json.RawMessage(`""`)
	}
	out := map[string]any{"id": id, "object": "text_completion", "created": time.Now().Unix(), "model": model,
		"choices": []map[string]any{{"index": 0, "text": text.String(), "finish_reason": finish}}}
	if usage != nil {
		out["usage"] = usage
	}
	h.Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(out)
}

// gone reports (and counts) a client that went away.
func (g *gateway) gone(r *http.Request) bool {
	if errors.Is(r.Context().Err(), context.Canceled) {
		g.disconnects.Inc()
		return true
	}
	return false
}
