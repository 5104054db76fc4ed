"""Python: _abi.py, _native.pyi and kvrouter_abi_tables.h of bindings/python, from the header.

The Python binding's extension module (bindings/python/native/kvrouter_native.c) includes
kvrouter.h itself and passes each struct's compiled size (sizeof) to its _init. Three files are
generated here:

- _abi.py, what Python code and type checkers see of the header: one IntEnum per X-macro list
  (with the list's descriptions), the flags and the other constants, the header version, and
  each struct's fields and size as clang laid them out.
- _native.pyi, the extension's type stubs: its result types (struct sequences of the RESULTS
  structs' value fields) and, as written here, its handles and functions.
- kvrouter_abi_tables.h, the lists the extension builds its field tables from: for every struct,
  its fields with their kind (U32, F64, PTR, ...), as X-macros. Offsets and sizes are not in it:
  the extension computes them with offsetof/sizeof from the header it is compiled against, so
  only the lists come from here (as with src/capi/abi_tables.h). It also lists each X-macro
  list with the prefix of its constants, the flags and the constants.

At import the package compares the enumerations, flags and constants the extension compiled
with _abi.py's and refuses to load if the two were made from different headers; the binding's
tests compare the extension's struct tables (offsetof, sizeof) with _abi.STRUCTS.
"""

from __future__ import annotations

from model import CType, Model
from names import HEADER_NOTE, one_line, type_name

OUT = "bindings/python/src/kvrouter/_abi.py"
TABLES = "bindings/python/native/kvrouter_abi_tables.h"
STUBS = "bindings/python/src/kvrouter/_native.pyi"

# The structs the extension returns to Python as struct sequences (its result_types table; the
# binding's tests check that the two lists agree).
RESULTS = [
    "kvr_route_result",
    "kvr_candidate",
    "kvr_overlap",
    "kvr_match",
    "kvr_potential_load",
    "kvr_metrics",
    "kvr_route_signals",
    "kvr_prefill_result",
    "kvr_ingest_stats",
]

