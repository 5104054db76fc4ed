//! KV events (stored, removed, cleared), FlatBuffers event batches and library-owned buffers.

use std::ffi::CString;
use std::fmt;
use std::ops::Deref;
use std::ptr::{self, NonNull};

use kvrouter_sys as sys;

use crate::error::{call, Error, Result};
use crate::raw::init;
use crate::util::{opt_cstring, opt_ptr, slice_ptr, Multimodal};

/// A storage tier (`KVR_TIER_*`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Tier {
    /// GPU memory (the default).
    #[default]
    Device,
    /// Pinned host memory.
    HostPinned,
    Disk,
    External,
}

impl Tier {
    pub(crate) fn raw(self) -> sys::kvr_tier {
        match self {
            Tier::Device => sys::KVR_TIER_DEVICE,
            Tier::HostPinned => sys::KVR_TIER_HOST_PINNED,
            Tier::Disk => sys::KVR_TIER_DISK,
            Tier::External => sys::KVR_TIER_EXTERNAL,
        }
    }

    /// The tier for a raw `KVR_TIER_*` value (None for one this binding does not know).
    pub fn from_raw(raw: sys::kvr_tier) -> Option<Tier> {
        match raw {
            sys::KVR_TIER_DEVICE => Some(Tier::Device),
            sys::KVR_TIER_HOST_PINNED => Some(Tier::HostPinned),
            sys::KVR_TIER_DISK => Some(Tier::Disk),
            sys::KVR_TIER_EXTERNAL => Some(Tier::External),
            _ => None,
        }
    }
}

/// Maps an engine's "medium" string (`GPU`, `CPU_PINNED`, `DISK`, ...; case-insensitive) to a
/// tier; None or an unknown medium is the device, as in Dynamo (`kvr_tier_from_medium`).
/// This function cannot fail: unlike every other string the binding passes to C (refused with
/// `InvalidArgument` for a NUL byte), a medium with a NUL byte is read up to it, as C would.
pub fn tier_from_medium(medium: Option<&str>) -> Tier {
    // C reads up to the first NUL, so a string with one means its prefix.
    let medium = medium.map(|m| CString::new(m.split('\0').next().unwrap_or("")).unwrap());
    // SAFETY: NULL or a NUL-terminated string that lives across the call.
    let raw = unsafe { sys::kvr_tier_from_medium(opt_ptr(&medium)) };
    Tier::from_raw(raw).unwrap_or_default()
}

/// Blocks newly cached by one worker rank, consecutive along one sequence
/// (`kvr_stored_event`). Each block has the engine's own hash (`block_hashes`) and either a
/// precomputed local hash (`local_hashes`) or its tokens (`token_ids`: `block_size` per
/// block, concatenated, plus one look-ahead token with eagle). With
/// [`sliding_window`](Self::sliding_window) it is instead a hybrid model's sliding-window
/// store, of blocks the rank holds in full attention.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoredEvent<'a> {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub event_id: u64,
    pub tier: Tier,
    /// The engine hash of the block this run continues.
    pub parent_hash: Option<u64>,
    /// `token_ids` use eagle windows.
    pub eagle: bool,
    pub block_hashes: &'a [u64],
    /// One per block; when given, `token_ids` is not read.
    pub local_hashes: Option<&'a [u64]>,
    pub token_ids: &'a [u32],
    pub lora_name: Option<&'a str>,
    pub cache_namespace: Option<&'a str>,
    /// Per-block multimodal hashes: `counts` has one entry per block.
    pub multimodal: Option<Multimodal<'a>>,
    /// A hybrid model's sliding-window store instead (`sliding_group`,
    /// `sliding_window_tokens`; docs/ingest.md, "Sliding windows"): the window's KV-cache group
    /// now holds the blocks `block_hashes` names, by engine hash, each one the rank holds in
    /// full attention under that hash (the others are skipped: `NotFound`). A prefix is then
    /// cached on the rank only where its sliding-window groups also hold the blocks before the
    /// prefix's end that their windows need, as the engine counts it. Such a store names blocks
    /// only: no `parent_hash`, `eagle`, `local_hashes`, `token_ids`, `lora_name`,
    /// `cache_namespace` nor `multimodal`, and the [`Tier::Device`] tier (`InvalidArgument`
    /// otherwise). `None` (the default): a full-attention store.
    pub sliding_window: Option<SlidingWindow>,
}

