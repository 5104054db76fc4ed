"""C++: src/capi/abi_tables.h, facts of the header the C layer checks callers against.

Where every field of a versioned struct ends (the only sizes a caller's struct can have, from
its first released layout on) and which bits each flags field may hold. The values are
offsetof/sizeof expressions and flag macros, so the compiler computes them from the header
itself; only the lists come from here.
"""

from __future__ import annotations

from formatting import clang_format
from model import Model
from names import HEADER_NOTE, plain_camel

OUT = "src/capi/abi_tables.h"


def generate(m: Model) -> dict[str, str]:
    lines = [
        f"// {HEADER_NOTE}",
        "//",
        "// Facts of include/kvrouter.h that the C layer checks callers against (versioned.h):",
        "// where each field of a versioned struct ends, i.e. the sizes a caller's struct can have,",
        "// and the bits each flags field may hold.",
        "#pragma once",
        "",
        "#include <cstddef>",
        "#include <cstdint>",
        "",
        '#include "kvrouter.h"',
        "",
        "namespace kvrouter::capi {",
        "",
        "// The end of every field of T, in order: a caller's struct_size below sizeof(T) must be one",
        "// of them (a size inside a field would mix the caller's bytes with the defaults).",
        "template <typename T>",
        "struct FieldEnds;",
    ]
    for s in m.structs:
        if not s.versioned:
            continue
        lines += ["", "template <>", f"struct FieldEnds<{s.name}> {{", "  static constexpr size_t kEnds[] = {"]
        lines += [f"      offsetof({s.name}, {f.name}) + sizeof({s.name}::{f.name})," for f in s.fields]
        lines += ["  };", "};"]
    lines += ["", "// The flag bits this library knows, per group of KVR_*_ flags."]
    for group in m.flags:
        word = group.name[len("KVR_") : -len("_*")]
        mask = " | ".join(v.c_name for v in group.values)
        lines.append(f"inline constexpr uint32_t kKnown{plain_camel(word)}Flags = {mask};")
    lines += ["", "}  // namespace kvrouter::capi", ""]
    return {OUT: clang_format("\n".join(lines), OUT)}
