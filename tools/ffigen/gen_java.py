"""Java: the enum classes, Abi.java (constants and struct layouts) and the JNI struct codecs.

Structs cross JNI as long[] arrays: one slot per value field (every field that is not a
pointer, struct_size or reserved; arrays take one slot per element, row by row), integers as
their value, doubles as their raw bits. Abi.java gives each slot its index in Java, and
kvrouter_jni_abi.h the same indices in C with the two codecs of every struct, so neither side
counts fields by hand.
"""

from __future__ import annotations

from formatting import clang_format
from model import CType, Enumeration, Field, Model, Struct
from names import HEADER_NOTE, comment_lines, plain_camel, type_name

JAVA_DIR = "bindings/java/src/main/java/io/kvrouter"
JNI_HEADER = "bindings/java/src/main/c/kvrouter_jni_abi.h"

# Java class names where the C typedef's name would be too vague.
_CLASS_NAMES = {"kvr_engine": "EngineKind"}


def class_name(e: Enumeration) -> str:
    return _CLASS_NAMES.get(e.typedef, type_name(e.typedef))


def value_fields(s: Struct) -> list[Field]:
    return [
        f
        for f in s.fields
        if f.type.kind in ("int", "float", "array") and f.name != "struct_size" and not f.name.startswith("reserved")
    ]


def slot_count(f: Field) -> int:
    """Slots a field takes: one, or one per element of an array (row by row from its first)."""
    count = 1
    for d in f.type.dims:
        count *= d
    return count


def _element_loops(f: Field) -> tuple[str, str, str]:
    """For an array field: the C loops over its elements, the element's subscripts, and its
    slot offset ("for (int i = 0; i < 3; ++i) for (int j = 0; j < 5; ++j) ", "[i][j]", "i * 5 + j")."""
    names = "ijk"[: len(f.type.dims)]
    loops = "".join(f"for (int {n} = 0; {n} < {d}; ++{n}) " for n, d in zip(names, f.type.dims))
    offset, stride = [], 1
    for n, d in reversed(list(zip(names, f.type.dims))):
        offset.insert(0, n if stride == 1 else f"{n} * {stride}")
        stride *= d
    return loops, "".join(f"[{n}]" for n in names), " + ".join(offset)


def _is_float(t: CType) -> bool:
    return (t.element if t.kind == "array" else t).kind == "float"


def _c_scalar(t: CType) -> str:
    t = t.element if t.kind == "array" else t
    return t.typedef or t.spelling


def sentence(doc: str) -> str:
    doc = doc[:1].upper() + doc[1:]
    return doc if doc.endswith(".") else doc + "."


def javadoc(doc: str, indent: str) -> list[str]:
    one = f"{indent}/** {' '.join(doc.split())} */"
    if len(one) <= 100:
        return [one]
    return [f"{indent}/**", *comment_lines(doc, indent + " * "), f"{indent} */"]


def enum_class(e: Enumeration) -> tuple[str, str]:
    name = class_name(e)
    status = e.typedef == "kvr_status"
    lines = [f"// {HEADER_NOTE}", "package io.kvrouter;", "", "/**"]
    lines += comment_lines(e.doc, " * ")
    lines.append(" *")
    lines += comment_lines(
        f"<p>{{@code {e.typedef}}}: the values of {{@code {e.map_name}}} ({{@code {e.prefix}*}}).", " * "
    )
    lines.append(" */")
    lines.append(f"public enum {name} {{")
    for v in e.values:
        lines += javadoc(sentence(v.doc), "  ")
        lines.append(f"  {v.name}({v.value}),")
    if status:
        lines += ["  /** A code newer than this binding (the exception still carries the number). */", "  UNKNOWN(-1),"]
    lines[-1] = lines[-1][:-1] + ";"
    lines += [
        "",
        "  private final int code;",
        "",
        f"  {name}(int code) {{",
        "    this.code = code;",
        "  }",
        "",
        "  /** The C value. */",
        "  public int code() {",
        "    return code;",
        "  }",
        "",
    ]
    if status:
        lines += [
            "  /** The status with this C value, or {@link #UNKNOWN}. */",
            f"  public static {name} of(int code) {{",
            f"    for ({name} value : values()) {{",
            "      if (value.code == code) return value;",
            "    }",
            "    return UNKNOWN;",
            "  }",
            "",
            '  /** The C name, as {@code kvr_status_str} gives it ("KVR_NOT_FOUND"). */',
            "  public String cName() {",
            "    return KvRouter.statusName(code);",
            "  }",
        ]
    else:
        lines += [
            "  /** The constant for a C value; IllegalArgumentException for one this binding does not know. */",
            f"  public static {name} of(int code) {{",
            f"    for ({name} value : values()) {{",
            "      if (value.code == code) return value;",
            "    }",
            f'    throw new IllegalArgumentException("no {name} with code " + code);',
            "  }",
        ]
    lines += ["}", ""]
    return f"{JAVA_DIR}/{name}.java", "\n".join(lines)


