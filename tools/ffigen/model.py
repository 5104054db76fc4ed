"""The C ABI of include/kvrouter.h as data, read through clang.

clang does the C parsing: `-ast-dump=json` gives every declaration (structs, fields, enums,
functions, typedefs, with the comments attached to them), `-fdump-record-layouts-simple` gives
each struct's size and field offsets as the compiler lays them out, and `-dM -E` gives the macros
(the X-macro lists with their descriptions, and the few constants that are not enum values).
Nothing here guesses a layout or re-implements C's rules.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import tempfile
from dataclasses import dataclass, field

# ---- The model ---------------------------------------------------------------------------------


@dataclass
class CType:
    """A C type as the ABI uses it: a scalar, a pointer to one, a fixed array, a callback."""

    spelling: str  # as written in the header ("const uint64_t *", "kvr_tier", "uint64_t[3][5]")
    kind: str  # "int", "float", "pointer", "array", "function_pointer", "opaque", "void"
    bits: int = 0  # int and float: width
    signed: bool = False  # int
    typedef: str = ""  # a kvr_* typedef of an integer (kvr_tier, kvr_status), else ""
    pointee: CType | None = None  # pointer
    const: bool = False  # pointer: to const
    dims: tuple[int, ...] = ()  # array
    element: CType | None = None  # array


@dataclass
class Field:
    name: str
    type: CType
    offset: int  # bytes
    size: int
    doc: str


@dataclass
class Struct:
    name: str
    size: int
    align: int
    fields: list[Field]
    doc: str

    @property
    def versioned(self) -> bool:
        """Begins with struct_size: initialised by kvr_<name>_init with the caller's size."""
        return bool(self.fields) and self.fields[0].name == "struct_size"


@dataclass
class Value:
    name: str  # without the enumeration's prefix: "HOST_PINNED"
    c_name: str  # "KVR_TIER_HOST_PINNED"
    value: int
    doc: str


@dataclass
class Enumeration:
    """One X-macro list (KVR_TIER_MAP ...): a typedef'd integer and its named values."""

    map_name: str  # "KVR_TIER_MAP"
    typedef: str  # "kvr_tier"
    prefix: str  # "KVR_TIER_"
    values: list[Value]
    doc: str


@dataclass
class Flags:
    """A set of bit flags (an enum of the header without an X-macro list)."""

    name: str  # "kvr_router_flag"
    values: list[Value]  # name is the full C name here
    doc: str


@dataclass
class Constant:
    c_name: str
    value: int
    bits: int  # 32 or 64
    signed: bool
    doc: str


@dataclass
class Param:
    name: str
    type: CType


@dataclass
class Function:
    name: str
    result: CType
    params: list[Param]
    doc: str


@dataclass
class Callback:
    name: str  # kvr_replica_publish_fn
    result: CType
    params: list[CType]
    doc: str


@dataclass
class Model:
    version: tuple[int, int, int]
    enumerations: list[Enumeration]
    flags: list[Flags]
    constants: list[Constant]  # enum values outside lists and flags, and integer macros
    opaque: list[str]
    structs: list[Struct]
    callbacks: list[Callback]
    functions: list[Function]
    integer_typedefs: dict[str, CType] = field(default_factory=dict)  # kvr_tier -> uint32_t

    def struct(self, name: str) -> Struct:
        return next(s for s in self.structs if s.name == name)


# ---- Reading it --------------------------------------------------------------------------------

_SCALARS = {
    "uint8_t": ("int", 8, False),
    "uint16_t": ("int", 16, False),
    "uint32_t": ("int", 32, False),
    "uint64_t": ("int", 64, False),
    "int8_t": ("int", 8, True),
    "int16_t": ("int", 16, True),
    "int32_t": ("int", 32, True),
    "int64_t": ("int", 64, True),
    "size_t": ("int", 64, False),
    "int": ("int", 32, True),
    "char": ("int", 8, True),
    "double": ("float", 64, True),
    "float": ("float", 32, True),
}


def _clang(clang: str, args: list[str], source: str, include_dirs: list[str]) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".c", delete=False) as f:
        f.write(source)
        path = f.name
    try:
        cmd = [clang, "-x", "c", "-std=c11", *args, *[f"-I{d}" for d in include_dirs], path]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"ffigen: {' '.join(cmd)} failed:\n{done.stderr}")
        return done.stdout
    finally:
        os.unlink(path)


