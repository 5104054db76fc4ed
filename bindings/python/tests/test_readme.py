"""The Python example of README.md (section "Python") runs as written and prints what it says."""

from __future__ import annotations

import contextlib
import io
import os
import re

import pytest

from conftest import ROOT


def test_the_readme_example_runs():
    path = os.path.join(ROOT, "README.md")
    if not os.path.exists(path):
        pytest.skip("no checkout around the tests")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    section = text.split("\n## Python\n", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md (Python)", "exec"), {})
    assert out.getvalue() == "worker 2 rank 0, 32 tokens cached\n"
