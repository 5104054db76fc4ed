//go:build cgo

package kvrouter

/*
#include "kvrouter.h"
*/
import "C"

import (
	"runtime"
	"sync"
	"time"
	"unsafe"
)

// IngestOptions configure an Ingest. The zero value (or nil) is every default.
type IngestOptions struct {
	MaxFrameBytes uint32 // largest stream frame accepted; 0 = the default (and maximum) 64 MiB
	// ReplayTimeout: a vLLM replay taking longer falls back to clearing; 0 (or negative) = 2 s.
	// Whole milliseconds rounded up, at most 2^32-1 ms (about 49.7 days, the C field's range):
	// a longer timeout is that.
	ReplayTimeout time.Duration
	// Replica liveness for SyncReplicas (docs/replicas.md): a heartbeat is published every
	// ReplicaHeartbeat (0 = 1 s; negative = none), and the bookings of a replica silent for
	// ReplicaTimeout are dropped (0 = 10 s; negative = never). At most 1 h each (rounded up to
	// whole milliseconds); NewIngest refuses more with ErrInvalidArgument.
	ReplicaHeartbeat time.Duration
	ReplicaTimeout   time.Duration
}

func (o *IngestOptions) toC() *C.kvr_ingest_options {
	if o == nil {
		return nil
	}
	c := new(C.kvr_ingest_options)
	initIngestOptions(c)
	var m cIngestOptions
	m.load(c) // the defaults
	if o.MaxFrameBytes != 0 {
		m.MaxFrameBytes = o.MaxFrameBytes
	}
	if o.ReplayTimeout > 0 {
		m.ReplayTimeoutMs = millis32(o.ReplayTimeout)
	}
	m.ReplicaHeartbeatMs = optionalMillis(o.ReplicaHeartbeat, m.ReplicaHeartbeatMs)
	m.ReplicaTimeoutMs = optionalMillis(o.ReplicaTimeout, m.ReplicaTimeoutMs)
	m.store(c)
	return c
}

// optionalMillis is d in whole milliseconds rounded up for a positive d, def for 0 and 0 (off)
// for a negative d. A d longer than a uint32 of milliseconds is clamped to math.MaxUint32 ms
// (millis32), not wrapped: still past the library's 1 h limit, so NewIngest refuses it.
func optionalMillis(d time.Duration, def uint32) uint32 {
	switch {
	case d == 0:
		return def
	case d < 0:
		return 0
	}
	return millis32(d)
}

// Ingest receives KV events from its sources on one event-loop thread of its own and applies
// them to a Router, concurrently with routing. Sources: native stream listeners (Listen),
// NATS subscriptions (SubscribeNATS), JetStream streams (SubscribeJetStream) and vLLM / SGLang
// ZMQ publishers (AddEngineWorker); they may be added before or after Start (RelayJetStream
// republishes what they change into a JetStream stream). Its methods may be called from any
// goroutine concurrently, Close included (see Close; Stop is the way to end ingestion while
// other goroutines still use the object).
type Ingest struct {
	ptr    handlePtr // the C object, with the calls in flight
	router *Router   // kept reachable: the router must outlive the ingest object
	// natsMu makes Stop and Close wait for a SubscribeNATS, SubscribeJetStream, RelayJetStream
	// or SyncReplicas in progress, whose round trips run on the caller's thread (since 0.2.0
	// kvr_ingest_stop waits for them itself, and refuses those begun after it). Those calls
	// share it; nothing else takes it.
	natsMu sync.RWMutex
}

// NewIngest creates a stopped ingest object feeding router, which must stay open until the
// Ingest is closed (Router.Close refuses while it is open). opts may be nil.
func NewIngest(router *Router, opts *IngestOptions) (*Ingest, error) {
	if err := CheckVersion(); err != nil {
		return nil, err
	}
	h := router.acquire()
	if h == nil {
		return nil, ErrClosed
	}
	defer router.release()
	// Counted before it exists, so that a Router.Close racing this either refuses or is seen
	// here (ErrClosed): the router must outlive the ingest object.
	fed := router.fed()
	if !fed.addFeed() {
		return nil, ErrClosed
	}
	var out *C.kvr_ingest
	var cerr *C.kvr_error
	st := C.kvr_ingest_new(h, opts.toC(), &out, &cerr)
	if err := takeError(st, cerr); err != nil {
		fed.dropFeed()
		return nil, err
	}
	in := &Ingest{router: router}
	in.ptr.open(unsafe.Pointer(out))
	runtime.SetFinalizer(in, (*Ingest).Close)
	return in, nil
}

