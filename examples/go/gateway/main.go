// Command gateway is an LLM gateway routed by kvrouter: OpenAI-style completions with token-id
// prompts, sent to the engine whose KV cache holds the longest prefix of the prompt at the
// lowest load.
//
//	go run ./gateway -listen 127.0.0.1:8000 -block-size 16 \
//	    -worker id=1,url=http://10.0.0.5:8000,zmq=tcp://10.0.0.5:5557 \
//	    -worker id=2,url=http://10.0.0.6:8000,zmq=tcp://10.0.0.6:5557
//
// For each POST /v1/completions ({"prompt": [token ids], "max_tokens": N, "stream": bool, ...})
// it asks the router for the best worker rank and books the request there
// (Router.FindBestMatch with a request id), forwards the request to that engine (always
// streamed from it), marks the request's prefill completed at the first streamed token, and
// streams the engine's server-sent events to the client, or gathers them into one JSON answer
// for "stream": false. The end of the stream, an engine failure or the client going away (its
// request context cancelled, which cancels the engine's request too) frees the booking. The
// engines' KV events reach the router through an Ingest: vLLM's (or SGLang's) ZMQ publishers
// (zmq= in -worker), or kvrouter's native event stream on -kv-listen. GET /metrics serves the
// router's and the ingest's metrics (the library's own names, through kvrouterprom) and the
// gateway's counters; GET /health answers ok. README.md says how to run it.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	kvrouter "github.com/kvrouter/kvrouter/bindings/go"
)

// workerFlags collects -worker flags.
type workerFlags []workerSpec

func (f *workerFlags) String() string { return fmt.Sprint(len(*f), " workers") }

// Set parses "id=1,url=http://host:port[,zmq=ENDPOINT][,replay=ENDPOINT][,topic=T][,dp=N]".
func (f *workerFlags) Set(s string) error {
	w, err := parseWorker(s)
	if err != nil {
		return err
	}
	*f = append(*f, w)
	return nil
}

func parseWorker(s string) (workerSpec, error) {
	var w workerSpec
	hasID := false
	for _, field := range strings.Split(s, ",") {
		key, value, ok := strings.Cut(field, "=")
		if !ok {
			return w, fmt.Errorf("%q: want key=value fields (id, url, zmq, replay, topic, dp)", field)
		}
		switch key {
		case "id":
			id, err := strconv.ParseUint(value, 10, 64)
			if err != nil {
				return w, fmt.Errorf("id %q: %v", value, err)
			}
			w.ID, hasID = id, true
		case "url":
			w.URL = strings.TrimRight(value, "/")
		case "zmq":
			w.ZMQ = value
		case "replay":
			w.Replay = value
		case "topic":
			w.Topic = value
		case "dp":
			n, err := strconv.ParseUint(value, 10, 32)
			if err != nil || n == 0 {
				return w, fmt.Errorf("dp %q: want a rank count >= 1", value)
			}
			w.DP = uint32(n)
		default:
			return w, fmt.Errorf("unknown field %q (id, url, zmq, replay, topic, dp)", key)
		}
	}
	if !hasID || w.URL == "" {
		return w, fmt.Errorf("%q: id= and url= are required", s)
	}
	return w, nil
}

func main() {
	var workers workerFlags
	listen := flag.String("listen", "127.0.0.1:8000", "HTTP address to serve on (port 0: a free port, printed)")
	blockSize := flag.Uint("block-size", 16, "KV block size in tokens (the engines' --block-size)")
	kvListen := flag.String("kv-listen", "", "kvrouter native KV event stream listener (tcp://HOST:PORT or unix://PATH), for engines publishing with kvrouter's Publisher")
	engine := flag.String("engine", "vllm", "the engines' ZMQ KV event format: vllm or sglang")
	verbose := flag.Bool("v", false, "log every routing decision")
	flag.Var(&workers, "worker", "an engine: id=N,url=http://HOST:PORT[,zmq=ENDPOINT][,replay=ENDPOINT][,topic=TOPIC][,dp=RANKS] (repeat per engine); zmq, replay and topic as in vLLM's --kv-events-config")
	flag.Parse()
	if len(workers) == 0 {
		fmt.Fprintln(os.Stderr, "gateway: at least one -worker id=N,url=... is needed")
		flag.Usage()
		os.Exit(2)
	}
	cfg := config{BlockSize: uint32(*blockSize), KVListen: *kvListen, Workers: workers, Verbose: *verbose}
	switch *engine {
	case "vllm":
		cfg.Engine = kvrouter.EngineVLLM
	case "sglang":
		cfg.Engine = kvrouter.EngineSGLang
	default:
		log.Fatalf("gateway: -engine %q: vllm or sglang", *engine)
	}
	// The binding checks the library's version when it loads; a mismatch fails here, clearly.
	g, err := newGateway(cfg)
	if err != nil {
		log.Fatalf("gateway: %v", err)
	}
	defer g.close()
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		log.Fatalf("gateway: %v", err)
	}
	// One line for whoever started us (scripts read it): where we listen.
	json.NewEncoder(os.Stdout).Encode(map[string]string{"listening": "http://" + ln.Addr().String(),
		"kv_endpoint": g.kvEndpoint, "libkvrouter": kvrouter.VersionString()})
	srv := &http.Server{Handler: g.handler(), ReadHeaderTimeout: 10 * time.Second}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	go func() {
		<-ctx.Done()
		shutdown, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		srv.Shutdown(shutdown)
	}()
	if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		log.Fatalf("gateway: %v", err)
	}
}
