//go:build cgo

package kvrouter

/*
#include "kvrouter.h"
*/
import "C"

import (
	"errors"
	"strconv"
)

// Status (abi_gen.go: the type and its constants StatusOK, ErrNotFound, ...) is a kvr_status
// code; codes below 100 are absl::StatusCode's numbers. A Status is also an error, so the Err*
// codes serve as sentinels for errors.Is:
//
//	if errors.Is(err, kvrouter.ErrNotFound) { ... }
//
// and errors.As(err, &status) extracts the code of any error this package returns.

// String returns the code's C name ("KVR_NOT_FOUND"; "KVR_UNKNOWN" for a code the library does
// not know).
func (s Status) String() string {
	return C.GoString(C.kvr_status_str(C.kvr_status(s)))
}

// Error makes a Status usable as a sentinel error.
func (s Status) Error() string {
	return "kvrouter: " + s.String() + " (" + strconv.Itoa(int(s)) + ")"
}

// Error is a failed call's status and the library's message.
type Error struct {
	code Status
	msg  string
}

// Code returns the kvr_status of the failure.
func (e *Error) Code() Status { return e.code }

// Message returns the library's message (possibly empty).
func (e *Error) Message() string { return e.msg }

func (e *Error) Error() string {
	if e.msg == "" {
		return "kvrouter: " + e.code.String()
	}
	return "kvrouter: " + e.code.String() + ": " + e.msg
}

// Unwrap returns the code, so that errors.Is(err, kvrouter.ErrNotFound) holds for a
// KVR_NOT_FOUND failure.
func (e *Error) Unwrap() error { return e.code }

// ErrClosed is returned by calls on a handle after its Close (and on a pool router after its
// Disagg's Close). It carries KVR_FAILED_PRECONDITION.
var ErrClosed = &Error{code: ErrFailedPrecondition, msg: "the handle is closed"}

// StatusOf returns StatusOK for nil, the code carried by an error of this package, and -1
// for any other error.
func StatusOf(err error) Status {
	if err == nil {
		return StatusOK
	}
	var s Status
	if errors.As(err, &s) {
		return s
	}
	return -1
}

// takeError turns a failed call's status and optional error object into an *Error and frees
// the object. A success costs no C call (the library sets no error object on success; one that
// did would still be freed). Every call into the library that may run a replica publish
// callback returns through it, so it also raises again, on this goroutine, a panic such a
// callback recovered during the call (raisePublishPanic: one atomic load when there is none).
func takeError(st C.kvr_status, cerr *C.kvr_error) error {
	err := errorOf(st, cerr)
	raisePublishPanic()
	return err
}

// errorOf is takeError without raising a callback's panic.
func errorOf(st C.kvr_status, cerr *C.kvr_error) error {
	if st == C.KVR_OK {
		if cerr != nil {
			C.kvr_error_free(cerr)
		}
		return nil
	}
	e := &Error{code: Status(st)}
	if cerr != nil {
		if code := Status(C.kvr_error_status(cerr)); code != StatusOK {
			e.code = code // the same code as the status returned
		}
		e.msg = C.GoString(C.kvr_error_message(cerr))
		C.kvr_error_free(cerr)
	}
	return e
}

func newError(code Status, msg string) error { return &Error{code: code, msg: msg} }