// Close stops the ingest (as Stop: every source closed, the loop thread joined) and frees the
// object; idempotent. Always returns nil. It may run concurrently with other calls: it waits
// for a SubscribeNATS, SubscribeJetStream, RelayJetStream or SyncReplicas in progress, stops
// the ingest before it returns even while other calls are in flight (a Stats, a Prometheus
// scrape: they finish on the stopped object, which is freed when the last of them returns),
// and every call begun after it returns ErrClosed. Once it has returned, the sources' endpoints
// are unbound and Router.Close no longer refuses on this Ingest's account (the router is then
// freed after this object). Called from a replica publisher (this Ingest's heartbeats, or a
// routing call's booking change), which runs under the router's lock, Close is asynchronous:
// it returns at once and a goroutine of its own does the above once the publisher has returned
// (stopping joins the loop, which may be waiting for that lock, or be the very thread).
func (in *Ingest) Close() error {
	if in == nil {
		return nil
	}
	if inPublishCallback() {
		go in.Close()
		return nil
	}
	in.natsMu.Lock()
	defer in.natsMu.Unlock()
	h := in.acquire()
	if h == nil {
		return nil // closed before
	}
	defer in.release() // frees the object unless a call is in flight
	// Stopped here, not by the free, which a call in flight may defer: kvr_ingest_stop may
	// overlap any call but the free.
	var cerr *C.kvr_error
	_ = takeError(C.kvr_ingest_stop(h, &cerr), cerr) // fails only for a NULL ingest
	if closed, _ := in.ptr.close(); closed {
		// A stopped ingest no longer feeds the router, so Router.Close may proceed; but the C
		// object still points at the router until it is freed, so its feed becomes a
		// reference (as a call in flight's) that free gives back: the router, closed
		// meanwhile, is then freed after the ingest object, never before it.
		in.router.fed().feedToRef()
	}
	return nil
}

// free frees the C object, stopped by Close, closed and with no call in flight, and gives back
// the reference on the router that Close took in place of its feed.
func (in *Ingest) free() {
	runtime.SetFinalizer(in, nil)
	C.kvr_ingest_free((*C.kvr_ingest)(in.ptr.p))
	in.router.release()
}

// acquire returns the C object for one call, to give back with release (deferred), or nil
// once closed.
func (in *Ingest) acquire() *C.kvr_ingest {
	if in == nil {
		return nil
	}
	return (*C.kvr_ingest)(in.ptr.acquire())
}

// release ends a call begun by acquire (Close's too), freeing the object if it was closed
// meanwhile and this was the last call in flight. Inside a replica publish callback the free
// runs on a new goroutine instead: on the ingest's own loop thread (a publisher called by its
// heartbeats that calls this Ingest) kvr_ingest_free would join the thread it runs on, and on a
// goroutine (a publisher called by a routing call) the callback holds the router's lock, which
// the loop may be waiting for while the free joins it. The free is then done shortly after the
// call returns, not by then; the router, whose reference the free gives back, is freed after.
func (in *Ingest) release() {
	if in.ptr.release() {
		if inPublishCallback() {
			go in.free()
		} else {
			in.free()
		}
	}
}

// Start starts the loop thread. ErrFailedPrecondition if started or stopped before.
func (in *Ingest) Start() error {
	h := in.acquire()
	if h == nil {
		return ErrClosed
	}
	defer in.release()
	defer runtime.KeepAlive(in)
	var cerr *C.kvr_error
	return takeError(C.kvr_ingest_start(h, &cerr), cerr)
}

// Stop closes every source and joins the loop thread. It is final (an Ingest cannot be
// restarted) and idempotent. Called from a replica publisher it is asynchronous, as Close: a
// goroutine stops the ingest once the publisher has returned (the publisher runs under the
// router's lock, or on the loop Stop joins, which a NATS subscription in progress may be
// waiting for while it holds the lock Stop takes).
func (in *Ingest) Stop() error {
	if in == nil {
		return ErrClosed
	}
	if inPublishCallback() {
		go in.Stop()
		return nil
	}
	in.natsMu.Lock()
	defer in.natsMu.Unlock()
	h := in.acquire()
	if h == nil {
		return ErrClosed
	}
	defer in.release()
	var cerr *C.kvr_error
	err := takeError(C.kvr_ingest_stop(h, &cerr), cerr)
	runtime.KeepAlive(in)
	return err
}

