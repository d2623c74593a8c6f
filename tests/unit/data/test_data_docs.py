"""The examples of docs/data.md run, and every `expr  # literal` line gives that literal."""

from __future__ import annotations

import ast
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[3] / "docs" / "data.md"


def test_data_doc_examples_hold():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 5
    env: dict = {}
    checked = 0
    for block in blocks:
        lines = block.splitlines()
        for node in ast.parse(block).body:
            code = ast.get_source_segment(block, node)
            comment = lines[node.end_lineno - 1].partition("#")[2].strip()
            try:
                want = ast.literal_eval(comment) if isinstance(node, ast.Expr) and comment else None
            except (ValueError, SyntaxError):
                want = None  # a prose comment, not a result
            if want is None:
                exec(compile(code, str(DOC), "exec"), env)
                continue
            assert eval(compile(code, str(DOC), "eval"), env) == want, code
            checked += 1
    assert checked >= 12
