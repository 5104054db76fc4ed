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
pub(crate) fn nul_error(what: &str) -> Error {
    Error::invalid(format!("{what} contains a NUL byte"))
}

pub(crate) fn opt_cstring(what: &str, s: Option<&str>) -> Result<Option<CString>> {
    s.map(|s| cstring(what, s)).transpose()
}

/// The pointer C reads for an optional string: NULL for None.
pub(crate) fn opt_ptr(s: &Option<CString>) -> *const c_char {
    s.as_ref().map_or(ptr::null(), |c| c.as_ptr())
}

/// Copies `src` to `dst` followed by a NUL byte, in one pass that also looks for a NUL in
/// `src`: false if it finds one (`dst` is then partly written). Ids are short, so this beats a
/// `memchr` and a `memcpy` call (or a byte loop): 8 bytes at a time, each word tested for a zero
/// byte with the exact `(w - 0x01..01) & !w & 0x80..80` test, then the tail byte by byte.
///
/// # Safety
///
/// `dst` must be valid for writing `src.len() + 1` bytes, and not overlap `src`.
#[inline]
pub(crate) unsafe fn copy_with_nul(src: &[u8], dst: *mut u8) -> bool {
    const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGHS: u64 = u64::from_ne_bytes([0x80; 8]);
    let mut words = src.chunks_exact(8);
    let mut at = dst;
    for word in &mut words {
        let w = u64::from_ne_bytes([
            word[0], word[1], word[2], word[3], word[4], word[5], word[6], word[7],
        ]);
        if w.wrapping_sub(ONES) & !w & HIGHS != 0 {
            return false;
        }
        // SAFETY: within the src.len() + 1 bytes the caller gave (8 of the bytes copied).
        unsafe {
            at.cast::<u64>().write_unaligned(w);
            at = at.add(8);
        }
    }
    for &b in words.remainder() {
        if b == 0 {
            return false;
        }
        // SAFETY: as above (one byte of the tail).
        unsafe {
            *at = b;
            at = at.add(1);
        }
    }
    // SAFETY: the last of the src.len() + 1 bytes.
    unsafe { *at = 0 };
    true
}

/// NUL-terminated copies of a call's strings (ids, names) without a heap allocation: they go
/// to a buffer on the caller's stack while they fit ([`CStrs::STACK`] bytes in all), else to
/// `CString`s. The pointers handed out stay valid while the `CStrs` lives and is not moved, so
/// declare it (`let mut strs = CStrs::new();`) in the frame that makes the C call.
///
/// `repr(C)` with the buffer last, after `heap`: in Rust's own layout `used` (0) came right
/// after the uninitialised buffer, and LLVM merged the two into one `memset` of 264 bytes per
/// `CStrs::new()` (a libc call, then a stalled load of `used`: 3-7 ns of every call taking an
/// id). Check `memset` in the release disassembly of `RouterRef::free_request` after a change.
#[repr(C)]
pub(crate) struct CStrs {
    used: usize,
    heap: Vec<CString>,
    stack: [MaybeUninit<u8>; CStrs::STACK],
}

impl CStrs {
    pub(crate) const STACK: usize = 256;

    pub(crate) fn new() -> Self {
        CStrs {
            used: 0,
            heap: Vec::new(),
            stack: [MaybeUninit::uninit(); CStrs::STACK],
        }
    }

    /// A NUL-terminated copy of `s`; `what` names the argument in the error for an interior NUL.
    pub(crate) fn push(&mut self, what: &str, s: &str) -> Result<*const c_char> {
        let bytes = s.as_bytes();
        if self.used + bytes.len() < Self::STACK {
            // SAFETY: the buffer has STACK bytes; used + len + 1 <= STACK of them are written,
            // and nothing reads an unwritten byte.
            let at = unsafe { self.stack.as_mut_ptr().cast::<u8>().add(self.used) };
            // SAFETY: len + 1 bytes of room from `at`, checked above.
            if !unsafe { copy_with_nul(bytes, at) } {
                return Err(nul_error(what));
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `copy_with_nul` against the plain byte loop: every length around the word size, a NUL
    /// at every position, and bytes that trip a sloppier zero-byte test (0x80, 0x81, 0xFF,
    /// 0x01, and a 0x01 above a 0x00).
    #[test]
    fn copy_with_nul_copies_and_finds_every_nul() {
        for len in 0..40 {
            for fill in [b'a', 0x80, 0x81, 0xFF, 0x01] {
                let src: Vec<u8> = (0..len).map(|i| fill.wrapping_add(i as u8 % 3)).collect();
                let src: Vec<u8> = src.iter().map(|&b| if b == 0 { 1 } else { b }).collect();
                let mut dst = vec![0xAAu8; len + 1];
                // SAFETY: len + 1 bytes of room.
                assert!(unsafe { copy_with_nul(&src, dst.as_mut_ptr()) });
                assert_eq!(&dst[..len], &src[..]);
                assert_eq!(dst[len], 0);
                for nul in 0..len {
                    let mut bad = src.clone();
                    bad[nul] = 0;
                    if nul + 1 < len {
                        bad[nul + 1] = 1;
                    }
                    // SAFETY: as above.
                    assert!(
                        !unsafe { copy_with_nul(&bad, dst.as_mut_ptr()) },
                        "len {len}, NUL at {nul}, fill {fill:#x}"
                    );
                }
            }
        }
    }

    #[test]
    fn cstrs_push_is_nul_terminated_and_refuses_nul_bytes() {
        let mut strs = CStrs::new();
        let a = strs.push("a", "request-17").unwrap();
        let b = strs.push("b", "é-ünïcødé").unwrap();
        // SAFETY: NUL-terminated copies, alive with strs.
        unsafe {
            assert_eq!(std::ffi::CStr::from_ptr(a).to_str(), Ok("request-17"));
            assert_eq!(std::ffi::CStr::from_ptr(b).to_str(), Ok("é-ünïcødé"));
        }
        let err = strs.push("request_id", "abcdefgh\0ij").unwrap_err();
        assert_eq!(err.message(), "request_id contains a NUL byte");
    }
}
