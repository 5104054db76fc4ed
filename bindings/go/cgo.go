//go:build cgo

package kvrouter

// The whole binding is cgo over include/kvrouter.h and libkvrouter.so, found with pkg-config
// (set PKG_CONFIG_PATH to the install's lib/pkgconfig for a staged or non-system install).
// With the build tag kvrouter_static it links the static libkvrouter.a instead: the link
// flags are `pkg-config --static --libs kvrouter` (the library's own dependencies) with the
// archive named first, and --as-needed keeps the -lkvrouter that pkg-config also prints from
// recording libkvrouter.so as needed (every kvr_ symbol is then defined by the archive).

/*
#cgo !kvrouter_static pkg-config: kvrouter
#cgo kvrouter_static pkg-config: --static kvrouter
#cgo kvrouter_static LDFLAGS: -l:libkvrouter.a -Wl,--as-needed

// The binding needs a 64-bit platform: its struct mirrors (abi_gen.go) have LP64's layouts and
// it passes lengths as 64-bit counts. A 32-bit target stops here, before anything else
// (arch32.go stops a build of it without cgo).
#if !defined(__SIZEOF_POINTER__) || __SIZEOF_POINTER__ != 8
#error "kvrouter Go binding: needs a 64-bit platform (GOARCH amd64, arm64, ppc64le, s390x, riscv64, ...); this target's pointers are not 8 bytes"
#endif

#include <stdlib.h>
#include "kvrouter.h"

// This package wraps the 0.2 ABI (abi_gen.go is generated from the 0.2 header). A minor
// release may break the ABI while kvrouter is at 0.x, so building against any other version
// fails here rather than misbehaving at run time. (The library loaded at run time is checked
// too: see CheckVersion.)
#if KVR_VERSION_MAJOR != 0 || KVR_VERSION_MINOR != 2
#error "kvrouter Go binding: this package needs libkvrouter 0.2.x (kvrouter.h reports another version)"
#endif
*/
import "C"

import (
	"math"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
	"unsafe"
)

// argCheck records the first argument of a call that cannot go to C as it is: a string holding
// a NUL byte (C would read the byte as the string's end, so "t\x00a" and "t\x00b" would be one
// request id, and a LoRA name "x\x00v2" would hash as "x"), or a number out of its C field's
// range. Every conversion of a string for C goes through it (args.str and args.optStr for C
// copies, view for the shims' (bytes, length)), and every call checks err before calling C, so
// such an argument is refused with ErrInvalidArgument naming it instead of being cut short.
type argCheck struct{ bad error }

// err is the first argument refused, or nil.
func (c *argCheck) err() error { return c.bad }

// refuse records that field cannot go to C (why), unless an earlier argument was refused.
func (c *argCheck) refuse(field, why string) {
	if c.bad == nil {
		c.bad = newError(ErrInvalidArgument, field+": "+why)
	}
}

// cString says whether s can go to C as a NUL-terminated string, and refuses field otherwise.
func (c *argCheck) cString(field, s string) bool {
	if strings.IndexByte(s, 0) < 0 {
		return true
	}
	c.refuse(field, "contains a NUL byte")
	return false
}

// rank converts a data-parallel rank for an int32_t field of the ABI, where -1 means "none":
// a rank past math.MaxInt32 would wrap to a negative, read as "none", so field is refused.
func (c *argCheck) rank(field string, r uint32) int32 {
	if r > math.MaxInt32 {
		c.refuse(field, "rank "+strconv.FormatUint(uint64(r), 10)+" is out of range (at most 2147483647)")
		return -1
	}
	return int32(r)
}

// view passes a string to a shim as (bytes, length) from Go's memory (no copy, no pointers
// inside, so no pinning; the shim NUL-terminates a copy); "" is (NULL, 0), and so is a string
// refused for a NUL byte.
func (c *argCheck) view(field, s string) (*C.char, C.size_t) {
	if s == "" || !c.cString(field, s) {
		return nil, 0
	}
	return (*C.char)(unsafe.Pointer(unsafe.StringData(s))), C.size_t(len(s))
}

