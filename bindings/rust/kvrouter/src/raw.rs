//! Sized initialisation of the C ABI's versioned structs (those beginning with `struct_size`).
//!
//! Every `kvr_X_init(kvr_X *, size_t size)` must be given the size of the struct *as the
//! caller compiled it*: the library writes its defaults no further than that, zero-fills a tail
//! it does not know, and records the size in `struct_size`, after which it reads (or, for a
//! result, writes) no further than `struct_size` bytes. [`init`] is the one place in this crate
//! that calls an `_init` function: the size it passes is always `size_of::<T>()` of the
//! generated `kvrouter-sys` struct, so no call site computes a size of its own. It is public for
//! code that mixes raw [`kvrouter_sys`] calls with the safe layer:
//!
//! ```
//! use kvrouter::{raw, sys};
//!
//! let options: sys::kvr_router_options = raw::init();
//! assert_eq!(options.struct_size as usize, std::mem::size_of::<sys::kvr_router_options>());
//! assert_eq!(options.block_size, 16);
//! ```

use std::mem::{size_of, MaybeUninit};
use std::sync::OnceLock;

use kvrouter_sys as sys;

mod sealed {
    use kvrouter_sys as sys;

    /// Holds the `_init` function where no code outside this module can name it: nothing calls
    /// an `_init` but [`init`](super::init), with the size it takes from `size_of`.
    pub trait Sealed: Sized {
        const INIT: unsafe extern "C" fn(*mut Self, usize) -> sys::kvr_status;
    }
}

/// A `kvrouter-sys` struct that begins with `struct_size` and has a sized `_init` function.
/// Sealed: implemented for exactly the header's versioned structs.
pub trait Versioned: Copy + sealed::Sealed {
    /// The C name of the struct (`"kvr_router_options"`).
    const NAME: &'static str;
    /// The C name of its `_init` function.
    const INIT_NAME: &'static str;
    /// The size the struct says it has (what `_init` recorded).
    fn struct_size(&self) -> u32;
}

macro_rules! versioned {
    ($($name:ident => $init:ident),* $(,)?) => {
        $(
            impl sealed::Sealed for sys::$name {
                const INIT: unsafe extern "C" fn(*mut Self, usize) -> sys::kvr_status = sys::$init;
            }
            impl Versioned for sys::$name {
                const NAME: &'static str = stringify!($name);
                const INIT_NAME: &'static str = stringify!($init);
                fn struct_size(&self) -> u32 {
                    self.struct_size
                }
            }
        )*
        /// Every versioned struct: (name, `init::<T>()`'s struct_size, `size_of::<T>()`).
        #[cfg(test)]
        pub(crate) fn every_versioned() -> Vec<(&'static str, u32, usize)> {
            vec![$(
                (stringify!($name), init::<sys::$name>().struct_size, size_of::<sys::$name>())
            ),*]
        }
    };
}

// In the header's order; one line per `kvr_X_init` of kvrouter.h.
versioned! {
    kvr_hash_options => kvr_hash_options_init,
    kvr_router_options => kvr_router_options_init,
    kvr_worker_config => kvr_worker_config_init,
    kvr_stored_event => kvr_stored_event_init,
    kvr_removed_event => kvr_removed_event_init,
    kvr_request_options => kvr_request_options_init,
    kvr_route_result => kvr_route_result_init,
    kvr_metrics => kvr_metrics_init,
    kvr_routing_hints => kvr_routing_hints_init,
    kvr_route_signals => kvr_route_signals_init,
    kvr_disagg_options => kvr_disagg_options_init,
    kvr_prefill_result => kvr_prefill_result_init,
    kvr_ingest_options => kvr_ingest_options_init,
    kvr_engine_worker => kvr_engine_worker_init,
    kvr_jetstream_source => kvr_jetstream_source_init,
    kvr_ingest_stats => kvr_ingest_stats_init,
}

