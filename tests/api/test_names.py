"""Every name the library uses is defined: pyflakes over hugeembed/, bench/ and tests/ reports no undefined name.

A name used and never defined (a constant not imported, a typo) is a NameError only when its line runs,
which may be a path no other test reaches (TritonIndex.insert was one: loading a snapshot into a CUDA
group).  Unused imports and the like are left to review: only undefined names fail here."""

from __future__ import annotations

from pathlib import Path

import pytest

pyflakes_api = pytest.importorskip("pyflakes.api")
from pyflakes import messages  # noqa: E402
from pyflakes.reporter import Reporter  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
UNDEFINED = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)


class _Collect(Reporter):
    def __init__(self) -> None:
        self.found: list[str] = []

    def flake(self, message) -> None:
        if isinstance(message, UNDEFINED):
            self.found.append(str(message))

    def syntaxError(self, filename, msg, lineno, offset, text) -> None:
        self.found.append(f"{filename}:{lineno}: {msg}")

    def unexpectedError(self, filename, msg) -> None:
        self.found.append(f"{filename}: {msg}")


@pytest.mark.parametrize("part", ["hugeembed", "bench", "tests"])
def test_no_name_is_used_undefined(part):
    report = _Collect()
    for path in sorted((ROOT / part).rglob("*.py")):
        pyflakes_api.check(path.read_text(), str(path.relative_to(ROOT)), report)
    assert not report.found, "\n".join(report.found)


def test_the_check_sees_an_undefined_name():
    report = _Collect()
    pyflakes_api.check("def f():\n    return G_ENTRIES + 1\n", "example.py", report)
    assert report.found and "G_ENTRIES" in report.found[0]