def abi_class(m: Model) -> str:
    major, minor, patch = m.version
    lines = [
        f"// {HEADER_NOTE}",
        "package io.kvrouter;",
        "",
        "/**",
        " * The header's constants and the long[] layout of each struct as it crosses JNI",
        " * (kvrouter_jni_abi.h has the same slots in C). A struct's class lists one index per value",
        " * field (arrays row by row), LEN slots in all; doubles travel as their raw bits.",
        " */",
        "final class Abi {",
        "  private Abi() {}",
        "",
        "  /** The header version the binding was generated from: it needs a library of this major.minor. */",
        f"  static final int VERSION_MAJOR = {major};",
        f"  static final int VERSION_MINOR = {minor};",
        f"  static final int VERSION_PATCH = {patch};",
        "",
    ]
    for f in m.flags:
        lines += comment_lines(f.doc, "  // ")
        for v in f.values:
            lines.append(f"  static final int {v.c_name[len('KVR_') :]} = {v.value:#x};")
        lines.append("")
    for c in m.constants:
        lines += comment_lines(c.doc, "  // ")
        java_value = "-1L" if c.value == 2**64 - 1 else str(c.value)
        java_type = "long" if c.bits == 64 else "int"
        lines.append(f"  static final {java_type} {c.c_name[len('KVR_') :]} = {java_value};")
    for s in m.structs:
        fields = value_fields(s)
        if not fields:
            continue
        lines += ["", f"  /** {{@code {s.name}}}. */", f"  static final class {plain_camel(s.name[len('kvr_') :])} {{"]
        lines.append(f"    private {plain_camel(s.name[len('kvr_') :])}() {{}}")
        lines.append("")
        index = 0
        for f in fields:
            if f.type.kind == "array":
                dims = "][".join(map(str, f.type.dims))
                lines.append(f"    /** The first of {slot_count(f)} slots: [{dims}], row by row. */")
            lines.append(f"    static final int {f.name.upper()} = {index};")
            index += slot_count(f)
        lines += [f"    static final int LEN = {index};", "  }"]
    lines += ["}", ""]
    return "\n".join(lines)


def jni_header(m: Model) -> str:
    lines = [
        f"/* {HEADER_NOTE}",
        " *",
        " * The JNI struct codecs: each struct's value fields to and from a jlong array, in the slots",
        " * of io.kvrouter.Abi. abi_decode_* leaves every other field (pointers, struct_size) as it",
        " * was: initialise the struct with its _init and sizeof first. */",
        "#ifndef KVROUTER_JNI_ABI_H",
        "#define KVROUTER_JNI_ABI_H",
        "",
        "#include <jni.h>",
        "#include <stdint.h>",
        "#include <string.h>",
        "",
        '#include "kvrouter.h"',
        "",
        "/* The header version these codecs (and io.kvrouter.Abi) were generated from. The slots are",
        " * only known to fit a header of the same major.minor. */",
        f"#define ABI_VERSION_MAJOR {m.version[0]}",
        f"#define ABI_VERSION_MINOR {m.version[1]}",
        f"#define ABI_VERSION_PATCH {m.version[2]}",
        "#if KVR_VERSION_MAJOR != ABI_VERSION_MAJOR || KVR_VERSION_MINOR != ABI_VERSION_MINOR",
        f'#error "kvrouter.h is not a {m.version[0]}.{m.version[1]}.x header, which kvrouter_jni_abi.h was generated from"',
        "#endif",
        "",
        "static inline jlong abi_double_bits(double d) {",
        "  jlong v;",
        "  memcpy(&v, &d, sizeof v);",
        "  return v;",
        "}",
        "",
        "static inline double abi_bits_double(jlong v) {",
        "  double d;",
        "  memcpy(&d, &v, sizeof d);",
        "  return d;",
        "}",
    ]
    for s in m.structs:
        fields = value_fields(s)
        if not fields:
            continue
        short = s.name[len("kvr_") :]
        prefix = f"ABI_{short.upper()}_"
        lines += ["", f"/* {s.name} */", "enum {"]
        index = 0
        for f in fields:
            lines.append(f"  {prefix}{f.name.upper()} = {index},")
            index += slot_count(f)
        lines += [f"  {prefix}LEN = {index}", "};", ""]
        lines.append(f"static inline void abi_encode_{short}(const {s.name} *c, jlong *v) {{")
        for f in fields:
            slot = f"{prefix}{f.name.upper()}"
            if f.type.kind == "array":
                loops, element, offset = _element_loops(f)
                lines.append(f"  {loops}v[{slot} + {offset}] = (jlong)c->{f.name}{element};")
            elif _is_float(f.type):
                lines.append(f"  v[{slot}] = abi_double_bits(c->{f.name});")
            else:
                lines.append(f"  v[{slot}] = (jlong)c->{f.name};")
        lines += ["}", ""]
        lines.append(f"static inline void abi_decode_{short}(const jlong *v, {s.name} *c) {{")
        for f in fields:
            slot = f"{prefix}{f.name.upper()}"
            if f.type.kind == "array":
                loops, element, offset = _element_loops(f)
                lines.append(f"  {loops}c->{f.name}{element} = ({_c_scalar(f.type)})v[{slot} + {offset}];")
            elif _is_float(f.type):
                lines.append(f"  c->{f.name} = abi_bits_double(v[{slot}]);")
            else:
                lines.append(f"  c->{f.name} = ({_c_scalar(f.type)})v[{slot}];")
        lines += ["}"]
    lines += ["", "#endif /* KVROUTER_JNI_ABI_H */", ""]
    return "\n".join(lines)


def generate(m: Model) -> dict[str, str]:
    files = dict(enum_class(e) for e in m.enumerations)
    files[f"{JAVA_DIR}/Abi.java"] = abi_class(m)
    files[JNI_HEADER] = clang_format(jni_header(m), JNI_HEADER)
    return files
