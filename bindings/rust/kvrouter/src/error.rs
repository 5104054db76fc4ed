//! Errors: every fallible call returns [`Result`], whose [`Error`] carries the C status as a
//! [`Code`] and the library's message. The C `kvr_error` is read and freed at once, so an
//! `Error` is plain owned data (`Send + Sync + Clone`).

use std::any::Any;
use std::ffi::CStr;
use std::fmt;
use std::ptr;

use kvrouter_sys as sys;

/// A `kvr_status` other than `KVR_OK`. Codes below 100 are `absl::StatusCode`'s numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Code {
    /// `KVR_CANCELLED`: a queued request freed while it waited, or the admission queue closed
    /// ([`RouterRef::close_queue`](crate::RouterRef::close_queue)).
    Cancelled,
    /// `KVR_INVALID_ARGUMENT`: a bad setting, a malformed buffer, a block size mismatch.
    InvalidArgument,
    /// `KVR_DEADLINE_EXCEEDED`: the admission queue's timeout passed.
    DeadlineExceeded,
    /// `KVR_NOT_FOUND`: an unknown worker, rank, plan, session or source.
    NotFound,
    /// `KVR_ALREADY_EXISTS`: a registered worker id, an active request id.
    AlreadyExists,
    /// `KVR_RESOURCE_EXHAUSTED`.
    ResourceExhausted,
    /// `KVR_FAILED_PRECONDITION`: e.g. events applied in approximate mode, or a binding and
    /// library whose versions do not match.
    FailedPrecondition,
    /// `KVR_UNIMPLEMENTED`.
    Unimplemented,
    /// `KVR_INTERNAL`: an exception inside the library.
    Internal,
    /// `KVR_UNAVAILABLE`: no eligible worker, a connection or bind that failed.
    Unavailable,
    /// `KVR_BUFFER_TOO_SMALL`: the binding retries these itself, with headroom; it surfaces
    /// only where a retry is impossible, or when the length the library asks for kept growing
    /// through a handful of attempts (e.g. workers added faster than the calls).
    BufferTooSmall,
    /// A code this binding does not know (a newer library).
    Other(i32),
}

impl Code {
    /// The code for a raw `kvr_status` (`KVR_OK`, which is no error, maps to `Other(0)`).
    pub fn from_raw(status: sys::kvr_status) -> Code {
        match status {
            sys::KVR_CANCELLED => Code::Cancelled,
            sys::KVR_INVALID_ARGUMENT => Code::InvalidArgument,
            sys::KVR_DEADLINE_EXCEEDED => Code::DeadlineExceeded,
            sys::KVR_NOT_FOUND => Code::NotFound,
            sys::KVR_ALREADY_EXISTS => Code::AlreadyExists,
            sys::KVR_RESOURCE_EXHAUSTED => Code::ResourceExhausted,
            sys::KVR_FAILED_PRECONDITION => Code::FailedPrecondition,
            sys::KVR_UNIMPLEMENTED => Code::Unimplemented,
            sys::KVR_INTERNAL => Code::Internal,
            sys::KVR_UNAVAILABLE => Code::Unavailable,
            sys::KVR_BUFFER_TOO_SMALL => Code::BufferTooSmall,
            other => Code::Other(other),
        }
    }

    /// The raw `kvr_status`.
    pub fn raw(self) -> sys::kvr_status {
        match self {
            Code::Cancelled => sys::KVR_CANCELLED,
            Code::InvalidArgument => sys::KVR_INVALID_ARGUMENT,
            Code::DeadlineExceeded => sys::KVR_DEADLINE_EXCEEDED,
            Code::NotFound => sys::KVR_NOT_FOUND,
            Code::AlreadyExists => sys::KVR_ALREADY_EXISTS,
            Code::ResourceExhausted => sys::KVR_RESOURCE_EXHAUSTED,
            Code::FailedPrecondition => sys::KVR_FAILED_PRECONDITION,
            Code::Unimplemented => sys::KVR_UNIMPLEMENTED,
            Code::Internal => sys::KVR_INTERNAL,
            Code::Unavailable => sys::KVR_UNAVAILABLE,
            Code::BufferTooSmall => sys::KVR_BUFFER_TOO_SMALL,
            Code::Other(raw) => raw,
        }
    }

