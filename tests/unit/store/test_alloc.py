"""Big store arrays get 2 MiB pages where the kernel gives them, and go back to the system when freed.

The oracle is the kernel's own account of the mapping (/proc/self/smaps), not our code.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from hugeembed.store import allocate_rows
from hugeembed.store._alloc import _MIN_BYTES

THP = Path("/sys/kernel/mm/transparent_hugepage")


def _setting(name: str) -> str | None:
    try:
        return re.search(r"\[(\S+)\]", (THP / name).read_text()).group(1)
    except (OSError, AttributeError):
        return None


def _mapping(address: int) -> dict[str, int] | None:
    """The smaps fields (kB) of the mapping that holds ``address``; None when none does."""
    found = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            if found is not None:
                return found
            lo, hi = int(head.group(1), 16), int(head.group(2), 16)
            found = {} if lo <= address < hi else None
        elif found is not None:
            field = re.match(r"(\w+):\s+(\d+) kB", line)
            if field:
                found[field.group(1)] = int(field.group(2))
    return found


# madvised regions are huge-paged at fault time when THP is on and its defrag setting compacts
# for them (the usual "madvise"); other settings may hand out small pages, so there is nothing to check.
needs_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux")
    or _setting("enabled") not in ("always", "madvise")
    or _setting("defrag") not in ("always", "madvise", "defer+madvise"),
    reason="transparent huge pages are not given to madvised regions here")


@needs_thp
def test_big_tables_sit_on_huge_pages():
    rows = allocate_rows(2 * _MIN_BYTES // 256, 64)  # 16 MiB of fp32 rows
    rows.fill_(1.0)  # first touch: the pages are chosen now
    smaps = _mapping(rows.data_ptr())
    assert smaps is not None
    # private anonymous memory: a shared anonymous map is shmem, which THP does not back under "madvise"
    assert smaps["Anonymous"] >= 16 << 10, smaps
    assert smaps["AnonHugePages"] >= 8 << 10, smaps


def test_freed_tables_leave_the_process():
    rows = allocate_rows(2 * _MIN_BYTES // 256, 64)
    rows.fill_(1.0)
    address = rows.data_ptr()
    assert _mapping(address) is not None
    del rows
    assert _mapping(address) is None  # unmapped with its last view, not kept by malloc
