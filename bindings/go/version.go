//go:build cgo

package kvrouter

/*
#include "kvrouter.h"
*/
import "C"

import "fmt"

// The version of kvrouter.h this package was compiled against (KVR_VERSION_*).
const (
	HeaderVersionMajor  = C.KVR_VERSION_MAJOR
	HeaderVersionMinor  = C.KVR_VERSION_MINOR
	HeaderVersionPatch  = C.KVR_VERSION_PATCH
	HeaderVersionNumber = HeaderVersionMajor*10000 + HeaderVersionMinor*100 + HeaderVersionPatch
)

// Version returns the loaded library's version number, major*10000 + minor*100 + patch.
func Version() uint32 { return uint32(C.kvr_version()) }

// VersionString returns the loaded library's version as "MAJOR.MINOR.PATCH".
func VersionString() string { return C.GoString(C.kvr_version_string()) }

// CheckVersion reports an error when the shared library loaded at run time has another major
// or minor version than the header this package was built against (at 0.x a minor release may
// change the ABI). A newer patch release is accepted.
func CheckVersion() error {
	v := Version()
	if v/100 != HeaderVersionNumber/100 {
		return newError(ErrFailedPrecondition, fmt.Sprintf(
			"libkvrouter %s is loaded, but this package was built against kvrouter.h %d.%d.%d",
			VersionString(), HeaderVersionMajor, HeaderVersionMinor, HeaderVersionPatch))
	}
	return nil
}