// Listen listens for native event streams (length-prefixed FlatBuffers EventBatches) on
// "tcp://HOST:PORT" (PORT 0 = a free port) or "unix://PATH", and returns the source's id (for
// Stats) and the endpoint actually bound. ErrUnavailable if the address cannot be bound.
func (in *Ingest) Listen(endpoint string) (sourceID uint64, bound string, err error) {
	h := in.acquire()
	if h == nil {
		return 0, "", ErrClosed
	}
	defer in.release()
	defer runtime.KeepAlive(in)
	var a args
	defer a.release()
	ep := a.str("endpoint", endpoint)
	if err := a.err(); err != nil {
		return 0, "", err
	}
	// One call only: on KVR_BUFFER_TOO_SMALL the listener is open all the same (a retry would
	// open a second one), and its endpoint is read by source id instead.
	var id C.uint64_t
	var cerr *C.kvr_error
	st := C.kvr_ingest_listen(h, ep, &id, nil, 0, nil, &cerr)
	if err := takeError(st, cerr); err != nil {
		return 0, "", err
	}
	bound, err = in.SourceEndpoint(uint64(id))
	return uint64(id), bound, err
}

// SourceEndpoint returns where a source is: a listener's bound endpoint (with its real port),
// an engine worker's endpoint, a NATS server's url. ErrNotFound for an unknown id.
func (in *Ingest) SourceEndpoint(sourceID uint64) (string, error) {
	h := in.acquire()
	if h == nil {
		return "", ErrClosed
	}
	defer in.release()
	defer runtime.KeepAlive(in)
	text, err := fillGrowing(128, func(p *C.char, cap C.size_t, n *C.size_t, cerr **C.kvr_error) C.kvr_status {
		return C.kvr_ingest_source_endpoint(h, C.uint64_t(sourceID), p, cap, n, cerr)
	})
	return cText(text), err
}

// EngineWorker is an engine publishing KV events over ZMQ PUB.
type EngineWorker struct {
	Engine Engine
	// Endpoint is rank DPStart's socket, e.g. "tcp://10.0.0.5:5557"; rank DPStart + r is on
	// port + r (ENDPOINT_dp<r> for other transports).
	Endpoint  string
	WorkerID  uint64
	DPStart   uint32
	DPSize    uint32 // 0 = 1
	BlockSize uint32 // 0 = the router's; anything else must equal it
	Eagle     bool   // the model uses eagle block windows
	Topic     string // subscription prefix; "" = every message
	// ReplayEndpoint is vLLM's replay socket (--kv-events-config replay_endpoint), or "":
	// missed messages are then unrecoverable and the worker is cleared and flagged.
	ReplayEndpoint string
}

func (w *EngineWorker) toC(a *args) *C.kvr_engine_worker {
	c := new(C.kvr_engine_worker)
	initEngineWorker(c)
	var m cEngineWorker
	m.load(c) // the defaults (one rank)
	m.Engine = w.Engine
	m.WorkerID = w.WorkerID
	m.DPStart = w.DPStart
	if w.DPSize != 0 {
		m.DPSize = w.DPSize
	}
	m.BlockSize = w.BlockSize
	m.Flags = flagIf(w.Eagle, C.KVR_STORED_EAGLE)
	m.store(c)
	c.endpoint = a.str("EngineWorker.Endpoint", w.Endpoint)
	c.topic = a.optStr("EngineWorker.Topic", w.Topic)
	c.replay_endpoint = a.optStr("EngineWorker.ReplayEndpoint", w.ReplayEndpoint)
	return c
}

