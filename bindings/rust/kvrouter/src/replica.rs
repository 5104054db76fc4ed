//! Router replica sync over a caller's own bus: the Rust closure behind
//! `kvr_router_set_replica_publisher`.
//!
//! A `RouterRef` has no room for state, so the closures live in a process-wide table keyed by
//! router address. A closure is freed only once C has stopped calling it: when it is replaced
//! or cleared (the C call returns only after the previous callback has finished and will not
//! run again) or when its router is freed. A new closure runs before the installing call
//! returns (the router announces itself: Reset, its bookings, SyncRequest), so it is
//! registered even when it panicked there. A router's closure leaves the table before the
//! router is freed (`take_before_free`), since its address may be reused at once.
//!
//! The table is never locked while C may run a closure (installing one runs the old one's
//! farewell and the new one's announcement): a closure may drop a `Router` or install another
//! router's publisher, which lock it. So concurrent setters on one router do not learn the
//! order C applied them in; each entry carries the stamp of its setter's return instead, and a
//! setter frees only what was installed by setters that had returned before it started
//! (`set`).

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::ffi::c_void;
use std::panic::{self, AssertUnwindSafe};
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use kvrouter_sys as sys;

use crate::error::{call_keeping_panic, Result};
use crate::util::{opt_cstring, opt_ptr};

pub(crate) type Callback = Box<dyn Fn(&[u8]) + Send + Sync + 'static>;

/// Router address, stamp (of the return of the `set` that installed it), closure. The inner
/// Box gives the closure a stable, thin address to pass as `user_data`.
pub(crate) type Entry = (usize, u64, Box<Callback>);

/// The publisher closures of the routers, and the clock that stamps them.
struct Table {
    /// A router has one entry, or more after setters overlapped (see `set`).
    entries: Vec<Entry>,
    /// Advanced at every stamp: a later stamp was taken later.
    clock: u64,
}

impl Table {
    fn stamp(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }
}

/// Locked only briefly, never across a C call that may run a closure.
static CALLBACKS: Mutex<Table> = Mutex::new(Table {
    entries: Vec::new(),
    clock: 0,
});

fn table() -> std::sync::MutexGuard<'static, Table> {
    CALLBACKS.lock().unwrap_or_else(|e| e.into_inner())
}

thread_local! {
    /// How many publisher callbacks are running on this thread, one inside another (a closure
    /// that calls another router, whose closure runs in turn): 0 outside any. A `const`
    /// initialiser without `Drop`, so it can be read at any time, during thread exit too.
    static DEPTH: Cell<u32> = const { Cell::new(0) };
    /// The panics caught in callbacks on this thread, each tagged with the callback's depth
    /// (`DEPTH` while it ran), at most one per depth (the first: a later one is dropped). The
    /// kvr_* call that ran the callback takes it when it returns to Rust and resumes it (see
    /// `error::call`); a panic must not unwind through C.
    static PANICS: RefCell<Caught> = const { RefCell::new(Caught(Vec::new())) };
}

/// Panics caught on one thread, with the depth of the callback that raised each.
struct Caught(Vec<(u32, Box<dyn Any + Send>)>);

impl Drop for Caught {
    /// At thread exit: payloads nothing resumed (caught on a library thread) are dropped, a
    /// payload whose own `Drop` panics included.
    fn drop(&mut self) {
        for (_, payload) in self.0.drain(..) {
            drop_quietly(payload);
        }
    }
}

/// Drops a panic payload without letting a panic in its `Drop` escape (the trampoline is
/// `extern "C"`, and a panic while another unwinds aborts): such a second payload is leaked.
pub(crate) fn drop_quietly(payload: Box<dyn Any + Send>) {
    if let Err(second) = panic::catch_unwind(AssertUnwindSafe(move || drop(payload))) {
        std::mem::forget(second);
    }
}

/// Set (for good) by the first panic caught in a callback, on any thread, before it is stored
/// in that thread's `PANICS`: until then no thread's `PANICS` can hold one, and `take_panic`
/// and `discard_stale_panics` skip the thread-local. A thread reading false after its kvr_*
/// call returned ran no callback that panicked during it (its own store would precede its
/// load).
static ANY_PANIC: AtomicBool = AtomicBool::new(false);

