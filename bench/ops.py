"""Ops and host reads per training step vs the number of tables (the launch count a GPU would pay),
and the Python each table adds to a step.

One EmbeddingCollection training step (forward + backward with Adagrad applied in backward),
counted with a ``TorchDispatchMode``, for 2, 8, 32 and 128 tables, static and dynamic, on the
native and the torch backends:

* steady state: 256 samples, dim 16, one id per bag from 1,000 ids, after 64 warm-up steps;
* fresh start: each of the first 3 steps of a new collection, 256 samples, 0-3 ids per bag from
  1,000 ids (every step brings new ids and grows the dynamic tables): the worst of the 3 steps.

"reads" are the ops whose output size or value the host must read before going on
(``.item()``, ``.tolist()``, ``nonzero``, ``unique``, boolean masking, ...): on a GPU each is a
stall.  On the CPU they are plain reads of memory, but counted alike.  Native kernels called
through ctypes are not torch ops, so a native step shows only the torch ops around them.

"Python per table": (a step at batch 8 over 26 tables - the same at 2 tables) / 24, medians of
interleaved runs, in CPU time of the calling thread with one intra-op thread: what each table costs a
step beyond the kernels' work; and the Python lines each table adds to a step (a line tracer: the
figure without timing noise, 0 when no step loops over tables).

    python bench/ops.py                  # the tables
    python bench/ops.py --tables 2 32    # some sizes only
    python bench/ops.py --device cuda    # on a GPU: the torch and triton backends, the CUDA launches per step
                                         # (torch profiler) and the step time vs tables

Issue 29's targets: ops for 32 tables <= 1.2x those for 2 tables from the first step on, at most 2
reads per step on the native backend, and <= 5 us of Python per table per step.  Issue 32's: <= 25
CUDA launches per training step static, <= 40 dynamic, independent of the number of tables.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

if not torch.cuda.is_available():  # the triton step's launches, counted on the CPU: before triton imports
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _callgrind import Regions, run_counted  # noqa: E402
from _callgrind import available as callgrind_available  # noqa: E402
from _common import print_table  # noqa: E402

from hugeembed.features import SparseFeatures  # noqa: E402
from hugeembed.nn import EmbeddingCollection, TableConfig  # noqa: E402
from hugeembed.optim import Adagrad, Adam, SparseOptimizer  # noqa: E402
from hugeembed.store import StaticGroup  # noqa: E402

# Ops whose result shape or value depends on data the host must read (a device sync on GPU).
# "h2d": a copy of host memory to the device that the host waits for (``torch.tensor(...,
# device=...)``, ``cpu_tensor.to(device)`` without non_blocking): on a GPU it synchronizes the
# stream.  Counted on every device (on the CPU such a call is what would stall a GPU).
SYNC_OPS = {"h2d", "_local_scalar_dense", "nonzero", "unique", "_unique", "_unique2", "unique_consecutive",
            "unique_dim", "masked_select", "item", "is_nonzero", "equal", "bincount", "repeat_interleave",
            "tolist", "numpy", "index(mask)", "index_put(mask)", "index_put_(mask)", "_index_put_impl_(mask)"}


class CountOps(TorchDispatchMode):
    """Counts every aten op dispatched inside the context, by name.

    ``Tensor.tolist()`` and ``Tensor.numpy()`` read a tensor to the host without dispatching an
    op: they are counted too (as "tolist" / "numpy"), by wrapping them while the context is open,
    and so are the host-to-device copies the host waits for (as "h2d": ``torch.tensor`` given a
    device, ``.to(device)`` / ``.cuda()`` of a CPU tensor without ``non_blocking``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self._saved: dict[str, object] = {}

    def __enter__(self):
        for name in ("tolist", "numpy"):
            original = self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._counting(name, original))
        for name in ("to", "cuda"):
            original = self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._counting_h2d(name == "cuda", original))
        self._tensor = torch.tensor
        torch.tensor = self._counting_tensor(torch.tensor)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        torch.tensor = self._tensor
        return super().__exit__(*exc)

    def _counting_h2d(self, always: bool, original):
        def move(tensor, *args, **kwargs):
            to_device = always or kwargs.get("device") is not None or any(
                isinstance(a, (str, torch.device)) or isinstance(a, torch.Tensor) for a in args)
            if to_device and tensor.device.type == "cpu" and not kwargs.get("non_blocking") and not (
                    len(args) > 1 and isinstance(args[1], bool) and args[1]):
                self.ops["h2d"] += 1
            return original(tensor, *args, **kwargs)
        return move

    def _counting_tensor(self, original):
        def tensor(*args, **kwargs):
            if kwargs.get("device") is not None:
                self.ops["h2d"] += 1
            return original(*args, **kwargs)
        return tensor

    def _counting(self, name, original):
        def read(tensor, *args, **kwargs):
            self.ops[name] += 1
            return original(tensor, *args, **kwargs)
        return read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        # x[mask] and x[mask] = y: the result's size is the mask's count, read to the host
        if name in ("index", "index_put", "index_put_", "_index_put_impl_") and len(args) > 1 and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
            name = f"{name}(mask)"
        if name == "repeat_interleave" and (kwargs or {}).get("output_size") is not None:
            name = "repeat_interleave(sized)"  # its output size given: no read
        self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    def syncs(self) -> int:
        return sum(n for op, n in self.ops.items() if op in SYNC_OPS)