// AddEngineWorker subscribes to the worker's ranks and returns the source's id (register the
// worker with the Router too, for routing). ErrInvalidArgument for a block size other than the
// router's, a bad endpoint or a bad rank count; ErrAlreadyExists for a worker id already
// subscribed.
func (in *Ingest) AddEngineWorker(w EngineWorker) (uint64, error) {
	return in.addSource(func(a *args) sourceCall {
		cw := w.toC(a)
		return func(h *C.kvr_ingest, id *C.uint64_t, cerr **C.kvr_error) C.kvr_status {
			return C.kvr_ingest_add_engine_worker(h, cw, id, cerr)
		}
	})
}

// sourceCall is one of the C calls that add a source, its arguments converted: it gets the
// handle and where to put the source's id and the error.
type sourceCall func(h *C.kvr_ingest, id *C.uint64_t, cerr **C.kvr_error) C.kvr_status

// addSource converts a source's arguments (prepare, with the arguments' allocator), refuses
// them if one cannot go to C (args.err), else makes the call prepare returns, and returns the
// source's id.
func (in *Ingest) addSource(prepare func(a *args) sourceCall) (uint64, error) {
	h := in.acquire()
	if h == nil {
		return 0, ErrClosed
	}
	defer in.release()
	defer runtime.KeepAlive(in)
	var a args
	defer a.release()
	call := prepare(&a)
	if err := a.err(); err != nil {
		return 0, err
	}
	var id C.uint64_t
	var cerr *C.kvr_error
	if err := takeError(call(h, &id, &cerr), cerr); err != nil {
		return 0, err
	}
	return uint64(id), nil
}

// RemoveEngineWorker unsubscribes; clearIndex also drops the worker's entries from the index.
// ErrNotFound for an unknown id.
func (in *Ingest) RemoveEngineWorker(workerID uint64, clearIndex bool) error {
	h := in.acquire()
	if h == nil {
		return ErrClosed
	}
	defer in.release()
	defer runtime.KeepAlive(in)
	clear := C.int(0)
	if clearIndex {
		clear = 1
	}
	var cerr *C.kvr_error
	return takeError(C.kvr_ingest_remove_engine_worker(h, C.uint64_t(workerID), clear, &cerr), cerr)
}

// SubscribeNATS subscribes to subject (wildcards * and > allowed) on the NATS server at url
// (e.g. "nats://127.0.0.1:4222"); each message is one encoded EventBatch. After Start it
// returns once the server has the subscription; before, the subscription is sent when the
// loop starts. The connection retries forever when the server goes away (messages published
// meanwhile are lost). ErrUnavailable if the first connection fails.
func (in *Ingest) SubscribeNATS(url, subject string) (uint64, error) {
	in.natsMu.RLock()
	defer in.natsMu.RUnlock()
	return in.addSource(func(a *args) sourceCall {
		u, s := a.str("url", url), a.str("subject", subject)
		return func(h *C.kvr_ingest, id *C.uint64_t, cerr **C.kvr_error) C.kvr_status {
			return C.kvr_ingest_subscribe_nats(h, u, s, id, cerr)
		}
	})
}

// JetStreamSource is a NATS JetStream stream to consume KV events from (the messages
// SubscribeNATS takes), through a durable consumer: each message is acknowledged once applied,
// so nothing is lost while the ingest or the server is away. The zero value of every optional
// field is the library's default.
type JetStreamSource struct {
	URL     string // "nats://HOST:PORT"
	Stream  string // the stream's name (no spaces, '.', '*' or '>')
	Subject string // the subjects consumed (wildcards allowed); the stream's when CreateStream creates it
	// Durable is the consumer's name, one per router (rules as the stream's); "" = an ephemeral
	// consumer, deleted when the source goes away.
	Durable string
	// StartSequence is the first stream sequence delivered; 0 = the stream's first message.
	// After restoring a snapshot taken when IngestStats.StreamSequence was N: N + 1. Without
	// Resume an existing durable consumer of that name is replaced.
	StartSequence uint64
	Resume        bool // an existing durable consumer keeps its position (StartSequence unused)
	CreateStream  bool // create the stream if absent, with the limits below
	// MaxAge: with CreateStream, messages older than this are dropped; 0 = the default (1 h),
	// negative = no limit.
	MaxAge time.Duration
	// MaxBytes: with CreateStream, the oldest messages are dropped beyond this size; 0 = the
	// default (1 GiB), negative = no limit.
	MaxBytes int64
}