/// A sliding-window KV-cache group of a hybrid model (Gemma-2/3, gpt-oss), as a
/// [`StoredEvent::sliding_window`] names it.
///
/// ```
/// # use kvrouter::{Router, RouterOptions, SlidingWindow, StoredEvent};
/// # let router = Router::new(&RouterOptions::with_block_size(16))?;
/// # let prompt: Vec<u32> = (0..64).collect();
/// # router.apply_stored(&StoredEvent {
/// #     worker_id: 1,
/// #     block_hashes: &[100, 101, 102, 103],
/// #     token_ids: &prompt,
/// #     ..Default::default()
/// # })?;
/// // Group 0's 32-token window holds the last two of the blocks worker 1 stored.
/// router.apply_stored(&StoredEvent {
///     worker_id: 1,
///     block_hashes: &[102, 103],
///     sliding_window: Some(SlidingWindow { group: 0, window_tokens: 32 }),
///     ..Default::default()
/// })?;
/// # Ok::<(), kvrouter::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SlidingWindow {
    /// The engine's index of the KV-cache group (`sliding_group`).
    pub group: i64,
    /// The group's window in tokens (`sliding_window_tokens`): more than 0
    /// (`InvalidArgument` otherwise).
    pub window_tokens: u32,
}

pub(crate) struct LoweredStored {
    pub(crate) raw: sys::kvr_stored_event,
    _strings: [Option<CString>; 2],
}

impl StoredEvent<'_> {
    pub(crate) fn lower(&self) -> Result<LoweredStored> {
        let mut raw = init::<sys::kvr_stored_event>();
        let strings = [
            opt_cstring("lora_name", self.lora_name)?,
            opt_cstring("cache_namespace", self.cache_namespace)?,
        ];
        raw.dp_rank = self.dp_rank;
        raw.worker_id = self.worker_id;
        raw.event_id = self.event_id;
        raw.tier = self.tier.raw();
        if let Some(parent) = self.parent_hash {
            raw.flags |= sys::KVR_STORED_HAS_PARENT;
            raw.parent_hash = parent;
        }
        if self.eagle {
            raw.flags |= sys::KVR_STORED_EAGLE;
        }
        raw.block_hashes = slice_ptr(self.block_hashes);
        raw.num_blocks = self.block_hashes.len();
        if let Some(local) = self.local_hashes {
            // C reads num_blocks local hashes: the slice must hold exactly that many.
            if local.len() != self.block_hashes.len() {
                return Err(Error::invalid(format!(
                    "stored event: {} local hashes for {} blocks",
                    local.len(),
                    self.block_hashes.len()
                )));
            }
            // A non-NULL pointer even for zero blocks: NULL would mean "hash the tokens".
            raw.local_hashes = local.as_ptr();
        }
        raw.token_ids = slice_ptr(self.token_ids);
        raw.num_tokens = self.token_ids.len();
        raw.lora_name = opt_ptr(&strings[0]);
        raw.cache_namespace = opt_ptr(&strings[1]);
        if let Some(mm) = &self.multimodal {
            mm.check("stored event", Some(self.block_hashes.len()))?;
            raw.mm_hashes = slice_ptr(mm.hashes);
            raw.mm_counts = mm.counts.as_ptr();
        }
        if let Some(window) = self.sliding_window {
            // C takes a window of 0 for a full-attention store: refuse it rather than apply the
            // event as one.
            if window.window_tokens == 0 {
                return Err(Error::invalid(
                    "stored event: a sliding window of 0 tokens (window_tokens must be > 0)",
                ));
            }
            raw.sliding_group = window.group;
            raw.sliding_window_tokens = window.window_tokens;
        }
        Ok(LoweredStored {
            raw,
            _strings: strings,
        })
    }
}

