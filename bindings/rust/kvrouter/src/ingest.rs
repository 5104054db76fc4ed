//! Live KV event ingestion (`kvr_ingest`: native streams over TCP / Unix sockets, NATS, NATS
//! JetStream, vLLM and SGLang ZMQ publishers) and the native-stream publisher (`kvr_publisher`).

use std::fmt;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::ptr::{self, NonNull};
use std::sync::Arc;
use std::thread;

use kvrouter_sys as sys;

use crate::disagg::Disagg;
use crate::error::{call, call_dropping_panic, call_keeping_panic, fill_vec, Code, Error, Result};
use crate::events::EventBatch;
use crate::raw::init;
use crate::router::{Router, RouterRef};
use crate::util::{cstring, opt_cstring, opt_ptr};

/// Settings of an [`Ingest`] (`kvr_ingest_options`); `Default` is the library's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IngestOptions {
    /// Largest stream frame accepted; default (and maximum) 64 MiB.
    pub max_frame_bytes: u32,
    /// A vLLM replay taking longer falls back to clearing the worker; default 2000.
    pub replay_timeout_ms: u32,
    /// How often [`Ingest::sync_replicas`] publishes a heartbeat
    /// ([`RouterRef::replica_heartbeat`]); default 1000, 0 = none, at most 3,600,000.
    pub replica_heartbeat_ms: u32,
    /// How long a replica that sent heartbeats may stay silent before its bookings are dropped
    /// ([`RouterRef::expire_replicas`]); default 10000, 0 = never, at most 3,600,000.
    pub replica_timeout_ms: u32,
}

impl Default for IngestOptions {
    fn default() -> Self {
        let raw = init::<sys::kvr_ingest_options>();
        IngestOptions {
            max_frame_bytes: raw.max_frame_bytes,
            replay_timeout_ms: raw.replay_timeout_ms,
            replica_heartbeat_ms: raw.replica_heartbeat_ms,
            replica_timeout_ms: raw.replica_timeout_ms,
        }
    }
}

impl IngestOptions {
    pub(crate) fn to_raw(self) -> sys::kvr_ingest_options {
        let mut raw = init::<sys::kvr_ingest_options>();
        raw.max_frame_bytes = self.max_frame_bytes;
        raw.replay_timeout_ms = self.replay_timeout_ms;
        raw.replica_heartbeat_ms = self.replica_heartbeat_ms;
        raw.replica_timeout_ms = self.replica_timeout_ms;
        raw
    }
}

/// The engine publishing KV events over ZMQ (both share the wire format; informational).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Engine {
    #[default]
    Vllm,
    Sglang,
}

/// A vLLM or SGLang engine worker publishing KV events over ZMQ PUB (`kvr_engine_worker`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineWorker<'a> {
    pub engine: Engine,
    /// e.g. `tcp://10.0.0.5:5557`; rank `dp_start + r` on port + r.
    pub endpoint: &'a str,
    pub worker_id: u64,
    pub dp_start: u32,
    pub dp_size: u32,
    /// 0 = the router's; anything else must equal it.
    pub block_size: u32,
    /// The model uses eagle block windows.
    pub eagle: bool,
    /// Subscription prefix; None = every message.
    pub topic: Option<&'a str>,
    /// vLLM's replay socket (rank r as for `endpoint`); None: missed messages clear the worker.
    pub replay_endpoint: Option<&'a str>,
}

impl<'a> EngineWorker<'a> {
    /// A one-rank vLLM worker at `endpoint` with the library's defaults.
    pub fn new(endpoint: &'a str, worker_id: u64) -> Self {
        let raw = init::<sys::kvr_engine_worker>();
        EngineWorker {
            engine: Engine::Vllm,
            endpoint,
            worker_id,
            dp_start: raw.dp_start,
            dp_size: raw.dp_size,
            block_size: raw.block_size,
            eagle: raw.flags & sys::KVR_STORED_EAGLE != 0,
            topic: None,
            replay_endpoint: None,
        }
    }
}

/// A NATS JetStream stream to consume KV events from (`kvr_jetstream_source`), for
/// [`Ingest::subscribe_jetstream`]: the messages [`Ingest::subscribe_nats`] takes, through a
/// durable consumer, each acknowledged once applied, so nothing is lost while the ingest or the
/// server is away. `Default` is the library's (with empty `url`, `stream` and `subject`, which
/// must be set): `JetStreamSource { url, stream: "KV", subject: "kv.>", ..Default::default() }`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct JetStreamSource<'a> {
    /// `nats://HOST:PORT`.
    pub url: &'a str,
    /// The stream's name (no spaces, `.`, `*` or `>`).
    pub stream: &'a str,
    /// The subjects consumed (wildcards allowed); the stream's own when `create_stream`
    /// creates it.
    pub subject: &'a str,
    /// The durable consumer's name, one per router (rules as the stream's); None = an ephemeral
    /// consumer, deleted when the source goes away.
    pub durable: Option<&'a str>,
    /// The first stream sequence delivered; 0 (default) = the stream's first message. After
    /// restoring a snapshot taken when [`IngestStats::stream_sequence`] was N: N + 1. Without
    /// `resume`, an existing durable consumer of that name is replaced.
    pub start_sequence: u64,
    /// An existing durable consumer keeps its position (`KVR_JETSTREAM_RESUME`).
    pub resume: bool,
    /// Creates the stream if absent, with the limits below (`KVR_JETSTREAM_CREATE_STREAM`).
    pub create_stream: bool,
    /// With `create_stream`: messages older than this are dropped; default 3600; 0 = no limit.
    pub max_age_seconds: f64,
    /// With `create_stream`: the oldest messages are dropped beyond this many bytes; default
    /// 1 GiB; -1 = no limit.
    pub max_bytes: i64,
}