    /// The status's C name (`"KVR_NOT_FOUND"`, ...; `"KVR_UNKNOWN"` for a code the library
    /// does not know), from `kvr_status_str`.
    pub fn name(self) -> &'static str {
        status_name(self.raw())
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The C name of any status code (`kvr_status_str`).
pub fn status_name(status: sys::kvr_status) -> &'static str {
    // SAFETY: kvr_status_str accepts any value and returns a static, NUL-terminated string
    // that is never NULL.
    let name = unsafe { CStr::from_ptr(sys::kvr_status_str(status)) };
    name.to_str().unwrap_or("KVR_UNKNOWN")
}

/// A failed call: the status code and the library's message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    code: Code,
    message: String,
}

impl Error {
    /// An error raised by the binding itself (an argument it refuses before calling C).
    pub(crate) fn new(code: Code, message: impl Into<String>) -> Error {
        Error {
            code,
            message: message.into(),
        }
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Error {
        Error::new(Code::InvalidArgument, message)
    }

    /// The status code.
    pub fn code(&self) -> Code {
        self.code
    }

    /// The library's message (empty if it gave none).
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.message.is_empty() {
            write!(f, "{}", self.code)
        } else {
            write!(f, "{}: {}", self.code, self.message)
        }
    }
}

impl std::error::Error for Error {}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Runs one fallible C call, passing it the address of a NULL `kvr_error *`, and turns its
/// status (and error object, which it frees) into a `Result`.
pub(crate) fn call(f: impl FnOnce(*mut *mut sys::kvr_error) -> sys::kvr_status) -> Result<()> {
    let (result, panicked) = call_keeping_panic(f);
    if let Some(payload) = panicked {
        // A replica publisher closure panicked inside this call: re-raise it.
        std::panic::resume_unwind(payload);
    }
    result
}

/// As [`call`] for a call that never runs a replica publisher closure (a query-only one), so
/// there is no caught panic to look for.
pub(crate) fn call_without_callbacks(
    f: impl FnOnce(*mut *mut sys::kvr_error) -> sys::kvr_status,
) -> Result<()> {
    let mut err: *mut sys::kvr_error = ptr::null_mut();
    let status = f(&mut err);
    status_result(status, err)
}

/// A routing call: [`call`] when it admits (only an admitting call can book, and so publish to
/// a replica publisher), else [`call_without_callbacks`].
pub(crate) fn call_routing(
    admits: bool,
    f: impl FnOnce(*mut *mut sys::kvr_error) -> sys::kvr_status,
) -> Result<()> {
    if admits {
        call(f)
    } else {
        call_without_callbacks(f)
    }
}

/// As [`call`], but a replica publisher closure's panic caught during the call is handed back
/// instead of resumed, for a caller with something to settle before it unwinds. Only a panic
/// caught during this call is: one an earlier call of this thread left behind is dropped first.
pub(crate) fn call_keeping_panic(
    f: impl FnOnce(*mut *mut sys::kvr_error) -> sys::kvr_status,
) -> (Result<()>, Option<Box<dyn Any + Send>>) {
    crate::replica::discard_stale_panics();
    let mut err: *mut sys::kvr_error = ptr::null_mut();
    let status = f(&mut err);
    (status_result(status, err), crate::replica::take_panic())
}

/// As [`call`], on a thread where no caller waits to resume a replica publisher closure's panic
/// (a thread of the binding's own, doing work handed over from a publisher): a panic caught
/// during the call, which the panic hook printed then, is dropped (quietly: a payload whose own
/// `Drop` panics is leaked) rather than resumed to end the thread.
pub(crate) fn call_dropping_panic(
    f: impl FnOnce(*mut *mut sys::kvr_error) -> sys::kvr_status,
) -> Result<()> {
    let (result, panicked) = call_keeping_panic(f);
    if let Some(payload) = panicked {
        crate::replica::drop_quietly(payload);
    }
    result
}