/// Blocks one worker rank evicted, by engine hash (`kvr_removed_event`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RemovedEvent<'a> {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub event_id: u64,
    pub tier: Tier,
    pub block_hashes: &'a [u64],
    /// `Some(group)`: the blocks left the hybrid model's sliding-window KV-cache group `group`
    /// (the engine's group index; `KVR_REMOVED_SLIDING` and `sliding_group`; docs/ingest.md,
    /// "Sliding windows"), whose window let go of them: the rank's full-attention blocks stay
    /// (a window lets go of a block long before full attention does). `None` (the default):
    /// the rank evicted them.
    pub sliding_group: Option<i64>,
}

impl RemovedEvent<'_> {
    pub(crate) fn lower(&self) -> sys::kvr_removed_event {
        let mut raw = init::<sys::kvr_removed_event>();
        raw.dp_rank = self.dp_rank;
        raw.worker_id = self.worker_id;
        raw.event_id = self.event_id;
        raw.tier = self.tier.raw();
        raw.block_hashes = slice_ptr(self.block_hashes);
        raw.num_blocks = self.block_hashes.len();
        if let Some(group) = self.sliding_group {
            raw.flags |= sys::KVR_REMOVED_SLIDING;
            raw.sliding_group = group;
        }
        raw
    }
}

/// Bytes owned by the library (`kvr_buffer`: an encoded event batch, an index snapshot).
/// Derefs to `[u8]`.
pub struct Buffer(NonNull<sys::kvr_buffer>);

// SAFETY: a kvr_buffer is an immutable byte vector once returned: kvr_buffer_data and
// kvr_buffer_size are tagged concurrent, and kvr_buffer_free (the only `none` function) runs
// only in Drop, which needs ownership. Nothing ties it to the thread that created it.
unsafe impl Send for Buffer {}
// SAFETY: as above: through a shared reference only the concurrent accessors are reachable.
unsafe impl Sync for Buffer {}

impl Buffer {
    /// # Safety
    /// `raw` must be a non-NULL buffer returned by the library, owned by the caller.
    pub(crate) unsafe fn from_raw(raw: *mut sys::kvr_buffer) -> Result<Buffer> {
        NonNull::new(raw)
            .map(Buffer)
            .ok_or_else(|| Error::new(crate::Code::Internal, "the library returned no buffer"))
    }

    /// The bytes (also reachable through `Deref`).
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: the buffer is live for &self; data is valid for size bytes until
        // kvr_buffer_free, which only Drop calls.
        unsafe {
            let size = sys::kvr_buffer_size(self.0.as_ptr());
            if size == 0 {
                return &[];
            }
            std::slice::from_raw_parts(sys::kvr_buffer_data(self.0.as_ptr()), size)
        }
    }
}

impl Deref for Buffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_bytes()
    }
}

impl AsRef<[u8]> for Buffer {
    fn as_ref(&self) -> &[u8] {
        self.as_bytes()
    }
}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer").field("len", &self.len()).finish()
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: owned, freed once.
        unsafe { sys::kvr_buffer_free(self.0.as_ptr()) }
    }
}

/// Events collected and encoded as one FlatBuffers `EventBatch` (`kvr_event_batch`): what
/// [`RouterRef::apply_event_batch`](crate::RouterRef::apply_event_batch), the stream
/// listeners and NATS subscriptions take. Build one in any engine to publish its KV events.
pub struct EventBatch(NonNull<sys::kvr_event_batch>);

// SAFETY: a batch is a plain C++ object with no thread affinity, so it may move between
// threads. It is deliberately not Sync: every kvr_event_batch_* function is tagged
// `none (for this batch)`, including the &self ones here (len, encode) and
// kvr_publisher_send's read of it, so no two threads may ever reach it at once.
unsafe impl Send for EventBatch {}

