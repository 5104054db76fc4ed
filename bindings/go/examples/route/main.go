// Command route shows kvrouter's Go binding end to end: a router with four workers, a KV
// "stored" event from one of them, a routing decision with its cost breakdown, the request's
// lifecycle, and the same events arriving over a Unix socket through an Ingest and a Publisher.
//
//	PKG_CONFIG_PATH=<prefix>/lib/pkgconfig go run ./examples/route
package main

import (
	"errors"
	"fmt"
	"io"
	"log"
	"os"
	"path/filepath"
	"time"

	kvrouter "github.com/kvrouter/kvrouter/bindings/go"
)

func main() {
	if err := run(os.Stdout); err != nil {
		log.Fatal(err)
	}
}

func run(w io.Writer) error {
	if err := kvrouter.CheckVersion(); err != nil {
		return err
	}
	opts := kvrouter.DefaultRouterOptions()
	opts.BlockSize = 16
	router, err := kvrouter.NewRouter(&opts)
	if err != nil {
		return err
	}
	defer router.Close()
	for id := uint64(1); id <= 4; id++ {
		if err := router.AddWorker(kvrouter.WorkerConfig{WorkerID: id}); err != nil {
			return err
		}
	}

	// Worker 2's engine cached the first two blocks of this prompt.
	prompt := make([]uint32, 48)
	for i := range prompt {
		prompt[i] = 1000 + uint32(i)
	}
	err = router.ApplyStored(&kvrouter.StoredEvent{
		WorkerID: 2, BlockHashes: []uint64{0xA1, 0xA2}, TokenIDs: prompt[:32],
	})
	if err != nil {
		return err
	}

	// Route and book the request, with every candidate's cost.
	candidates := make([]kvrouter.Candidate, 8)
	res, n, err := router.FindBestMatchCandidates(prompt,
		&kvrouter.RequestOptions{Admit: true, RequestID: "req-1"}, candidates)
	if err != nil {
		return err
	}
	fmt.Fprintf(w, "worker %d rank %d, %d tokens cached\n", res.WorkerID, res.DPRank, res.CachedTokens)
	for _, c := range candidates[:n] {
		fmt.Fprintf(w, "  worker %d: %d cached blocks, cost %.2f, chosen %v\n",
			c.WorkerID, c.DeviceBlocks, c.Cost, c.Chosen)
	}
	// A second booking under the same id is refused with a code.
	if _, err := router.FindBestMatch(prompt, &kvrouter.RequestOptions{Admit: true, RequestID: "req-1"}); err != nil {
		fmt.Fprintln(w, "again:", kvrouter.StatusOf(err).String())
	}
	if err := router.MarkPrefillCompleted("req-1"); err != nil { // first token produced
		return err
	}
	if err := router.FreeRequest("req-1"); err != nil { // request ended
		return err
	}

	// Live events: an ingest loop on a Unix socket, fed by a publisher.
	dir, err := os.MkdirTemp("", "kvrouter-example")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	ingest, err := kvrouter.NewIngest(router, nil)
	if err != nil {
		return err
	}
	defer ingest.Close()
	source, endpoint, err := ingest.Listen("unix://" + filepath.Join(dir, "events.sock"))
	if err != nil {
		return err
	}
	if err := ingest.Start(); err != nil {
		return err
	}
	pub, err := kvrouter.ConnectPublisher(endpoint)
	if err != nil {
		return err
	}
	defer pub.Close()
	batch, err := kvrouter.NewEventBatch()
	if err != nil {
		return err
	}
	defer batch.Close()
	err = batch.AddStored(&kvrouter.StoredEvent{
		WorkerID: 4, BlockHashes: []uint64{0xB1, 0xB2, 0xB3}, TokenIDs: prompt,
	})
	if err != nil {
		return err
	}
	if err := pub.Send(batch); err != nil {
		return err
	}
	for deadline := time.Now().Add(10 * time.Second); ; {
		s, err := ingest.Stats(source)
		if err != nil {
			return err
		}
		if s.EventsApplied > 0 {
			fmt.Fprintf(w, "ingest: %d message, %d event applied, lag %v\n", s.Messages, s.EventsApplied, s.LagLast)
			break
		}
		if time.Now().After(deadline) {
			return errors.New("the published event did not arrive")
		}
		time.Sleep(time.Millisecond)
	}
	res, err = router.FindBestMatch(prompt, nil)
	if err != nil {
		return err
	}
	fmt.Fprintf(w, "now worker %d, %d tokens cached\n", res.WorkerID, res.CachedTokens)
	return nil
}