# Torch ops that launch no kernel on a GPU: views and metadata, allocations left uninitialized, Python
# scalars wrapped as CPU tensors.  Every other op dispatched counts as (at least) one launch; a CUDA
# sort or scan may run several kernels for one op (the profiler's count, on a GPU, tells).
NO_LAUNCH = {"view", "_unsafe_view", "reshape", "_reshape_alias", "as_strided", "slice", "select", "expand",
             "unsqueeze", "squeeze", "t", "transpose", "permute", "detach", "alias", "split", "split_with_sizes",
             "unbind", "narrow", "view_as", "empty", "empty_like", "empty_strided", "new_empty",
             "new_empty_strided", "lift_fresh", "scalar_tensor", "sym_size", "sym_stride", "sym_numel",
             "is_same_size", "_has_compatible_shallow_copy_type", "set_", "resize_", "detach_", "numpy"}


class CountLaunches(CountOps):
    """CountOps that also counts the launches a GPU would make: each triton kernel launch (by kernel
    name, compiled or under triton's interpreter), and each dispatched torch op not in NO_LAUNCH
    (copies to and from the host included: "tolist", "h2d", "_local_scalar_dense").

    Works without a GPU: on CPU tensors under ``TRITON_INTERPRET=1`` the step runs the same kernels
    and torch ops as on CUDA (the torch ops the interpreter runs to move a kernel's arguments are not
    the step's: not counted).
    """

    def __init__(self) -> None:
        super().__init__()
        self.kernels: Counter[str] = Counter()
        self._in_kernel = False
        self._runs: list[tuple[type, object]] = []

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        for cls in (JITFunction, InterpretedFunction):
            self._runs.append((cls, cls.__dict__["run"]))
            cls.run = self._counting_run(cls.__dict__["run"])
        return super().__enter__()

    def __exit__(self, *exc):
        for cls, original in self._runs:
            cls.run = original
        self._runs.clear()
        return super().__exit__(*exc)

    def _counting_run(self, original):
        def run(kernel, *args, warmup=False, **kwargs):
            if not warmup:
                self.kernels[getattr(kernel.fn, "__name__", str(kernel.fn))] += 1
            before, self._in_kernel = self._in_kernel, True
            try:
                return original(kernel, *args, warmup=warmup, **kwargs)
            finally:
                self._in_kernel = before
        return run

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._in_kernel:  # the interpreter's own moves of the kernel's arguments
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def torch_launches(self) -> Counter:
        """The counted torch ops that launch, by name."""
        return Counter({op: n for op, n in self.ops.items() if op.split("(")[0] not in NO_LAUNCH})

    def launches(self) -> int:
        """Kernels and copies a GPU would launch for what ran in the context."""
        return sum(self.torch_launches().values()) + sum(self.kernels.values())