# The stubs of what the extension defines by hand (its handles and functions).
_STUB_TAIL = """
_Fields = Optional[Dict[str, Any]]
_R = TypeVar("_R", bound="Router")
_Ints = Any  # a sequence of ints or an integer buffer
_Str = Optional[str]
_Buffer = Any  # bytes-like

class Request:
    def __init__(self, fields: _Fields, request_id: _Str, lora_name: _Str, cache_namespace: _Str,
                 mm_hashes: Optional[Sequence[int]], mm_counts: Optional[Sequence[int]],
                 allowed: Optional[Sequence[int]]) -> None: ...

class Hints:
    def __init__(self, fields: _Fields, session_id: _Str) -> None: ...

class Router:
    @property
    def closed(self) -> bool: ...
    def __new__(cls: Type[_R], fields: _Fields = ...) -> _R: ...
    def close(self) -> None: ...
    def _add_worker(self, fields: _Fields) -> None: ...
    def _update_worker(self, fields: _Fields) -> None: ...
    def _remove_worker(self, worker_id: int) -> None: ...
    def _apply_stored(self, fields: _Fields, block_hashes: _Ints, local_hashes: _Ints, token_ids: _Ints,
                     lora_name: _Str, cache_namespace: _Str, mm_hashes: Optional[Sequence[int]],
                     mm_counts: Optional[Sequence[int]]) -> None: ...
    def _apply_removed(self, fields: _Fields, block_hashes: _Ints) -> None: ...
    def _apply_cleared(self, worker_id: int, dp_rank: int, event_id: int) -> None: ...
    def _apply_event_batch(self, data: _Buffer) -> None: ...
    def _set_replica_publisher(self, replica_id: str, publish: Optional[Callable[[bytes], Any]]) -> None: ...
    def _apply_replica_event(self, data: _Buffer) -> None: ...
    def _replica_heartbeat(self, interval_ms: int) -> None: ...
    def _expire_replicas(self, timeout_seconds: float) -> int: ...
    def find_best_match(self, tokens: _Ints, /, options: Optional[RequestOptions] = None, *,
                        request_id: _Str = None) -> RouteResult: ...
    @overload
    def _find_best_match(self, tokens: _Ints, request: Optional[Request], request_id: _Str,
                         max_candidates: Literal[0]) -> RouteResult: ...
    @overload
    def _find_best_match(self, tokens: _Ints, request: Optional[Request], request_id: _Str,
                         max_candidates: int) -> Tuple[RouteResult, List[Candidate], int]: ...
    def _time_find_best_match(self, tokens: _Ints, request: Optional[Request], request_id: _Str) -> int: ...
    def _overlap_scores(self, tokens: _Ints, request: Optional[Request]) -> List[Overlap]: ...
    def _overlap_scores_hashed(self, hashes: _Ints, request: Optional[Request]) -> List[Overlap]: ...
    def _find_matches(self, hashes: _Ints) -> List[Match]: ...
    def _potential_loads(self, tokens: _Ints, request: Optional[Request]) -> List[PotentialLoad]: ...
    def _add_request(self, tokens: _Ints, worker_id: int, dp_rank: int, request: Optional[Request],
                    request_id: _Str) -> None: ...
    def mark_prefill_completed(self, request_id: str) -> None: ...
    def _record_output(self, request_id: str, output_tokens: int) -> None: ...
    def free_request(self, request_id: str) -> None: ...
    def _close_queue(self) -> int: ...
    def _expire_requests(self) -> int: ...
    def _snapshot(self) -> bytes: ...
    def _restore(self, data: _Buffer) -> None: ...
    def _get_metrics(self) -> Metrics: ...
    def _metrics_prometheus(self) -> str: ...
    def _preview_route(self, tokens: _Ints, request: Optional[Request], hints: Optional[Hints]) -> RouteSignals: ...
    def _plan_route(self, tokens: _Ints, request: Optional[Request], hints: Optional[Hints],
                   previewed: Optional[RouteSignals], request_id: _Str) -> RouteSignals: ...
    def _commit_route(self, request_id: str) -> None: ...
    def _abort_route(self, request_id: str) -> bool: ...
    def _set_plan_deadline(self, seconds: float) -> None: ...
    def _set_time(self, ns: int) -> None: ...
    def _expire_plans(self) -> int: ...
    def _session_binding(self, session_id: str) -> Tuple[int, int]: ...
    def _close_session(self, session_id: str) -> None: ...
    def _reclaim_sessions(self) -> int: ...
    def _state_digest(self) -> int: ...
    def _index_digest(self) -> int: ...

class Disagg:
    @property
    def closed(self) -> bool: ...
    def __init__(self, prefill: _Fields, decode: _Fields, options: _Fields) -> None: ...
    def close(self) -> None: ...
    def pool_router(self, prefill: bool, cls: Type[_R]) -> _R: ...
    def route_prefill(self, tokens: _Ints, request: Optional[Request], hints: Optional[Hints],
                      request_id: _Str) -> PrefillResult: ...
    def route_decode(self, tokens: _Ints, request: Optional[Request], hints: Optional[Hints],
                     remote_prefill: bool, request_id: _Str) -> RouteSignals: ...
    def prefill_worker_busy(self, tokens: _Ints, request: Optional[Request], threshold: float) -> bool: ...

class Ingest:
    @property
    def closed(self) -> bool: ...
    def __init__(self, router: Router, fields: _Fields) -> None: ...
    def close(self) -> None: ...
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def listen(self, endpoint: str) -> Tuple[int, str]: ...
    def source_endpoint(self, source_id: int) -> str: ...
    def add_engine_worker(self, fields: _Fields, endpoint: str, topic: _Str, replay_endpoint: _Str) -> int: ...
    def remove_engine_worker(self, worker_id: int, clear_index: bool) -> None: ...
    def subscribe_nats(self, url: str, subject: str) -> int: ...
    def subscribe_jetstream(self, fields: _Fields, url: str, stream: str, subject: str, durable: _Str) -> int: ...
    def relay_jetstream(self, fields: _Fields, url: str, stream: str, subject: str, durable: _Str) -> int: ...
    def sync_replicas(self, url: str, subject: str, replica_id: str) -> int: ...
    def get_stats(self, source_id: int) -> IngestStats: ...
    def metrics_prometheus(self) -> str: ...

class EventBatch:
    @property
    def closed(self) -> bool: ...
    def close(self) -> None: ...
    def __len__(self) -> int: ...
    def add_stored(self, fields: _Fields, block_hashes: _Ints, local_hashes: _Ints, token_ids: _Ints,
                   lora_name: _Str, cache_namespace: _Str, mm_hashes: Optional[Sequence[int]],
                   mm_counts: Optional[Sequence[int]]) -> None: ...
    def add_removed(self, fields: _Fields, block_hashes: _Ints) -> None: ...
    def add_cleared(self, worker_id: int, dp_rank: int, event_id: int) -> None: ...
    def set_publish_time(self, unix_ns: int) -> None: ...
    def encode(self) -> bytes: ...
    def clear(self) -> None: ...

class Publisher:
    @property
    def closed(self) -> bool: ...
    def __init__(self, endpoint: str) -> None: ...
    def close(self) -> None: ...
    def send(self, batch: EventBatch) -> None: ...
    def send_encoded(self, data: _Buffer) -> None: ...

def version() -> int: ...
def version_string() -> str: ...
def status_str(status: int) -> str: ...
def tier_from_medium(medium: _Str) -> int: ...
def compute_block_hashes(tokens: _Ints, block_size: int, flags: int, lora_name: _Str, cache_namespace: _Str,
                         mm_hashes: Optional[Sequence[int]], mm_counts: Optional[Sequence[int]]) -> List[int]: ...
def compute_sequence_hashes(hashes: _Ints) -> List[int]: ...
def defaults(struct: str) -> Dict[str, Any]: ...
def lower(struct: str, fields: _Fields) -> Dict[str, Any]: ...
def abi() -> Dict[str, Any]: ...
def close_publishers_at_exit() -> None: ...
def setup(error_base: type, error_classes: Dict[int, type], closed_error: type,
          enum_classes: Dict[str, type], hashed_prompt: type) -> None: ...
"""