impl Default for JetStreamSource<'_> {
    fn default() -> Self {
        let raw = init::<sys::kvr_jetstream_source>();
        JetStreamSource {
            url: "",
            stream: "",
            subject: "",
            durable: None,
            start_sequence: raw.start_sequence,
            resume: raw.flags & sys::KVR_JETSTREAM_RESUME != 0,
            create_stream: raw.flags & sys::KVR_JETSTREAM_CREATE_STREAM != 0,
            max_age_seconds: raw.max_age_seconds,
            max_bytes: raw.max_bytes,
        }
    }
}

impl<'a> JetStreamSource<'a> {
    /// The stream `stream` on the server at `url`, consuming `subject`, with the library's
    /// defaults.
    pub fn new(url: &'a str, stream: &'a str, subject: &'a str) -> Self {
        JetStreamSource {
            url,
            stream,
            subject,
            ..Default::default()
        }
    }

    /// The C struct, pointing into the returned strings (kept alive with it).
    pub(crate) fn lower(&self) -> Result<LoweredJetStream> {
        let strings = [
            Some(cstring("url", self.url)?),
            Some(cstring("stream", self.stream)?),
            Some(cstring("subject", self.subject)?),
            opt_cstring("durable", self.durable)?,
        ];
        let mut raw = init::<sys::kvr_jetstream_source>();
        raw.flags = (if self.resume {
            sys::KVR_JETSTREAM_RESUME
        } else {
            0
        }) | (if self.create_stream {
            sys::KVR_JETSTREAM_CREATE_STREAM
        } else {
            0
        });
        raw.url = opt_ptr(&strings[0]);
        raw.stream = opt_ptr(&strings[1]);
        raw.subject = opt_ptr(&strings[2]);
        raw.durable = opt_ptr(&strings[3]);
        raw.start_sequence = self.start_sequence;
        raw.max_age_seconds = self.max_age_seconds;
        raw.max_bytes = self.max_bytes;
        Ok(LoweredJetStream {
            raw,
            _strings: strings,
        })
    }
}

/// A lowered [`JetStreamSource`]: the C struct and the strings it points into.
pub(crate) struct LoweredJetStream {
    pub(crate) raw: sys::kvr_jetstream_source,
    _strings: [Option<std::ffi::CString>; 4],
}

/// Why ingest rejected a message or an event (`KVR_INGEST_REJECT_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RejectReason {
    /// A stream header over the limit: that connection is closed.
    FrameTooLarge,
    /// A frame or NATS message that is not a valid EventBatch.
    BadFlatbuffers,
    /// An engine payload that does not decode.
    BadMsgpack,
    /// A ZMQ message not `[topic, 8-byte seq, payload]`.
    BadMessage,
    /// A stored event of another block size.
    BlockSize,
    /// An event the index refused (unknown parent...).
    Index,
    /// A sequence number already seen.
    StaleSequence,
}

impl RejectReason {
    fn index(self) -> usize {
        let reason: sys::kvr_ingest_reject = match self {
            RejectReason::FrameTooLarge => sys::KVR_INGEST_REJECT_FRAME_TOO_LARGE,
            RejectReason::BadFlatbuffers => sys::KVR_INGEST_REJECT_BAD_FLATBUFFERS,
            RejectReason::BadMsgpack => sys::KVR_INGEST_REJECT_BAD_MSGPACK,
            RejectReason::BadMessage => sys::KVR_INGEST_REJECT_BAD_MESSAGE,
            RejectReason::BlockSize => sys::KVR_INGEST_REJECT_BLOCK_SIZE,
            RejectReason::Index => sys::KVR_INGEST_REJECT_INDEX,
            RejectReason::StaleSequence => sys::KVR_INGEST_REJECT_STALE_SEQUENCE,
        };
        // A kvr_ingest_reject indexes kvr_ingest_stats.rejected (a u32 always fits a usize).
        reason as usize
    }
}