/// A C call's status and error object (freed here) as a `Result`.
#[inline]
fn status_result(status: sys::kvr_status, err: *mut sys::kvr_error) -> Result<()> {
    // The usual success, inline; anything else (an error, or an error object on success) in
    // a call of its own.
    if status == sys::KVR_OK && err.is_null() {
        return Ok(());
    }
    status_result_slow(status, err)
}

#[cold]
#[inline(never)]
fn status_result_slow(status: sys::kvr_status, err: *mut sys::kvr_error) -> Result<()> {
    if status == sys::KVR_OK {
        if !err.is_null() {
            // SAFETY: a caller-owned error object, freed once.
            unsafe { sys::kvr_error_free(err) };
        }
        return Ok(());
    }
    let message = if err.is_null() {
        String::new()
    } else {
        // SAFETY: err is a live error object; its message is valid until kvr_error_free,
        // and is copied before that.
        let message = unsafe { CStr::from_ptr(sys::kvr_error_message(err)) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: freed exactly once, after its last use.
        unsafe { sys::kvr_error_free(err) };
        message
    };
    Err(Error {
        code: Code::from_raw(status),
        message,
    })
}

/// Calls [`fill_vec`] makes before it returns the `KVR_BUFFER_TOO_SMALL` error: the first and
/// up to 4 retries. A length that outgrows every retry's headroom (workers added faster than
/// the calls) does not keep the caller looping.
pub(crate) const FILL_ATTEMPTS: usize = 5;

/// The capacity a retry asks for when the library wants `n` entries: a quarter more and a few,
/// so that a fleet growing between two calls (a worker added, a longer metrics text) still
/// fits (saturating: an impossible length fails in `try_reserve_exact`).
fn with_headroom(n: usize) -> usize {
    n.saturating_add(n / 4).saturating_add(8)
}

/// Fills a vector through a C function taking `(out, cap, *len)`: on `KVR_BUFFER_TOO_SMALL`
/// retries with room for the length the library asks for plus headroom
/// ([`with_headroom`]), at most [`FILL_ATTEMPTS`] calls in all, then returns that
/// `BufferTooSmall` error. `initial` is the first capacity tried. A length no `Vec` can hold
/// is `ResourceExhausted` (no panic, no abort).
///
/// `f` must call a function that writes `*len` initialised elements of `T` to `out` on
/// success (and none past `cap`).
pub(crate) fn fill_vec<T>(
    initial: usize,
    mut f: impl FnMut(*mut T, usize, *mut usize, *mut *mut sys::kvr_error) -> sys::kvr_status,
) -> Result<Vec<T>> {
    let mut v: Vec<T> = Vec::with_capacity(initial);
    let mut attempt = 1;
    loop {
        let cap = v.capacity();
        let mut len = 0usize;
        match call(|err| f(v.as_mut_ptr(), cap, &mut len, err)) {
            Ok(()) if len <= cap => {
                // SAFETY: on success the library wrote `len` <= cap elements (the C ABI's
                // caller-buffer rule), so the first `len` are initialised.
                unsafe { v.set_len(len) };
                return Ok(v);
            }
            Ok(()) => {
                return Err(Error::new(
                    Code::Internal,
                    format!("the library reported {len} entries for a buffer of {cap}"),
                ))
            }
            Err(e) if e.code() == Code::BufferTooSmall && len > cap => {
                if attempt == FILL_ATTEMPTS {
                    let gave_up = format!(
                        "the length kept growing through {FILL_ATTEMPTS} attempts (the last \
                         asked for {len} entries, with room for {cap})"
                    );
                    return Err(Error::new(
                        Code::BufferTooSmall,
                        match e.message() {
                            "" => gave_up,
                            library => format!("{library}; {gave_up}"),
                        },
                    ));
                }
                attempt += 1;
                // v is empty: this reserves room for the whole length.
                v.try_reserve_exact(with_headroom(len)).map_err(|_| {
                    Error::new(
                        Code::ResourceExhausted,
                        format!("the library asked for {len} entries, more than can be allocated"),
                    )
                })?;
            }
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::{Cell, RefCell};
    use std::sync::atomic::{AtomicBool, Ordering};

    /// A panic payload that records its drop.
    struct Payload(&'static AtomicBool);

    impl Drop for Payload {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[test]
    fn call_dropping_panic_drops_a_publisher_panic() {
        // The library runs a replica publisher closure during the call (here the fake call runs
        // the trampoline itself), and the closure panics: on a helper thread (the deferred
        // Ingest::stop) nobody is there to resume it to, so it is dropped, not re-raised.
        static DROPPED: AtomicBool = AtomicBool::new(false);
        let callback: crate::replica::Callback =
            Box::new(|_| std::panic::panic_any(Payload(&DROPPED)));
        let user_data = &callback as *const crate::replica::Callback as *mut std::ffi::c_void;
        let outcome = std::panic::catch_unwind(|| {
            call_dropping_panic(|_err| {
                // SAFETY: user_data is a live Callback for the whole call; no data.
                unsafe { crate::replica::trampoline(user_data, ptr::null(), 0) };
                sys::KVR_OK
            })
        });
        assert!(
            matches!(outcome, Ok(Ok(()))),
            "the closure's panic was resumed"
        );
        assert!(
            DROPPED.load(Ordering::SeqCst),
            "the payload was not dropped"
        );
        // Nothing left behind for a later call on this thread to resume.
        assert!(call(|_err| sys::KVR_OK).is_ok());
    }

    /// A fake `(out, cap, *len)` C call, with what it was called with.
    #[derive(Default)]
    struct Fake {
        calls: Cell<usize>,
        caps: RefCell<Vec<usize>>,
    }

    impl Fake {
        /// The call, wanting `need(call number, cap)` entries: it writes them (0, 1, ...) when
        /// they fit, else reports `KVR_BUFFER_TOO_SMALL` with the length it wants. Panics past
        /// 100 calls, so an unbounded retry loop fails instead of hanging.
        fn call<'a>(
            &'a self,
            need: impl Fn(usize, usize) -> usize + 'a,
        ) -> impl FnMut(*mut u32, usize, *mut usize, *mut *mut sys::kvr_error) -> sys::kvr_status + 'a
        {
            move |out, cap, len, _err| {
                let n = self.calls.get();
                assert!(n < 100, "fill_vec retried {n} times without giving up");
                self.calls.set(n + 1);
                self.caps.borrow_mut().push(cap);
                let want = need(n, cap);
                // SAFETY: `len` is fill_vec's; `out` has room for `cap` entries.
                unsafe {
                    *len = want;
                    if want > cap {
                        return sys::KVR_BUFFER_TOO_SMALL;
                    }
                    for i in 0..want {
                        out.add(i).write(i as u32);
                    }
                }
                sys::KVR_OK
            }
        }
    }

    #[test]
    fn fill_vec_gives_up_on_a_size_that_keeps_growing() {
        // Workers added faster than the retries: every call wants more than it was given.
        let fake = Fake::default();
        let e = fill_vec(4, fake.call(|_, cap| cap + 1)).unwrap_err();
        assert_eq!(e.code(), Code::BufferTooSmall);
        assert_eq!(fake.calls.get(), FILL_ATTEMPTS, "{:?}", fake.caps);
        assert!(e.message().contains("attempts"), "{e}");
    }

    #[test]
    fn fill_vec_grows_with_headroom() {
        // One more entry on every call (a worker added between the calls): the retry's
        // headroom holds it, where an exact fit would be short again, and again.
        let fake = Fake::default();
        let v = fill_vec(16, fake.call(|n, _| 100 + n)).unwrap();
        assert_eq!(v, (0..101).collect::<Vec<u32>>());
        assert_eq!(fake.calls.get(), 2, "{:?}", fake.caps);
        assert!(fake.caps.borrow()[1] >= 100 + 100 / 4);

        // A first guess that fits: one call.
        let fake = Fake::default();
        assert_eq!(fill_vec(16, fake.call(|_, _| 3)).unwrap(), [0, 1, 2]);
        assert_eq!(fake.calls.get(), 1);
    }

    #[test]
    fn fill_vec_refuses_a_length_it_cannot_allocate() {
        // A length no Vec can hold is an error, not a capacity-overflow panic or an abort.
        let fake = Fake::default();
        let e = fill_vec(4, fake.call(|_, _| usize::MAX / 2)).unwrap_err();
        assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
        assert_eq!(fake.calls.get(), 1);
    }
}