def _wrap(text: str, indent: str, width: int = 100) -> list[str]:
    import textwrap

    return textwrap.wrap(
        one_line(text), width=width - len(indent), initial_indent=indent, subsequent_indent=indent,
        break_long_words=False, break_on_hyphens=False,
    )


def _py_str(text: str) -> str:
    return repr(one_line(text))


def generate(m: Model) -> dict[str, str]:
    major, minor, patch = m.version
    out = [
        f'"""The ABI of include/kvrouter.h seen from Python: enumerations, flags, constants, layouts.',
        "",
        HEADER_NOTE,
        "Regenerate with `python3 tools/ffigen/ffigen.py` (tools/ffigen/gen_python.py).",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "import enum",
        "from typing import Dict, Tuple, Type",
        "",
        "#: The header version this file was generated from; the library's major.minor must match.",
        f"ABI_VERSION: Tuple[int, int, int] = ({major}, {minor}, {patch})",
    ]
    names = []
    for e in m.enumerations:
        name = type_name(e.typedef)
        names.append(name)
        out += ["", ""]
        out.append(f"class {name}(enum.IntEnum):")
        doc = e.doc or f"The values of {e.typedef}."
        doc_lines = _wrap(f"{doc} (C: {e.typedef}, {e.prefix}*.)", "    ")
        doc_lines[0] = '    """' + doc_lines[0].lstrip()
        out += doc_lines
        out.append('    """')
        out.append("")
        for v in e.values:
            out += _wrap(v.doc, "    #: ") if v.doc else []
            out.append(f"    {v.name} = {v.value}")
        out += [
            "",
            "    @property",
            "    def description(self) -> str:",
            '        """The header\'s description of this value (its X-macro list\'s third column)."""',
            f"        return _DESCRIPTIONS[{e.typedef!r}][self.value]",
        ]
    out += ["", ""]
    out.append("#: Each enumeration's values with their descriptions, from the X-macro lists.")
    out.append("_DESCRIPTIONS: Dict[str, Dict[int, str]] = {")
    for e in m.enumerations:
        out.append(f"    {e.typedef!r}: {{")
        for v in e.values:
            out.append(f"        {v.value}: {_py_str(v.doc)},")
        out.append("    },")
    out.append("}")
    out += ["", "#: The X-macro lists as (C typedef, IntEnum) pairs, in the header's order."]
    out.append("ENUMERATIONS: Tuple[Tuple[str, Type[enum.IntEnum]], ...] = (")
    for e in m.enumerations:
        out.append(f"    ({e.typedef!r}, {type_name(e.typedef)}),")
    out.append(")")
    out += ["", "# Flags (unsigned macros, combined with |)."]
    flag_names = []
    for f in m.flags:
        for v in f.values:
            out += _wrap(v.doc, "#: ") if v.doc else []
            out.append(f"{v.c_name[len('KVR_'):]} = {v.value:#x}")
            flag_names.append(v.c_name)
    out += ["", "# Other constants."]
    for c in m.constants:
        out += _wrap(c.doc, "#: ") if c.doc else []
        out.append(f"{c.c_name[len('KVR_'):]} = {c.value}")
    out += ["", "#: The flags and constants by C name (what the import check compares with the extension's)."]
    out.append("CONSTANTS: Dict[str, int] = {")
    for name in flag_names:
        out.append(f"    {name!r}: {name[len('KVR_'):]},")
    for c in m.constants:
        out.append(f"    {c.c_name!r}: {c.c_name[len('KVR_'):]},")
    out.append("}")
    out += ["", "#: Every struct's fields in order, as (name, offset, size), and its size, as clang laid it out."]
    out.append("STRUCTS: Dict[str, Tuple[int, Tuple[Tuple[str, int, int], ...]]] = {")
    for s in m.structs:
        out.append(f"    {s.name!r}: (")
        out.append(f"        {s.size},")
        out.append("        (")
        for f in s.fields:
            out.append(f"            ({f.name!r}, {f.offset}, {f.size}),")
        out.append("        ),")
        out.append("    ),")
    out.append("}")
    out += ["", "__all__ = ["]
    out += [f"    {n!r}," for n in names + ["ABI_VERSION", "ENUMERATIONS", "CONSTANTS", "STRUCTS"]]
    out += [f"    {name[len('KVR_'):]!r}," for name in flag_names]
    out += [f"    {c.c_name[len('KVR_'):]!r}," for c in m.constants]
    out += ["]", ""]
    return {OUT: "\n".join(out), TABLES: _tables(m), STUBS: _stubs(m)}