/// Counters of one source, or of every source together (`kvr_ingest_stats`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IngestStats {
    /// Ranks whose state was lost (gap) and not yet re-established.
    pub state_unknown: u32,
    /// Frames or ZMQ / NATS messages received.
    pub messages: u64,
    pub events_applied: u64,
    /// Per `KVR_INGEST_REJECT_*`; read with [`IngestStats::rejected`].
    pub rejected: [u64; sys::KVR_INGEST_REJECT_REASONS],
    /// Sequence jumps forward.
    pub gaps: u64,
    /// Messages lost in those jumps.
    pub missed_messages: u64,
    /// Publisher sequence resets to 0.
    pub restarts: u64,
    /// Worker states cleared or replayed because they were lost.
    pub recoveries: u64,
    /// Stream connections accepted; NATS connections and reconnections.
    pub connections: u64,
    /// Messages whose lag (publication to events applied) was measured.
    pub lag_samples: u64,
    /// Their lags summed, in µs (mean = lag_total_us / lag_samples).
    pub lag_total_us: u64,
    /// The largest lag, in µs.
    pub lag_max_us: u64,
    /// The most recent message's lag, in µs.
    pub lag_last_us: u64,
    /// Replica sync: changes published.
    pub published: u64,
    /// Replica sync: changes the NATS client refused.
    pub publish_failures: u64,
    /// The most recent reject's reason in words (e.g. "event 1: unknown event tag 'X'"), empty
    /// if none was given; for every source together, the most recent of them all.
    pub last_reject: String,
    /// A JetStream source's last stream sequence applied (and acknowledged); for every source
    /// together, the largest; 0 for other sources.
    pub stream_sequence: u64,
    /// A JetStream source's consumer made again because deliveries were lost on the way (they
    /// come again, in order, from the new consumer), or a core NATS, replica sync or JetStream
    /// relay source's connection made again after the NATS client gave it up (a server's
    /// error); for every source together, the sum; 0 for other sources.
    pub consumer_remakes: u64,
    /// A JetStream source's attempts to make its consumer (or a NATS source's its connection)
    /// again that failed and were retried; for every source together, the sum.
    pub consumer_remake_failures: u64,
    /// Engine events no router indexes, by design: those of a KV-cache group neither full
    /// attention nor a sliding window whose size the engine said (a hybrid model's Mamba
    /// layers; sliding windows limit a rank's hit). Not rejects: the rest of their batch
    /// applies. For every source together, the sum.
    pub events_ignored: u64,
    /// Replica sync: publications of a booking with only its leading block ids, the NATS
    /// server's messages (its max_payload) too short for them all, or the connection
    /// reconnecting (3,584 bytes then); a booking announced again counts again. Peers count
    /// those bookings' prefix blocks only. For every source together, the sum.
    pub bookings_trimmed: u64,
}

impl IngestStats {
    /// Messages or events rejected for `reason`.
    pub fn rejected(&self, reason: RejectReason) -> u64 {
        self.rejected[reason.index()]
    }
}

impl From<sys::kvr_ingest_stats> for IngestStats {
    fn from(s: sys::kvr_ingest_stats) -> Self {
        IngestStats {
            state_unknown: s.state_unknown,
            messages: s.messages,
            events_applied: s.events_applied,
            rejected: s.rejected,
            gaps: s.gaps,
            missed_messages: s.missed_messages,
            restarts: s.restarts,
            recoveries: s.recoveries,
            connections: s.connections,
            lag_samples: s.lag_samples,
            lag_total_us: s.lag_total_us,
            lag_max_us: s.lag_max_us,
            lag_last_us: s.lag_last_us,
            published: s.published,
            publish_failures: s.publish_failures,
            // Up to the NUL (the whole buffer if none); bytes that are not UTF-8 replaced.
            last_reject: {
                let bytes: Vec<u8> = s.last_reject.iter().map(|&c| c as u8).collect();
                let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
                String::from_utf8_lossy(&bytes[..end]).into_owned()
            },
            stream_sequence: s.stream_sequence,
            consumer_remakes: s.consumer_remakes,
            consumer_remake_failures: s.consumer_remake_failures,
            events_ignored: s.events_ignored,
            bookings_trimmed: s.bookings_trimmed,
        }
    }
}

/// A listening native-stream source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listener {
    /// The source's id, for [`Ingest::stats`].
    pub source_id: u64,
    /// The endpoint actually bound (`tcp://HOST:PORT` with the real port for port 0).
    pub endpoint: String,
}

/// An event-loop thread applying KV events from every source to a router (`kvr_ingest`),
/// concurrently with routing. Created stopped; sources may be added before or after
/// [`start`](Self::start).
///
/// The router must outlive the loop thread, whatever becomes of the `Ingest` (dropped,
/// or leaked with `mem::forget`, which is safe), so every constructor sees to it:
///
/// * [`with_shared_router`](Self::with_shared_router) (an `Arc<Router>`) and
///   [`with_shared_disagg`](Self::with_shared_disagg) (an `Arc<Disagg>` and one of its pools)
///   keep the router alive for as long as the ingest object exists: an `Ingest<'static>`
///   that may be stored, shared (`Arc<Ingest>`) and moved anywhere;
/// * [`with_static_router`](Self::with_static_router) takes a `&'static` router (a `static`,
///   or a leaked one), which is never freed;
/// * [`scope`](Self::scope) borrows any router (a `Router` on the stack, a `Disagg`'s pool) for
///   the length of a closure, and frees the ingest object, joining its thread, before it
///   returns, in the manner of `std::thread::scope`.
///
/// ```
/// use std::sync::Arc;
/// use kvrouter::{Ingest, IngestOptions, Router, RouterOptions};
///
/// let router = Arc::new(Router::new(&RouterOptions::with_block_size(16))?);
/// let ingest = Ingest::with_shared_router(router.clone(), &IngestOptions::default())?;
/// ingest.start()?;
/// let listener = ingest.listen("tcp://127.0.0.1:0")?;
/// println!("engines publish to {}", listener.endpoint);
/// drop(router); // the ingest keeps it alive
/// # Ok::<(), kvrouter::Error>(())
/// ```
///
/// Dropping the last handle stops the ingest and frees it. Inside a replica publisher
/// closure (which the library runs under its router's lock, on the thread making a change:
/// a caller's, or this ingest's own loop thread for its heartbeats), that would join the loop
/// thread from itself, or wait for a loop that may be waiting for that lock: there the drop
/// returns at once, and a thread of its own stops and frees the object (and then drops what it
/// kept alive) once the publisher has returned. [`stop`](Self::stop) likewise.
///
/// The borrowing constructor of 0.2.0, `Ingest::new(&RouterRef, ..)`, is gone: an `Ingest`
/// leaked with `mem::forget` ended the borrow without stopping its thread, which then applied
/// events to a freed router.
///
/// ```compile_fail
/// # use kvrouter::{Ingest, IngestOptions, Router, RouterOptions};
/// let router = Router::new(&RouterOptions::default())?;
/// let ingest = Ingest::new(&router, &IngestOptions::default())?;
/// std::mem::forget(ingest);
/// drop(router);
/// # Ok::<(), kvrouter::Error>(())
/// ```
pub struct Ingest<'r> {
    /// Shared with a thread that stops the object for a publisher (`stop`), which must not
    /// find it freed.
    inner: Arc<Inner>,
    /// The router's borrow, for an ingest object of [`Ingest::scope`] (`'static` otherwise).
    _router: PhantomData<&'r RouterRef>,
}