func (s *JetStreamSource) toC(a *args) *C.kvr_jetstream_source {
	c := new(C.kvr_jetstream_source)
	initJetstreamSource(c)
	var m cJetstreamSource
	m.load(c) // the defaults (retention limits)
	m.Flags = flagIf(s.Resume, C.KVR_JETSTREAM_RESUME) | flagIf(s.CreateStream, C.KVR_JETSTREAM_CREATE_STREAM)
	m.StartSequence = s.StartSequence
	if s.MaxAge > 0 {
		m.MaxAgeSeconds = s.MaxAge.Seconds()
	} else if s.MaxAge < 0 {
		m.MaxAgeSeconds = 0 // no limit
	}
	if s.MaxBytes > 0 {
		m.MaxBytes = s.MaxBytes
	} else if s.MaxBytes < 0 {
		m.MaxBytes = -1 // no limit
	}
	m.store(c)
	c.url = a.str("JetStreamSource.URL", s.URL)
	c.stream = a.str("JetStreamSource.Stream", s.Stream)
	c.subject = a.str("JetStreamSource.Subject", s.Subject)
	c.durable = a.optStr("JetStreamSource.Durable", s.Durable)
	return c
}

// SubscribeJetStream consumes a JetStream stream (see JetStreamSource) and returns the source's
// id; IngestStats.StreamSequence is then the last stream sequence applied. It connects and sets
// up the consumer on the calling goroutine; the connection then reconnects forever and the
// consumer continues where it was. ErrInvalidArgument for a missing URL, Stream or Subject, a
// bad name or bad limits; ErrNotFound if the stream does not exist (without CreateStream);
// ErrUnavailable if the server cannot be reached or refuses.
func (in *Ingest) SubscribeJetStream(s JetStreamSource) (uint64, error) {
	in.natsMu.RLock()
	defer in.natsMu.RUnlock()
	return in.addSource(func(a *args) sourceCall {
		cs := s.toC(a)
		return func(h *C.kvr_ingest, id *C.uint64_t, cerr **C.kvr_error) C.kvr_status {
			return C.kvr_ingest_subscribe_jetstream(h, cs, id, cerr)
		}
	})
}

// RelayJetStream republishes every change the ingest's other sources make to the router's
// index into a JetStream stream (see JetStreamSource), each change as a native EventBatch on
// target.Subject + "." + the worker id (Subject is a prefix, without wildcards), and returns
// the relay's source id; a router consuming that stream (SubscribeJetStream on Subject + ".>")
// then holds what this router's index holds of those workers. Not relayed: what a JetStream
// source consumed, and events applied on the Router directly (ApplyStored, ApplyEventBatch,
// ...). Durable, StartSequence and Resume must be unset; CreateStream creates the stream on
// Subject + ".>". One relay per Ingest (ErrFailedPrecondition for a second); it lasts until
// Stop. Its IngestStats: Messages the changes handed to the relay, EventsApplied those the
// stream acknowledged, Published the messages acknowledged, StreamSequence the last message's
// stream sequence, MissedMessages the changes dropped while the server was away (sent again
// by a resync; StateUnknown is 1 until then); it has caught up when Messages ==
// EventsApplied + MissedMessages and StateUnknown == 0. Errors as SubscribeJetStream.
func (in *Ingest) RelayJetStream(target JetStreamSource) (uint64, error) {
	in.natsMu.RLock()
	defer in.natsMu.RUnlock()
	return in.addSource(func(a *args) sourceCall {
		ct := target.toC(a)
		return func(h *C.kvr_ingest, id *C.uint64_t, cerr **C.kvr_error) C.kvr_status {
			return C.kvr_ingest_relay_jetstream(h, ct, id, cerr)
		}
	})
}

