// Package fakeengine is a stand-in for an LLM engine with prefix caching, for trying the
// gateway and testing it: an OpenAI-style completions server (POST /v1/completions with a
// token-id prompt, streamed as server-sent events) that "generates" one token per Delay and,
// before its first token, caches the prompt's complete blocks and publishes a KV "stored"
// event for the blocks it did not hold yet, over kvrouter's native event stream (a Publisher
// connected to the gateway's -kv-listen). Its block hashes are the ones vLLM's router-facing
// events carry: the engine hash of a block is the chained sequence hash of the prompt's local
// block hashes. GET /stats returns its counters.
package fakeengine

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"sync"
	"time"

	kvrouter "github.com/kvrouter/kvrouter/bindings/go"
)

// Stats are an engine's counters.
type Stats struct {
	Requests     int `json:"requests"`
	Completed    int `json:"completed"`
	Cancelled    int `json:"cancelled"` // the client (the gateway) went away mid-stream
	StoredBlocks int `json:"stored_blocks"`
}

// Engine is a fake engine. Its methods may be called from any goroutine.
type Engine struct {
	WorkerID  uint64
	BlockSize uint32
	Delay     time.Duration // between tokens

	mu        sync.Mutex
	cache     map[uint64]bool // engine block hashes held
	stats     Stats
	endpoint  string
	publisher *kvrouter.Publisher
	batch     *kvrouter.EventBatch
}

// New returns an engine publishing its KV events to kvEndpoint (a kvrouter stream listener,
// "tcp://HOST:PORT" or "unix://PATH"), or to nobody if it is "".
func New(workerID uint64, blockSize uint32, delay time.Duration, kvEndpoint string) *Engine {
	return &Engine{WorkerID: workerID, BlockSize: blockSize, Delay: delay, endpoint: kvEndpoint, cache: map[uint64]bool{}}
}

// Close closes the event connection.
func (e *Engine) Close() {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.publisher.Close()
	e.batch.Close()
	e.publisher, e.batch = nil, nil
}

// Stats returns the engine's counters.
func (e *Engine) Stats() Stats {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.stats
}

// cachePrompt caches the prompt's complete blocks and publishes the new ones (one event, its
// parent the last block already held).
func (e *Engine) cachePrompt(prompt []uint32) error {
	local, err := kvrouter.ComputeBlockHashes(prompt, e.BlockSize, nil)
	if err != nil {
		return err
	}
	hashes, err := kvrouter.ComputeSequenceHashes(local)
	if err != nil {
		return err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	held := 0
	for held < len(hashes) && e.cache[hashes[held]] {
		held++
	}
	if held == len(hashes) {
		return nil
	}
	for _, h := range hashes[held:] {
		e.cache[h] = true
	}
	e.stats.StoredBlocks += len(hashes) - held
	if e.endpoint == "" {
		return nil
	}
	ev := &kvrouter.StoredEvent{WorkerID: e.WorkerID, BlockHashes: hashes[held:],
		TokenIDs: prompt[held*int(e.BlockSize) : len(hashes)*int(e.BlockSize)]}
	if held > 0 {
		ev.HasParent, ev.ParentHash = true, hashes[held-1]
	}
	if e.batch == nil {
		if e.batch, err = kvrouter.NewEventBatch(); err != nil {
			return err
		}
	}
	e.batch.Clear()
	if err := e.batch.AddStored(ev); err != nil {
		return err
	}
	if err := e.batch.SetPublishTime(time.Now()); err != nil {
		return err
	}
	for attempt := 0; ; attempt++ { // (re)connect once if the connection was lost
		if e.publisher == nil {
			if e.publisher, err = kvrouter.ConnectPublisher(e.endpoint); err != nil {
				return err
			}
		}
		if err = e.publisher.Send(e.batch); err == nil || attempt == 1 {
			return err
		}
		e.publisher.Close()
		e.publisher = nil
	}
}

func (e *Engine) count(f func(*Stats)) {
	e.mu.Lock()
	f(&e.stats)
	e.mu.Unlock()
}

// ServeHTTP serves POST /v1/completions and GET /stats.
func (e *Engine) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch r.URL.Path {
	case "/stats":
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(e.Stats())
		return
	case "/v1/completions":
	default:
		http.NotFound(w, r)
		return
	}
	var req struct {
		Prompt    []uint32 `json:"prompt"`
		MaxTokens *int     `json:"max_tokens"`
		Stream    bool     `json:"stream"`
	}
	body, _ := io.ReadAll(r.Body)
	if err := json.Unmarshal(body, &req); err != nil || len(req.Prompt) == 0 {
		http.Error(w, `{"error":{"message":"prompt: a list of token ids"}}`, http.StatusBadRequest)
		return
	}
	if !req.Stream {
		http.Error(w, `{"error":{"message":"this fake engine only streams"}}`, http.StatusBadRequest)
		return
	}
	e.count(func(s *Stats) { s.Requests++ })
	if err := e.cachePrompt(req.Prompt); err != nil {
		http.Error(w, fmt.Sprintf(`{"error":{"message":%q}}`, err.Error()), http.StatusInternalServerError)
		return
	}
	n := 16
	if req.MaxTokens != nil {
		n = *req.MaxTokens
	}
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(http.StatusOK)
	flush := http.NewResponseController(w)
	timer := time.NewTimer(e.Delay)
	defer timer.Stop()
	for i := 0; i < n; i++ {
		select {
		case <-r.Context().Done():
			e.count(func(s *Stats) { s.Cancelled++ })
			return
		case <-timer.C:
			timer.Reset(e.Delay)
		}
		var finish any
		if i == n-1 {
			finish = "length"
		}
		chunk, _ := json.Marshal(map[string]any{"id": "cmpl-fake", "object": "text_completion", "created": time.Now().Unix(),
			"model": fmt.Sprint("fake-", e.WorkerID), "choices": []map[string]any{{"index": 0, "text": fmt.Sprint(" t", i), "finish_reason": finish}}})
		fmt.Fprintf(w, "data: %s\n\n", chunk)
		if err := flush.Flush(); err != nil {
			e.count(func(s *Stats) { s.Cancelled++ })
			return
		}
	}
	io.WriteString(w, "data: [DONE]\n\n")
	flush.Flush()
	e.count(func(s *Stats) { s.Completed++ })
}