// args collects what one call lends the C side: C strings to free after the call and Go
// memory that a struct passed to C points at (pinned, as cgo's pointer rules require for a Go
// pointer stored in memory that C reads). The library copies everything it keeps, so all of it
// is released as soon as the call returns. Its argCheck holds the first argument refused: check
// a.err() after building the arguments and before the C call.
type args struct {
	argCheck
	pin  runtime.Pinner
	strs [4]unsafe.Pointer // the first C strings (no allocation for the common case)
	n    int
	more []unsafe.Pointer
}

func (a *args) release() {
	for i := 0; i < a.n; i++ {
		C.free(a.strs[i])
	}
	for _, p := range a.more {
		C.free(p)
	}
	a.n, a.more = 0, nil
	a.pin.Unpin()
}

// optStr returns NULL for "" (every optional string of the ABI treats NULL and "" alike) and a
// C copy of s otherwise (as str).
func (a *args) optStr(field, s string) *C.char {
	if s == "" {
		return nil
	}
	return a.str(field, s)
}

// str returns a C copy of s, freed by release; NULL, with field refused, if s holds a NUL byte.
func (a *args) str(field, s string) *C.char {
	if !a.cString(field, s) {
		return nil
	}
	p := C.CString(s)
	if a.n < len(a.strs) {
		a.strs[a.n] = unsafe.Pointer(p)
		a.n++
	} else {
		a.more = append(a.more, unsafe.Pointer(p))
	}
	return p
}

func (a *args) u64s(s []uint64) *C.uint64_t {
	if len(s) == 0 {
		return nil
	}
	a.pin.Pin(&s[0])
	return (*C.uint64_t)(unsafe.Pointer(&s[0]))
}

func (a *args) u32s(s []uint32) *C.uint32_t {
	if len(s) == 0 {
		return nil
	}
	a.pin.Pin(&s[0])
	return (*C.uint32_t)(unsafe.Pointer(&s[0]))
}

// mm flattens per-block multimodal hashes into the ABI's (hashes, counts) form (flattenMM),
// pinned for a struct that points at them.
func (a *args) mm(perBlock [][]uint64) (*C.uint64_t, *C.size_t, int) {
	flat, counts := flattenMM(perBlock)
	if len(counts) == 0 {
		return nil, nil, 0
	}
	a.pin.Pin(&counts[0])
	return a.u64s(flat), &counts[0], len(counts)
}

// flattenMM flattens per-block multimodal hashes into the ABI's (hashes, counts) form; counts
// has one entry per block of perBlock (none for no blocks).
func flattenMM(perBlock [][]uint64) ([]uint64, []C.size_t) {
	if len(perBlock) == 0 {
		return nil, nil
	}
	total := 0
	for _, b := range perBlock {
		total += len(b)
	}
	counts := make([]C.size_t, len(perBlock))
	flat := make([]uint64, 0, total)
	for i, b := range perBlock {
		counts[i] = C.size_t(len(b))
		flat = append(flat, b...)
	}
	return flat, counts
}

// emptyCString is "" for a required string argument.
var emptyCString = [1]C.char{0}

func sizePtr(s []C.size_t) *C.size_t {
	if len(s) == 0 {
		return nil
	}
	return &s[0]
}

// tokensPtr passes a token slice as a direct argument (Go memory without pointers may be
// passed for the duration of a call without pinning).
func tokensPtr(tokens []uint32) (*C.uint32_t, C.size_t) {
	if len(tokens) == 0 {
		return nil, 0
	}
	return (*C.uint32_t)(unsafe.Pointer(&tokens[0])), C.size_t(len(tokens))
}

func bytesPtr(b []byte) (unsafe.Pointer, C.size_t) {
	if len(b) == 0 {
		return nil, 0
	}
	return unsafe.Pointer(&b[0]), C.size_t(len(b))
}

