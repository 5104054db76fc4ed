"""Tests of ffigen: its reading of the header and the rules it enforces.

Run: python3 -m unittest discover -s tools/ffigen -t tools/ffigen (scripts/test.sh does).
"""

from __future__ import annotations

import os
import pathlib
import re
import tempfile
import textwrap
import unittest

import ffigen
import model

ROOT = ffigen.ROOT
HEADER = os.path.join(ROOT, "include", "kvrouter.h")


def read_header(text: str) -> model.Model:
    """The model of a header written for a test (with a version header beside it)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kvrouter.h")
        with open(path, "w", encoding="utf-8") as f:
            f.write('#include <stddef.h>\n#include <stdint.h>\n#include "kvrouter_version.h"\n' + text)
        ffigen.version_header(tmp, (9, 8, 7))
        return model.read(path, tmp)


class RealHeader(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with tempfile.TemporaryDirectory() as tmp:
            ffigen.version_header(tmp, ffigen.project_version())
            cls.m = model.read(HEADER, tmp)
        cls.text = pathlib.Path(HEADER).read_text(encoding="utf-8")

    def test_every_function_is_read(self):
        declared = re.findall(r"^KVR_API [^;]*?\b(kvr_\w+)\(", self.text, re.M | re.S)
        self.assertEqual(sorted(declared), sorted(f.name for f in self.m.functions))

    def test_every_versioned_struct_has_a_sized_init(self):
        inits = {f.name: f for f in self.m.functions}
        for s in self.m.structs:
            if not s.versioned:
                continue
            init = inits.get(s.name + "_init")
            self.assertIsNotNone(init, f"{s.name} begins with struct_size but has no {s.name}_init")
            self.assertEqual([p.type.spelling for p in init.params], [f"{s.name} *", "size_t"])
            self.assertEqual(init.result.spelling, "kvr_status")

    def test_capi_knows_the_first_layout_of_every_versioned_struct(self):
        # src/capi/versioned.h lists each versioned struct with the last field of its first
        # released layout; a struct missing there has no sized init in the library.
        table = pathlib.Path(os.path.join(ROOT, "src", "capi", "versioned.h")).read_text(encoding="utf-8")
        listed = dict(re.findall(r"X\((kvr_\w+), (\w+)\)", table))
        versioned = {s.name: s for s in self.m.structs if s.versioned}
        self.assertEqual(set(listed), set(versioned))
        for name, last_field in listed.items():
            self.assertIn(last_field, [f.name for f in versioned[name].fields], name)

    def test_enumerations_come_with_their_descriptions(self):
        tier = next(e for e in self.m.enumerations if e.typedef == "kvr_tier")
        self.assertEqual([(v.c_name, v.value) for v in tier.values][:2], [("KVR_TIER_DEVICE", 0), ("KVR_TIER_HOST_PINNED", 1)])
        self.assertTrue(all(v.doc for e in self.m.enumerations for v in e.values))
        status = next(e for e in self.m.enumerations if e.typedef == "kvr_status")
        self.assertEqual(status.values[-1].c_name, "KVR_BUFFER_TOO_SMALL")
        self.assertEqual(status.values[-1].value, 100)

    def test_layouts_are_the_compilers(self):
        metrics = self.m.struct("kvr_metrics")
        events = next(f for f in metrics.fields if f.name == "events")
        self.assertEqual(events.type.dims, (3, 5))
        self.assertEqual((events.offset, events.size), (8, 120))
        ffigen.check_layouts(self.m)  # the real header follows the rules


class Rules(unittest.TestCase):
    def test_tail_padding_is_refused(self):
        m = read_header(
            textwrap.dedent(
                """
                typedef struct kvr_padded { uint32_t struct_size; uint64_t a; uint32_t b; } kvr_padded;
                """
            )
        )
        with self.assertRaises(SystemExit) as raised:
            ffigen.check_layouts(m)
        self.assertIn("kvr_padded ends in 4 bytes of padding", str(raised.exception))

    def test_inner_padding_is_refused(self):
        m = read_header("typedef struct kvr_gap { uint32_t struct_size; uint64_t a; } kvr_gap;\n")
        with self.assertRaises(SystemExit) as raised:
            ffigen.check_layouts(m)
        self.assertIn("padding between struct_size and a", str(raised.exception))

    def test_x_macro_list_with_escaped_quotes(self):
        m = read_header(
            textwrap.dedent(
                r"""
                /* Colours. */
                typedef uint32_t kvr_colour;
                #define KVR_COLOUR_MAP(X) X(RED, 0, "the \"warm\" one") X(BLUE, 7, "cold")
                enum kvr_colour_value {
                #define KVR_COLOUR_ENUM_(name, value, description) KVR_COLOUR_##name = value,
                  KVR_COLOUR_MAP(KVR_COLOUR_ENUM_)
                #undef KVR_COLOUR_ENUM_
                };
                """
            )
        )
        (colour,) = m.enumerations
        self.assertEqual(colour.typedef, "kvr_colour")
        self.assertEqual([(v.c_name, v.value, v.doc) for v in colour.values], [("KVR_COLOUR_RED", 0, 'the "warm" one'), ("KVR_COLOUR_BLUE", 7, "cold")])
        self.assertEqual(colour.doc, "Colours.")
        self.assertEqual(m.version, (9, 8, 7))


if __name__ == "__main__":
    unittest.main()