def _stubs(m: Model) -> str:
    enums = {e.typedef: type_name(e.typedef) for e in m.enumerations}
    lines = [
        '"""Type stubs of kvrouter._native, the CPython extension (native/kvrouter_native.c).',
        "",
        HEADER_NOTE,
        "",
        "The result types are struct sequences (named tuples made in C) of the C structs' value",
        "fields, in order; an enumeration-typed field holds its IntEnum when the value is known.",
        '"""',
        "",
        "from typing import Any, Callable, Dict, List, Literal, Optional, Sequence, Tuple, Type, TypeVar, Union, overload",
        "",
        "from ._abi import "
        + ", ".join(sorted({enums[f.type.typedef] for r in RESULTS for f in m.struct(r).fields if f.type.typedef in enums})),
        "from ._options import RequestOptions",
    ]
    for name in RESULTS:
        s = m.struct(name)
        lines += ["", "", f"class {type_name(name)}(Tuple[Any, ...]):"]
        doc = one_line(s.doc).split(". ")[0].rstrip(".") if s.doc else name
        lines += [f'    """{doc} ({name})."""', ""]
        for f in s.fields:
            if f.name == "struct_size" or f.name.startswith("reserved") or _kind(f.type) == "PTR":
                continue
            if _kind(f.type) == "TEXT":
                t = "str"
            elif f.type.kind == "array":
                t = "Tuple[Tuple[int, ...], ...]" if len(f.type.dims) == 2 else "Tuple[int, ...]"
            elif f.type.typedef in enums:
                t = f"Union[{enums[f.type.typedef]}, int]"
            else:
                t = "float" if f.type.kind == "float" else "int"
            lines += ["    @property", f"    def {f.name}(self) -> {t}: ..."]
    return "\n".join(lines) + "\n" + _STUB_TAIL