def batch(tables: int, samples: int, rows: int, step: int, device: str = "cpu", max_ids: int = 1) -> SparseFeatures:
    """`samples` rows of `tables` features, each bag 1 id (`max_ids` 1) or 0..max_ids ids, from `rows` ids."""
    g = torch.Generator().manual_seed(1000 + step)
    lengths = torch.ones(tables * samples, dtype=torch.int64) if max_ids == 1 else \
        torch.randint(0, max_ids + 1, (tables * samples,), generator=g)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
    return SparseFeatures([f"f{t}" for t in range(tables)], values, lengths=lengths, batch_size=samples).to(device)


def collection(tables: int, dynamic: bool, backend: str, dim: int, rows: int, optimizer: SparseOptimizer | None,
               device: str) -> EmbeddingCollection:
    return EmbeddingCollection([TableConfig(f"f{t}", dim, num_rows=None if dynamic else rows, combiner="sum")
                                for t in range(tables)], optimizer=optimizer or Adagrad(lr=0.05), backend=backend,
                               device=device)


def count_step(tables: int, dynamic: bool, backend: str, samples: int = 256, dim: int = 16,
               rows: int = 1000, warmup: int = 64, optimizer: SparseOptimizer | None = None,
               device: str = "cpu", counter: type = CountOps) -> CountOps:
    """Ops of one steady-state training step of `tables` tables (Adagrad unless `optimizer`), counted by a
    `counter` (CountOps, or CountLaunches for the launches)."""
    ec = collection(tables, dynamic, backend, dim, rows, optimizer, device)
    # steady state: every id seen (1000 ids, 256 a step: e^-16 unseen), tables grown, buffers sized
    for s in range(warmup):
        ec(batch(tables, samples, rows, s, device)).stacked().sum().backward()
    sf = batch(tables, samples, rows, warmup, device)
    with counter() as counter:
        ec(sf).stacked().sum().backward()
    return counter


def count_fresh(tables: int, dynamic: bool, backend: str, steps: int = 3, samples: int = 256, rows: int = 1000,
                max_ids: int = 3, device: str = "cpu") -> list[CountOps]:
    """Ops of each of the first `steps` training steps of a new collection (bags of 0..max_ids ids)."""
    ec = collection(tables, dynamic, backend, 16, rows, None, device)
    out = []
    for s in range(steps):
        sf = batch(tables, samples, rows, s, device, max_ids)
        with CountOps() as counter:
            ec(sf).stacked().sum().backward()
        out.append(counter)
    return out


def counted_launches(tables: int, dynamic: bool, samples: int = 8, rows: int = 8, warmup: int = 6,
                     device: str = "cpu", optimizer: SparseOptimizer | None = None) -> CountLaunches:
    """The launches of one steady-state triton training step, counted without a GPU (on CPU tensors under
    triton's interpreter: tiny batches, the interpreter runs ~ms a program; the count does not depend on
    the batch size).  Steady state: 6 warm-up steps of 8 samples from 8 ids (every id seen, the tables grown).

    Adagrad unless `optimizer`."""
    with _triton_index():
        return count_step(tables, dynamic, "triton", samples=samples, rows=rows, warmup=warmup, device=device,
                          counter=CountLaunches, optimizer=optimizer)


