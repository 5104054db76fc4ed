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

// StoredEvent says that one worker rank newly cached blocks, consecutive along one sequence.
// Each block has the engine's own hash (BlockHashes) and either a precomputed local hash
// (LocalHashes) or its tokens (TokenIDs: every block's tokens concatenated, block_size per
// block, plus one look-ahead token with Eagle). With SlidingWindowTokens it is instead a hybrid
// model's sliding-window store, of blocks the rank holds in full attention.
type StoredEvent struct {
	WorkerID    uint64
	DPRank      uint32
	EventID     uint64
	Tier        Tier
	HasParent   bool   // ParentHash is set
	ParentHash  uint64 // the engine hash of the block before the first one
	Eagle       bool   // TokenIDs use eagle windows
	BlockHashes []uint64
	LocalHashes []uint64 // nil, or one per block (ErrInvalidArgument otherwise): then TokenIDs is not read
	TokenIDs    []uint32
	LoraName    string
	// CacheNamespace salts the local hashes as HashOptions.CacheNamespace does.
	CacheNamespace string
	// MultimodalHashes[i] holds block i's multimodal content hashes; nil = none. When set it
	// must have one entry per block (ErrInvalidArgument otherwise).
	MultimodalHashes [][]uint64
	// SlidingWindowTokens > 0 makes the event a hybrid model's sliding-window store instead
	// (docs/ingest.md, "Sliding windows"): KV-cache group SlidingGroup (the engine's group
	// index), whose window is SlidingWindowTokens tokens, now holds the blocks BlockHashes
	// names, by engine hash, each one the rank holds in full attention under that hash (the
	// others are skipped: ErrNotFound). A prefix is then cached on the rank only where its
	// sliding-window groups also hold the blocks before the prefix's end that their windows
	// need, as the engine counts it. Such a store names blocks only: no HasParent, Eagle,
	// LocalHashes, TokenIDs, LoraName, CacheNamespace nor MultimodalHashes, and Tier
	// TierDevice (ErrInvalidArgument otherwise). 0, the zero value, is a full-attention store;
	// SlidingGroup is set only with a window (a group without one is ErrInvalidArgument).
	SlidingGroup        int64
	SlidingWindowTokens uint32
}

// toC fills a kvr_stored_event. The C struct has no counts of its own for local hashes and
// multimodal counts (it reads num_blocks of each), so their lengths are checked here.
func (e *StoredEvent) toC(a *args) (*C.kvr_stored_event, error) {
	if e == nil {
		return nil, newError(ErrInvalidArgument, "event is nil")
	}
	if e.LocalHashes != nil && len(e.LocalHashes) != len(e.BlockHashes) {
		return nil, newError(ErrInvalidArgument, "LocalHashes must have one entry per block hash")
	}
	if e.MultimodalHashes != nil && len(e.MultimodalHashes) != len(e.BlockHashes) {
		return nil, newError(ErrInvalidArgument, "MultimodalHashes must have one entry per block hash")
	}
	c := new(C.kvr_stored_event)
	initStoredEvent(c)
	m := cStoredEvent{
		DPRank:    e.DPRank,
		WorkerID:  e.WorkerID,
		EventID:   e.EventID,
		Tier:      e.Tier,
		Flags:     flagIf(e.HasParent, C.KVR_STORED_HAS_PARENT) | flagIf(e.Eagle, C.KVR_STORED_EAGLE),
		NumBlocks: uint64(len(e.BlockHashes)),
		NumTokens: uint64(len(e.TokenIDs)),
		// Passed on as set: the library refuses what does not make a sliding-window store.
		SlidingGroup:        e.SlidingGroup,
		SlidingWindowTokens: e.SlidingWindowTokens,
	}
	if e.HasParent {
		m.ParentHash = e.ParentHash
	}
	m.store(c)
	c.block_hashes = a.u64s(e.BlockHashes)
	c.local_hashes = a.u64s(e.LocalHashes)
	c.token_ids = a.u32s(e.TokenIDs)
	c.lora_name = a.optStr("StoredEvent.LoraName", e.LoraName)
	c.cache_namespace = a.optStr("StoredEvent.CacheNamespace", e.CacheNamespace)
	c.mm_hashes, c.mm_counts, _ = a.mm(e.MultimodalHashes)
	return c, a.err()
}

