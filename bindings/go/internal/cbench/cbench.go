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

// Runs iters calls of one kind (op 0: a preview of prompt i % nq; 1: an admitted route of it
// under ids[i % nids] and its free; 2: mark_prefill_completed and free of ids[i % nids]) and
// returns the whole chunk's time in ns (-1 on a failed call). ids is nids NUL-terminated
// strings of stride bytes each, formatted beforehand.
static int64_t kvrgo_bench_chunk(kvr_router *router, int op, const uint32_t *tokens, size_t nq,
                                 size_t qlen, const char *ids, size_t nids, size_t stride,
                                 size_t iters) {
  kvr_request_options opts;
  kvr_request_options_init(&opts, sizeof opts);
  opts.flags = KVR_REQUEST_ADMIT;
  struct timespec start, end;
  clock_gettime(CLOCK_MONOTONIC, &start);
  for (size_t i = 0; i < iters; ++i) {
    const char *id = ids + (i % nids) * stride;
    kvr_status st = KVR_OK;
    if (op == 0 || op == 1) {
      kvr_route_result result;
      kvr_route_result_init(&result, sizeof result);
      opts.request_id = id;
      st = kvr_find_best_match(router, tokens + (i % nq) * qlen, qlen, op == 1 ? &opts : NULL,
                               &result, NULL, 0, NULL, NULL);
      if (st == KVR_OK && op == 1) st = kvr_router_free_request(router, id, NULL);
    } else {
      st = kvr_router_mark_prefill_completed(router, id, NULL);
      if (st == KVR_OK) st = kvr_router_free_request(router, id, NULL);
    }
    if (st != KVR_OK) return -1;
  }
  clock_gettime(CLOCK_MONOTONIC, &end);
  return (int64_t)(end.tv_sec - start.tv_sec) * 1000000000 + (end.tv_nsec - start.tv_nsec);
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

// Chunk operations of ChunkLoop.
const (
	OpPreview   = 0 // a query-only kvr_find_best_match
	OpAdmitFree = 1 // an admitted kvr_find_best_match and kvr_router_free_request of its id
	OpMarkFree  = 2 // kvr_router_mark_prefill_completed and kvr_router_free_request
)

// ChunkLoop runs iters calls of op from C on router (prompt i % nq of tokens, which holds nq
// prompts of qlen tokens; id i % len(ids)) and returns the chunk's time in ns.
func ChunkLoop(router unsafe.Pointer, op int, tokens []uint32, nq, qlen int, ids []string, iters int) (int64, error) {
	stride := 1
	for _, id := range ids {
		stride = max(stride, len(id)+1)
	}
	flat := make([]byte, stride*len(ids))
	for i, id := range ids {
		copy(flat[i*stride:], id)
	}
	ns := C.kvrgo_bench_chunk((*C.kvr_router)(router), C.int(op), (*C.uint32_t)(unsafe.Pointer(&tokens[0])),
		C.size_t(nq), C.size_t(qlen), (*C.char)(unsafe.Pointer(&flat[0])), C.size_t(len(ids)), C.size_t(stride), C.size_t(iters))
	if ns < 0 {
		return 0, fmt.Errorf("cbench: op %d failed", op)
	}
	return int64(ns), nil
}