/// Whether this thread is running a replica publisher closure (the library runs them under
/// their router's lock, on the thread making a change: a caller's, or an ingest's loop).
pub(crate) fn in_publisher() -> bool {
    DEPTH.with(Cell::get) > 0
}

/// The panic caught in a callback that the kvr_* call just made from this thread ran, if any:
/// one of depth `DEPTH + 1` (a callback that call ran itself, not one a callback inside it ran
/// through a call of its own, which that call took). A panic caught during another call, on a
/// thread where no Rust call was waiting for it (an ingest's loop thread), is never resumed
/// here: it stays at its own depth until this thread exits.
pub(crate) fn take_panic() -> Option<Box<dyn Any + Send>> {
    if !ANY_PANIC.load(Ordering::Relaxed) {
        return None;
    }
    take_deeper(DEPTH.with(Cell::get))
}

/// Before a kvr_* call that may run callbacks: drops the panics of depth `DEPTH + 1` or more
/// that an earlier call of this thread left (one that ran a callback without taking its panic,
/// a `Drop`), so that the call resumes only a panic caught during it.
pub(crate) fn discard_stale_panics() {
    if !ANY_PANIC.load(Ordering::Relaxed) {
        return;
    }
    if let Some(payload) = take_deeper(DEPTH.with(Cell::get)) {
        drop_quietly(payload);
    }
}

/// Takes this thread's panics caught deeper than `depth`: returns the one of depth `depth + 1`
/// and drops the others (of callbacks run by calls that did not take them).
fn take_deeper(depth: u32) -> Option<Box<dyn Any + Send>> {
    let mut taken = Vec::new();
    let _ = PANICS.try_with(|caught| {
        if let Ok(mut caught) = caught.try_borrow_mut() {
            let mut i = 0;
            while i < caught.0.len() {
                if caught.0[i].0 > depth {
                    taken.push(caught.0.remove(i));
                } else {
                    i += 1;
                }
            }
        }
    });
    let mut resumed = None;
    for (at, payload) in taken {
        if at == depth + 1 && resumed.is_none() {
            resumed = Some(payload);
        } else {
            drop_quietly(payload);
        }
    }
    resumed
}

/// Keeps a panic caught in a callback of depth `depth` for the call that ran it, unless one of
/// that depth is kept already (the first panic of a call is the one resumed): then, or if the
/// thread-local is gone (thread exit), it is dropped, quietly.
fn keep_panic(depth: u32, payload: Box<dyn Any + Send>) {
    ANY_PANIC.store(true, Ordering::Relaxed);
    let mut payload = Some(payload);
    let _ = PANICS.try_with(|caught| {
        if let Ok(mut caught) = caught.try_borrow_mut() {
            if !caught.0.iter().any(|&(at, _)| at == depth) {
                if let Some(payload) = payload.take() {
                    caught.0.push((depth, payload));
                }
            }
        }
    });
    if let Some(payload) = payload {
        drop_quietly(payload);
    }
}

/// The `kvr_replica_publish_fn` of every Rust closure (`user_data` is the address of its
/// `Callback`): runs it, marking the thread as in a publisher, and keeps its panic for the call
/// that ran it.
pub(crate) unsafe extern "C" fn trampoline(
    user_data: *mut c_void,
    data: *const c_void,
    size: usize,
) {
    // SAFETY: user_data is the address of a Callback in CALLBACKS, which stays there (and
    // alive) until C has stopped calling this function with it.
    let callback = unsafe { &*(user_data as *const Callback) };
    let bytes = if size == 0 || data.is_null() {
        &[][..]
    } else {
        // SAFETY: C passes `size` readable bytes, valid during this call.
        unsafe { std::slice::from_raw_parts(data.cast::<u8>(), size) }
    };
    let depth = DEPTH.with(|d| {
        let depth = d.get().saturating_add(1);
        d.set(depth);
        depth
    });
    let result = panic::catch_unwind(AssertUnwindSafe(|| callback(bytes)));
    DEPTH.with(|d| d.set(depth - 1));
    if let Err(payload) = result {
        // The panic hook has printed it already; the kvr_* call that ran this callback resumes
        // it when it returns to Rust (a library thread's never does: it is only printed).
        keep_panic(depth, payload);
    }
}

