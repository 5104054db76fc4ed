// Command go-consumer is a program outside the binding's module that uses it as a user's
// project would: its go.mod requires github.com/kvrouter/kvrouter/bindings/go and replaces it
// with this checkout's bindings/go; libkvrouter is found through pkg-config (PKG_CONFIG_PATH).
// scripts/test-go.sh builds it against the staged library, linked with libkvrouter.so and,
// with -tags kvrouter_static, with libkvrouter.a, and runs it; it routes one request and prints
// the library's version and the worker chosen. Run with a library reporting another version
// (test-go.sh preloads a kvr_version that says 0.3.0), it fails with the binding's error.
package main

import (
	"fmt"
	"log"

	kvrouter "github.com/kvrouter/kvrouter/bindings/go"
)

func main() {
	// No version call: the binding compared the loaded library's version with its own when it
	// was initialised, and with another major.minor NewRouter returns that error.
	opts := kvrouter.DefaultRouterOptions()
	opts.BlockSize = 16
	router, err := kvrouter.NewRouter(&opts)
	if err != nil {
		log.Fatal(err)
	}
	defer router.Close()
	for id := uint64(1); id <= 3; id++ {
		if err := router.AddWorker(kvrouter.WorkerConfig{WorkerID: id}); err != nil {
			log.Fatal(err)
		}
	}
	prompt := make([]uint32, 64)
	for i := range prompt {
		prompt[i] = uint32(100 + i)
	}
	if err := router.ApplyStored(&kvrouter.StoredEvent{WorkerID: 3, BlockHashes: []uint64{1, 2, 3}, TokenIDs: prompt[:48]}); err != nil {
		log.Fatal(err)
	}
	res, err := router.FindBestMatch(prompt, &kvrouter.RequestOptions{Admit: true, RequestID: "r1"})
	if err != nil {
		log.Fatal(err)
	}
	if err := router.FreeRequest("r1"); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("libkvrouter %s: worker %d, %d tokens cached\n", kvrouter.VersionString(), res.WorkerID, res.CachedTokens)
	if res.WorkerID != 3 || res.CachedTokens != 48 {
		log.Fatal("wrong decision")
	}
}
