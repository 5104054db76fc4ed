//go:build !cgo

package kvrouter

// The binding calls libkvrouter through cgo. Building with CGO_ENABLED=0 stops here, on the
// identifier below, instead of failing later on undefined symbols.
var _ = kvrouter_Go_binding_requires_cgo__build_with_CGO_ENABLED_1
