//go:build cgo

package kvrouter

// A file of its own: a cgo preamble next to //export may only declare, not define.

/*
#include <stddef.h>
*/
import "C"

import (
	"runtime/cgo"
	"unsafe"
)

//export kvrGoReplicaPublish
func kvrGoReplicaPublish(userData unsafe.Pointer, data unsafe.Pointer, size C.size_t) {
	publish := cgo.Handle(uintptr(userData)).Value().(func([]byte))
	publish(unsafe.Slice((*byte)(data), int(size)))
}