// IngestStats are the counters of one source, or of every source together.
type IngestStats struct {
	StateUnknown   uint32 // ranks whose state was lost (gap) and not yet re-established, or whose engine connection dropped
	Messages       uint64 // frames or messages received
	EventsApplied  uint64
	Rejected       [IngestRejectReasons]uint64 // per IngestReject
	Gaps           uint64                      // sequence jumps forward
	MissedMessages uint64                      // messages lost in those jumps
	Restarts       uint64                      // publisher sequence resets to 0
	Recoveries     uint64                      // worker states cleared because they were lost
	Connections    uint64                      // stream connections accepted; NATS (re)connections
	// Replica sync (SyncReplicas): changes published, and those the NATS client refused.
	Published       uint64
	PublishFailures uint64
	// Lag, from a message's publication time (vLLM's batch ts, a native batch's publish time)
	// to its events being applied, at microsecond resolution; messages without one are not
	// measured. For all sources together: sums and the maximum.
	LagSamples uint64        // messages measured
	LagTotal   time.Duration // their lags summed
	LagMax     time.Duration // the largest
	LagLast    time.Duration // the most recent message's
	// The most recent reject's reason in words (e.g. "event 1: unknown event tag 'X'"), empty
	// if none was given; for all sources together, the most recent of them all.
	LastReject string
	// A JetStream source's last stream sequence applied (and acknowledged); for all sources
	// together, the largest; 0 for other sources.
	StreamSequence uint64
	// A JetStream source's consumer made again because deliveries were lost on the way (they
	// come again, in order, from the new consumer), or a core NATS, replica sync or JetStream
	// relay source's connection made again after the NATS client gave it up (a server's
	// error), and the attempts that failed and were retried; for all sources together, sums;
	// 0 for others.
	ConsumerRemakes        uint64
	ConsumerRemakeFailures uint64
	// Engine events no router indexes, by design: those of a KV-cache group neither full
	// attention nor a sliding window whose size the engine said (a hybrid model's Mamba
	// layers; sliding windows limit a rank's hit). Not rejects: the rest of their batch
	// applies. For all sources together, the sum.
	EventsIgnored uint64
	// Replica sync (SyncReplicas): publications of a booking with only its leading block ids,
	// the NATS server's messages (its max_payload) too short for them all, or the connection
	// reconnecting (3,584 bytes then); a booking announced again counts again. Peers count
	// those bookings' prefix blocks only. For all sources together, the sum.
	BookingsTrimmed uint64
}

// MeanLag returns LagTotal / LagSamples (0 without samples).
func (s IngestStats) MeanLag() time.Duration {
	if s.LagSamples == 0 {
		return 0
	}
	return s.LagTotal / time.Duration(s.LagSamples)
}

func micros(us uint64) time.Duration { return time.Duration(us) * time.Microsecond }

// text reads a NUL-terminated string out of a fixed char buffer of the C ABI.
func text(chars []int8) string {
	b := make([]byte, 0, len(chars))
	for _, c := range chars {
		if c == 0 {
			break
		}
		b = append(b, byte(c))
	}
	return string(b)
}

// Stats returns a source's counters; sourceID 0 sums every source (removed ones included).
// ErrNotFound for an unknown id.
func (in *Ingest) Stats(sourceID uint64) (IngestStats, error) {
	h := in.acquire()
	if h == nil {
		return IngestStats{}, ErrClosed
	}
	defer in.release()
	defer runtime.KeepAlive(in)
	var c C.kvr_ingest_stats
	initIngestStats(&c)
	var cerr *C.kvr_error
	if err := takeError(C.kvr_ingest_get_stats(h, C.uint64_t(sourceID), &c, &cerr), cerr); err != nil {
		return IngestStats{}, err
	}
	var m cIngestStats
	m.load(&c)
	return ingestStatsFrom(&m), nil
}

func ingestStatsFrom(m *cIngestStats) IngestStats {
	return IngestStats{
		StateUnknown:           m.StateUnknown,
		Messages:               m.Messages,
		EventsApplied:          m.EventsApplied,
		Rejected:               m.Rejected,
		Gaps:                   m.Gaps,
		MissedMessages:         m.MissedMessages,
		Restarts:               m.Restarts,
		Recoveries:             m.Recoveries,
		Connections:            m.Connections,
		Published:              m.Published,
		PublishFailures:        m.PublishFailures,
		LagSamples:             m.LagSamples,
		LagTotal:               micros(m.LagTotalUs),
		LagMax:                 micros(m.LagMaxUs),
		LastReject:             text(m.LastReject[:]),
		StreamSequence:         m.StreamSequence,
		LagLast:                micros(m.LagLastUs),
		ConsumerRemakes:        m.ConsumerRemakes,
		ConsumerRemakeFailures: m.ConsumerRemakeFailures,
		EventsIgnored:          m.EventsIgnored,
		BookingsTrimmed:        m.BookingsTrimmed,
	}
}