class _Reader:
    def __init__(self, header: str, version_dir: str, clang: str):
        self.header = header
        self.raw = pathlib.Path(header).read_bytes()  # clang's offsets count bytes
        self.text = self.raw.decode("utf-8")
        self.dirs = [os.path.dirname(os.path.abspath(header)), version_dir]
        self.clang = clang
        self.typedefs: dict[str, str] = {}  # kvr_tier -> "uint32_t", kvr_router_options -> struct
        self.records: dict[str, dict] = {}

    # Comments come straight from the header's text, by the offsets clang gives.
    def comment(self, node: dict) -> str:
        for inner in node.get("inner", []):
            if inner["kind"] == "FullComment":
                begin = inner["range"]["begin"].get("offset")
                end = inner["range"]["end"].get("offset")
                if begin is None or end is None:
                    return ""
                return _clean_comment(self.raw[begin:end].decode("utf-8"))
        return ""

    def ctype(self, spelling: str) -> CType:
        s = spelling.strip()
        m = re.fullmatch(r"(.*?)\s*((?:\[\d+\])+)", s)
        if m:
            dims = tuple(int(d) for d in re.findall(r"\[(\d+)\]", m.group(2)))
            return CType(s, "array", dims=dims, element=self.ctype(m.group(1)))
        if re.fullmatch(r".*\(\*\)\(.*\)", s):
            return CType(s, "function_pointer")
        if s.endswith("*"):
            inner = s[:-1].strip()
            const = inner.startswith("const ")
            pointee = self.ctype(inner[len("const ") :] if const else inner)
            return CType(s, "pointer", pointee=pointee, const=const, bits=64)
        if s == "void":
            return CType(s, "void")
        if s in _SCALARS:
            kind, bits, signed = _SCALARS[s]
            return CType(s, kind, bits=bits, signed=signed)
        if s in self.typedefs and self.typedefs[s] in _SCALARS:
            base = self.ctype(self.typedefs[s])
            base.spelling, base.typedef = s, s
            return base
        if s.startswith("kvr_") or s.startswith("struct kvr_"):
            return CType(s.replace("struct ", ""), "opaque")
        raise SystemExit(f"ffigen: no mapping for the C type '{s}'")

    def read(self) -> Model:
        ast = json.loads(
            _clang(
                self.clang,
                ["-fsyntax-only", "-fparse-all-comments", "-Xclang", "-ast-dump=json"],
                '#include "kvrouter.h"\n',
                self.dirs,
            )
        )
        decls = [d for d in ast["inner"] if d.get("name", "").lower().startswith("kvr_")]
        decls += [d for d in ast["inner"] if d["kind"] == "EnumDecl" and "name" in d]
        for d in decls:
            if d["kind"] == "TypedefDecl":
                self.typedefs[d["name"]] = d["type"]["qualType"]
            elif d["kind"] == "RecordDecl":
                self.records[d["name"]] = d
        macros = self.macros()
        lists = self.x_lists(macros)
        enumerations, flags, constants = self.enums(ast, lists, macros)
        structs = self.structs()
        opaque = sorted(
            n
            for n, t in self.typedefs.items()
            if t == f"struct {n}" and not self.records.get(n, {}).get("completeDefinition")
        )
        opaque = [n for n in self.declaration_order(opaque)]
        return Model(
            version=self.version(macros),
            enumerations=enumerations,
            flags=flags,
            constants=constants,
            opaque=opaque,
            structs=structs,
            callbacks=self.callbacks(ast),
            functions=self.functions(ast),
            integer_typedefs={n: self.ctype(n) for n, t in self.typedefs.items() if t in _SCALARS},
        )

    def declaration_order(self, names: list[str]) -> list[str]:
        return sorted(names, key=lambda n: self.text.find(f"typedef struct {n} {n};"))

    def macros(self) -> dict[str, str]:
        out = _clang(self.clang, ["-dM", "-E"], '#include "kvrouter.h"\n', self.dirs)
        macros = {}
        for line in out.splitlines():
            m = re.match(r"#define (KVR_\w+)(\(X\))? (.*)", line)
            if m:
                macros[m.group(1)] = m.group(3)
        return macros

    def x_lists(self, macros: dict[str, str]) -> dict[str, list[tuple[str, int, str]]]:
        lists = {}
        for name, body in macros.items():
            if name.endswith("_MAP"):
                entries = re.findall(r'X\((\w+), (-?\w+), "((?:[^"\\]|\\.)*)"\)', body)
                # The descriptions are C string literals: their escapes are C's, not the text's.
                lists[name] = [(n, int(v, 0), re.sub(r"\\(.)", r"\1", d)) for n, v, d in entries]
        return lists

    def enums(self, ast: dict, lists: dict, macros: dict):
        enumerations, constants = [], []
        for d in ast["inner"]:
            if d["kind"] != "EnumDecl" or "name" not in d:
                continue
            values = []
            for c in d.get("inner", []):
                if c["kind"] != "EnumConstantDecl":
                    continue
                value = int(c["inner"][0]["value"]) if c.get("inner") else None
                if value is None:
                    raise SystemExit(f"ffigen: enum constant {c['name']} has no explicit value")
                values.append((c["name"], value, self.comment(c)))
            map_name = self._list_of(d["name"], lists)
            if map_name is None:
                raise SystemExit(
                    f"ffigen: enum {d['name']} is not filled from an X-macro list (the header's "
                    "enumerations are; flags are unsigned macros)"
                )
            names = [n for n, _, _ in lists[map_name]]
            listed = [v for v in values if any(v[0].endswith("_" + n) for n in names)]
            prefix = listed[0][0][: -len(lists[map_name][0][0])]
            typedef = self._typedef_of(map_name)
            if self.typedefs[typedef] not in ("uint32_t", "int32_t"):
                raise SystemExit(f"ffigen: {typedef} is {self.typedefs[typedef]}: enumerations are 32-bit")
            enumerations.append(
                Enumeration(
                    map_name=map_name,
                    typedef=typedef,
                    prefix=prefix,
                    values=[Value(n, prefix + n, v, doc) for (n, v, doc) in lists[map_name]],
                    doc=self.typedef_comment(typedef),
                )
            )
            for c_name, value, doc in values:  # the fixed dimensions beside a list
                if c_name not in {prefix + n for n in names}:
                    constants.append(Constant(c_name, value, 32, True, doc))
        unused = set(lists) - {e.map_name for e in enumerations}
        if unused:
            raise SystemExit(f"ffigen: no enum is filled from {', '.join(sorted(unused))}")
        flags = self.flags(macros)
        for name, body in macros.items():
            if name == "KVR_WORKER_NONE":
                doc_m = re.search(rf"#define {name} .*?/\* (.*?) \*/", self.text)
                constants.append(Constant(name, 2**64 - 1, 64, False, doc_m.group(1) if doc_m else ""))
            elif re.fullmatch(r"\d+", body) and re.search(rf"^#define {name} {body}$", self.text, re.M):
                # A decimal macro of the header itself (an array dimension), with the comment
                # on the line before it.
                doc_m = re.search(rf"/\* ((?:(?!\*/).)*?) \*/\n#define {name} ", self.text, re.S)
                doc = re.sub(r"\s*\n\s*\*?\s*", " ", doc_m.group(1)) if doc_m else ""
                constants.append(Constant(name, int(body), 32, True, doc))
        return enumerations, flags, constants

    def flags(self, macros: dict) -> list[Flags]:
        """The unsigned flag macros (#define KVR_ROUTER_EAGLE 0x8u), grouped by their prefix
        (KVR_ROUTER_), each group with the comment that introduces it."""
        groups: dict[str, Flags] = {}
        for m in re.finditer(r"^#define (KVR_([A-Z]+)_\w+) (0x[0-9a-fA-F]+)u\b(?:[ \t]*/\*(.*?)\*/)?", self.text, re.M | re.S):
            name, group, value, doc = m.group(1), m.group(2), int(m.group(3), 16), m.group(4) or ""
            if name not in macros:
                raise SystemExit(f"ffigen: {name} is not a macro clang sees")
            if group not in groups:
                intro = self._preceding_comment(m.start())
                groups[group] = Flags(f"KVR_{group}_*", [], intro if ".flags" in intro else "")
            groups[group].values.append(Value(name, name, value, _clean_comment(doc) if doc else self._preceding_comment(m.start())))
        return list(groups.values())

    def _preceding_comment(self, offset: int) -> str:
        """The comment that ends right before `offset` (a line), if any."""
        before = self.text[:offset].rstrip()
        if not before.endswith("*/"):
            return ""
        start = before.rfind("/*")
        return _clean_comment(before[start:])

    def _list_of(self, enum_name: str, lists: dict) -> str | None:
        # enum kvr_tier_value is filled by KVR_TIER_MAP: find the list its body expands.
        m = re.search(rf"enum {enum_name} \{{\s*#define \w+\(name, value, description\)[^\n]*\n\s*(KVR_\w+_MAP)", self.text)
        return m.group(1) if m and m.group(1) in lists else None

    def _typedef_of(self, map_name: str) -> str:
        # The typedef declared right before the list: "typedef uint32_t kvr_tier;\n#define KVR_TIER_MAP(X)"
        m = re.search(rf"typedef \w+ (kvr_\w+);\s*\n#define {map_name}\(X\)", self.text)
        if not m:
            raise SystemExit(f"ffigen: {map_name} must follow the typedef of its integer type")
        return m.group(1)

    def typedef_comment(self, typedef: str) -> str:
        m = re.search(rf"/\*((?:(?!\*/).)*)\*/\s*\ntypedef \w+ {typedef};", self.text, re.S)
        return _clean_comment(m.group(1)) if m else ""

    def structs(self) -> list[Struct]:
        complete = [n for n, r in self.records.items() if r.get("completeDefinition")]
        source = '#include "kvrouter.h"\n' + "".join(f"{n} v_{n};\n" for n in complete)
        dump = _clang(self.clang, ["-c", "-o", os.devnull, "-Xclang", "-fdump-record-layouts-simple"], source, self.dirs)
        layouts = {}
        for m in re.finditer(
            r"Type: struct (\w+)\n\nLayout: <ASTRecordLayout\n\s+Size:(\d+)\n.*?Alignment:(\d+)\n\s+FieldOffsets: \[([\d, ]*)\]>",
            dump,
            re.S,
        ):
            offsets = [int(x) // 8 for x in m.group(4).split(",") if x.strip()]
            layouts[m.group(1)] = (int(m.group(2)) // 8, int(m.group(3)) // 8, offsets)
        structs = []
        for name in sorted(complete, key=lambda n: self.records[n]["range"]["begin"].get("offset", 0)):
            size, align, offsets = layouts[name]
            nodes = [f for f in self.records[name]["inner"] if f["kind"] == "FieldDecl"]
            fields = []
            for i, node in enumerate(nodes):
                end = offsets[i + 1] if i + 1 < len(offsets) else size
                fields.append(Field(node["name"], self.ctype(node["type"]["qualType"]), offsets[i], 0, self.comment(node)))
            for f in fields:
                f.size = _sizeof(f.type)
            structs.append(Struct(name, size, align, fields, self.struct_comment(name)))
        return structs

    def struct_comment(self, name: str) -> str:
        m = re.search(rf"/\*((?:(?!\*/).)*)\*/\s*\ntypedef struct {name} \{{", self.text, re.S)
        return _clean_comment(m.group(1)) if m else ""

    def callbacks(self, ast: dict) -> list[Callback]:
        out = []
        for d in ast["inner"]:
            if d["kind"] == "TypedefDecl" and d["name"].endswith("_fn"):
                m = re.fullmatch(r"(.*?)\s*\(\*\)\((.*)\)", d["type"]["qualType"])
                params = [self.ctype(p) for p in m.group(2).split(",")]
                out.append(Callback(d["name"], self.ctype(m.group(1)), params, self.comment(d)))
        return out

    def functions(self, ast: dict) -> list[Function]:
        out = []
        for d in ast["inner"]:
            if d["kind"] != "FunctionDecl" or not d["name"].startswith("kvr_"):
                continue
            result = self.ctype(d["type"]["qualType"].split("(")[0])
            params = [
                Param(p["name"], self.ctype(p["type"]["qualType"]))
                for p in d.get("inner", [])
                if p["kind"] == "ParmVarDecl"
            ]
            out.append(Function(d["name"], result, params, self.comment(d)))
        return out

    def version(self, macros: dict) -> tuple[int, int, int]:
        return tuple(int(macros[f"KVR_VERSION_{p}"]) for p in ("MAJOR", "MINOR", "PATCH"))


def _sizeof(t: CType) -> int:
    if t.kind == "array":
        n = 1
        for d in t.dims:
            n *= d
        return n * _sizeof(t.element)
    if t.kind in ("pointer", "function_pointer"):
        return 8
    return t.bits // 8


def _clean_comment(raw: str) -> str:
    """The text of a C comment: without its /* */ and leading asterisks, and without section
    banners ("---- Workers ----"), which are not about the declaration that follows."""
    text = raw.strip()
    text = text[2:] if text.startswith("/*") else text
    text = text[:-2] if text.endswith("*/") else text
    lines = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("*") and not line.startswith("*/"):
            line = line[1:]
            if line.startswith(" "):
                line = line[1:]
        if re.fullmatch(r"-{2,}.*-{2,}", line.strip()):
            continue
        lines.append(line.rstrip())
    return "\n".join(lines).strip()


def read(header: str, version_dir: str, clang: str = "clang-14") -> Model:
    """The model of `header`; `version_dir` holds the kvrouter_version.h it includes."""
    return _Reader(header, version_dir, clang).read()
