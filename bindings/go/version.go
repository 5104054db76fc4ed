//go:build cgo

package kvrouter

/*
#include "kvrouter.h"
*/
import "C"

import (
	"fmt"
	"sync"
	"sync/atomic"
)

// The version of kvrouter.h this package was compiled against (KVR_VERSION_*).
const (
	HeaderVersionMajor  = C.KVR_VERSION_MAJOR
	HeaderVersionMinor  = C.KVR_VERSION_MINOR
	HeaderVersionPatch  = C.KVR_VERSION_PATCH
	HeaderVersionNumber = HeaderVersionMajor*10000 + HeaderVersionMinor*100 + HeaderVersionPatch
)

// The header must be the major.minor that abi_gen.go was generated from (cgo.go's #error holds
// the header to 0.2; this holds the generated file to the header): a constant index out of
// range stops the build otherwise. Regenerate with tools/ffigen/ffigen.py.
var (
	_ = [1]struct{}{}[HeaderVersionMajor-abiVersionMajor]
	_ = [1]struct{}{}[HeaderVersionMinor-abiVersionMinor]
)

// Version returns the loaded library's version number, major*10000 + minor*100 + patch.
func Version() uint32 { return uint32(C.kvr_version()) }

// VersionString returns the loaded library's version as "MAJOR.MINOR.PATCH".
func VersionString() string { return C.GoString(C.kvr_version_string()) }

// versionErr is nil while the library loaded at run time has the ABI this package was generated
// for, and otherwise the error that CheckVersion and every constructor return. It is set when
// the package is initialised (before any init function of the package runs).
var versionErr atomic.Pointer[Error]

// templatesOnce fills routing.go's initialised structs, once a library is accepted.
var templatesOnce sync.Once

var _ = func() bool {
	setLibraryVersion(Version(), VersionString())
	return true
}()

// setLibraryVersion decides whether a library of this version is one this package accepts:
// the same major.minor as the header abi_gen.go was generated from, any patch release.
func setLibraryVersion(number uint32, text string) {
	if number/10000 == abiVersionMajor && number/100%100 == abiVersionMinor {
		templatesOnce.Do(initTemplates)
		versionErr.Store(nil)
		return
	}
	versionErr.Store(&Error{code: ErrFailedPrecondition, msg: fmt.Sprintf(
		"libkvrouter %s is loaded, but this Go package (built for kvrouter.h %d.%d.%d) accepts "+
			"libkvrouter %d.%d.x only: install libkvrouter %d.%d.x, or a release of the Go "+
			"binding made for libkvrouter %d.%d",
		text, HeaderVersionMajor, HeaderVersionMinor, HeaderVersionPatch,
		abiVersionMajor, abiVersionMinor, abiVersionMajor, abiVersionMinor, number/10000, number/100%100)})
}

// CheckVersion returns nil when the shared library loaded at run time is one this package
// accepts: libkvrouter with the major.minor of the header it was built against (0.2; at 0.x a
// minor release may change the ABI), any patch release. Otherwise it returns an *Error with
// ErrFailedPrecondition naming both versions, and so does every constructor (NewRouter,
// NewDisagg, NewIngest, NewEventBatch, ConnectPublisher, the hashing functions) without
// calling into the library. The check runs once, when the package is initialised.
func CheckVersion() error {
	if e := versionErr.Load(); e != nil {
		return e
	}
	return nil
}