/// The C object, freed by the drop of the last handle.
struct Inner {
    ptr: NonNull<sys::kvr_ingest>,
    /// The router it feeds (the key of its publisher closures, for `sync_replicas`).
    router: *mut sys::kvr_router,
    /// What keeps the router alive; dropped after the free (fields drop after `Drop::drop`).
    keep: Keep,
}

/// What keeps an ingest object's router alive for as long as the object exists. (The Arcs are
/// held, never read: dead code to the compiler.)
#[allow(dead_code)]
enum Keep {
    /// [`Ingest::scope`]: the router is borrowed for the scope, which frees the object before
    /// it returns.
    Scoped,
    /// A `&'static` router, which nothing frees.
    Static,
    Router(Arc<Router>),
    /// A `Disagg`, one of whose pools the ingest object feeds.
    Disagg(Arc<Disagg>),
}

/// One of the two routers of a [`Disagg`], for [`Ingest::with_shared_disagg`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DisaggPool {
    /// [`Disagg::prefill_router`].
    Prefill,
    /// [`Disagg::decode_router`].
    Decode,
}

// SAFETY: every kvr_ingest function is tagged `concurrent` except kvr_ingest_free, which only
// Inner's Drop calls, once the last handle is gone (the Arc), and kvr_ingest_stop, concurrent
// with every call since 0.2.0 (it waits for a kvr_ingest_subscribe_nats / _subscribe_jetstream /
// _relay_jetstream / _sync_replicas in progress and refuses later ones) except when called from
// a callback on the ingest's own thread, where it cannot wait for them. The only Rust code the
// library runs on its threads is a replica publisher closure, and inside one `stop` never calls
// it: a thread of its own does. The router it feeds is Sync, and kept alive (`Keep`) by Arcs
// that are Send + Sync, or borrowed (`scope`).
unsafe impl Send for Inner {}
// SAFETY: as above: a shared &Inner reaches only functions that may run concurrently with each
// other.
unsafe impl Sync for Inner {}

impl Drop for Inner {
    fn drop(&mut self) {
        if crate::replica::in_publisher() && !matches!(self.keep, Keep::Scoped) {
            // Inside a publisher, under a router's lock, maybe on this very loop thread: the
            // free (which joins the loop) moves to a thread of its own, with what keeps the
            // router alive. Its kvr_ingest_free waits for the loop, which finishes once the
            // publisher has returned. A scoped object is never dropped here (`scope` refuses to
            // run inside a publisher, and none can reach its object), and could not wait.
            let deferred = ManuallyDrop::new(Inner {
                ptr: self.ptr,
                router: self.router,
                keep: std::mem::replace(&mut self.keep, Keep::Static),
            });
            let spawned = thread::Builder::new()
                .name("kvrouter-ingest-free".to_owned())
                .spawn(move || drop(ManuallyDrop::into_inner(deferred)));
            // Without a thread (the system refused one), the closure is gone with its
            // ManuallyDrop: the object and its router leak, which is sound.
            drop(spawned);
            return;
        }
        // SAFETY: the last handle, so no other call is in progress; the router (kept by `keep`,
        // which drops after this, or borrowed by a scope that is not over) is alive.
        unsafe { sys::kvr_ingest_free(self.ptr.as_ptr()) }
        // A panic of a publisher the free ran is not resumed from a drop.
        crate::replica::discard_stale_panics();
    }
}

