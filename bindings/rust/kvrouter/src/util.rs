//! Borrowed inputs turned into what C reads: NUL-terminated copies of `&str`s, checked slices.

use std::ffi::{c_char, CString};
use std::ptr;

use crate::error::{Error, Result};

/// A NUL-terminated copy of `s`; `what` names the argument in the error for an interior NUL.
pub(crate) fn cstring(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::invalid(format!("{what} contains a NUL byte")))
}

pub(crate) fn opt_cstring(what: &str, s: Option<&str>) -> Result<Option<CString>> {
    s.map(|s| cstring(what, s)).transpose()
}

/// The pointer C reads for an optional string: NULL for None.
pub(crate) fn opt_ptr(s: &Option<CString>) -> *const c_char {
    s.as_ref().map_or(ptr::null(), |c| c.as_ptr())
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
