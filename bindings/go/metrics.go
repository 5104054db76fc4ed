//go:build cgo

package kvrouter

/*
#include "kvrouter.h"
*/
import "C"

import (
	"runtime"
	"time"
)

// Snapshot returns the whole KV index as a FlatBuffers IndexSnapshot
// (schema/index_snapshot.fbs), for a warm restart or a new replica.
func (r *Router) Snapshot() ([]byte, error) {
	h := r.acquire()
	if h == nil {
		return nil, ErrClosed
	}
	defer r.release()
	var buf *C.kvr_buffer
	var cerr *C.kvr_error
	st := C.kvr_router_snapshot(h, &buf, &cerr)
	runtime.KeepAlive(r)
	if err := takeError(st, cerr); err != nil {
		return nil, err
	}
	return takeBuffer(nil, buf), nil
}

// Restore loads a snapshot into a router whose index is empty (else ErrFailedPrecondition, as
// in approximate mode; of two restores at once, one loads its snapshot and the other gets
// that). A buffer that fails verification, or one of another block size,
// changes nothing (ErrInvalidArgument).
func (r *Router) Restore(snapshot []byte) error {
	h := r.acquire()
	if h == nil {
		return ErrClosed
	}
	defer r.release()
	p, n := bytesPtr(snapshot)
	var cerr *C.kvr_error
	st := C.kvr_router_restore(h, p, n, &cerr)
	runtime.KeepAlive(r)
	runtime.KeepAlive(snapshot)
	return takeError(st, cerr)
}

// Metrics are the router's counters and gauges.
type Metrics struct {
	// Events[kind][outcome] (indexed by EventKind and EventOutcome): events applied (EventOK)
	// or rejected per reason.
	Events               [EventKinds][EventOutcomes]uint64
	EventBatchesRejected uint64 // buffers that failed verification
	Decisions            uint64 // FindBestMatch calls that picked a worker
	RequestsActive       uint64
	QueuePending         uint64
	QueuePendingTokens   uint64
	Workers              uint64
	IndexNodes           uint64
	IndexBlocks          uint64 // cached (block, rank) entries
	IndexBytes           int64
	// Other router replicas' booking changes applied and rejected here, and their bookings
	// active here now (counted in RequestsActive too).
	ReplicaChangesApplied  uint64
	ReplicaChangesRejected uint64
	ReplicaRequestsActive  uint64
	// Replica liveness: the other replicas heard sending heartbeats and not expired, and those
	// whose bookings ExpireReplicas dropped because they fell silent.
	ReplicasLive    uint64
	ReplicasExpired uint64
	// What the heap refused: KV events the index could not apply for want of memory
	// (ErrResourceExhausted), before they changed anything or midway, the rank then left
	// holding nothing (0 in approximate mode, which takes no events), and this
	// router's own booking changes its replica publisher lost for want of memory or its
	// transport refused (each repaired by announcing every booking again).
	EventsRefusedForMemory    uint64
	ReplicaChangesUnpublished uint64
	// Routing decisions decided a second time: priced outside the router's lock while another
	// call changed what they priced (the chosen rank's load, the queue, the session's binding),
	// then decided again under it. Such a change comes from another thread (another routing
	// call, a release, another replica's booking); 0 while nothing else calls the router. What
	// concurrent callers cost each other.
	DecisionsPricedAgain uint64
	// Hybrid models' sliding-window KV-cache groups (docs/ingest.md, "Sliding windows"): their
	// events applied, and rejected (a stored block the rank does not hold in full attention, a
	// removed block the group lacks, a window of 0, a tier other than the device), and the
	// (group, block) entries held over every rank; 0 for models without such groups.
	SlidingEventsApplied  uint64
	SlidingEventsRejected uint64
	IndexSlidingBlocks    uint64
	// How long routing calls took to decide (routing and plans answered without queueing,
	// and previews; failed calls are not measured), from the call's start to its decision,
	// over a sample of the calls (the first, then one in 16: Count is not Decisions).
	DecisionLatency LatencyHistogram
}

// LatencyHistogram is a cumulative histogram, as Prometheus keeps one: Counts[i] calls took at
// most Bounds[i] (the bounds rise, and are the library's to choose); Count is every call
// measured (the +Inf bucket) and Sum their durations added up.
type LatencyHistogram struct {
	Bounds [DecisionLatencyBuckets]time.Duration
	Counts [DecisionLatencyBuckets]uint64
	Count  uint64
	Sum    time.Duration
}

