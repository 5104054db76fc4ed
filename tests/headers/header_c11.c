/* include/kvrouter.h compiles alone as strict C11, and the layout of the structs whose layout is
 * frozen forever (array elements without struct_size) and of the versioned structs' leading
 * fields does not change by accident. */
#include <stddef.h>

#include "kvrouter.h"

#if !defined(__STDC_VERSION__) || __STDC_VERSION__ != 201112L
#error "this file must be compiled as C11"
#endif

_Static_assert(sizeof(kvr_status) == 4, "kvr_status is an int32_t");
_Static_assert(KVR_OK == 0, "KVR_OK is 0");
_Static_assert(offsetof(kvr_router_options, struct_size) == 0, "struct_size comes first");
_Static_assert(offsetof(kvr_worker_config, struct_size) == 0, "struct_size comes first");
_Static_assert(offsetof(kvr_request_options, struct_size) == 0, "struct_size comes first");
_Static_assert(offsetof(kvr_route_result, struct_size) == 0, "struct_size comes first");
_Static_assert(offsetof(kvr_hash_options, struct_size) == 0, "struct_size comes first");
_Static_assert(offsetof(kvr_stored_event, struct_size) == 0, "struct_size comes first");
_Static_assert(offsetof(kvr_removed_event, struct_size) == 0, "struct_size comes first");
_Static_assert(offsetof(kvr_metrics, struct_size) == 0, "struct_size comes first");

#if UINTPTR_MAX == 0xFFFFFFFFFFFFFFFFu
/* LP64: the frozen array-element layouts as first published. */
_Static_assert(sizeof(kvr_candidate) == 152, "kvr_candidate layout is frozen");
_Static_assert(offsetof(kvr_candidate, chosen) == 28, "kvr_candidate layout is frozen");
_Static_assert(offsetof(kvr_candidate, effective_overlap_blocks) == 32, "frozen");
_Static_assert(offsetof(kvr_candidate, cost) == 104, "kvr_candidate layout is frozen");
_Static_assert(offsetof(kvr_candidate, credit_decay) == 120, "kvr_candidate layout is frozen");
_Static_assert(offsetof(kvr_candidate, reserved) == 144, "kvr_candidate layout is frozen");
_Static_assert(sizeof(kvr_overlap) == 72, "kvr_overlap layout is frozen");
_Static_assert(offsetof(kvr_overlap, effective_overlap_blocks) == 32, "frozen");
_Static_assert(offsetof(kvr_overlap, tree_size) == 48, "kvr_overlap layout is frozen");
_Static_assert(sizeof(kvr_potential_load) == 72, "kvr_potential_load layout is frozen");
_Static_assert(offsetof(kvr_potential_load, active_requests) == 48, "frozen");
_Static_assert(sizeof(kvr_router_options) == 152,
               "kvr_router_options size (0.2: + cost knobs, + index_shards, + cost function)");
_Static_assert(offsetof(kvr_router_options, cost_function) == 128,
               "kvr_router_options 0.2 fields are appended");
_Static_assert(offsetof(kvr_router_options, index_shards) == 120,
               "kvr_router_options 0.2 fields are appended");
_Static_assert(offsetof(kvr_router_options, overlap_score_credit_decay) == 104,
               "kvr_router_options v1 fields are frozen");
_Static_assert(sizeof(kvr_stored_event) == 128 && offsetof(kvr_stored_event, sliding_group) == 112,
               "kvr_stored_event: the sliding-window fields appended (0.2)");
_Static_assert(sizeof(kvr_removed_event) == 64 && offsetof(kvr_removed_event, sliding_group) == 48,
               "kvr_removed_event: the sliding-window fields appended (0.2)");
_Static_assert(sizeof(kvr_metrics) % 8 == 0, "kvr_metrics has no odd tail");
_Static_assert(sizeof(kvr_metrics) == 528,
               "kvr_metrics size (0.2: + the decision-latency histogram, 240 bytes, replica "
               "liveness, 16, the refusals for memory, 16, decisions priced again, 8, and "
               "sliding windows, 24)");
_Static_assert(offsetof(kvr_metrics, decision_latency_bounds_ns) == 224,
               "kvr_metrics 0.2 fields are appended");
_Static_assert(sizeof(kvr_ingest_stats) == 344,
               "kvr_ingest_stats size (0.2: + last_reject, 128 bytes, stream_sequence, 8, "
               "the JetStream consumer remakes, 16, events_ignored, 8, and bookings_trimmed, 8)");
_Static_assert(sizeof(kvr_jetstream_source) == 64, "kvr_jetstream_source size (0.2)");
_Static_assert(offsetof(kvr_ingest_stats, last_reject) == 176,
               "kvr_ingest_stats 0.2 fields are appended");
#endif

int main(void) {
  kvr_metrics metrics;
  kvr_metrics_init(&metrics, sizeof metrics);
  return metrics.struct_size == sizeof metrics ? 0 : 1;
}
