"""Human-readable sizes and rates for summaries, plans and benchmarks (one place for them)."""

from __future__ import annotations

__all__ = ["human_bytes", "human_count"]


def human_bytes(n: float, digits: int = 1) -> str:
    """``1536 -> '1.5 KiB'`` (binary units; whole bytes below 1 KiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    return f"{n:.{digits}f} TiB"


def human_count(x: float, small: float = 1e3) -> str:
    """``2_400_000 -> '2.40 M'``, ``31_400 -> '31.4 k'``; below `small` the plain number."""
    if abs(x) >= 1e6:
        return f"{x / 1e6:.2f} M"
    if abs(x) >= small:
        return f"{x / 1e3:.1f} k"
    return f"{x:.0f}"
