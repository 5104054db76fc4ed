package kvrouter_test

import (
	"errors"
	"fmt"

	kvrouter "github.com/kvrouter/kvrouter/bindings/go"
)

func Example() {
	opts := kvrouter.DefaultRouterOptions()
	opts.BlockSize = 16
	router, _ := kvrouter.NewRouter(&opts)
	defer router.Close()
	for id := uint64(1); id <= 4; id++ {
		router.AddWorker(kvrouter.WorkerConfig{WorkerID: id})
	}
	prompt := make([]uint32, 48)
	for i := range prompt {
		prompt[i] = 1000 + uint32(i)
	}
	// Worker 2 cached the first two blocks.
	router.ApplyStored(&kvrouter.StoredEvent{WorkerID: 2, BlockHashes: []uint64{0xA1, 0xA2}, TokenIDs: prompt[:32]})

	res, err := router.FindBestMatch(prompt, &kvrouter.RequestOptions{Admit: true, RequestID: "req-1"})
	if err != nil {
		panic(err)
	}
	fmt.Printf("worker %d, %d tokens cached, booked %v\n", res.WorkerID, res.CachedTokens, res.Booked)
	router.MarkPrefillCompleted("req-1")
	router.FreeRequest("req-1")
	// Output: worker 2, 32 tokens cached, booked true
}

func ExampleStatus() {
	router, _ := kvrouter.NewRouter(nil)
	defer router.Close()
	err := router.RemoveWorker(42)
	fmt.Println(errors.Is(err, kvrouter.ErrNotFound), kvrouter.StatusOf(err).String())
	var e *kvrouter.Error
	if errors.As(err, &e) {
		fmt.Println(e.Code() == kvrouter.ErrNotFound)
	}
	// Output:
	// true KVR_NOT_FOUND
	// true
}
