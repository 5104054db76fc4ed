"""The formatters the generated files go through, so that they read as the hand-written ones.

Each generated file is exactly what its language's formatter makes of it, run with the
repository's own configuration (never a user's): rustfmt from bindings/rust (rustfmt.toml),
gofmt, and clang-format 14 (Debian 12's, which .clang-format is written for) with the
repository's .clang-format. A formatter that is not installed leaves its file unformatted and
is recorded in UNFORMATTED: ffigen then refuses to write that file, and --check skips comparing
it, saying so (the binding's own suite still builds and tests it).
"""

from __future__ import annotations

import os
import shutil
import subprocess

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

# Generated files (relative paths) whose formatter is missing on this machine, with its name.
UNFORMATTED: dict[str, str] = {}


def _find(*names: str) -> str | None:
    for name in names:
        found = shutil.which(name) or (name if os.path.isabs(name) and os.path.exists(name) else None)
        if found:
            return found
    return None


def _run(tool: str | None, tool_name: str, args: list[str], source: str, path: str, cwd: str) -> str:
    if tool is None:
        UNFORMATTED[path] = tool_name
        return source
    done = subprocess.run([tool, *args], input=source, capture_output=True, text=True, cwd=cwd)
    if done.returncode != 0:
        raise SystemExit(f"ffigen: {tool_name} refused the generated {path}:\n{done.stderr}")
    return done.stdout


def rustfmt(source: str, path: str) -> str:
    # From bindings/rust, so that its rustfmt.toml (and no user's) is the configuration.
    tool = _find("rustfmt", os.path.expanduser("~/.cargo/bin/rustfmt"))
    return _run(tool, "rustfmt", ["--edition", "2021"], source, path, os.path.join(ROOT, "bindings", "rust"))


def gofmt(source: str, path: str) -> str:
    tool = _find("gofmt", "/usr/local/go/bin/gofmt")
    return _run(tool, "gofmt", [], source, path, ROOT)


def clang_format(source: str, path: str) -> str:
    tool = _find("clang-format-14", "clang-format")
    return _run(tool, "clang-format", [f"--assume-filename={os.path.join(ROOT, path)}"], source, path, ROOT)
