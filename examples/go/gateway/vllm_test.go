package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	kvrouter "github.com/kvrouter/kvrouter/bindings/go"
)

// vllmEngine is a real vLLM CPU engine (a tiny random Llama, no weights, no tokenizer).
type vllmEngine struct {
	id      uint64
	url     string
	events  string // its ZMQ KV event publisher (ipc: vLLM binds it)
	replay  string
	cmd     *exec.Cmd
	logPath string
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

const vllmBlockSize = 32 // vLLM's CPU attention needs block size 32

func startVLLM(t *testing.T, python, model, workdir string, id uint64) *vllmEngine {
	t.Helper()
	port := freePort(t)
	e := &vllmEngine{id: id, url: fmt.Sprintf("http://127.0.0.1:%d", port),
		events:  fmt.Sprintf("ipc://%s/go-%d.kv-events", workdir, id),
		replay:  fmt.Sprintf("tcp://127.0.0.1:%d", freePort(t)),
		logPath: filepath.Join(workdir, fmt.Sprintf("go-engine-%d.log", id))}
	kvEvents, _ := json.Marshal(map[string]any{"enable_kv_cache_events": true, "publisher": "zmq",
		"endpoint": e.events, "replay_endpoint": e.replay, "topic": "kv-events"})
	e.cmd = exec.Command("nice", "-n", "10", python, "-m", "vllm.entrypoints.openai.api_server",
		"--host", "127.0.0.1", "--port", strconv.Itoa(port), "--model", model, "--served-model-name", "tiny",
		"--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "float32",
		"--block-size", strconv.Itoa(vllmBlockSize), "--max-model-len", "256", "--enable-prefix-caching",
		"--num-gpu-blocks-override", "64", "--max-num-seqs", "4", "--enforce-eager",
		"--enable-prompt-tokens-details", "--kv-events-config", string(kvEvents))
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "LD_LIBRARY_PATH=") { // the staged libkvrouter is not the engine's business
			env = append(env, kv)
		}
	}
	e.cmd.Env = append(env, "VLLM_CPU_KVCACHE_SPACE=1", "VLLM_CPU_OMP_THREADS_BIND=nobind", "OMP_NUM_THREADS=1",
		"HF_HUB_OFFLINE=1", "TRANSFORMERS_OFFLINE=1", "VLLM_NO_USAGE_STATS=1", "DO_NOT_TRACK=1")
	e.cmd.Dir = workdir
	e.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	logFile, err := os.Create(e.logPath)
	if err != nil {
		t.Fatal(err)
	}
	e.cmd.Stdout, e.cmd.Stderr = logFile, logFile
	if err := e.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Logf("engine %d: %s (events %s, replay %s, log %s)", id, e.url, e.events, e.replay, e.logPath)
	t.Cleanup(func() {
		syscall.Kill(-e.cmd.Process.Pid, syscall.SIGTERM)
		done := make(chan struct{})
		go func() { e.cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			syscall.Kill(-e.cmd.Process.Pid, syscall.SIGKILL)
			<-done
		}
		logFile.Close()
	})
	return e
}

func (e *vllmEngine) waitHealthy(t *testing.T, timeout time.Duration) {
	t.Helper()
	began := time.Now()
	for time.Since(began) < timeout {
		if e.cmd.ProcessState != nil {
			break
		}
		if resp, err := http.Get(e.url + "/health"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				t.Logf("engine %d: healthy after %.0f s", e.id, time.Since(began).Seconds())
				return
			}
		}
		time.Sleep(time.Second)
	}
	logText, _ := os.ReadFile(e.logPath)
	if len(logText) > 4000 {
		logText = logText[len(logText)-4000:]
	}
	t.Fatalf("engine %d not healthy after %v:\n%s", e.id, timeout, logText)
}

// vllmCompletion is what the test reads from a completion answered through the gateway.
type vllmCompletion struct {
	worker, cached     uint64 // the gateway's routing headers
	engineCachedTokens int    // vLLM's usage.prompt_tokens_details.cached_tokens
}