def counted_new_keys(tables: int, new: int = 3, samples: int = 8, rows: int = 8, warmup: int = 6, device: str = "cpu",
                     optimizer: SparseOptimizer | None = None) -> CountLaunches:
    """The launches of a steady triton training step of `tables` dynamic tables that brings `new` new keys to
    each table without growing it: counted_launches' warm-up (every id of [0, rows) seen), then the keys
    [0, new) removed from every table (their rows freed, as an eviction does), and a step whose bags hold
    each id of [0, samples) % rows (those `new` keys among them), counted as counted_launches counts."""
    with _triton_index():
        ec = collection(tables, True, "triton", 16, rows, optimizer, device)
        for s in range(warmup):
            ec(batch(tables, samples, rows, s, device)).stacked().sum().backward()
        for t in range(tables):  # (random warm-up bags miss a key now and then: table 45 of 128 never saw 0)
            store, keys = ec.store(f"f{t}"), torch.arange(new, device=device)
            store.remove(keys[store.find(keys) >= 0])

        def of(ids: torch.Tensor) -> SparseFeatures:
            values = ids.repeat(tables)
            return SparseFeatures([f"f{t}" for t in range(tables)], values, lengths=torch.ones_like(values),
                                  batch_size=samples).to(device)
        # a step without the removed keys first: an edit leaves the group's counts to be read again (a host
        # tensor, no read of the device on a GPU, but counted here), the next step's report brings them
        ec(of(new + torch.arange(samples) % (rows - new))).stacked().sum().backward()
        sf = of(torch.arange(samples) % rows)
        with CountLaunches() as counter:
            ec(sf).stacked().sum().backward()
    return counter


def counted_fresh(tables: int, dynamic: bool, steps: int = 3, samples: int = 8, rows: int = 64, max_ids: int = 3,
                  device: str = "cpu") -> list[CountLaunches]:
    """The launches of each of the first `steps` triton training steps of a new collection (count_fresh's
    case at 8 samples: bags of 0..max_ids ids from `rows` ids, new ids every step), counted as
    counted_launches counts."""
    out = []
    with _triton_index():
        ec = collection(tables, dynamic, "triton", 16, rows, None, device)
        for s in range(steps):
            sf = batch(tables, samples, rows, s, device, max_ids)
            with CountLaunches() as counter:
                ec(sf).stacked().sum().backward()
            out.append(counter)
    return out


@contextlib.contextmanager
def _triton_index():
    """The hash tables' index and the static tables' fetch on triton too, as on a GPU (backend='triton' on the
    CPU leaves them native)."""
    index_backend, static_on_triton = EmbeddingCollection._index_backend, StaticGroup._on_triton
    EmbeddingCollection._index_backend = lambda self: "triton"
    StaticGroup._on_triton = lambda self: True
    try:
        yield
    finally:
        EmbeddingCollection._index_backend, StaticGroup._on_triton = index_backend, static_on_triton


def worst(counts: list[CountOps]) -> tuple[int, int]:
    """(most ops, most reads) over a few steps' counts."""
    return max(sum(c.ops.values()) for c in counts), max(c.syncs() for c in counts)