// RemovedEvent says that one worker rank evicted blocks (by engine hash).
type RemovedEvent struct {
	WorkerID    uint64
	DPRank      uint32
	EventID     uint64
	Tier        Tier
	BlockHashes []uint64
	// Sliding says that the blocks left a hybrid model's sliding-window KV-cache group,
	// SlidingGroup (the engine's group index; KVR_REMOVED_SLIDING, docs/ingest.md, "Sliding
	// windows"): the window let go of them, and the rank's full-attention blocks stay (a
	// window lets go of a block long before full attention does). false, the zero value, is an
	// eviction from full attention; SlidingGroup is set only with Sliding (a group without it
	// is ErrInvalidArgument).
	Sliding      bool
	SlidingGroup int64
}

func (e *RemovedEvent) toC(a *args) *C.kvr_removed_event {
	c := new(C.kvr_removed_event)
	initRemovedEvent(c)
	m := cRemovedEvent{
		DPRank:       e.DPRank,
		WorkerID:     e.WorkerID,
		EventID:      e.EventID,
		Tier:         e.Tier,
		NumBlocks:    uint64(len(e.BlockHashes)),
		SlidingGroup: e.SlidingGroup,
		Flags:        flagIf(e.Sliding, C.KVR_REMOVED_SLIDING),
	}
	m.store(c)
	c.block_hashes = a.u64s(e.BlockHashes)
	return c
}

// ApplyStored applies one stored event. A rejected part is reported (ErrNotFound: unknown
// parent or block; ErrInvalidArgument: broken sequence or incomplete block) and counted in the
// metrics, while the part Dynamo applies despite it is applied. ErrFailedPrecondition in
// approximate mode. Events of unregistered workers are indexed all the same.
func (r *Router) ApplyStored(e *StoredEvent) error {
	h := r.acquire()
	if h == nil {
		return ErrClosed
	}
	defer r.release()
	var a args
	defer a.release()
	ce, err := e.toC(&a)
	if err != nil {
		return err
	}
	var cerr *C.kvr_error
	st := C.kvr_router_apply_stored(h, ce, &cerr)
	runtime.KeepAlive(r)
	return takeError(st, cerr)
}

// ApplyRemoved applies one removed event (errors as ApplyStored).
func (r *Router) ApplyRemoved(e *RemovedEvent) error {
	h := r.acquire()
	if h == nil {
		return ErrClosed
	}
	defer r.release()
	if e == nil {
		return newError(ErrInvalidArgument, "event is nil")
	}
	var a args
	defer a.release()
	var cerr *C.kvr_error
	st := C.kvr_router_apply_removed(h, e.toC(&a), &cerr)
	runtime.KeepAlive(r)
	return takeError(st, cerr)
}

// ApplyCleared says the rank (workerID, dpRank) lost every block; the worker's other ranks
// keep theirs (each rank has a cache of its own). RemoveWorker forgets every rank.
func (r *Router) ApplyCleared(workerID uint64, dpRank uint32, eventID uint64) error {
	h := r.acquire()
	if h == nil {
		return ErrClosed
	}
	defer r.release()
	var cerr *C.kvr_error
	st := C.kvr_router_apply_cleared(h, C.uint64_t(workerID), C.uint32_t(dpRank),
		C.uint64_t(eventID), &cerr)
	runtime.KeepAlive(r)
	return takeError(st, cerr)
}

// ApplyEventBatch applies an encoded FlatBuffers EventBatch (schema/kv_events.fbs, as
// EventBatch.Encode produces). Bytes that fail verification change nothing
// (ErrInvalidArgument); events the index rejects do not stop the others, and the first
// rejection is returned.
func (r *Router) ApplyEventBatch(data []byte) error {
	h := r.acquire()
	if h == nil {
		return ErrClosed
	}
	defer r.release()
	p, n := bytesPtr(data)
	var cerr *C.kvr_error
	st := C.kvr_router_apply_event_batch(h, p, n, &cerr)
	runtime.KeepAlive(r)
	runtime.KeepAlive(data)
	return takeError(st, cerr)
}

// EventBatch collects events and encodes them as one FlatBuffers EventBatch, the format that
// Router.ApplyEventBatch, Ingest listeners, NATS subscriptions and Publisher take. An
// EventBatch is not safe for concurrent use (as a bytes.Buffer); Close releases it.
type EventBatch struct {
	ptr *C.kvr_event_batch
}