def _kind(t: CType) -> str:
    """How the extension reads and writes a field: its C type as one word."""
    if t.kind == "array":
        if t.element.spelling == "char" and len(t.dims) == 1:
            return "TEXT"  # a NUL-terminated string in a fixed buffer: a Python str
        element = _kind(t.element)
        if element != "U64":
            raise SystemExit(f"ffigen: gen_python knows arrays of uint64_t and char only, not {t.spelling}")
        return "U64_ARRAY"
    if t.kind in ("pointer", "function_pointer"):
        return "PTR"
    if t.kind == "float" and t.bits == 64:
        return "F64"
    if t.kind == "int" and t.bits in (32, 64):
        return f"{'I' if t.signed else 'U'}{t.bits}"
    raise SystemExit(f"ffigen: gen_python has no field kind for {t.spelling}")


def _macro(name: str, entries: list[str]) -> list[str]:
    """#define NAME \\ with one entry per line, the backslashes aligned."""
    head = f"#define {name}"
    width = max(len(head), *(len(e) + 2 for e in entries)) + 1
    out = [head.ljust(width) + "\\"]
    for i, e in enumerate(entries):
        line = "  " + e
        out.append(line if i == len(entries) - 1 else line.ljust(width) + "\\")
    return out


def _tables(m: Model) -> str:
    lines = [
        f"/* {HEADER_NOTE}",
        " * Regenerate with `python3 tools/ffigen/ffigen.py` (tools/ffigen/gen_python.py).",
        " *",
        " * The lists the Python extension (kvrouter_native.c) builds its tables from. Offsets and",
        " * sizes are not here: the extension takes them from the header with offsetof and sizeof. */",
        "#ifndef KVROUTER_PY_ABI_TABLES_H",
        "#define KVROUTER_PY_ABI_TABLES_H",
        "",
        '#include "kvrouter.h"',
        "",
        "/* The structs that begin with struct_size (initialised by their sized _init): S(struct) */",
    ]
    lines += _macro("KVRPY_VERSIONED_STRUCTS(S)", [f"S({s.name})" for s in m.structs if s.versioned])
    lines += ["", "/* The fixed-layout array elements: S(struct) */"]
    lines += _macro("KVRPY_FIXED_STRUCTS(S)", [f"S({s.name})" for s in m.structs if not s.versioned])
    lines += [
        "",
        "/* Each struct's fields in order: F(struct, field, kind, enumeration typedef or 0, row)",
        " * where row is the length of a two-dimensional array's rows (0 otherwise). */",
    ]
    enum_typedefs = {e.typedef for e in m.enumerations}
    for s in m.structs:
        entries = []
        for f in s.fields:
            enum = f'"{f.type.typedef}"' if f.type.typedef in enum_typedefs else "0"
            row = f.type.dims[-1] if f.type.kind == "array" and len(f.type.dims) == 2 else 0
            entries.append(f"F({s.name}, {f.name}, {_kind(f.type)}, {enum}, {row})")
        lines += _macro(f"KVRPY_FIELDS_{s.name}(F)", entries)
    lines += [
        "",
        "/* Each X-macro list's ENTRY(name, value, description), which names the enumeration",
        " * constant the list made (the prefixes differ from list to list). */",
    ]
    for e in m.enumerations:
        lines.append(f"#define KVRPY_ENUM_{e.typedef}(name, value, description) {{#name, {e.prefix}##name}},")
    lines += ["", "/* The X-macro lists: E(typedef, list, ENTRY) */"]
    lines += _macro("KVRPY_ENUMERATIONS(E)", [f"E({e.typedef}, {e.map_name}, KVRPY_ENUM_{e.typedef})" for e in m.enumerations])
    lines += ["", "/* The flags and the other constants: C(name) */"]
    names = [v.c_name for f in m.flags for v in f.values] + [c.c_name for c in m.constants]
    lines += _macro("KVRPY_CONSTANTS(C)", [f"C({n})" for n in names])
    lines += ["", "#endif /* KVROUTER_PY_ABI_TABLES_H */", ""]
    return "\n".join(lines)
