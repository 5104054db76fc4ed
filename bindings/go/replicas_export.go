//go:build cgo

package kvrouter

// A file of its own: a cgo preamble next to //export may only declare, not define.

/*
#include <stddef.h>
*/
import "C"

import (
	"bytes"
	"runtime"
	"runtime/cgo"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"
)

// kvrGoReplicaPublish is the library's replica publish callback: it runs the Go callback whose
// handle is userData (Router.SetReplicaPublisher), under the router's lock. A Go panic must not
// unwind through the library's frames: it would skip their destructors (golang/go#16150), the
// lock guard among them, and every later call on the router would block. So when a goroutine
// made the call into the library that runs this callback, the panic is recovered here and kept
// for that goroutine, which raises it again once the library has returned (takeError). On a
// thread the library started (an ingest loop) no goroutine waits: the panic is left alone and,
// recovered by nobody, ends the program as any other would.
//
//export kvrGoReplicaPublish
func kvrGoReplicaPublish(userData unsafe.Pointer, data unsafe.Pointer, size C.size_t) {
	returned := false
	defer func() {
		if !returned && calledFromGo() {
			keepPublishPanic(recover())
		}
	}()
	publish := cgo.Handle(uintptr(userData)).Value().(func([]byte))
	publish(unsafe.Slice((*byte)(data), int(size)))
	returned = true
}

// publishPanics holds the panics recovered in publish callbacks, by goroutine, until the call
// into the library that ran the callback returns to that goroutine.
var publishPanics struct {
	pending     atomic.Int32 // len(byGoroutine): read, without mu, after every call (takeError)
	mu          sync.Mutex
	byGoroutine map[uint64]any
}

// keepPublishPanic keeps p, recovered in a callback, for the goroutine running it: the first
// panic of a call into the library, if several callbacks of one call panic. A nil p (the
// callback called runtime.Goexit, which cannot be stopped) is ignored.
func keepPublishPanic(p any) {
	if p == nil {
		return
	}
	g := goroutineID()
	publishPanics.mu.Lock()
	defer publishPanics.mu.Unlock()
	if publishPanics.byGoroutine == nil {
		publishPanics.byGoroutine = make(map[uint64]any)
	}
	if _, held := publishPanics.byGoroutine[g]; !held {
		publishPanics.byGoroutine[g] = p
		publishPanics.pending.Add(1)
	}
}

// raisePublishPanic panics with the panic a publish callback run by this goroutine's last call
// into the library recovered, if any. Inlined, it costs one atomic load unless a panic is
// waiting for some goroutine.
func raisePublishPanic() {
	if publishPanics.pending.Load() != 0 {
		raiseKeptPublishPanic()
	}
}

func raiseKeptPublishPanic() {
	g := goroutineID()
	publishPanics.mu.Lock()
	p, held := publishPanics.byGoroutine[g]
	if held {
		delete(publishPanics.byGoroutine, g)
		publishPanics.pending.Add(-1)
	}
	publishPanics.mu.Unlock()
	if held {
		panic(p)
	}
}

// calledFromGo reports whether the running callback was called by the library inside a call a
// goroutine made into it, rather than on a thread the library started. A callback runs on the
// goroutine that called C: below its frames (kvrGoReplicaPublish, then the runtime's callback
// frames) the stack goes on to runtime.cgocall and that goroutine's frames; on a thread of the
// library's it ends there (runtime.goexit). Only called for a panic: it walks the whole stack.
func calledFromGo() bool {
	frames := runtime.CallersFrames(callers())
	below := false // past this callback's own frame
	for {
		f, more := frames.Next()
		switch {
		case strings.HasSuffix(f.Function, ".kvrGoReplicaPublish"):
			below = true
		case below && f.Function == "runtime.cgocall":
			return true
		case below && f.Function == "runtime.goexit":
			return false
		}
		if !more {
			return false
		}
	}
}

// inPublishCallback reports whether the caller runs inside a replica publish callback, on a
// thread of the library's (an Ingest's loop) or on a goroutine whose call into the library
// runs it under a router's lock. It walks the whole stack: for rare paths only (the free of an
// Ingest by its last call, Ingest.release; Close, CloseQueue, SetReplicaPublisher).
func inPublishCallback() bool {
	frames := runtime.CallersFrames(callers())
	for {
		f, more := frames.Next()
		if strings.HasSuffix(f.Function, ".kvrGoReplicaPublish") {
			return true
		}
		if !more {
			return false
		}
	}
}

// callers returns the program counters of the calling goroutine's whole stack.
func callers() []uintptr {
	pcs := make([]uintptr, 64)
	for {
		n := runtime.Callers(2, pcs)
		if n < len(pcs) {
			return pcs[:n]
		}
		pcs = make([]uintptr, 2*len(pcs))
	}
}

// goroutineID returns the running goroutine's id, from the first line of its stack trace
// ("goroutine 18 [running]:"); 0 if that cannot be read (then every such panic is the
// goroutine 0's, raised by whichever goroutine looks first).
func goroutineID() uint64 {
	var buf [64]byte
	line := buf[:runtime.Stack(buf[:], false)]
	line = bytes.TrimPrefix(line, []byte("goroutine "))
	if i := bytes.IndexByte(line, ' '); i > 0 {
		if id, err := strconv.ParseUint(string(line[:i]), 10, 64); err == nil {
			return id
		}
	}
	return 0
}
