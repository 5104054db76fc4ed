//! [`PreparedRequest`]: request options lowered to their C struct once, for a hot loop of
//! admitted calls that differ only in the request id.

use std::ffi::{c_char, CString};
use std::fmt;

use kvrouter_sys as sys;

use crate::error::Result;
use crate::options::{prompt_arg, request_template, PrehashedPrompt, RequestOptions};
use crate::util::{copy_with_nul, nul_error, opt_cstring, slice_ptr, CStrs};

/// Bytes reserved for the id at first: request ids are short (a UUID is 36 bytes); a longer
/// one grows the buffer once, and it stays that size.
const ID_CAPACITY: usize = 64;

/// [`RequestOptions`] lowered once into an owned `kvr_request_options`, for
/// [`RouterRef::find_best_match_prepared`](crate::RouterRef::find_best_match_prepared): the hot
/// call writes only the request id (copied with its NUL into a buffer the prepared request
/// keeps and reuses) and calls `kvr_find_best_match` with the struct as it stands, as a C
/// caller reusing one options struct does.
/// [`RouterRef::find_best_match`](crate::RouterRef::find_best_match) builds the quarter-KiB
/// struct from the library's defaults on every call instead.
///
/// ```
/// use kvrouter::{PreparedRequest, RequestOptions, Router, RouterOptions, WorkerConfig};
///
/// let router = Router::new(&RouterOptions::default())?;
/// router.add_worker(&WorkerConfig::new(1))?;
/// // Once, outside the loop: admitted, with a LoRA adapter (the id given here is not kept).
/// let mut prepared = PreparedRequest::new(&RequestOptions {
///     lora_name: Some("adapter-a"),
///     ..RequestOptions::admit("")
/// })?;
/// let prompt: Vec<u32> = (0..64).collect();
/// for id in ["req-17", "req-18"] {
///     let decision = router.find_best_match_prepared(&prompt, &mut prepared, id)?;
///     assert!(decision.booked);
/// }
/// // The same decision and errors as the per-call options: "req-17" is booked already.
/// let again = router.find_best_match_prepared(&prompt, &mut prepared, "req-17");
/// assert_eq!(again.unwrap_err().code(), kvrouter::Code::AlreadyExists);
/// # Ok::<(), kvrouter::Error>(())
/// ```
///
/// # Lifetimes
///
/// A prepared request owns copies of everything the options borrowed (`lora_name`,
/// `cache_namespace`, `multimodal`, `allowed_worker_ids`, and the hashes of `prehashed`, with
/// which it routes that one prompt, its calls taking empty `tokens`), so it borrows nothing and
/// belongs to no router: one may serve every router and [`Disagg`](crate::Disagg) pool of a
/// process, and outlive them. The options' `request_id` is not kept: each call names its own, so
/// `RequestOptions::admit("")` is the usual start. Nothing is allocated per call, except when
/// an id is longer than any before (64 bytes are reserved at first); the C struct never points
/// at the caller's `&str`.
///
/// # Threads
///
/// `Send` and `Sync`: it holds no reference to anything outside itself, and the pointers in its
/// C struct point into its own buffers. A call takes it by `&mut` (it writes the id), so one
/// prepared request serves one call at a time; give each thread its own (`Clone` makes one
/// with buffers of its own), or keep one per worker task.
pub struct PreparedRequest {
    raw: sys::kvr_request_options,
    admit: bool,
    /// The last call's id and its NUL; only its heap buffer is reused.
    id: Vec<u8>,
    // What `raw` points into (heap buffers: they stay put when the prepared request moves).
    lora_name: Option<CString>,
    cache_namespace: Option<CString>,
    mm_hashes: Vec<u64>,
    mm_counts: Vec<usize>,
    /// The options' allow-list (empty for `None` too: the struct's `KVR_REQUEST_ALLOW_LIST`
    /// flag, set for `Some(&[])` only, tells an empty list from none).
    allowed_worker_ids: Vec<u64>,
    local_hashes: Vec<u64>,
    /// `prehashed`'s length in tokens: Some when the options gave the prompt hashed.
    prehashed_tokens: Option<usize>,
}

// SAFETY: the raw struct's pointers are NULL or point into buffers this value owns (its
// CStrings and Vecs), which move with it and are freed with it; nothing is shared with another
// value, so it may move to another thread.
unsafe impl Send for PreparedRequest {}
// SAFETY: a shared reference only reads (the id is written through `&mut`), and what it reads
// is owned as above.
unsafe impl Sync for PreparedRequest {}