impl Ingest<'static> {
    /// A stopped ingest object feeding a shared router, which it keeps alive for as long as the
    /// object exists (whether the `Ingest` is dropped or leaked).
    pub fn with_shared_router(router: Arc<Router>, options: &IngestOptions) -> Result<Self> {
        let raw = router.as_raw();
        // SAFETY: the Arc, kept in the object, keeps the router alive for as long as it.
        unsafe { Ingest::create(raw, options, Keep::Router(router)) }
    }

    /// A stopped ingest object feeding one pool of a shared [`Disagg`], which it keeps alive
    /// for as long as the object exists. (A pool is a [`RouterRef`] borrowed from its
    /// `Disagg`: an ingest object for one either keeps the `Disagg`, as here, or lives in an
    /// [`Ingest::scope`].)
    pub fn with_shared_disagg(
        disagg: Arc<Disagg>,
        pool: DisaggPool,
        options: &IngestOptions,
    ) -> Result<Self> {
        let raw = match pool {
            DisaggPool::Prefill => disagg.prefill_router().as_raw(),
            DisaggPool::Decode => disagg.decode_router().as_raw(),
        };
        // SAFETY: the Arc, kept in the object, keeps the Disagg, which owns the pool, alive for
        // as long as it.
        unsafe { Ingest::create(raw, options, Keep::Disagg(disagg)) }
    }

    /// A stopped ingest object feeding a router that lives for the rest of the program (a
    /// `static`, e.g. in a `LazyLock`, or a `Box::leak`ed one, or a pool of such a `Disagg`).
    pub fn with_static_router(router: &'static RouterRef, options: &IngestOptions) -> Result<Self> {
        // SAFETY: a 'static router is never freed.
        unsafe { Ingest::create(router.as_raw(), options, Keep::Static) }
    }
}

impl<'r> Ingest<'r> {
    /// Runs `f` with a stopped ingest object feeding `router`, which it borrows, and frees the
    /// object (stopping it and joining its thread) before it returns `f`'s result, also when
    /// `f` panics. For a router owned on the stack, or a [`Disagg`]'s pool, without an `Arc`;
    /// `f` may start it, add sources, and run scoped threads that route meanwhile. An error if
    /// the object cannot be created (`f` is not run then), and `FailedPrecondition` inside a
    /// replica publisher closure, where the scope's end could not free the object.
    ///
    /// ```
    /// use kvrouter::{Ingest, IngestOptions, Publisher, Router, RouterOptions};
    ///
    /// let router = Router::new(&RouterOptions::with_block_size(16))?;
    /// let sent = Ingest::scope(&router, &IngestOptions::default(), |ingest| {
    ///     ingest.start()?;
    ///     let listener = ingest.listen("tcp://127.0.0.1:0")?;
    ///     let publisher = Publisher::connect(&listener.endpoint)?;
    ///     // ... engines publish, requests are routed ...
    ///     # drop(publisher);
    ///     Ok::<_, kvrouter::Error>(listener.source_id)
    /// })??; // the scope's error, then the closure's
    /// # let _ = sent;
    /// # Ok::<(), kvrouter::Error>(())
    /// ```
    pub fn scope<T>(
        router: &'r RouterRef,
        options: &IngestOptions,
        f: impl FnOnce(&Ingest<'r>) -> T,
    ) -> Result<T> {
        if crate::replica::in_publisher() {
            // Its end would free the object there, under a router's lock, joining a loop that
            // may wait for that lock; and a borrowed router forbids handing the free to another
            // thread as a drop does.
            return Err(Error::new(
                Code::FailedPrecondition,
                "Ingest::scope called from a replica publisher, which runs under its router's \
                 lock: the scope could not free its ingest object there",
            ));
        }
        // SAFETY: the object is dropped (freed) at the end of this function, or while f unwinds,
        // within the borrow of the router; f only borrows it, so cannot leak it.
        let ingest = unsafe { Ingest::create(router.as_raw(), options, Keep::Scoped) }?;
        Ok(f(&ingest))
    }

    /// # Safety
    /// `router` is a live router that `keep` keeps alive for as long as the object (and its
    /// loop thread) exists, or, for `Keep::Scoped`, that outlives `'r`, the returned object
    /// being freed within `'r` (`scope`).
    unsafe fn create(
        router: *mut sys::kvr_router,
        options: &IngestOptions,
        keep: Keep,
    ) -> Result<Ingest<'r>> {
        let raw = options.to_raw();
        let mut out = ptr::null_mut();
        // SAFETY: a live router (the caller's promise); out is written on success only.
        call(|err| unsafe { sys::kvr_ingest_new(router, &raw, &mut out, err) })?;
        let ptr = NonNull::new(out)
            .ok_or_else(|| Error::new(Code::Internal, "kvr_ingest_new gave NULL"))?;
        Ok(Ingest {
            inner: Arc::new(Inner { ptr, router, keep }),
            _router: PhantomData,
        })
    }

    fn as_ptr(&self) -> *mut sys::kvr_ingest {
        self.inner.ptr.as_ptr()
    }

    /// Starts the loop thread. `FailedPrecondition` if started or stopped before.
    pub fn start(&self) -> Result<()> {
        // SAFETY: a live ingest object (concurrent).
        call(|err| unsafe { sys::kvr_ingest_start(self.as_ptr(), err) })
    }

