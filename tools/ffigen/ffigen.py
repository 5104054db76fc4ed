#!/usr/bin/env python3
"""ffigen: the bindings' FFI layers, generated from include/kvrouter.h.

Reads the header through clang (model.py) and writes, for each binding, the part that only
restates the header:

  bindings/rust/kvrouter-sys/src/lib.rs          every declaration, with compile-time layout checks
  bindings/java/src/main/java/io/kvrouter/Abi.java   constants and struct layouts (long[] slots)
  bindings/java/src/main/java/io/kvrouter/<Enum>.java  one Java enum per X-macro list
  bindings/java/src/main/c/kvrouter_jni_abi.h   the JNI struct codecs (C struct <-> long[])
  bindings/go/abi_gen.go                        typed enumerations and struct converters
  bindings/python/src/kvrouter/_abi.py          IntEnums, flags, constants and struct layouts
  bindings/python/native/kvrouter_abi_tables.h  the Python extension's field and constant lists
  src/capi/abi_tables.h                         the library's own checks: field ends, flag masks

The safe layers (bindings/*/ outside these files) stay hand-written. The output is committed;
`ffigen.py --check` regenerates into memory and fails on any difference, which CI runs.

Usage: tools/ffigen/ffigen.py [--check] [--clang clang-14]
"""

from __future__ import annotations

import argparse
import difflib
import os
import pathlib
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import formatting  # noqa: E402
import gen_capi  # noqa: E402
import gen_go  # noqa: E402
import gen_java  # noqa: E402
import gen_python  # noqa: E402
import gen_rust  # noqa: E402
import model  # noqa: E402

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def project_version() -> tuple[int, int, int]:
    """The version in the top-level CMakeLists.txt (the header's kvrouter_version.h is made from it)."""
    text = pathlib.Path(os.path.join(ROOT, "CMakeLists.txt")).read_text(encoding="utf-8")
    m = re.search(r"project\(kvrouter VERSION (\d+)\.(\d+)\.(\d+)", text)
    if not m:
        raise SystemExit("ffigen: no project(kvrouter VERSION x.y.z) in CMakeLists.txt")
    return tuple(int(x) for x in m.groups())


def version_header(directory: str, version: tuple[int, int, int]) -> None:
    """Writes kvrouter_version.h as CMake would (include/kvrouter_version.h.in)."""
    template = pathlib.Path(os.path.join(ROOT, "include", "kvrouter_version.h.in")).read_text(encoding="utf-8")
    text = (
        template.replace("@PROJECT_VERSION_MAJOR@", str(version[0]))
        .replace("@PROJECT_VERSION_MINOR@", str(version[1]))
        .replace("@PROJECT_VERSION_PATCH@", str(version[2]))
        .replace("@PROJECT_VERSION@", ".".join(map(str, version)))
    )
    with open(os.path.join(directory, "kvrouter_version.h"), "w", encoding="utf-8") as f:
        f.write(text)


def check_layouts(m: model.Model) -> None:
    """The rules that make struct_size name exactly one layout (docs/api-stability.md)."""
    problems = []
    for s in m.structs:
        last = s.fields[-1]
        if last.offset + last.size != s.size:
            problems.append(
                f"{s.name} ends in {s.size - last.offset - last.size} bytes of padding: an "
                "appended field could then leave its size unchanged; make the padding an "
                "explicit reserved field"
            )
        for a, b in zip(s.fields, s.fields[1:]):
            if a.offset + a.size != b.offset:
                problems.append(f"{s.name} has padding between {a.name} and {b.name}")
    if problems:
        raise SystemExit("ffigen: " + "\n  ".join(problems))


def outputs(m: model.Model) -> dict[str, str]:
    files = {}
    files.update(gen_capi.generate(m))
    files.update(gen_rust.generate(m))
    files.update(gen_java.generate(m))
    files.update(gen_go.generate(m))
    files.update(gen_python.generate(m))
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if any output differs")
    parser.add_argument("--clang", default=os.environ.get("KVR_CLANG", "clang-14"))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        version_header(tmp, project_version())
        m = model.read(os.path.join(ROOT, "include", "kvrouter.h"), tmp, args.clang)
    check_layouts(m)

    stale = []
    for rel, text in sorted(outputs(m).items()):
        if rel in formatting.UNFORMATTED:
            tool = formatting.UNFORMATTED[rel]
            if not args.check:
                raise SystemExit(f"ffigen: {tool} is not installed: cannot write {rel}")
            print(f"ffigen: {tool} is not installed: {rel} not compared")
            continue
        path = os.path.join(ROOT, rel)
        old = pathlib.Path(path).read_text(encoding="utf-8") if os.path.exists(path) else None
        if old == text:
            continue
        if args.check:
            stale.append(rel)
            diff = difflib.unified_diff(
                (old or "").splitlines(True), text.splitlines(True), f"{rel} (committed)", f"{rel} (generated)"
            )
            sys.stdout.writelines(list(diff)[:60])
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            print(f"ffigen: wrote {rel}")
    if stale:
        print(f"ffigen: {len(stale)} generated file(s) differ from include/kvrouter.h: run tools/ffigen/ffigen.py and commit")
        return 1
    if args.check:
        print("ffigen: every generated file matches include/kvrouter.h")
    return 0


if __name__ == "__main__":
    sys.exit(main())