def python_per_table(backend: str, dynamic: bool, few: int = 2, many: int = 26, samples: int = 8, steps: int = 60,
                     runs: int = 7, threads: int = 1) -> float:
    """Microseconds each table adds to a steady-state step at a tiny batch: (step(many) - step(few)) / (many - few),
    medians of interleaved runs of `steps` steps each, in CPU time of the calling thread (the Python and
    the kernels' share of the caller: on a loaded machine wall time mostly measures the other jobs).

    With one intra-op thread (`threads`): at batch 8 no op gains from a second one, and some of torch's
    CPU ops (index_add_, searchsorted, ...) hand work to their OpenMP workers once a batch array passes
    a size that 26 tables reach and 2 do not; on a shared machine the calling thread then spins for
    milliseconds until a worker gets a core, which is neither Python nor per-table work."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _python_per_table(backend, dynamic, few, many, samples, steps, runs)
    finally:
        torch.set_num_threads(saved)


def _python_per_table(backend: str, dynamic: bool, few: int, many: int, samples: int, steps: int,
                      runs: int) -> float:
    ecs = {n: collection(n, dynamic, backend, 16, 1000, None, "cpu") for n in (few, many)}
    sfs = {n: [batch(n, samples, 1000, s) for s in range(steps)] for n in (few, many)}
    for n, ec in ecs.items():  # warm up: tables grown, buffers sized
        for sf in sfs[n]:
            ec(sf).stacked().sum().backward()
    times: dict[int, list[float]] = {few: [], many: []}
    for _ in range(runs):
        for n in (few, many):
            t0 = time.thread_time()
            for sf in sfs[n]:
                ecs[n](sf).stacked().sum().backward()
            times[n].append((time.thread_time() - t0) / steps)
    per = (statistics.median(times[many]) - statistics.median(times[few])) / (many - few)
    return per * 1e6


def counted_per_table(backend: str, dynamic: bool, regions, few: int = 2, many: int = 26, samples: int = 8,
                      steps: int = 10, warmup: int = 60, rounds: int = 2) -> None:
    """The counted child's side of instructions_per_table: `steps` steady steps at `few` and at `many`
    tables, `rounds` times each, as regions labelled backend.kind.tables.round."""
    torch.set_num_threads(1)
    ecs = {n: collection(n, dynamic, backend, 16, 1000, None, "cpu") for n in (few, many)}
    sfs = {n: [batch(n, samples, 1000, s) for s in range(warmup)] for n in (few, many)}
    for n, ec in ecs.items():  # warm up: tables grown, buffers sized
        for sf in sfs[n]:
            ec(sf).stacked().sum().backward()
    for r in range(rounds):
        for n in (few, many):
            regions.start()
            for sf in sfs[n][:steps]:
                ecs[n](sf).stacked().sum().backward()
            regions.stop(f"{backend}.{'dynamic' if dynamic else 'static'}.{n}.{r}")


def instructions_per_table(cases: list[tuple[str, bool]], few: int = 2, many: int = 26,
                           steps: int = 10) -> dict[tuple[str, bool], tuple[float, float]]:
    """Instructions each table adds to a steady-state step at batch 8 (python_per_table's figure counted,
    not timed: the same steps run the same instructions whatever the load): (instructions(many) -
    instructions(few)) / (many - few) / steps, counted by callgrind in one child process, each case
    twice.  Returns (per table, the two rounds' spread of it) by (backend, dynamic)."""
    cases_arg = [f"{b}:{'dynamic' if d else 'static'}" for b, d in cases]
    counts = run_counted([sys.executable, __file__, "--callgrind-child", *cases_arg, "--tables", str(few), str(many)])
    out = {}
    for backend, dynamic in cases:
        kind = "dynamic" if dynamic else "static"
        per = [(counts[f"{backend}.{kind}.{many}.{r}"] - counts[f"{backend}.{kind}.{few}.{r}"]) / (many - few) / steps
               for r in range(2)]
        out[backend, dynamic] = (statistics.mean(per), abs(per[0] - per[1]))
    return out


def python_lines_per_table(backend: str, dynamic: bool, few: int = 2, many: int = 26, samples: int = 8,
                          steps: int = 3, warmup: int = 60) -> float:
    """Python lines each table adds to a steady-state step at a tiny batch: (lines(many) - lines(few)) /
    (many - few) / steps, counted by a line tracer (sys.settrace: every line of Python run, library and
    torch's own, no timing noise).  A loop over tables in a step shows as >= 1."""
    counts = {}
    for n in (few, many):
        ec = collection(n, dynamic, backend, 16, 1000, None, "cpu")
        sfs = [batch(n, samples, 1000, s) for s in range(warmup)]
        for sf in sfs:  # warm up: tables grown, buffers sized
            ec(sf).stacked().sum().backward()
        lines = 0

        def tracer(frame, event, arg):
            nonlocal lines
            lines += event == "line"
            return tracer
        for sf in sfs[:steps]:
            sys.settrace(tracer)
            try:
                ec(sf).stacked().sum().backward()
            finally:
                sys.settrace(None)
        counts[n] = lines
    return (counts[many] - counts[few]) / (many - few) / steps


def cuda_launches(tables: int, dynamic: bool, backend: str, device: str, samples: int = 256,
                  warmup: int = 8) -> tuple[int, int]:
    """(kernels, memcpy + memset) the GPU ran for one steady-state training step, as torch's profiler
    records them (CUPTI: every launch, triton's included)."""
    from torch.profiler import ProfilerActivity, profile

    ec = collection(tables, dynamic, backend, 16, 1000, None, device)
    for s in range(warmup):  # tables grown, kernels compiled, buffers sized
        ec(batch(tables, samples, 1000, s, device)).stacked().sum().backward()
    sf = batch(tables, samples, 1000, warmup, device)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ec(sf).stacked().sum().backward()
        torch.cuda.synchronize()
    on_gpu = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = sum(name.startswith(("Memcpy", "Memset")) for name in on_gpu)
    return len(on_gpu) - copies, copies


def time_step(tables: int, dynamic: bool, backend: str, device: str, samples: int, dim: int = 16,
              rows: int = 100_000, warmup: int = 5, steps: int = 20) -> float:
    """Median seconds of one steady-state training step (the device synchronized around each)."""
    ec = collection(tables, dynamic, backend, dim, rows, None, device)
    sfs = [batch(tables, samples, rows, s, device) for s in range(warmup + steps)]
    times = []
    for i, sf in enumerate(sfs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ec(sf).stacked().sum().backward()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _triton_counts() -> bool:
    """Whether this run can count the triton step's launches (triton imports)."""
    from hugeembed import _triton

    return _triton.available()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--tables", type=int, nargs="+", default=[2, 8, 32, 128])
    ap.add_argument("--backends", nargs="+", default=None, choices=["native", "torch", "triton"],
                    help="default: native and torch on cpu, torch and triton on cuda (the native kernels are CPU code)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--time-samples", type=int, nargs="+", default=[256, 8192],
                    help="on cuda: batch sizes of the timed steps")
    ap.add_argument("--instructions", action="store_true",
                    help="on cpu: also count the instructions each table adds to a step (valgrind's callgrind, "
                         "a figure load does not move; minutes)")
    ap.add_argument("--callgrind-child", nargs="+", metavar="BACKEND:KIND", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.callgrind_child:  # run by instructions_per_table under callgrind
        regions = Regions()
        for case in args.callgrind_child:
            backend, kind = case.split(":")
            counted_per_table(backend, kind == "dynamic", regions, *args.tables)
        return
    gpu = args.device != "cpu"
    backends = args.backends or (["torch", "triton"] if gpu else ["native", "torch"])
    header = ["backend", "tables"] + [f"{n} tables" for n in args.tables] + [
        f"ops {args.tables[-1]}/{args.tables[0]}", f"reads at {args.tables[-1]}"]
    if gpu:  # first: the figure issue 32 targets (a run cut short by gpu_check's timeout still shows it)
        out = []
        for backend in backends:
            for dynamic in (False, True):
                launches = [cuda_launches(n, dynamic, backend, args.device) for n in args.tables]
                out.append([backend, "dynamic" if dynamic else "static", *[f"{k} + {c}" for k, c in launches]])
        print("CUDA launches per training step (torch profiler: kernels + memcpy/memset), steady state, 256 samples, "
              "1 id per bag, d16")
        print_table(["backend", "tables", *[f"{n} tables" for n in args.tables]], out)
        print()
    if "triton" in backends or (not gpu and args.backends is None and _triton_counts()):
        out = []
        for name, optimizer in (("Adagrad", None), ("Adam", Adam(lr=0.01))):
            for dynamic in (False, True):
                counts = [counted_launches(n, dynamic, device=args.device, optimizer=optimizer) for n in args.tables]
                out.append([name, "dynamic" if dynamic else "static",
                            *[f"{c.launches()} ({sum(c.kernels.values())} triton) / {c.syncs()} reads"
                              for c in counts]])
                if dynamic:  # a steady step that makes rows (issue 32: still <= 2 reads)
                    counts = [counted_new_keys(n, device=args.device, optimizer=optimizer) for n in args.tables]
                    out.append([name, "dynamic, 3 new keys",
                                *[f"{c.launches()} ({sum(c.kernels.values())} triton) / {c.syncs()} reads"
                                  for c in counts]])
        print(f"triton backend: launches / host reads per training step, counted (triton kernels + torch ops that "
              f"launch; {'compiled' if gpu else 'no GPU: under the interpreter'}), steady state, 8 samples, 1 id "
              f"per bag, d16; issue 32: <= 25 static, <= 40 dynamic, independent of the tables")
        print_table(["optimizer", "tables", *[f"{n} tables" for n in args.tables]], out)
        out = []
        for dynamic in (False, True):
            counts = [counted_fresh(n, dynamic, device=args.device) for n in args.tables]
            out.append(["dynamic" if dynamic else "static",
                        *[" | ".join(f"{c.launches()} / {c.syncs()}" for c in steps) for steps in counts]])
        print("\ntriton backend, fresh start: launches / host reads of each of the first 3 steps of a new collection "
              "(8 samples, 0-3 ids per bag from 64 ids: new ids every step), counted as above, Adagrad")
        print_table(["tables", *[f"{n} tables" for n in args.tables]], out)
        print()
        backends = [b for b in backends if b != "triton" or gpu]  # (ops of the interpreted step: above)
        if not backends:
            return
    out = []
    for backend in backends:
        for dynamic in (False, True):
            counts = [count_step(n, dynamic, backend, device=args.device) for n in args.tables]
            ops = [sum(c.ops.values()) for c in counts]
            out.append([backend, "dynamic" if dynamic else "static",
                        *[f"{o:,} ops / {c.syncs()} reads" for o, c in zip(ops, counts)],
                        f"{ops[-1] / ops[0]:.1f}x", str(counts[-1].syncs())])
    print(f"steady state: ops and host reads per training step (forward + backward, Adagrad in backward), 256 "
          f"samples, 1 id per bag, d16, {args.device}")
    print_table(header, out)
    out = []
    for backend in backends:
        for dynamic in (False, True):
            counts = [worst(count_fresh(n, dynamic, backend, device=args.device)) for n in args.tables]
            out.append([backend, "dynamic" if dynamic else "static",
                        *[f"{o:,} ops / {r} reads" for o, r in counts],
                        f"{counts[-1][0] / counts[0][0]:.2f}x", str(counts[-1][1])])
    print(f"\nfresh start: the worst of the first 3 steps of a new collection, 256 samples, 0-3 ids per bag from "
          f"1,000 ids, d16, {args.device}")
    print_table(header, out)
    if not gpu:
        cases = [(b, d) for b in backends for d in (False, True)]
        counted = instructions_per_table(cases) if args.instructions and callgrind_available() else {}
        out = [[b, "dynamic" if d else "static", f"{python_per_table(b, d):.1f} us",
                f"{python_lines_per_table(b, d):.1f}"] + (
                    [f"{counted[b, d][0] / 1e3:,.1f} k (+- {counted[b, d][1] / 1e3:,.1f} k)"] if counted else [])
               for b, d in cases]
        print("\nPython per table per step: (step at batch 8 over 26 tables - over 2 tables) / 24, CPU time of the "
              "calling thread, one intra-op thread, medians of 7 interleaved runs of 60 steps; lines: Python lines run "
              "(a line tracer)" + ("; instructions: counted by callgrind over 10 steps, twice (load does not move "
                                   "them)" if counted else ""))
        print_table(["backend", "tables", "us per table", "lines per table"] + (
            ["instructions per table"] if counted else []), out)
    if gpu:
        out = []
        for samples in args.time_samples:
            for backend in backends:
                for dynamic in (False, True):
                    ms = [time_step(n, dynamic, backend, args.device, samples) * 1e3 for n in args.tables]
                    out.append([f"{samples}", backend, "dynamic" if dynamic else "static",
                                *[f"{m:.2f} ms" for m in ms], f"{ms[-1] / ms[0]:.1f}x"])
        print(f"\nstep time on {torch.cuda.get_device_name(args.device)} (median of 20 steps), d16, 100 k rows/table")
        print_table(["samples", "backend", "tables", *[f"{n} tables" for n in args.tables],
                     f"{args.tables[-1]}/{args.tables[0]}"], out)


if __name__ == "__main__":
    main()
