"""Rust: bindings/rust/kvrouter-sys/src/lib.rs, every declaration of the header."""

from __future__ import annotations

from formatting import rustfmt
from model import CType, Model
from names import HEADER_NOTE, comment_lines

OUT = "bindings/rust/kvrouter-sys/src/lib.rs"


def rust_type(t: CType, callbacks: set[str]) -> str:
    if t.kind == "int":
        if t.typedef:
            return t.typedef
        return {"size_t": "usize", "int": "c_int", "char": "c_char"}.get(
            t.spelling, f"{'i' if t.signed else 'u'}{t.bits}"
        )
    if t.kind == "float":
        return f"f{t.bits}"
    if t.kind == "void":
        return "c_void"
    if t.kind == "opaque":
        return t.spelling
    if t.kind == "array":
        inner = rust_type(t.element, callbacks)
        for d in reversed(t.dims):
            inner = f"[{inner}; {d}]"
        return inner
    if t.kind == "pointer":
        pointee = t.pointee
        if pointee.kind == "opaque" and pointee.spelling in callbacks:
            raise SystemExit("ffigen: pointers to callbacks are not supported")
        return f"*{'const' if t.const else 'mut'} {rust_type(pointee, callbacks)}"
    raise SystemExit(f"ffigen: no Rust type for {t.spelling}")


def _param_type(t: CType, callbacks: set[str]) -> str:
    # A callback typedef reaches the model as an opaque name.
    return t.spelling if t.kind == "opaque" and t.spelling in callbacks else rust_type(t, callbacks)


def generate(m: Model) -> dict[str, str]:
    callbacks = {c.name for c in m.callbacks}
    major, minor, patch = m.version
    out = [
        f"//! Raw declarations of libkvrouter's C ABI, `include/kvrouter.h` {major}.{minor}.{patch}:",
        "//! every function, struct, type and constant of the header, in its order, with the header's",
        "//! own comments. The safe layer is the `kvrouter` crate.",
        "//!",
        f"//! {HEADER_NOTE}",
        "//! Every struct's size, alignment and field offsets are checked at compile time against what",
        "//! clang laid out when this file was generated; `tests/layout.rs` checks them again against",
        "//! the installed header.",
        "#![no_std]",
        "#![allow(non_camel_case_types)]",
        "// The header's comments are C comments, not Markdown: `mm_counts[i]` is no intra-doc link.",
        "#![allow(rustdoc::broken_intra_doc_links)]",
        "",
        "use core::ffi::{c_char, c_int, c_void};",
        "use core::marker::{PhantomData, PhantomPinned};",
        "use core::mem::{align_of, offset_of, size_of};",
        "",
        "/// The header version these declarations were generated from (`kvrouter_version.h`): a",
        "/// library of the same major.minor has this ABI.",
        f"pub const KVR_VERSION_MAJOR: u32 = {major};",
        f"pub const KVR_VERSION_MINOR: u32 = {minor};",
        f"pub const KVR_VERSION_PATCH: u32 = {patch};",
        f'pub const KVR_VERSION_STRING: &str = "{major}.{minor}.{patch}";',
        "pub const KVR_VERSION_NUMBER: u32 =",
        "    KVR_VERSION_MAJOR * 10000 + KVR_VERSION_MINOR * 100 + KVR_VERSION_PATCH;",
        "",
        "// ---- Opaque handles ---------------------------------------------------------------------",
        "",
    ]
    for name in m.opaque:
        out += [
            "#[repr(C)]",
            f"pub struct {name} {{",
            "    _data: [u8; 0],",
            "    _marker: PhantomData<(*mut u8, PhantomPinned)>,",
            "}",
        ]
    out += ["", "// ---- Enumerations (the X-macro lists) ----------------------------------------------------", ""]
    for e in m.enumerations:
        base = m.integer_typedefs[e.typedef]
        out += comment_lines(e.doc, "/// ")
        out.append(f"pub type {e.typedef} = {rust_type(CType(base.spelling, 'int', base.bits, base.signed), callbacks)};")
        for v in e.values:
            out += comment_lines(v.doc, "/// ")
            out.append(f"pub const {v.c_name}: {e.typedef} = {v.value};")
        out.append("")
    out += ["// ---- Flags and constants ------------------------------------------------------------------", ""]
    for f in m.flags:
        out += comment_lines(f.doc, "/// ")
        for v in f.values:
            out += comment_lines(v.doc, "/// ")
            out.append(f"pub const {v.c_name}: u32 = {v.value:#x};")
        out.append("")
    for c in m.constants:
        out += comment_lines(c.doc, "/// ")
        rust = "u64" if c.bits == 64 else "usize"
        value = "u64::MAX" if c.value == 2**64 - 1 else str(c.value)
        out.append(f"pub const {c.c_name}: {rust} = {value};")
    out += ["", "// ---- Callbacks ----------------------------------------------------------------------------", ""]
    for cb in m.callbacks:
        out += comment_lines(cb.doc, "/// ")
        params = ", ".join(rust_type(p, callbacks) for p in cb.params)
        result = "" if cb.result.kind == "void" else f" -> {rust_type(cb.result, callbacks)}"
        out.append(f'pub type {cb.name} = Option<unsafe extern "C" fn({params}){result}>;')
    out += ["", "// ---- Structs ------------------------------------------------------------------------------", ""]
    for s in m.structs:
        out += comment_lines(s.doc, "/// ")
        out += ["#[repr(C)]", "#[derive(Clone, Copy, Debug)]", f"pub struct {s.name} {{"]
        for f in s.fields:
            out += comment_lines(f.doc, "    /// ")
            out.append(f"    pub {f.name}: {rust_type(f.type, callbacks)},")
        out += ["}", ""]
    out += ["// ---- Functions ----------------------------------------------------------------------------", ""]
    out.append('extern "C" {')
    for fn in m.functions:
        out += comment_lines(fn.doc, "    /// ")
        params = ", ".join(f"{_rust_ident(p.name)}: {_param_type(p.type, callbacks)}" for p in fn.params)
        result = "" if fn.result.kind == "void" else f" -> {rust_type(fn.result, callbacks)}"
        out.append(f"    pub fn {fn.name}({params}){result};")
    out += ["}", ""]
    out += ["// ---- Layouts, as clang laid them out ----------------------------------------------------", ""]
    out.append("const _: () = {")
    for s in m.structs:
        out.append(f"    assert!(size_of::<{s.name}>() == {s.size});")
        out.append(f"    assert!(align_of::<{s.name}>() == {s.align});")
        for f in s.fields:
            out.append(f"    assert!(offset_of!({s.name}, {f.name}) == {f.offset});")
    out += ["};", ""]
    return {OUT: rustfmt("\n".join(out), OUT)}


def _rust_ident(name: str) -> str:
    return f"r#{name}" if name in {"type", "ref", "in", "fn", "mod", "move", "match", "box"} else name