/// A `T` holding the library's defaults, initialised by its `_init` function with
/// `size_of::<T>()`, the size this binding was compiled with.
///
/// # Panics
///
/// If the loaded library is not a 0.2.x one ([`check_version`](crate::check_version) fails:
/// its `_init` functions may not even take a size), or if it refuses the size or records another
/// one in `struct_size`. None of this can happen
/// with a library this binding links against (its SONAME, `libkvrouter.so.0.2`, names the ABI
/// the structs were generated from, and an ABI only ever appends fields), so either is a
/// library bug or a mismatched library: a broken invariant rather than an error a caller could
/// handle. A panic also keeps the infallible constructors (`Default`, `WorkerConfig::new`)
/// infallible.
pub fn init<T: Versioned>() -> T {
    init_sized(size_of::<T>())
}

/// `init` with another size: only [`init`] and the tests (a size the library must refuse) call
/// it.
fn init_sized<T: Versioned>(size: usize) -> T {
    // A library of another ABI may not even take a size: refuse it before calling its _init
    // (the check runs once per process; later calls read a OnceLock).
    if let Err(e) = crate::check_version() {
        panic!("kvrouter: {}", e.message());
    }
    assert!(size <= size_of::<T>());
    // Zeroed first: all-zero bytes are a valid value of every generated struct (integers,
    // floats, raw pointers), so the value is initialised whatever the library wrote.
    let mut value = MaybeUninit::<T>::zeroed();
    // SAFETY: a valid, writable T of size_of::<T>() >= size bytes; _init writes no further
    // than `size`.
    let status = unsafe { T::INIT(value.as_mut_ptr(), size) };
    // SAFETY: zero-initialised above, and every bit pattern _init may write is a valid T.
    let value = unsafe { value.assume_init() };
    if status != sys::KVR_OK {
        panic!(
            "kvrouter: {}(&mut {}, {size}) failed with {}: libkvrouter {} refuses the struct \
             layout kvrouter-sys {} was generated with (a library bug or a mismatched library)",
            T::INIT_NAME,
            T::NAME,
            crate::error::status_name(status),
            crate::version_string(),
            sys::KVR_VERSION_STRING,
        );
    }
    assert!(
        value.struct_size() as usize == size,
        "kvrouter: {} recorded struct_size {} for a {} of {size} bytes (a library bug)",
        T::INIT_NAME,
        value.struct_size(),
        T::NAME,
    );
    value
}

/// An [`init`] result made once per process and copied afterwards (an `_init` result depends on
/// nothing but the library), so a hot call pays a copy instead of a call into the library.
pub(crate) struct Template<T>(OnceLock<Shared<T>>);

struct Shared<T>(T);

// SAFETY: what `_init` writes holds no pointer but NULLs (the ABI's defaults), so a copy shares
// nothing between threads.
unsafe impl<T> Sync for Shared<T> {}
// SAFETY: as for Sync.
unsafe impl<T> Send for Shared<T> {}

impl<T: Versioned + Copy> Template<T> {
    pub(crate) const fn new() -> Self {
        Template(OnceLock::new())
    }

    /// A copy of `init::<T>()` (made on the first call, with its checks and panics).
    pub(crate) fn get(&self) -> T {
        self.0.get_or_init(|| Shared(init())).0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_init_records_the_compiled_size() {
        let all = every_versioned();
        assert_eq!(all.len(), 16, "one entry per kvr_X_init of the header");
        for (name, struct_size, size) in all {
            assert_eq!(struct_size as usize, size, "{name}");
        }
    }

    #[test]
    #[should_panic(
        expected = "kvr_router_options_init(&mut kvr_router_options, 4) failed with \
                               KVR_INVALID_ARGUMENT"
    )]
    fn a_refused_size_panics_with_the_status() {
        // 4 bytes (struct_size alone) is below every struct's first released layout.
        let _: sys::kvr_router_options = init_sized(4);
    }
}