// takeBuffer copies a library-owned kvr_buffer into Go memory and frees it.
func takeBuffer(dst []byte, buf *C.kvr_buffer) []byte {
	defer C.kvr_buffer_free(buf)
	n := int(C.kvr_buffer_size(buf))
	if n == 0 {
		return dst
	}
	return append(dst, unsafe.Slice((*byte)(unsafe.Pointer(C.kvr_buffer_data(buf))), n)...)
}

// boolU32 is a flag field's value for b (for the generated mirrors' uint32 booleans).
func boolU32(b bool) uint32 {
	if b {
		return 1
	}
	return 0
}

// flagIf returns flag when b holds, else 0 (building a mirror's flags from booleans).
func flagIf(b bool, flag uint32) uint32 {
	if b {
		return flag
	}
	return 0
}

// seconds converts a C duration in seconds to a time.Duration.
func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// ceilMillis is d in whole milliseconds, rounded up (d > 0). (Adding a millisecond less a
// nanosecond before dividing would overflow for d near math.MaxInt64.)
func ceilMillis(d time.Duration) int64 {
	ms := int64(d / time.Millisecond)
	if d%time.Millisecond != 0 {
		ms++
	}
	return ms
}

// millis32 is ceilMillis(d) for a uint32_t field of milliseconds (d > 0), at most
// math.MaxUint32 (about 49.7 days): a longer d is that, rather than wrapping to a short one.
func millis32(d time.Duration) uint32 {
	return uint32(min(ceilMillis(d), math.MaxUint32))
}

func u64Ptr(s []uint64) *C.uint64_t {
	if len(s) == 0 {
		return nil
	}
	return (*C.uint64_t)(unsafe.Pointer(&s[0]))
}

// handlePtr holds a C handle and counts its uses, so that Close never frees it under a call in
// flight (the C library's _free must not overlap any other call on the object). Every method
// takes the handle with acquire and gives it back with release (deferred); Close takes it too,
// marks it closed (close), after which acquire answers nil (ErrClosed), does what must precede
// the free (a Router wakes its admission queue's waiters, an Ingest stops) and releases it; the
// handle is freed by whichever release comes last: Close's, when no other call is in flight,
// or else the last call in flight's. A Router or Disagg also counts in it the Ingests feeding
// it, which Close refuses to outlive.
//
// The count is one atomic word: a routing call costs a compare-and-swap and an add on it, a few
// nanoseconds beside the call's own locks. (A sync.RWMutex that Close would lock could deadlock:
// a request waiting in the admission queue holds its read lock until a FreeRequest admits it,
// and a waiting writer keeps that FreeRequest from taking its own.)
type handlePtr struct {
	p     unsafe.Pointer // set by open, before the handle is shared, and never changed
	state atomic.Uint64  // handleClosed | feeds × handleFeed | references (handleRefs)
}

const (
	handleClosed = 1 << 63
	handleFeed   = 1 << 32        // one open Ingest feeding the Router or Disagg
	handleRefs   = handleFeed - 1 // the handle's own reference (until Close) + the calls in flight
	handleFeeds  = handleClosed - handleFeed
)

// open sets the C handle of a new object, holding the object's own reference.
func (h *handlePtr) open(p unsafe.Pointer) {
	h.p = p
	h.state.Store(1)
}

// acquire returns the C handle for one call, to give back with release, or nil once the handle
// is closed (or was never opened).
func (h *handlePtr) acquire() unsafe.Pointer {
	for {
		s := h.state.Load()
		if s&handleClosed != 0 || s&handleRefs == 0 {
			return nil
		}
		if h.state.CompareAndSwap(s, s+1) {
			return h.p
		}
	}
}

// release ends a call begun by acquire. It reports whether the caller must free the handle:
// it was closed and this was the last call in flight.
func (h *handlePtr) release() bool {
	return h.state.Add(^uint64(0)) == handleClosed
}

