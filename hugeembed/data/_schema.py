"""The Criteo schema: column names, dtypes, and the reserved "missing" id of each feature.

A Criteo display-advertising line has 40 tab-separated fields::

    label \t I1 \t ... \t I13 \t C1 \t ... \t C26
      0/1     integer counts        categorical ids: 8 hex digits (32-bit)
              (may be empty or < 0) (may be empty)

hugeembed turns it into

    dense  float32 [B, 13]   log(1 + max(x, 0)), an empty field -> 0
    cats   int64   [B, 26]   the hex value itself (no vocabulary), an empty field ->
                             MISSING_IDS[j] = 2**32 + j for feature C{j+1}
    labels float32 [B]       0.0 / 1.0

Parsed hex ids are < 2**32, so the missing ids (2**32 .. 2**32 + 25) can never collide
with a real one, are non-negative (negative ids are dropped as invalid by the embedding
"clean" stage), and differ per feature so that features sharing one table still keep
"missing C3" apart from "missing C7".
"""

from __future__ import annotations

__all__ = [
    "N_DENSE",
    "N_CAT",
    "N_FIELDS",
    "DENSE_NAMES",
    "CAT_NAMES",
    "MISSING_ID_BASE",
    "MISSING_IDS",
    "missing_id",
    "field_name",
]

N_DENSE = 13
N_CAT = 26
N_FIELDS = 1 + N_DENSE + N_CAT
DENSE_NAMES: tuple[str, ...] = tuple(f"I{i}" for i in range(1, N_DENSE + 1))
CAT_NAMES: tuple[str, ...] = tuple(f"C{i}" for i in range(1, N_CAT + 1))
MISSING_ID_BASE = 1 << 32
MISSING_IDS: tuple[int, ...] = tuple(MISSING_ID_BASE + j for j in range(N_CAT))


def missing_id(feature: int | str) -> int:
    """The id that stands for an empty field of categorical `feature`.

    Args:
        feature: ``"C1"`` .. ``"C26"`` or its position 0 .. 25.

    Example::

        >>> missing_id("C1"), missing_id(25)
        (4294967296, 4294967321)
    """
    if isinstance(feature, str):
        if feature not in CAT_NAMES:
            raise KeyError(f"no categorical feature {feature!r}; features are C1..C26")
        return MISSING_IDS[CAT_NAMES.index(feature)]
    if not 0 <= feature < N_CAT:
        raise IndexError(f"categorical feature position {feature} out of range 0..{N_CAT - 1}")
    return MISSING_IDS[feature]


def field_name(field: int) -> str:
    """Name of field `field` of a line: 0 = "label", 1..13 = I1..I13, 14..39 = C1..C26."""
    if field == 0:
        return "label"
    if 1 <= field <= N_DENSE:
        return DENSE_NAMES[field - 1]
    return CAT_NAMES[field - 1 - N_DENSE]
