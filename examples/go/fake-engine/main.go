// Command fake-engine is a stand-in LLM engine for trying the gateway without GPUs: an
// OpenAI-style completions server that streams one token per -token-delay and publishes KV
// events for the prompt blocks it caches to the gateway's native event listener.
//
//	go run ./fake-engine -listen 127.0.0.1:9001 -worker-id 1 -kv-endpoint tcp://127.0.0.1:5557
package main

import (
	"flag"
	"log"
	"net/http"
	"time"

	"github.com/kvrouter/kvrouter/examples/go/internal/fakeengine"
)

func main() {
	listen := flag.String("listen", "127.0.0.1:9001", "HTTP address")
	worker := flag.Uint64("worker-id", 1, "the worker id the gateway knows this engine by")
	blockSize := flag.Uint("block-size", 16, "KV block size in tokens (the gateway's)")
	kv := flag.String("kv-endpoint", "", "the gateway's -kv-listen endpoint (tcp://HOST:PORT); empty: publish no events")
	delay := flag.Duration("token-delay", 20*time.Millisecond, "time per generated token")
	flag.Parse()
	e := fakeengine.New(*worker, uint32(*blockSize), *delay, *kv)
	defer e.Close()
	log.Printf("fake engine %d on http://%s, KV events to %q", *worker, *listen, *kv)
	log.Fatal(http.ListenAndServe(*listen, e))
}
