/* What the standalone C ABI benchmarks (capi_*.c, each built with one cc command) share: a
 * monotonic clock in ns, and an exit on any failed call. Define _POSIX_C_SOURCE 199309L first. */
#ifndef KVR_BENCH_CAPI_BENCH_H
#define KVR_BENCH_CAPI_BENCH_H

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "kvrouter.h"

static double now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static void must(kvr_status status, const char* what) {
  if (status != KVR_OK) {
    fprintf(stderr, "%s failed: %d\n", what, (int)status);
    exit(1);
  }
}

#endif