    /// Closes every source and joins the loop thread. Final (no restart); idempotent. Dropping
    /// the object stops it too. It may run concurrently with any other call: it waits for a
    /// [`subscribe_nats`](Self::subscribe_nats), [`subscribe_jetstream`](Self::subscribe_jetstream),
    /// [`relay_jetstream`](Self::relay_jetstream) or [`sync_replicas`](Self::sync_replicas) in
    /// progress, and those called after it fail with `FailedPrecondition`.
    ///
    /// Called from inside a replica publisher closure (which runs under the router's lock, maybe
    /// on this ingest's own loop thread, where the library cannot wait for those calls), it is
    /// asynchronous: it returns `Ok` at once, and a thread of its own stops the ingest once the
    /// publisher has returned (`ResourceExhausted` if no thread can be made). An ingest object
    /// of [`scope`](Self::scope) cannot be reached from a publisher; should it be, this is
    /// `FailedPrecondition`.
    pub fn stop(&self) -> Result<()> {
        if crate::replica::in_publisher() {
            if matches!(self.inner.keep, Keep::Scoped) {
                return Err(Error::new(
                    Code::FailedPrecondition,
                    "Ingest::stop of a scoped ingest object called from a replica publisher",
                ));
            }
            let inner = Arc::clone(&self.inner);
            let spawned = thread::Builder::new()
                .name("kvrouter-ingest-stop".to_owned())
                .spawn(move || {
                    // SAFETY: a live ingest object (this Arc), on a thread that runs no
                    // publisher: concurrent with any call. Should this hold the last handle,
                    // the object is freed here afterwards. A publisher closure's panic during
                    // the stop has no caller here to be resumed to (the panic hook printed it):
                    // dropped, rather than ending this thread with it.
                    let _ = call_dropping_panic(|err| unsafe {
                        sys::kvr_ingest_stop(inner.ptr.as_ptr(), err)
                    });
                });
            return spawned.map(drop).map_err(|e| {
                Error::new(
                    Code::ResourceExhausted,
                    format!("no thread to stop the ingest object from a replica publisher: {e}"),
                )
            });
        }
        // SAFETY: a live ingest object; outside a publisher, kvr_ingest_stop is concurrent.
        call(|err| unsafe { sys::kvr_ingest_stop(self.as_ptr(), err) })
    }

    /// Listens for native event streams on `tcp://HOST:PORT` (port 0 = a free port) or
    /// `unix://PATH`. `Unavailable` if the address cannot be bound.
    pub fn listen(&self, endpoint: &str) -> Result<Listener> {
        let c_endpoint = cstring("endpoint", endpoint)?;
        // Room for the endpoint with a real port in place of "0"; should the library need more,
        // the listener is open all the same (it must not be opened twice) and the endpoint is
        // read back by source id.
        let mut bound = vec![0u8; endpoint.len() + 16];
        let mut source_id = 0u64;
        let mut len = 0usize;
        // SAFETY: a live ingest object (concurrent); bound has room for bound.len() bytes.
        let result = call(|err| unsafe {
            sys::kvr_ingest_listen(
                self.as_ptr(),
                c_endpoint.as_ptr(),
                &mut source_id,
                bound.as_mut_ptr().cast(),
                bound.len(),
                &mut len,
                err,
            )
        });
        let endpoint = match result {
            Ok(()) => {
                bound.truncate(len.saturating_sub(1)); // len counts the NUL
                String::from_utf8_lossy(&bound).into_owned()
            }
            Err(e) if e.code() == Code::BufferTooSmall && source_id != 0 => {
                self.source_endpoint(source_id)?
            }
            Err(e) => return Err(e),
        };
        Ok(Listener {
            source_id,
            endpoint,
        })
    }

