//! Borrowed inputs turned into what C reads: NUL-terminated copies of `&str`s, checked slices.

use std::ffi::{c_char, CString};
use std::mem::MaybeUninit;
use std::ptr;

use crate::error::{Error, Result};

/// A NUL-terminated copy of `s`; `what` names the argument in the error for an interior NUL.
pub(crate) fn cstring(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| nul_error(what))
}

#[cold]
fn nul_error(what: &str) -> Error {
    Error::invalid(format!("{what} contains a NUL byte"))
}

pub(crate) fn opt_cstring(what: &str, s: Option<&str>) -> Result<Option<CString>> {
    s.map(|s| cstring(what, s)).transpose()
}

/// The pointer C reads for an optional string: NULL for None.
pub(crate) fn opt_ptr(s: &Option<CString>) -> *const c_char {
    s.as_ref().map_or(ptr::null(), |c| c.as_ptr())
}

/// NUL-terminated copies of a call's strings (ids, names) without a heap allocation: they go
/// to a buffer on the caller's stack while they fit ([`CStrs::STACK`] bytes in all), else to
/// `CString`s. The pointers handed out stay valid while the `CStrs` lives and is not moved, so
/// declare it (`let mut strs = CStrs::new();`) in the frame that makes the C call.
pub(crate) struct CStrs {
    stack: MaybeUninit<[u8; CStrs::STACK]>,
    used: usize,
    heap: Vec<CString>,
}

impl CStrs {
    pub(crate) const STACK: usize = 256;

    pub(crate) fn new() -> Self {
        CStrs {
            stack: MaybeUninit::uninit(),
            used: 0,
            heap: Vec::new(),
        }
    }

    /// A NUL-terminated copy of `s`; `what` names the argument in the error for an interior NUL.
    pub(crate) fn push(&mut self, what: &str, s: &str) -> Result<*const c_char> {
        let bytes = s.as_bytes();
        if self.used + bytes.len() < Self::STACK {
            // SAFETY: the buffer has STACK bytes; used + len + 1 <= STACK of them are written,
            // and nothing reads an unwritten byte.
            let at = unsafe { self.stack.as_mut_ptr().cast::<u8>().add(self.used) };
            // One pass copies and looks for an interior NUL (ids are short: a byte loop beats
            // a memchr and a memcpy call).
            for (i, &b) in bytes.iter().enumerate() {
                if b == 0 {
                    return Err(nul_error(what));
                }
                // SAFETY: i < len, within the room checked above.
                unsafe { *at.add(i) = b };
            }
            // SAFETY: as above (the NUL's byte is within the room).
            unsafe { *at.add(bytes.len()) = 0 };
            self.used += bytes.len() + 1;
            return Ok(at.cast_const().cast());
        }
        self.heap.push(cstring(what, s)?);
        Ok(self.heap.last().map_or(ptr::null(), |c| c.as_ptr()))
    }

    /// As [`push`](Self::push) for an optional string: NULL for None.
    pub(crate) fn push_opt(&mut self, what: &str, s: Option<&str>) -> Result<*const c_char> {
        s.map_or(Ok(ptr::null()), |s| self.push(what, s))
    }
}

/// A pointer to a slice's data, or NULL for an empty slice (C reads no element of either).
pub(crate) fn slice_ptr<T>(s: &[T]) -> *const T {
    if s.is_empty() {
        ptr::null()
    } else {
        s.as_ptr()
    }
}

/// Multimodal content that changes a prompt's block hashes: block `i` owns the next
/// `counts[i]` values of `hashes`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Multimodal<'a> {
    /// Every block's multimodal hashes, one flat array.
    pub hashes: &'a [u64],
    /// How many of `hashes` each block owns, in block order.
    pub counts: &'a [usize],
}

impl Multimodal<'_> {
    /// The C ABI passes no length for `hashes`: it reads `sum(counts)` values. Check that the
    /// slice holds them (and, for an event, that there is one count per block).
    pub(crate) fn check(&self, what: &str, blocks: Option<usize>) -> Result<()> {
        if let Some(blocks) = blocks {
            if self.counts.len() != blocks {
                return Err(Error::invalid(format!(
                    "{what}: {} multimodal counts for {blocks} blocks",
                    self.counts.len()
                )));
            }
        }
        let needed = self
            .counts
            .iter()
            .try_fold(0usize, |sum, &c| sum.checked_add(c))
            .ok_or_else(|| Error::invalid(format!("{what}: multimodal counts overflow")))?;
        if needed > self.hashes.len() {
            return Err(Error::invalid(format!(
                "{what}: multimodal counts need {needed} hashes, {} given",
                self.hashes.len()
            )));
        }
        Ok(())
    }
}
