"""The Python examples in docs/*.md run, and every `expr  # literal` line gives that literal.

A block may use names from earlier blocks of the same page unless the page is listed in
FRESH_BLOCKS (each block then starts from an empty namespace).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
# page -> (at least this many python blocks, at least this many checked results)
PAGES = {"features.md": (3, 6), "data.md": (5, 12), "models.md": (4, 7), "checkpoint.md": (1, 5)}
FRESH_BLOCKS = {"models.md"}


def run_examples(doc: Path, fresh_blocks: bool) -> tuple[int, int]:
    """Runs every ```python block of `doc`; returns (blocks, checked results)."""
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)
    env: dict = {}
    checked = 0
    for block in blocks:
        if fresh_blocks:
            env = {}
        lines = block.splitlines()
        for node in ast.parse(block).body:
            code = ast.get_source_segment(block, node)
            comment = lines[node.end_lineno - 1].partition("#")[2].strip()
            try:
                want = ast.literal_eval(comment) if isinstance(node, ast.Expr) and comment else None
            except (ValueError, SyntaxError):
                want = None  # a prose comment, not a result
            if want is None:
                exec(compile(code, str(doc), "exec"), env)
                continue
            assert eval(compile(code, str(doc), "eval"), env) == want, f"{doc.name}: {code}"
            checked += 1
    return len(blocks), checked


@pytest.mark.parametrize("page", sorted(PAGES))
def test_doc_examples_hold(page):
    blocks, checked = run_examples(DOCS / page, page in FRESH_BLOCKS)
    min_blocks, min_checked = PAGES[page]
    assert blocks >= min_blocks and checked >= min_checked, (page, blocks, checked)