impl PreparedRequest {
    /// Lowers `options` (all but `request_id`) once, onto the library's defaults. The errors
    /// are those [`RouterRef::find_best_match`](crate::RouterRef::find_best_match) would give
    /// for these options before calling C: `InvalidArgument` for a NUL byte in `lora_name` or
    /// `cache_namespace`, or multimodal counts needing more hashes than given.
    pub fn new(options: &RequestOptions<'_>) -> Result<PreparedRequest> {
        let lora_name = opt_cstring("lora_name", options.lora_name)?;
        let cache_namespace = opt_cstring("cache_namespace", options.cache_namespace)?;
        let (mm_hashes, mm_counts) = match &options.multimodal {
            Some(mm) => {
                mm.check("request options", None)?;
                (mm.hashes.to_vec(), mm.counts.to_vec())
            }
            None => (Vec::new(), Vec::new()),
        };
        let allowed_worker_ids = options.allowed_worker_ids.unwrap_or_default().to_vec();
        let local_hashes = options
            .prehashed
            .map_or_else(Vec::new, |p| p.local_hashes.to_vec());
        // Every other field is lowered exactly as per call (the prehashed flag included); the
        // borrowed ones are set below from the owned copies.
        let mut raw = request_template();
        RequestOptions {
            request_id: None,
            lora_name: None,
            cache_namespace: None,
            multimodal: None,
            // Kept as given, so that an empty list's flag is lowered (it allows no worker); the
            // pointer is set below to the owned copy.
            allowed_worker_ids: options.allowed_worker_ids,
            prehashed: options.prehashed.map(|p| PrehashedPrompt {
                local_hashes: &[],
                ..p
            }),
            ..*options
        }
        .lower_into(&mut raw, &mut CStrs::new())?;
        let mut prepared = PreparedRequest {
            raw,
            admit: options.admit,
            id: Vec::with_capacity(ID_CAPACITY),
            lora_name,
            cache_namespace,
            mm_hashes,
            mm_counts,
            allowed_worker_ids,
            local_hashes,
            prehashed_tokens: options.prehashed.map(|p| p.num_tokens),
        };
        prepared.point_at_buffers();
        Ok(prepared)
    }

    /// Sets the raw struct's pointers to this value's own buffers (after `new` or a clone).
    /// Empty lists go as NULL with length 0, as per call (`slice_ptr`).
    fn point_at_buffers(&mut self) {
        let str_ptr = |s: &Option<CString>| s.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
        self.raw.request_id = std::ptr::null();
        self.raw.lora_name = str_ptr(&self.lora_name);
        self.raw.cache_namespace = str_ptr(&self.cache_namespace);
        self.raw.mm_hashes = slice_ptr(&self.mm_hashes);
        self.raw.mm_counts = slice_ptr(&self.mm_counts);
        self.raw.mm_num_blocks = self.mm_counts.len();
        self.raw.allowed_worker_ids = slice_ptr(&self.allowed_worker_ids);
        self.raw.num_allowed_worker_ids = self.allowed_worker_ids.len();
        self.raw.local_hashes = slice_ptr(&self.local_hashes);
        self.raw.num_local_hashes = self.local_hashes.len();
    }

    /// The C struct as lowered (no id yet: `request_id` is NULL until a call).
    #[cfg(test)]
    pub(crate) fn raw(&self) -> &sys::kvr_request_options {
        &self.raw
    }

    /// Whether the calls book their request (`admit` of the options it was made from).
    pub fn admits(&self) -> bool {
        self.admit
    }

    /// A call's `tokens, num_tokens` (as `RequestOptions::prompt`): with `prehashed`, NULL
    /// and the prompt's length, and `tokens` must be empty.
    pub(crate) fn prompt(&self, tokens: &[u32]) -> Result<(*const u32, usize)> {
        prompt_arg(tokens, self.prehashed_tokens)
    }

    /// The C struct with `request_id` set to a NUL-terminated copy of `id` in this value's
    /// buffer, valid until the next call on `self`; `InvalidArgument` for an interior NUL
    /// byte, as per call.
    pub(crate) fn with_id(&mut self, id: &str) -> Result<&sys::kvr_request_options> {
        let bytes = id.as_bytes();
        self.id.clear();
        // Allocates only for an id longer than any before.
        self.id.reserve(bytes.len() + 1);
        // SAFETY: capacity >= len + 1 (reserved above); the Vec's own buffer, apart from `id`.
        if !unsafe { copy_with_nul(bytes, self.id.as_mut_ptr()) } {
            return Err(nul_error("request_id"));
        }
        // SAFETY: len + 1 <= capacity bytes were written just now.
        unsafe { self.id.set_len(bytes.len() + 1) };
        self.raw.request_id = self.id.as_ptr().cast::<c_char>();
        Ok(&self.raw)
    }
}

impl Clone for PreparedRequest {
    fn clone(&self) -> Self {
        let mut copy = PreparedRequest {
            raw: self.raw,
            admit: self.admit,
            id: Vec::with_capacity(self.id.capacity().max(ID_CAPACITY)),
            lora_name: self.lora_name.clone(),
            cache_namespace: self.cache_namespace.clone(),
            mm_hashes: self.mm_hashes.clone(),
            mm_counts: self.mm_counts.clone(),
            allowed_worker_ids: self.allowed_worker_ids.clone(),
            local_hashes: self.local_hashes.clone(),
            prehashed_tokens: self.prehashed_tokens,
        };
        copy.point_at_buffers();
        copy
    }
}

impl fmt::Debug for PreparedRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PreparedRequest")
            .field("admit", &self.admit)
            .field("lora_name", &self.lora_name)
            .field("cache_namespace", &self.cache_namespace)
            .field("mm_counts", &self.mm_counts)
            .field(
                "allowed_worker_ids",
                &(self.raw.flags & sys::KVR_REQUEST_ALLOW_LIST != 0
                    || !self.allowed_worker_ids.is_empty())
                .then_some(&self.allowed_worker_ids),
            )
            .field("local_hashes", &self.local_hashes)
            .field("prehashed_tokens", &self.prehashed_tokens)
            .finish_non_exhaustive()
    }
}