// Metrics returns the router's counters.
func (r *Router) Metrics() (Metrics, error) {
	h := r.acquire()
	if h == nil {
		return Metrics{}, ErrClosed
	}
	defer r.release()
	var c C.kvr_metrics
	initMetrics(&c)
	var cerr *C.kvr_error
	st := C.kvr_router_get_metrics(h, &c, &cerr)
	runtime.KeepAlive(r)
	if err := takeError(st, cerr); err != nil {
		return Metrics{}, err
	}
	var g cMetrics
	g.load(&c)
	return metricsFrom(&g), nil
}

func metricsFrom(g *cMetrics) Metrics {
	return Metrics{
		Events:               g.Events,
		EventBatchesRejected: g.EventBatchesRejected,
		Decisions:            g.Decisions,
		RequestsActive:       g.RequestsActive,
		QueuePending:         g.QueuePending,
		QueuePendingTokens:   g.QueuePendingTokens,
		Workers:              g.Workers,
		IndexNodes:           g.IndexNodes,
		IndexBlocks:          g.IndexBlocks,
		IndexBytes:           g.IndexBytes,

		ReplicaChangesApplied:  g.ReplicaChangesApplied,
		ReplicaChangesRejected: g.ReplicaChangesRejected,
		ReplicaRequestsActive:  g.ReplicaRequestsActive,
		ReplicasLive:           g.ReplicasLive,
		ReplicasExpired:        g.ReplicasExpired,

		EventsRefusedForMemory:    g.EventsRefusedForMemory,
		ReplicaChangesUnpublished: g.ReplicaChangesUnpublished,
		DecisionsPricedAgain:      g.DecisionsPricedAgain,

		SlidingEventsApplied:  g.SlidingEventsApplied,
		SlidingEventsRejected: g.SlidingEventsRejected,
		IndexSlidingBlocks:    g.IndexSlidingBlocks,

		DecisionLatency: latencyFrom(&g.DecisionLatencyBoundsNs, &g.DecisionLatencyLe, g.DecisionLatencyCount, g.DecisionLatencySumNs),
	}
}

func latencyFrom(boundsNs, le *[DecisionLatencyBuckets]uint64, count, sumNs uint64) LatencyHistogram {
	h := LatencyHistogram{Counts: *le, Count: count, Sum: time.Duration(sumNs)}
	for i, b := range boundsNs {
		h.Bounds[i] = time.Duration(b)
	}
	return h
}

// MetricsPrometheus returns the metrics, plus per-worker load gauges, in the Prometheus text
// exposition format.
func (r *Router) MetricsPrometheus() (string, error) {
	return r.metricsPrometheus(4096)
}

func (r *Router) metricsPrometheus(capHint int) (string, error) {
	h := r.acquire()
	if h == nil {
		return "", ErrClosed
	}
	defer r.release()
	defer runtime.KeepAlive(r)
	text, err := fillGrowing(capHint, func(p *C.char, cap C.size_t, n *C.size_t, cerr **C.kvr_error) C.kvr_status {
		return C.kvr_router_metrics_prometheus(h, p, cap, n, cerr)
	})
	return cText(text), err
}

// MetricsPrometheus returns every source's counters (kvrouter_ingest_*, one series per source
// labelled with its source_id, kind and endpoint; the sources Stats still knows, removed ones
// included until 1,024 newer ones were removed) in
// the Prometheus text exposition format. The names differ from Router.MetricsPrometheus's, so
// a /metrics page may serve both (kvrouterprom.NewCollector(router, ingest) does).
func (in *Ingest) MetricsPrometheus() (string, error) {
	return in.metricsPrometheus(4096)
}

func (in *Ingest) metricsPrometheus(capHint int) (string, error) {
	h := in.acquire()
	if h == nil {
		return "", ErrClosed
	}
	defer in.release()
	defer runtime.KeepAlive(in)
	text, err := fillGrowing(capHint, func(p *C.char, cap C.size_t, n *C.size_t, cerr **C.kvr_error) C.kvr_status {
		return C.kvr_ingest_metrics_prometheus(h, p, cap, n, cerr)
	})
	return cText(text), err
}