impl EventBatch {
    /// An empty batch (`kvr_event_batch_new`).
    pub fn new() -> Result<EventBatch> {
        crate::check_version()?;
        let mut out = ptr::null_mut();
        // SAFETY: out is written on success only.
        call(|err| unsafe { sys::kvr_event_batch_new(&mut out, err) })?;
        NonNull::new(out)
            .map(EventBatch)
            .ok_or_else(|| Error::new(crate::Code::Internal, "kvr_event_batch_new gave NULL"))
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::kvr_event_batch {
        self.0.as_ptr()
    }

    /// Appends a copy of the event (validated as `apply_stored` validates its arguments).
    pub fn add_stored(&mut self, event: &StoredEvent<'_>) -> Result<()> {
        let lowered = event.lower()?;
        // SAFETY: &mut self: no other call on the batch; the event's pointers live across it.
        call(|err| unsafe { sys::kvr_event_batch_add_stored(self.as_ptr(), &lowered.raw, err) })
    }

    pub fn add_removed(&mut self, event: &RemovedEvent<'_>) -> Result<()> {
        let raw = event.lower();
        // SAFETY: as add_stored.
        call(|err| unsafe { sys::kvr_event_batch_add_removed(self.as_ptr(), &raw, err) })
    }

    /// A clear of the rank (worker_id, dp_rank): its other ranks keep their blocks.
    pub fn add_cleared(&mut self, worker_id: u64, dp_rank: u32, event_id: u64) -> Result<()> {
        // SAFETY: &mut self: no other call on the batch.
        call(|err| unsafe {
            sys::kvr_event_batch_add_cleared(self.as_ptr(), worker_id, dp_rank, event_id, err)
        })
    }

    /// Events added so far.
    pub fn len(&self) -> usize {
        // SAFETY: the batch is live; not Sync, so no call runs on it concurrently.
        unsafe { sys::kvr_event_batch_size(self.as_ptr()) }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sets the batch's publication time, from which ingest measures its lag (publication to
    /// events applied). Until this is called, a batch is stamped with the wall clock when it is
    /// encoded or sent; `None` leaves it unstamped (no lag measured).
    pub fn set_publish_time(&mut self, time: Option<std::time::SystemTime>) -> Result<()> {
        let unix_ns = match time {
            None => 0,
            Some(t) => {
                let since = t
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_err(|_| Error::invalid("the publish time is before the Unix epoch"))?;
                u64::try_from(since.as_nanos())
                    .map_err(|_| Error::invalid("the publish time is past the year 2554"))?
                    .max(1)
            }
        };
        self.set_publish_time_unix_ns(unix_ns)
    }

    /// [`set_publish_time`](Self::set_publish_time) in nanoseconds since the Unix epoch;
    /// 0 leaves the batch unstamped.
    pub fn set_publish_time_unix_ns(&mut self, unix_ns: u64) -> Result<()> {
        // SAFETY: &mut self: no other call on the batch.
        call(|err| unsafe { sys::kvr_event_batch_set_publish_time(self.as_ptr(), unix_ns, err) })
    }

    /// Encodes the events added so far (the batch keeps them).
    pub fn encode(&self) -> Result<Buffer> {
        let mut out = ptr::null_mut();
        // SAFETY: the batch is live and not shared across threads (not Sync); out is written
        // on success only.
        call(|err| unsafe { sys::kvr_event_batch_encode(self.as_ptr(), &mut out, err) })?;
        // SAFETY: a buffer the call returned, now ours.
        unsafe { Buffer::from_raw(out) }
    }

    /// Drops every event (and any publish time set).
    pub fn clear(&mut self) {
        // SAFETY: &mut self: no other call on the batch.
        unsafe { sys::kvr_event_batch_clear(self.as_ptr()) }
    }
}

impl fmt::Debug for EventBatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventBatch")
            .field("len", &self.len())
            .finish()
    }
}

impl Drop for EventBatch {
    fn drop(&mut self) {
        // SAFETY: owned, freed once; Drop has exclusive access.
        unsafe { sys::kvr_event_batch_free(self.as_ptr()) }
    }
}
