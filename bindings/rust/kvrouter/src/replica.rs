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

use std::any::Any;
use std::cell::Cell;
use std::ffi::c_void;
use std::panic::{self, AssertUnwindSafe};
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use kvrouter_sys as sys;

use crate::error::{call_keeping_panic, Result};
use crate::util::{opt_cstring, opt_ptr};

pub(crate) type Callback = Box<dyn Fn(&[u8]) + Send + Sync + 'static>;

/// Router address → its publisher closure. The inner Box gives the closure a stable, thin
/// address to pass as `user_data`.
static CALLBACKS: Mutex<Vec<(usize, Box<Callback>)>> = Mutex::new(Vec::new());

thread_local! {
    /// A panic caught in a callback on this thread, resumed when the kvr_* call that ran the
    /// callback returns to Rust (see `error::call`); a panic must not unwind through C.
    static PANIC: Cell<Option<Box<dyn Any + Send>>> = const { Cell::new(None) };
}

/// Set (for good) by the first panic caught in a callback, on any thread, before it is stored
/// in that thread's `PANIC`: until then no thread's `PANIC` can hold one, and `take_panic` skips
/// the thread-local. A thread reading false after its kvr_* call returned ran no callback that
/// panicked during it (its own store would precede its load).
static ANY_PANIC: AtomicBool = AtomicBool::new(false);

pub(crate) fn take_panic() -> Option<Box<dyn Any + Send>> {
    if !ANY_PANIC.load(Ordering::Relaxed) {
        return None;
    }
    PANIC.with(Cell::take)
}

unsafe extern "C" fn trampoline(user_data: *mut c_void, data: *const c_void, size: usize) {
    // SAFETY: user_data is the address of a Callback in CALLBACKS, which stays there (and
    // alive) until C has stopped calling this function with it.
    let callback = unsafe { &*(user_data as *const Callback) };
    let bytes = if size == 0 || data.is_null() {
        &[][..]
    } else {
        // SAFETY: C passes `size` readable bytes, valid during this call.
        unsafe { std::slice::from_raw_parts(data.cast::<u8>(), size) }
    };
    if let Err(payload) = panic::catch_unwind(AssertUnwindSafe(|| callback(bytes))) {
        // The panic hook has printed it already; the thread's next return from a kvr_* call
        // in this crate resumes it (a library thread never does: it is then only printed).
        ANY_PANIC.store(true, Ordering::Relaxed);
        PANIC.with(|p| p.set(Some(payload)));
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
    // Held across the C call so that concurrent setters on one router keep this table in the
    // order C applied them. The callback never takes it (it gets its closure by address).
    let mut table = CALLBACKS.lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: a live router; id and the closure outlive the call, and the closure stays
    // registered below for as long as C may call it.
    //
    // Installing a publisher runs it at once (Reset, the router's bookings, SyncRequest), so
    // the new closure may panic inside this call. The panic is resumed only once the table
    // holds the closure: C keeps calling it, so it must not be dropped by the unwinding.
    let (result, panicked) = call_keeping_panic(|err| unsafe {
        sys::kvr_router_set_replica_publisher(router, opt_ptr(&id), publish, user_data, err)
    });
    // A closure runs only once installed: a panic means C holds it, whatever the status says.
    let old = if result.is_ok() || panicked.is_some() {
        let key = router as usize;
        let old = table
            .iter()
            .position(|(k, _)| *k == key)
            .map(|i| table.swap_remove(i));
        if let Some(b) = boxed {
            table.push((key, b));
        }
        old
    } else {
        None // refused: C kept the previous closure and never saw this one (dropped below)
    };
    drop(table);
    drop(old); // C no longer calls it
    if let Some(payload) = panicked {
        std::panic::resume_unwind(payload);
    }
    result
}

/// Takes the closures of routers about to be freed out of the table; the caller drops what
/// this returns once they are freed. The table is keyed by address, and as soon as a router is
/// freed another thread's new router may get its address and install a publisher under it:
/// removed after the free, the entry found could be that router's (its closure dropped while C
/// still calls it). Before the free the address is still this router's, so the entries taken
/// are its own. The closures stay alive until after the free, in case freeing calls them (the
/// owner has exclusive access, so no other call can).
#[must_use = "drop the closures after the routers are freed"]
pub(crate) fn take_before_free(routers: &[*mut sys::kvr_router]) -> Vec<(usize, Box<Callback>)> {
    let mut table = CALLBACKS.lock().unwrap_or_else(|e| e.into_inner());
    let mut taken = Vec::new();
    for &router in routers {
        let key = router as usize;
        if let Some(i) = table.iter().position(|(k, _)| *k == key) {
            taken.push(table.swap_remove(i));
        }
    }
    taken
}