// close marks the handle closed and drops its own reference. The caller holds a reference
// (acquire), which it may still use, and gives it back with release afterwards (that release
// frees the handle if no other call is in flight then). It reports whether this call closed the
// handle (false: closed before), and whether it refused because an Ingest feeds the object
// (fed; the handle stays open).
func (h *handlePtr) close() (closed, fed bool) {
	for {
		s := h.state.Load()
		if s&handleClosed != 0 {
			return false, false
		}
		if s&handleFeeds != 0 {
			return false, true
		}
		if h.state.CompareAndSwap(s, (s|handleClosed)-1) {
			return true, false
		}
	}
}

// addFeed counts an Ingest feeding the object (the caller holds a reference); false once the
// object is closing (the Ingest must not be made).
func (h *handlePtr) addFeed() bool {
	for {
		s := h.state.Load()
		if s&handleClosed != 0 || s&handleRefs == 0 {
			return false
		}
		if h.state.CompareAndSwap(s, s+handleFeed) {
			return true
		}
	}
}

// dropFeed ends what addFeed counted (an Ingest never made). The object cannot be closed while
// it is counted, so this never frees it.
func (h *handlePtr) dropFeed() { h.state.Add(^uint64(handleFeed - 1)) }

// feedToRef turns what addFeed counted into a reference, given back with release: the Ingest
// has stopped, so Close no longer refuses, but the object stays allocated until the Ingest's
// free releases it. (One add: minus a feed, plus a reference.)
func (h *handlePtr) feedToRef() { h.state.Add(^uint64(handleFeed - 2)) }

// closed reports whether the handle is closed and freed (closed, no call in flight).
func (h *handlePtr) closed() bool { return h.state.Load() == handleClosed }

// growRetries bounds fillGrowing's retries on KVR_BUFFER_TOO_SMALL: an answer that grows
// between the calls (workers added while a per-rank query runs, sources while the ingest's
// metrics are read) must not keep the caller retrying forever.
const growRetries = 4

// fillGrowing runs a call that fills a caller buffer (kvr_* with `out, cap, *len`), starting
// with capHint elements and growing on KVR_BUFFER_TOO_SMALL: the first time to the size the
// library asks for, then (the answer grew between the calls) with headroom (growTo). After
// growRetries retries it returns the last call's error (ErrBufferTooSmall). It returns the
// filled part.
func fillGrowing[T any](capHint int,
	call func(out *T, cap C.size_t, n *C.size_t, cerr **C.kvr_error) C.kvr_status) ([]T, error) {
	buf := make([]T, capHint)
	for retries := 0; ; retries++ {
		var n C.size_t
		var cerr *C.kvr_error
		var p *T
		if len(buf) > 0 {
			p = &buf[0]
		}
		st := call(p, C.size_t(len(buf)), &n, &cerr)
		if st == C.KVR_BUFFER_TOO_SMALL && int(n) > len(buf) && retries < growRetries {
			C.kvr_error_free(cerr)
			buf = make([]T, growTo(int(n), retries))
			continue
		}
		if err := takeError(st, cerr); err != nil {
			return nil, err
		}
		return buf[:n], nil
	}
}

// growTo is the size of fillGrowing's next buffer when the library needs need elements, after
// retries retries: need itself at first (the hint was short), then a quarter more and 16 (the
// answer grew since the last call, and may grow again).
func growTo(need, retries int) int {
	if retries == 0 {
		return need
	}
	return need + need/4 + 16
}

// cText is a NUL-terminated C string filled by the library, without its NUL.
func cText(b []C.char) string {
	if len(b) == 0 {
		return ""
	}
	return C.GoStringN(&b[0], C.int(len(b)-1))
}

// fromCU64s views C uint64s as Go uint64s (same size and layout), never nil.
func fromCU64s(s []C.uint64_t) []uint64 {
	if len(s) == 0 {
		return []uint64{}
	}
	return unsafe.Slice((*uint64)(unsafe.Pointer(&s[0])), len(s))
}