    /// Where a source is: a listener's bound endpoint, an engine worker's endpoint, a NATS
    /// server's url (kept after the source is removed). `NotFound` for an unknown id.
    pub fn source_endpoint(&self, source_id: u64) -> Result<String> {
        let mut bytes = fill_vec::<u8>(64, |out, cap, len, err| {
            // SAFETY: a live ingest object (concurrent); out has room for cap bytes.
            unsafe {
                sys::kvr_ingest_source_endpoint(self.as_ptr(), source_id, out.cast(), cap, len, err)
            }
        })?;
        if bytes.last() == Some(&0) {
            bytes.pop();
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// Subscribes to a vLLM / SGLang engine's ranks; returns the source id. Register the
    /// worker with the router too, for routing. `InvalidArgument` for another block size, a
    /// bad endpoint or dp_size 0; `AlreadyExists` for a worker id already subscribed.
    pub fn add_engine_worker(&self, worker: &EngineWorker<'_>) -> Result<u64> {
        let endpoint = cstring("endpoint", worker.endpoint)?;
        let topic = opt_cstring("topic", worker.topic)?;
        let replay = opt_cstring("replay_endpoint", worker.replay_endpoint)?;
        let mut raw = init::<sys::kvr_engine_worker>();
        raw.engine = match worker.engine {
            Engine::Vllm => sys::KVR_ENGINE_VLLM,
            Engine::Sglang => sys::KVR_ENGINE_SGLANG,
        };
        raw.endpoint = endpoint.as_ptr();
        raw.worker_id = worker.worker_id;
        raw.dp_start = worker.dp_start;
        raw.dp_size = worker.dp_size;
        raw.block_size = worker.block_size;
        raw.flags = if worker.eagle {
            sys::KVR_STORED_EAGLE
        } else {
            0
        };
        raw.topic = opt_ptr(&topic);
        raw.replay_endpoint = opt_ptr(&replay);
        let mut source_id = 0u64;
        // SAFETY: a live ingest object (concurrent); the strings live across the call.
        call(|err| unsafe {
            sys::kvr_ingest_add_engine_worker(self.as_ptr(), &raw, &mut source_id, err)
        })?;
        Ok(source_id)
    }

    /// Unsubscribes from an engine worker; `clear_index` also drops its index entries.
    /// `NotFound` for an unknown id.
    pub fn remove_engine_worker(&self, worker_id: u64, clear_index: bool) -> Result<()> {
        // SAFETY: a live ingest object (concurrent).
        call(|err| unsafe {
            sys::kvr_ingest_remove_engine_worker(
                self.as_ptr(),
                worker_id,
                i32::from(clear_index),
                err,
            )
        })
    }

    /// Subscribes to `subject` (wildcards `*`, `>`) on the NATS server at `url`; each message
    /// is one encoded EventBatch. After `start`, returns once the server has the subscription.
    /// `Unavailable` if the first connection fails.
    pub fn subscribe_nats(&self, url: &str, subject: &str) -> Result<u64> {
        let url = cstring("url", url)?;
        let subject = cstring("subject", subject)?;
        let mut source_id = 0u64;
        // SAFETY: a live ingest object (concurrent, kvr_ingest_stop included: see `Inner`); the
        // strings live across the call.
        call(|err| unsafe {
            sys::kvr_ingest_subscribe_nats(
                self.as_ptr(),
                url.as_ptr(),
                subject.as_ptr(),
                &mut source_id,
                err,
            )
        })?;
        Ok(source_id)
    }

    /// Consumes a JetStream stream (see [`JetStreamSource`]); returns the source id, whose
    /// [`IngestStats::stream_sequence`] is the last stream sequence applied. Connects and sets
    /// up the consumer on the calling thread; the connection then reconnects forever and the
    /// consumer continues where it was. `InvalidArgument` for a missing url, stream or subject,
    /// a bad name or bad limits; `NotFound` if the stream does not exist (without
    /// `create_stream`); `Unavailable` if the server cannot be reached or refuses.
    pub fn subscribe_jetstream(&self, source: &JetStreamSource<'_>) -> Result<u64> {
        let lowered = source.lower()?;
        let mut source_id = 0u64;
        // SAFETY: as subscribe_nats; the lowered struct's strings live across the call.
        call(|err| unsafe {
            sys::kvr_ingest_subscribe_jetstream(self.as_ptr(), &lowered.raw, &mut source_id, err)
        })?;
        Ok(source_id)
    }

    /// The JetStream relay: republishes every change this ingest's other sources make to the
    /// router's index into `target`'s stream, each as a native EventBatch on subject
    /// `<subject>.<worker id>` (`target.subject` is a prefix, without wildcards); returns the
    /// relay's source id. A router consuming that stream ([`subscribe_jetstream`] on
    /// `<subject>.>`) then holds what this router's index holds of those workers. Not relayed:
    /// what a JetStream source consumed, and events applied on the router directly.
    /// `target.durable`, `start_sequence` and `resume` must be unset (`InvalidArgument`);
    /// `create_stream` creates the stream on `<subject>.>`. One relay per ingest object
    /// (`FailedPrecondition` for a second); it lasts until [`stop`](Self::stop). Its
    /// [`IngestStats`]: `messages` the changes handed to the relay, `events_applied` those the
    /// stream acknowledged, `published` the messages acknowledged, `stream_sequence` the last
    /// message's stream sequence, `missed_messages` the changes dropped while the server was
    /// away (sent again by a resync; `state_unknown` is 1 until then): it has caught up when
    /// `messages == events_applied + missed_messages` and `state_unknown == 0`. Errors as
    /// `subscribe_jetstream`.
    ///
    /// [`subscribe_jetstream`]: Self::subscribe_jetstream
    pub fn relay_jetstream(&self, target: &JetStreamSource<'_>) -> Result<u64> {
        let lowered = target.lower()?;
        let mut source_id = 0u64;
        // SAFETY: as subscribe_nats; the lowered struct's strings live across the call.
        call(|err| unsafe {
            sys::kvr_ingest_relay_jetstream(self.as_ptr(), &lowered.raw, &mut source_id, err)
        })?;
        Ok(source_id)
    }

    /// Router replica sync over NATS: publishes the router's booking changes on `subject` as
    /// `replica_id` (see [`RouterRef::set_replica_publisher`] for the id's rules) and applies
    /// the other replicas' changes published there; returns the source id, whose counters
    /// include `published`, `publish_failures` and `bookings_trimmed` (publications of a
    /// booking longer than the server's max_payload, sent with its leading block ids).
    ///
    /// As with [`RouterRef::set_replica_publisher`], the router first publishes a `Reset`, an
    /// `Added` change for every booking it holds, and a `SyncRequest`, which every replica on
    /// the subject answers with its own Reset and bookings: `published` counts those
    /// messages (and the answers to later replicas' SyncRequests), and `messages` /
    /// `events_applied` count the Resets and SyncRequests received.
    ///
    /// One per ingest object (`FailedPrecondition` for a second, and for a server whose
    /// max_payload is under 4 KiB). It replaces the router's
    /// publisher (a [`RouterRef::set_replica_publisher`] closure, or another ingest object's
    /// sync); a later one replaces it in turn. A closure it replaced (after its farewell) is
    /// dropped before this returns; should the server not confirm the subscription, one it may
    /// have replaced meanwhile stays allocated until the next `set_replica_publisher` or
    /// `clear_replica_publisher` on the router, or the router's drop. When the ingest stops, its sync stops
    /// publishing unless it was replaced. `InvalidArgument` for a bad replica id (before any
    /// connection); `Unavailable`, with nothing left behind, if the server does not confirm
    /// the subscription.
    pub fn sync_replicas(&self, url: &str, subject: &str, replica_id: &str) -> Result<u64> {
        let url = cstring("url", url)?;
        let subject = cstring("subject", subject)?;
        let replica_id = cstring("replica_id", replica_id)?;
        let mut source_id = 0u64;
        let started = crate::replica::stamp();
        // SAFETY: as subscribe_nats.
        let (result, panicked) = call_keeping_panic(|err| unsafe {
            sys::kvr_ingest_sync_replicas(
                self.as_ptr(),
                url.as_ptr(),
                subject.as_ptr(),
                replica_id.as_ptr(),
                &mut source_id,
                err,
            )
        });
        // Listed, the sync installed its publisher (C's setter, under the router's lock) before
        // this returned: the Rust closures it replaced will not run again. On an error it may
        // or may not have (a subscription the server did not confirm is removed, its publisher
        // with it, and the replaced closure is not put back): they stay, as before.
        if result.is_ok() {
            drop(crate::replica::replace(self.inner.router, started, None));
        }
        if let Some(payload) = panicked {
            std::panic::resume_unwind(payload);
        }
        result.map(|()| source_id)
    }

    /// One source's counters (`source_id` 0 = the sum over every source, as
    /// [`total_stats`](Self::total_stats)). `NotFound` for an unknown id.
    pub fn stats(&self, source_id: u64) -> Result<IngestStats> {
        let mut out = init::<sys::kvr_ingest_stats>();
        // SAFETY: a live ingest object (concurrent); out is an initialised struct.
        call(|err| unsafe { sys::kvr_ingest_get_stats(self.as_ptr(), source_id, &mut out, err) })?;
        Ok(IngestStats::from(out))
    }

    /// Every source's counters summed (removed sources included).
    pub fn total_stats(&self) -> Result<IngestStats> {
        self.stats(0)
    }

    /// Every source's counters in Prometheus text exposition format
    /// (`kvr_ingest_metrics_prometheus`): `kvrouter_ingest_*`, one series per source labelled
    /// `source_id`, `kind` (`listener`, `engine`, `nats`, `replicas`) and `endpoint`, removed
    /// sources included. Its names differ from [`RouterRef::metrics_prometheus`]'s, so a
    /// `/metrics` page may serve both texts one after the other.
    pub fn metrics_prometheus(&self) -> Result<String> {
        let mut bytes = fill_vec::<u8>(4096, |out, cap, len, err| {
            // SAFETY: a live ingest object (concurrent); out has room for cap bytes.
            unsafe { sys::kvr_ingest_metrics_prometheus(self.as_ptr(), out.cast(), cap, len, err) }
        })?;
        if bytes.last() == Some(&0) {
            bytes.pop();
        }
        String::from_utf8(bytes)
            .map_err(|_| Error::new(Code::Internal, "the Prometheus text is not UTF-8"))
    }
}

impl fmt::Debug for Ingest<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Ingest").field(&self.inner.ptr).finish()
    }
}

