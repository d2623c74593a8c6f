"""The public surface: every name in __all__ exists, and imports only point down the layers."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import hugeembed

PACKAGE_DIR = Path(hugeembed.__file__).parent

# Layers, bottom first.  A module may import from its own layer and any layer
# before it in this list, never from one after it (docs/architecture.md, rules).
LAYERS = [
    {"errors", "types", "_native", "_hashing", "_tensors", "_durable", "_format", "_device", "_kernels", "_kernels_avx2",
     "_triton", "__version__"},
    {"features"},
    {"functional"},
    {"store"},
    {"optim"},
    {"nn"},
    {"distributed"},
    {"checkpoint"},
    {"data"},
    {"models"},
    {"metrics"},
    {"training"},
    {"serving"},
    {"cli", "__main__"},
]


def _layer_of(top: str) -> int:
    for i, layer in enumerate(LAYERS):
        if top in layer:
            return i
    raise AssertionError(f"hugeembed.{top} is in no layer of tests/api/test_surface.py::LAYERS")


def _modules():
    for info in pkgutil.walk_packages([str(PACKAGE_DIR)], prefix="hugeembed."):
        if info.name not in ("hugeembed._kernels", "hugeembed._kernels_avx2"):  # ctypes kernel libraries, not modules
            yield info.name


def test_every_module_in_a_layer():
    for name in _modules():
        _layer_of(name.split(".")[1])


@pytest.mark.parametrize("path", sorted(PACKAGE_DIR.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE_DIR)))
def test_imports_point_down(path: Path):
    rel = path.relative_to(PACKAGE_DIR)
    top = rel.parts[0].removesuffix(".py")
    if top == "__init__":
        return  # the root re-exports everything
    mine = _layer_of(top)
    package_parts = ["hugeembed", *rel.parts[:-1]]
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
                targets = [mod] if node.module else [f"{mod}.{a.name}" for a in node.names]
            elif node.module:
                targets = [node.module]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        for t in targets:
            parts = t.split(".")
            if parts[0] != "hugeembed" or len(parts) < 2:
                continue
            theirs = _layer_of(parts[1])
            assert theirs <= mine, f"{rel} imports {t}: layer {parts[1]} sits above {top}"


def test_all_names_exist():
    for name in _modules():
        mod = importlib.import_module(name)
        for exported in getattr(mod, "__all__", []):
            assert hasattr(mod, exported), f"{name}.__all__ lists {exported!r} which does not exist"


def test_subpackages_declare_all():
    for sub in PACKAGE_DIR.iterdir():
        if (sub / "__init__.py").exists():
            mod = importlib.import_module(f"hugeembed.{sub.name}")
            assert hasattr(mod, "__all__"), f"hugeembed.{sub.name} has no __all__"


def test_core_imports_without_optional_dependencies():
    """The core must not import torchrec, fbgemm, pyarrow or matplotlib at import time."""
    import subprocess
    import sys

    code = (
        "import sys, hugeembed, hugeembed.features, hugeembed.functional;"
        "bad = [m for m in ('torchrec', 'fbgemm_gpu', 'pyarrow', 'matplotlib', 'sklearn') if m in sys.modules];"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"optional dependencies imported at import time: {out.stdout}"
