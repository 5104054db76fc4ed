//go:build cgo

package kvrouter

/*
#include "kvrouter.h"
*/
import "C"

import "unsafe"

// Helpers for the package's tests (abi_test.go), which cannot use cgo themselves: they pass
// values through C structs without naming a C type, so a test can check the generated mirrors
// and the safe layer's conversions on both sides of the C struct. Nothing else calls them (the
// linker leaves them out of programs).

// loaded reads a C struct into its generated mirror: loaded(o.toC(), (*cRouterOptions).load)
// is what the safe layer hands the library for o.
func loaded[M, T any](c *T, load func(*M, *T)) M {
	var m M
	load(&m, c)
	return m
}

// initLoaded is the mirror of a struct as its generated init helper leaves it: the library's
// defaults.
func initLoaded[M, T any](init func(*T), load func(*M, *T)) M {
	var c T
	init(&c)
	return loaded(&c, load)
}

// storeLoaded passes a mirror through its C struct (store, then load into a fresh mirror).
func storeLoaded[M, T any](m M, store func(*M, *T), load func(*M, *T)) M {
	var c T
	store(&m, &c)
	return loaded(&c, load)
}

// sizedInit is struct_size as a generated init helper leaves it, and the size of the struct as
// this package was compiled (unsafe.Sizeof). Every versioned struct begins with uint32_t
// struct_size (the header's conventions).
type sizedInit struct {
	structSize uint32
	compiled   uintptr
}

func initSized[T any](init func(*T)) sizedInit {
	var c T
	init(&c)
	return sizedInit{structSize: *(*uint32)(unsafe.Pointer(&c)), compiled: unsafe.Sizeof(c)}
}

// initHelpers runs every generated init helper, by the name of its C struct.
func initHelpers() map[string]sizedInit {
	return map[string]sizedInit{
		"kvr_hash_options":     initSized(initHashOptions),
		"kvr_router_options":   initSized(initRouterOptions),
		"kvr_worker_config":    initSized(initWorkerConfig),
		"kvr_stored_event":     initSized(initStoredEvent),
		"kvr_removed_event":    initSized(initRemovedEvent),
		"kvr_request_options":  initSized(initRequestOptions),
		"kvr_route_result":     initSized(initRouteResult),
		"kvr_metrics":          initSized(initMetrics),
		"kvr_routing_hints":    initSized(initRoutingHints),
		"kvr_route_signals":    initSized(initRouteSignals),
		"kvr_disagg_options":   initSized(initDisaggOptions),
		"kvr_prefill_result":   initSized(initPrefillResult),
		"kvr_ingest_options":   initSized(initIngestOptions),
		"kvr_engine_worker":    initSized(initEngineWorker),
		"kvr_jetstream_source": initSized(initJetstreamSource),
		"kvr_ingest_stats":     initSized(initIngestStats),
	}
}

// fillGrowingFake runs fillGrowing over a fake call instead of the library's: answer(call) is
// the length the call-th call (from 1) needs, and the call says KVR_BUFFER_TOO_SMALL when that is
// more than the room it was given. It returns the length filled, the room each call was given,
// and fillGrowing's error.
func fillGrowingFake(capHint int, answer func(call int) int) (int, []int, error) {
	var caps []int
	buf, err := fillGrowing(capHint, func(p *C.uint64_t, cap C.size_t, n *C.size_t, cerr **C.kvr_error) C.kvr_status {
		caps = append(caps, int(cap))
		*n = C.size_t(answer(len(caps)))
		if *n > cap {
			return C.KVR_BUFFER_TOO_SMALL
		}
		return C.KVR_OK
	})
	return len(buf), caps, err
}