func completeVLLM(t *testing.T, url string, p []uint32) vllmCompletion {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"model": "tiny", "prompt": p, "max_tokens": 2, "temperature": 0,
		"stream": false, "stream_options": map[string]any{"include_usage": true}})
	resp, err := http.Post(url+"/v1/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	var answer struct {
		Usage struct {
			PromptTokensDetails struct {
				CachedTokens int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(b, &answer); err != nil {
		t.Fatalf("%v: %s", err, b)
	}
	var c vllmCompletion
	c.worker, _ = strconv.ParseUint(resp.Header.Get("X-Kvrouter-Worker"), 10, 64)
	c.cached, _ = strconv.ParseUint(resp.Header.Get("X-Kvrouter-Cached-Tokens"), 10, 64)
	c.engineCachedTokens = answer.Usage.PromptTokensDetails.CachedTokens
	return c
}

// TestVLLMEngines runs the gateway in front of two real vLLM CPU engines, their KV events
// ingested from their ZMQ publishers: scripts/test-engines.sh --go sets KVR_VLLM_PYTHON (the
// venv's python with vllm-cpu), KVR_VLLM_MODEL (the tiny model's directory) and
// KVR_VLLM_WORKDIR; skipped without them (and so in CI).
func TestVLLMEngines(t *testing.T) {
	python, model, workdir := os.Getenv("KVR_VLLM_PYTHON"), os.Getenv("KVR_VLLM_MODEL"), os.Getenv("KVR_VLLM_WORKDIR")
	if python == "" || model == "" || workdir == "" {
		t.Skip("real vLLM engines: run scripts/test-engines.sh --go")
	}
	engines := []*vllmEngine{startVLLM(t, python, model, workdir, 1), startVLLM(t, python, model, workdir, 2)}
	var specs []workerSpec
	for _, e := range engines {
		specs = append(specs, workerSpec{ID: e.id, URL: e.url, ZMQ: e.events, Replay: e.replay, Topic: "kv-events"})
	}
	g, err := newGateway(config{BlockSize: vllmBlockSize, Engine: kvrouter.EngineVLLM, Workers: specs, Verbose: true})
	if err != nil {
		t.Fatal(err)
	}
	gw := httptest.NewServer(g.handler())
	t.Cleanup(func() {
		gw.Close()
		g.close()
	})
	for _, e := range engines {
		e.waitHealthy(t, 10*time.Minute)
	}

	rng := rand.New(rand.NewSource(16))
	tokens := func(n int) []uint32 {
		p := make([]uint32, n)
		for i := range p {
			p[i] = uint32(3 + rng.Intn(2000)) // the tiny model's vocabulary is 2,048
		}
		return p
	}
	join := func(a, b []uint32) []uint32 { return append(append([]uint32{}, a...), b...) }
	// held waits until the router's index has the prompt's first `blocks` blocks on worker.
	held := func(p []uint32, worker uint64, blocks uint32) {
		t.Helper()
		deadline := time.Now().Add(60 * time.Second)
		for time.Now().Before(deadline) {
			scores, err := g.router.OverlapScores(p, nil)
			if err != nil {
				t.Fatal(err)
			}
			for _, s := range scores {
				if s.WorkerID == worker && s.DeviceBlocks >= blocks {
					return
				}
			}
			time.Sleep(20 * time.Millisecond)
		}
		st, _ := g.ingest.Stats(0)
		t.Fatalf("worker %d's events for %d blocks did not arrive in 60 s (ingest: %+v)", worker, blocks, st)
	}

	// Prefix A through the gateway; prefix B straight to the other engine, as if another
	// gateway had sent it there. Both reach the router only as the engines' KV events.
	a, b := tokens(4*vllmBlockSize), tokens(4*vllmBlockSize)
	first := completeVLLM(t, gw.URL, join(a, tokens(10)))
	wa := first.worker
	if wa == 0 || first.cached != 0 {
		t.Fatalf("first request: worker %d, %d cached", wa, first.cached)
	}
	other := engines[0]
	if other.id == wa {
		other = engines[1]
	}
	body, _ := json.Marshal(map[string]any{"model": "tiny", "prompt": join(b, tokens(10)), "max_tokens": 1})
	resp, err := http.Post(other.url+"/v1/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	held(a, wa, 4)
	held(b, other.id, 4)

	// Follow-ups go where their prefix is, and the engine finds it cached as the router said.
	for i, c := range []struct {
		p    []uint32
		want uint64
	}{{join(b, tokens(20)), other.id}, {join(a, tokens(5)), wa}, {join(b[:3*vllmBlockSize], tokens(40)), other.id}, {join(a, tokens(30)), wa}} {
		got := completeVLLM(t, gw.URL, c.p)
		t.Logf("follow-up %d: worker %d (want %d), router %d cached tokens, engine %d", i, got.worker, c.want, got.cached, got.engineCachedTokens)
		if got.worker != c.want {
			t.Errorf("follow-up %d went to worker %d, want %d (which holds its prefix)", i, got.worker, c.want)
		}
		if got.cached < 3*vllmBlockSize || uint64(got.engineCachedTokens) != got.cached {
			t.Errorf("follow-up %d: the router said %d tokens cached, the engine found %d", i, got.cached, got.engineCachedTokens)
		}
	}
	waitFor(t, "the loads to return to zero", func() bool { return idle(t, g, a) })

	// A client leaving mid-stream: the booking is freed (and vLLM's request aborted).
	ctx, cancel := context.WithCancel(context.Background())
	stream := post(ctx, t, gw.URL, map[string]any{"model": "tiny", "prompt": tokens(70), "max_tokens": 150,
		"ignore_eos": true, "stream": true})
	if _, err := bufio.NewReader(stream.Body).ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	cancel()
	stream.Body.Close()
	waitFor(t, "the abandoned request to be freed", func() bool { return idle(t, g, a) })

	resp, err = http.Get(gw.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	text, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{`kvrouter_kv_events_total{kind="stored",outcome="ok"}`, "kvrouter_gateway_requests_total 6"} {
		if !bytes.Contains(text, []byte(want)) {
			t.Errorf("/metrics has no %q", want)
		}
	}
	st, err := g.ingest.Stats(0)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("ingest: %d messages, %d events applied, %d gaps, mean lag %v", st.Messages, st.EventsApplied, st.Gaps, st.MeanLag())
}