// NewEventBatch returns an empty batch.
func NewEventBatch() (*EventBatch, error) {
	if err := CheckVersion(); err != nil {
		return nil, err
	}
	var cerr *C.kvr_error
	var out *C.kvr_event_batch
	if err := takeError(C.kvr_event_batch_new(&out, &cerr), cerr); err != nil {
		return nil, err
	}
	b := &EventBatch{ptr: out}
	runtime.SetFinalizer(b, (*EventBatch).Close)
	return b, nil
}

// Close releases the batch; idempotent. Always returns nil.
func (b *EventBatch) Close() error {
	if b == nil || b.ptr == nil {
		return nil
	}
	runtime.SetFinalizer(b, nil)
	C.kvr_event_batch_free(b.ptr)
	b.ptr = nil
	return nil
}

// AddStored appends a copy of the event (validated as Router.ApplyStored validates its
// arguments).
func (b *EventBatch) AddStored(e *StoredEvent) error {
	if b == nil || b.ptr == nil {
		return ErrClosed
	}
	var a args
	defer a.release()
	ce, err := e.toC(&a)
	if err != nil {
		return err
	}
	var cerr *C.kvr_error
	st := C.kvr_event_batch_add_stored(b.ptr, ce, &cerr)
	runtime.KeepAlive(b)
	return takeError(st, cerr)
}

// AddRemoved appends a copy of the event.
func (b *EventBatch) AddRemoved(e *RemovedEvent) error {
	if b == nil || b.ptr == nil {
		return ErrClosed
	}
	if e == nil {
		return newError(ErrInvalidArgument, "event is nil")
	}
	var a args
	defer a.release()
	var cerr *C.kvr_error
	st := C.kvr_event_batch_add_removed(b.ptr, e.toC(&a), &cerr)
	runtime.KeepAlive(b)
	return takeError(st, cerr)
}

// AddCleared appends a clear of the rank (workerID, dpRank).
func (b *EventBatch) AddCleared(workerID uint64, dpRank uint32, eventID uint64) error {
	if b == nil || b.ptr == nil {
		return ErrClosed
	}
	var cerr *C.kvr_error
	st := C.kvr_event_batch_add_cleared(b.ptr, C.uint64_t(workerID), C.uint32_t(dpRank),
		C.uint64_t(eventID), &cerr)
	runtime.KeepAlive(b)
	return takeError(st, cerr)
}

// Len returns the number of events added so far (0 after Close).
func (b *EventBatch) Len() int {
	if b == nil || b.ptr == nil {
		return 0
	}
	n := int(C.kvr_event_batch_size(b.ptr))
	runtime.KeepAlive(b)
	return n
}

// Encode returns the events added so far as one encoded EventBatch; the batch keeps them.
func (b *EventBatch) Encode() ([]byte, error) { return b.AppendEncoded(nil) }

// AppendEncoded appends the encoded batch to dst and returns the extended slice.
func (b *EventBatch) AppendEncoded(dst []byte) ([]byte, error) {
	if b == nil || b.ptr == nil {
		return dst, ErrClosed
	}
	var cerr *C.kvr_error
	var buf *C.kvr_buffer
	st := C.kvr_event_batch_encode(b.ptr, &buf, &cerr)
	runtime.KeepAlive(b)
	if err := takeError(st, cerr); err != nil {
		return dst, err
	}
	return takeBuffer(dst, buf), nil
}

// Clear drops the events added so far (and any publish time set).
func (b *EventBatch) Clear() {
	if b == nil || b.ptr == nil {
		return
	}
	C.kvr_event_batch_clear(b.ptr)
	runtime.KeepAlive(b)
}

// SetPublishTime stamps the batch with its publication time, from which ingest measures its
// lag (publication to events applied; IngestStats.Lag*). Until it is called a batch is stamped
// with the wall clock when it is encoded or sent; the zero time leaves it unstamped (no lag
// measured). Times before 1970 are ErrInvalidArgument.
func (b *EventBatch) SetPublishTime(t time.Time) error {
	if b == nil || b.ptr == nil {
		return ErrClosed
	}
	var ns uint64
	if !t.IsZero() {
		if t.UnixNano() < 0 {
			return newError(ErrInvalidArgument, "publish time before the Unix epoch")
		}
		ns = uint64(t.UnixNano())
	}
	var cerr *C.kvr_error
	st := C.kvr_event_batch_set_publish_time(b.ptr, C.uint64_t(ns), &cerr)
	runtime.KeepAlive(b)
	return takeError(st, cerr)
}
