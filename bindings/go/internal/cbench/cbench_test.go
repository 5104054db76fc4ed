package cbench

import (
	"strings"
	"testing"
)

// The loop reports the library's refusal of a NULL router instead of timing nothing.
func TestNullRouter(t *testing.T) {
	_, err := FindBestMatchLoop(nil, make([]uint32, 16), 1, 16, 1, false)
	if err == nil || !strings.Contains(err.Error(), "KVR_INVALID_ARGUMENT") {
		t.Fatalf("got %v, want KVR_INVALID_ARGUMENT", err)
	}
	ns, err := FindBestMatchLoop(nil, nil, 0, 0, 0, false)
	if err != nil || len(ns) != 0 {
		t.Fatalf("zero iterations: %v %v", ns, err)
	}
}