/// A blocking client connection to a kvrouter stream listener (`kvr_publisher`), for engines
/// publishing their KV events.
pub struct Publisher(NonNull<sys::kvr_publisher>);

// SAFETY: a publisher is a socket with no thread affinity. kvr_publisher_send and
// _send_encoded are tagged `none`, so they take &mut self; kvr_publisher_free runs in Drop.
unsafe impl Send for Publisher {}
// SAFETY: a shared &Publisher reaches no C function at all (every call needs &mut self), so
// sharing references cannot cause concurrent calls (zstd-safe's argument for its contexts).
unsafe impl Sync for Publisher {}

impl Publisher {
    /// Connects to `tcp://HOST:PORT` or `unix://PATH`. `Unavailable` if that fails.
    pub fn connect(endpoint: &str) -> Result<Publisher> {
        crate::check_version()?;
        let endpoint = cstring("endpoint", endpoint)?;
        let mut out = ptr::null_mut();
        // SAFETY: endpoint lives across the call; out is written on success only.
        call(|err| unsafe { sys::kvr_publisher_connect(endpoint.as_ptr(), &mut out, err) })?;
        NonNull::new(out)
            .map(Publisher)
            .ok_or_else(|| Error::new(Code::Internal, "kvr_publisher_connect gave NULL"))
    }

    /// Encodes the batch's events and sends them as one frame. `Unavailable` if the
    /// connection is lost.
    pub fn send(&mut self, batch: &EventBatch) -> Result<()> {
        // SAFETY: exclusive use of the publisher; the batch is not Sync, so no other thread
        // can be calling on it.
        call(|err| unsafe { sys::kvr_publisher_send(self.0.as_ptr(), batch.as_ptr(), err) })
    }

    /// Sends an already encoded EventBatch as one frame (the length header is added).
    pub fn send_encoded(&mut self, bytes: &[u8]) -> Result<()> {
        // SAFETY: exclusive use of the publisher; bytes borrowed for the call.
        call(|err| unsafe {
            sys::kvr_publisher_send_encoded(
                self.0.as_ptr(),
                bytes.as_ptr().cast(),
                bytes.len(),
                err,
            )
        })
    }
}

impl fmt::Debug for Publisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Publisher").field(&self.0).finish()
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        // SAFETY: owned, closed once.
        unsafe { sys::kvr_publisher_free(self.0.as_ptr()) }
    }
}
