//go:build 386 || amd64p32 || arm || armbe || mips || mipsle || mips64p32 || mips64p32le || ppc || riscv || s390 || sparc

package kvrouter

// The binding needs a 64-bit platform: it mirrors the C structs with 64-bit size_t and
// pointer fields (abi_gen.go's layouts are those of LP64), and passes lengths as 64-bit
// counts. On a 32-bit GOARCH the build stops here, on the identifier below, with its name as
// the message, instead of on a layout check or, worse, a struct that C reads differently.
var _ = kvrouter_Go_binding_requires_a_64_bit_platform__this_GOARCH_is_32_bit
