"""Instructions counted by valgrind's callgrind: a cost that load does not move.

On a shared VM wall (and CPU) time of a 1-2 ms step swings by more than a per-table difference
of a few microseconds; the instructions the same steps run do not (the same inputs run the same
instructions whatever else the machine does: two runs agree within ~0.5%).  A benchmark re-runs
itself under callgrind with instrumentation off (imports and warm-up at near native speed),
switches it on once its state is built, and counts each region between `Regions.start()` and
`Regions.stop(label)`: callgrind's client requests (zero the counters, dump them under a label),
made from a few lines of C built here, cost a few hundred instructions, the same in every region.

    counts = run_counted([sys.executable, "bench/ops.py", "--child", ...])   # {label: instructions}
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
import tempfile

ENV = "HUGEEMBED_CALLGRIND"  # set in the counted child: the folder its dumps go to

_REQUESTS = r"""
#include <valgrind/callgrind.h>
void he_cg_start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void he_cg_stop(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }
"""


def available() -> bool:
    """Whether valgrind, a C compiler and callgrind's header are here."""
    return shutil.which("valgrind") is not None and shutil.which("cc") is not None and \
        os.path.exists("/usr/include/valgrind/callgrind.h")


def run_counted(argv: list[str], timeout: float = 3600) -> dict[str, int]:
    """Runs `argv` under callgrind (instrumentation off at start); returns the instructions of each region
    its `Regions` dumped, by label.  The child's stdout and stderr pass through (valgrind's own log
    does not)."""
    with tempfile.TemporaryDirectory(prefix="callgrind-") as out:
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}/cg.%p",
               f"--log-file={out}/valgrind.log", *argv]
        subprocess.run(cmd, check=True, timeout=timeout, env={**os.environ, ENV: out})
        counts = {}
        for name in os.listdir(out):
            if not name.startswith("cg."):
                continue
            with open(os.path.join(out, name)) as f:
                text = f.read()
            label = re.search(r"^desc: Trigger: Client Request: (\S+)$", text, re.M)
            total = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
            if label and total:
                counts[label.group(1)] = int(total.group(1))
        return counts


class Regions:
    """The counted child's side: `start()` zeroes the counters (instrumentation on from the first),
    `stop(label)` dumps what ran since under `label`."""

    def __init__(self) -> None:
        folder = os.environ.get(ENV) or sys.exit("Regions: run under run_counted")
        src, lib = os.path.join(folder, "requests.c"), os.path.join(folder, "requests.so")
        with open(src, "w") as f:
            f.write(_REQUESTS)
        subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", lib, src], check=True)
        self._lib = ctypes.CDLL(lib)
        self._lib.he_cg_stop.argtypes = [ctypes.c_char_p]

    def start(self) -> None:
        self._lib.he_cg_start()

    def stop(self, label: str) -> None:
        if not re.fullmatch(r"[\w.-]+", label):  # the dump's trigger line carries it as is
            raise ValueError(f"region label {label!r}: letters, digits, '_', '.', '-' only")
        self._lib.he_cg_stop(label.encode())
