//! Safe Rust binding of kvrouter, a KV-cache-aware LLM request router, over its stable C ABI
//! (`include/kvrouter.h`, declared in [`kvrouter_sys`]).
//!
//! A gateway creates a [`Router`], registers its workers, feeds it the KV events its engines
//! publish, asks it per request which worker should serve a prompt, and tells it when the
//! request's prefill finished and when the request ended:
//!
//! ```
//! use kvrouter::{RequestOptions, Router, RouterOptions, StoredEvent, WorkerConfig};
//!
//! let router = Router::new(&RouterOptions::with_block_size(16))?;
//! for id in 1..=4 {
//!     router.add_worker(&WorkerConfig::new(id))?;
//! }
//! // Worker 2's engine cached the first two blocks of this prompt.
//! let prompt: Vec<u32> = (1000..1048).collect();
//! router.apply_stored(&StoredEvent {
//!     worker_id: 2,
//!     block_hashes: &[0xA1, 0xA2],
//!     token_ids: &prompt[..32],
//!     ..Default::default()
//! })?;
//! let decision = router.find_best_match(&prompt, &RequestOptions::admit("req-1"))?;
//! assert_eq!((decision.worker_id, decision.cached_tokens), (2, 32));
//! router.mark_prefill_completed("req-1")?; // first token produced
//! router.free_request("req-1")?; // request ended
//! # Ok::<(), kvrouter::Error>(())
//! ```
//!
//! Conventions:
//! * Every fallible call returns [`Result`]; [`Error`] carries the C status as a [`Code`] and
//!   the library's message.
//! * Handles own their C object and free it in `Drop`. They are `Send + Sync` where the
//!   header's `@thread_safety` tags allow it: [`Router`], [`Disagg`], [`Ingest`] and
//!   [`Buffer`] are shared between threads (`Arc`), [`EventBatch`] only moves between them,
//!   and functions tagged `none` take `&mut self`.
//! * Inputs are borrowed as slices and `&str` (copied to NUL-terminated strings for the call,
//!   `InvalidArgument` for one with a NUL byte);
//!   array results come back as `Vec`s, grown (with headroom) and retried on
//!   `KVR_BUFFER_TOO_SMALL`, a handful of times at most.
//! * A hot loop of admitted calls can lower its options once: a [`PreparedRequest`] holds the
//!   C struct, and [`RouterRef::find_best_match_prepared`] writes only the id into it.
//! * A prompt is its token ids, or, hashed by the caller ([`compute_block_hashes`]), its local
//!   hashes and length in [`RequestOptions::prehashed`], the calls then taking empty tokens.
//! * The first constructor call checks that the library's major.minor version matches the one
//!   this binding was generated for, 0.2 ([`check_version`]).
//! * [`raw::init`] initialises a [`kvrouter_sys`] struct with its sized `_init` function, for
//!   code that mixes raw calls with the safe layer.

#![warn(missing_debug_implementations)]

// 64-bit only: kvrouter-sys mirrors the header's 64-bit struct layout (its build script refuses
// other targets first, before its layout asserts would), and neither crate is built or tested
// for anything else. A readable error here too, for a kvrouter-sys built some other way.
#[cfg(not(target_pointer_width = "64"))]
compile_error!(
    "kvrouter supports 64-bit targets only (x86-64, aarch64, ...): libkvrouter's C ABI is laid \
     out and built for 64-bit targets, and this binding assumes 64-bit pointers"
);

mod disagg;
mod error;
mod events;
mod hashing;
mod ingest;
#[cfg(test)]
mod lowering_tests;
mod options;
mod prepared;
#[cfg(feature = "prometheus")]
pub mod prometheus;
pub mod raw;
mod replica;
mod router;
mod util;

use std::ffi::CStr;
use std::sync::OnceLock;

pub use kvrouter_sys as sys;

pub use disagg::{Disagg, DisaggOptions, DisaggPolicy, PrefillReason, PrefillResult};
pub use error::{status_name, Code, Error, Result};
pub use events::{
    tier_from_medium, Buffer, EventBatch, RemovedEvent, SlidingWindow, StoredEvent, Tier,
};
pub use hashing::{compute_block_hashes, compute_sequence_hashes, HashOptions};
pub use ingest::{
    DisaggPool, Engine, EngineWorker, Ingest, IngestOptions, IngestStats, JetStreamSource,
    Listener, Publisher, RejectReason,
};
pub use options::{
    CostFunction, Phase, PrehashedPrompt, QueuePolicy, RequestOptions, RouterOptions, RoutingHints,
    SessionMode, WorkerConfig,
};
pub use prepared::PreparedRequest;
pub use router::{
    Candidate, DecisionLatency, EventKind, EventOutcome, Match, Metrics, Overlap, PotentialLoad,
    RouteResult, RouteSignals, Router, RouterRef, DECISION_LATENCY_BUCKETS,
};
pub use util::Multimodal;

/// The library's version number (major·10000 + minor·100 + patch), `kvr_version`.
pub fn version() -> u32 {
    // SAFETY: no arguments, no state.
    unsafe { sys::kvr_version() }
}

/// The library's version as "MAJOR.MINOR.PATCH", `kvr_version_string`.
pub fn version_string() -> &'static str {
    // SAFETY: a static NUL-terminated string, never NULL.
    let s = unsafe { CStr::from_ptr(sys::kvr_version_string()) };
    s.to_str().unwrap_or("?")
}

/// Checks once per process that the loaded library's major.minor version is the one these
/// bindings were generated for (`kvrouter_sys::KVR_VERSION_MAJOR` / `KVR_VERSION_MINOR`, 0.2):
/// at 0.x a minor release may change the ABI, so any 0.2.x library is accepted and nothing else.
/// Constructors call it; a mismatch is `FailedPrecondition`.
pub fn check_version() -> Result<()> {
    static CHECKED: OnceLock<Result<()>> = OnceLock::new();
    CHECKED
        .get_or_init(|| {
            if accepts_library(version()) {
                Ok(())
            } else {
                Err(Error::new(
                    Code::FailedPrecondition,
                    format!(
                        "libkvrouter {} is loaded, but this binding was generated for {}.{}.x",
                        version_string(),
                        sys::KVR_VERSION_MAJOR,
                        sys::KVR_VERSION_MINOR
                    ),
                ))
            }
        })
        .clone()
}

/// Whether a library version number (`kvr_version()`: major·10000 + minor·100 + patch) has the
/// major.minor of the header kvrouter-sys was generated from.
fn accepts_library(number: u32) -> bool {
    number / 10000 == sys::KVR_VERSION_MAJOR && number / 100 % 100 == sys::KVR_VERSION_MINOR
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_generated_major_minor_is_accepted() {
        // This release of the binding is for libkvrouter 0.2.x (README.md, build.rs).
        assert_eq!((sys::KVR_VERSION_MAJOR, sys::KVR_VERSION_MINOR), (0, 2));
        for accepted in [200, 201, 299] {
            assert!(accepts_library(accepted), "{accepted}");
        }
        for refused in [0, 100, 199, 300, 10200, 20000] {
            assert!(!accepts_library(refused), "{refused}");
        }
        assert!(accepts_library(version()), "{}", version_string());
        check_version().unwrap();
    }
}
