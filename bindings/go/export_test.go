package kvrouter

import "unsafe"

// unsafePtr hands a router's C handle to the C benchmark loop (tests only).
func unsafePtr(r *Router) unsafe.Pointer { return r.ptr.p }
