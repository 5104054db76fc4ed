//go:build cgo

// Package cbench times kvr_find_best_match in a loop written in C, on a router made by the
// kvrouter package, so that its benchmarks can show what cgo and the Go wrapper add to the
// same call. It is used by tests only.
package cbench

/*
#cgo pkg-config: kvrouter
#include <stdio.h>
#include <time.h>
#include "kvrouter.h"

// Routes iters prompts (query i % nq of the nq prompts of qlen tokens each), timing each
// kvr_find_best_match alone. With admit, each request is booked under a fresh id (formatted
// before the clock starts) and freed after the clock stops.
static kvr_status kvrgo_bench_find(kvr_router *router, const uint32_t *tokens, size_t nq,
                                   size_t qlen, size_t iters, int admit, int64_t *ns) {
  char id[32];
  kvr_request_options opts;
  kvr_request_options_init(&opts, sizeof opts);
  if (admit) {
    opts.flags = KVR_REQUEST_ADMIT;
    opts.request_id = id;
  }
  for (size_t i = 0; i < iters; ++i) {
    kvr_route_result result;
    struct timespec start, end;
    snprintf(id, sizeof id, "c-%zu", i);
    kvr_route_result_init(&result, sizeof result);
    clock_gettime(CLOCK_MONOTONIC, &start);
    kvr_status status = kvr_find_best_match(router, tokens + (i % nq) * qlen, qlen,
                                            admit ? &opts : NULL, &result, NULL, 0, NULL, NULL);
    clock_gettime(CLOCK_MONOTONIC, &end);
    if (status != KVR_OK) return status;
    ns[i] = (int64_t)(end.tv_sec - start.tv_sec) * 1000000000 + (end.tv_nsec - start.tv_nsec);
    if (admit) kvr_router_free_request(router, id, NULL);
  }
  return KVR_OK;
}
*/
import "C"

import (
	"fmt"
	"unsafe"
)

// FindBestMatchLoop runs the C loop on router (a *C.kvr_router of the kvrouter package) over
// tokens, which holds nq prompts of qlen tokens, and returns each call's time in ns.
func FindBestMatchLoop(router unsafe.Pointer, tokens []uint32, nq, qlen, iters int, admit bool) ([]int64, error) {
	ns := make([]int64, iters)
	if iters == 0 {
		return ns, nil
	}
	a := C.int(0)
	if admit {
		a = 1
	}
	st := C.kvrgo_bench_find((*C.kvr_router)(router), (*C.uint32_t)(unsafe.Pointer(&tokens[0])),
		C.size_t(nq), C.size_t(qlen), C.size_t(iters), a, (*C.int64_t)(unsafe.Pointer(&ns[0])))
	if st != C.KVR_OK {
		return nil, fmt.Errorf("kvr_find_best_match: %s", C.GoString(C.kvr_status_str(st)))
	}
	return ns, nil
}