/// Installs (Some) or clears (None) the router's publisher.
pub(crate) fn set(
    router: *mut sys::kvr_router,
    replica_id: Option<&str>,
    callback: Option<Callback>,
) -> Result<()> {
    let id = opt_cstring("replica_id", replica_id)?;
    let boxed = callback.map(Box::new);
    let user_data = boxed
        .as_ref()
        .map_or(ptr::null_mut(), |b| &**b as *const Callback as *mut c_void);
    let publish: sys::kvr_replica_publish_fn = boxed.as_ref().map(|_| trampoline as _);
    // Every closure in the table stamped before this was installed by a setter that returned
    // before this call starts, so C applied it before this one.
    let started = stamp();
    // SAFETY: a live router; id and the closure outlive the call, and the closure stays
    // registered below for as long as C may call it. Until then this frame owns it (its heap
    // address, user_data, does not move), and no other call can free the router meanwhile.
    //
    // No lock of this crate is held: the closures C runs here (the old one's farewell, the new
    // one's announcement) may take CALLBACKS (dropping a Router, installing a publisher).
    //
    // Installing a publisher runs it at once (Reset, the router's bookings, SyncRequest), so
    // the new closure may panic inside this call. The panic is resumed only once the table
    // holds the closure: C keeps calling it, so it must not be dropped by the unwinding.
    let (result, panicked) = call_keeping_panic(|err| unsafe {
        sys::kvr_router_set_replica_publisher(router, opt_ptr(&id), publish, user_data, err)
    });
    // A closure runs only once installed: a panic means C holds it, whatever the status says.
    let retired = if result.is_ok() || panicked.is_some() {
        replace(router, started, boxed)
    } else {
        drop(boxed); // refused: C kept the previous closure and never saw this one
        Vec::new()
    };
    drop(retired); // C no longer calls them; dropped unlocked, as they may drop a Router
    if let Some(payload) = panicked {
        std::panic::resume_unwind(payload);
    }
    result
}

/// A stamp for a call that replaces a router's publisher (`set`, `Ingest::sync_replicas`),
/// taken before it starts, for `replace` once it has returned.
pub(crate) fn stamp() -> u64 {
    table().stamp()
}

/// After a call that started at `started` replaced `router`'s publisher (C's setters run one at
/// a time under the router's lock, each replacing the closure before it, which does not run
/// again once that setter returned): takes out of the table the closures it retired, and
/// registers `installed`, the closure it installed, if any. The closures installed before the
/// call started were applied before it: replaced by now, by it or by an earlier setter. Those of
/// setters that overlapped it may have been applied after it (one is then current), so they
/// stay, until a setter that starts after they returned, or the router's free. The caller drops
/// what this returns, unlocked (a closure may own a `Router`).
#[must_use = "drop the retired closures, unlocked"]
pub(crate) fn replace(
    router: *mut sys::kvr_router,
    started: u64,
    installed: Option<Box<Callback>>,
) -> Vec<Entry> {
    let key = router as usize;
    let mut table = table();
    let mut retired = Vec::new();
    let mut i = 0;
    while i < table.entries.len() {
        let (k, stamp, _) = table.entries[i];
        if k == key && stamp < started {
            retired.push(table.entries.swap_remove(i));
        } else {
            i += 1;
        }
    }
    if let Some(b) = installed {
        let stamp = table.stamp();
        table.entries.push((key, stamp, b));
    }
    retired
}

/// Takes the closures of routers about to be freed out of the table; the caller drops what
/// this returns once they are freed. The table is keyed by address, and as soon as a router is
/// freed another thread's new router may get its address and install a publisher under it:
/// removed after the free, the entry found could be that router's (its closure dropped while C
/// still calls it). Before the free the address is still this router's, so the entries taken
/// are its own. The closures stay alive until after the free, in case freeing calls them (the
/// owner has exclusive access, so no other call can).
#[must_use = "drop the closures after the routers are freed"]
pub(crate) fn take_before_free(routers: &[*mut sys::kvr_router]) -> Vec<Entry> {
    let mut table = table();
    let mut taken = Vec::new();
    let mut i = 0;
    while i < table.entries.len() {
        if routers.contains(&(table.entries[i].0 as *mut sys::kvr_router)) {
            taken.push(table.entries.swap_remove(i));
        } else {
            i += 1;
        }
    }
    taken
}
