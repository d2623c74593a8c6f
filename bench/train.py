"""End-to-end training throughput: our models vs the same dense model with other embedding layers.

Cases (all in this run, same synthetic Criteo-like data, same dense layers, SGD everywhere):
  ours       hugeembed DLRM / Wide&Deep on dynamic tables (rows created on first sight),
             batches read by the Loader from converted shards (background prefetch)
  ours-mem   the same with batches already in memory (no loading)
  dense      (a) DLRM's dense part alone on fixed random pooled embeddings: the MLP-bound ceiling
  ebag       (b) the same model with 26 torch.nn.EmbeddingBag(sparse=True) over ids hashed
             into Criteo-capped cardinalities, trained by torch.optim.SGD
  torchrec   (c) TorchRec's DLRM under DistributedModelParallel (gloo, 1 rank) with its fused
             in-backward SGD (when torchrec + fbgemm-gpu-cpu are installed)
  loader     Loader alone over the converted shards (rows/s)

    python bench/train.py                 # d16 and d64, batch 2048 and 8192
    python bench/train.py --quick         # d16, batch 2048, few steps
    python bench/train.py --device cuda   # on a GPU (torchrec only where its CUDA build is installed)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import fmt_rate, measure, print_table  # noqa: E402

from hugeembed._native import tune_malloc  # noqa: E402
from hugeembed.data import Batch, Loader, SyntheticConfig, SyntheticCriteo, convert, write_criteo_tsv  # noqa: E402
from hugeembed.functional import PooledEmbeddings  # noqa: E402
from hugeembed.models import make_model  # noqa: E402
from hugeembed.optim import SGD  # noqa: E402

LR = 0.01
MAX_CARD = 1_000_000


def synthetic(rows: int, seed: int = 0) -> SyntheticCriteo:
    return SyntheticCriteo(SyntheticConfig(seed=seed, max_cardinality=MAX_CARD))


def shards(rows: int, workdir: Path) -> Path:
    """Converted shards of `rows` synthetic rows (cached in workdir)."""
    out = workdir / f"shards-{rows}"
    if (out / "manifest.json").exists():
        return out
    tsv = workdir / f"rows-{rows}.tsv"
    write_criteo_tsv(tsv, rows, config=SyntheticConfig(seed=0, max_cardinality=MAX_CARD))
    convert([tsv], out)
    tsv.unlink()
    return out


class _BagAdapter(torch.nn.Module):
    """nn.EmbeddingBag tables standing in for a model's EmbeddingCollection (same output layout)."""

    def __init__(self, collection, cardinalities: dict[str, int]) -> None:
        super().__init__()
        self.plan = collection.lookup.plan
        self.where = collection.lookup._where
        self.bags = torch.nn.ModuleDict()
        for f in self.plan.features:
            t = self.plan.tables[self.plan.table_index[f.table]]
            rows = cardinalities[f.source_name]
            self.bags[f.name] = torch.nn.EmbeddingBag(rows, t.dim, mode="sum", sparse=True,
                                                      device=collection.device)
        self.rows = cardinalities

    def forward(self, sparse) -> PooledEmbeddings:
        groups = []
        for g in self.plan.groups:
            outs = []
            for f in g.pooled:
                spec = self.plan.features[f]
                jf = sparse.feature(spec.source_name)
                outs.append(self.bags[spec.name](jf.values % self.rows[spec.source_name], jf.offsets[:-1]))
            groups.append(torch.stack(outs, dim=1))
        return PooledEmbeddings(self.plan.pooled_names(), groups, self.where)


class _FixedPooled(torch.nn.Module):
    """Random pooled embeddings, fixed: the embedding layer costs nothing (the MLP-bound ceiling).

    They require grad, as real embeddings do: a DLRM step computes the gradient of its
    loss with respect to the embeddings (the interaction's input), part of the dense work."""

    def __init__(self, collection, batch: int) -> None:
        super().__init__()
        plan = collection.lookup.plan
        self.groups = [torch.randn(batch, len(g.pooled), g.dim, device=collection.device) * 0.01 for g in plan.groups]
        self.names, self.where = plan.pooled_names(), collection.lookup._where

    def forward(self, sparse) -> PooledEmbeddings:
        return PooledEmbeddings(self.names, [g.detach().requires_grad_() for g in self.groups], self.where)


def build(model_name: str, dim: int, kind: str, batch: int, cards: dict[str, int], device: str = "cpu"):
    kw = {"deep": (256, 128)} if model_name == "widedeep" else {}
    model, dense_params = make_model(model_name, embedding_dim=dim, sparse_optimizer=SGD(lr=LR), seed=0,
                                     device=device, **kw)
    params = list(dense_params)
    if kind == "ebag":
        model.embeddings = _BagAdapter(model.embeddings, cards)
        params += list(model.embeddings.parameters())
    elif kind == "dense":
        model.embeddings = _FixedPooled(model.embeddings, batch)
    return model, torch.optim.SGD(params, lr=LR)


def warmed(step, warm: int):
    """`step` after training on batches [0, warm) (untimed), then indexed from batch `warm` on."""
    for i in range(warm):
        step(i)
    return lambda i: step(warm + i)


def step_fn(model, opt, batches):
    def step(i: int) -> None:
        b = batches(i)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(b.dense, b.sparse), b.labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def bench_torchrec(dim: int, batch: int, mem_batches, cards: dict[str, int], iters: int, runs: int, warm: int):
    import torch.distributed as dist
    from torchrec import EmbeddingBagCollection, KeyedJaggedTensor
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("gloo", rank=0, world_size=1)
    names = list(cards)
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=f"t_{n}", embedding_dim=dim, num_embeddings=cards[n],
                                                            feature_names=[n]) for n in names], device=torch.device("meta"))
    model = DLRM(ebc, dense_in_features=13, dense_arch_layer_sizes=[512, 256, dim],
                 over_arch_layer_sizes=[512, 512, 256, 1])
    apply_optimizer_in_backward(torch.optim.SGD, model.sparse_arch.parameters(), {"lr": LR})
    dmp = DistributedModelParallel(model, device=torch.device("cpu"))
    dense_params = [p for n, p in dmp.named_parameters() if "embedding_bags" not in n]
    opt = torch.optim.SGD(dense_params, lr=LR)
    kjts = []
    for b in mem_batches:
        vals = torch.cat([b.sparse.feature(n).values % cards[n] for n in names])
        kjts.append((b.dense, KeyedJaggedTensor.from_lengths_sync(names, vals, b.sparse.lengths()), b.labels))

    def step(i: int) -> None:
        dense, kjt, labels = kjts[i % len(kjts)]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(dmp(dense, kjt).squeeze(1), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return measure(warmed(step, warm), iters, runs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", type=int, nargs="+", default=[16, 64])
    p.add_argument("--batches", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--iters", type=int, default=3, help="steps per timed run")
    p.add_argument("--cases", nargs="+", default=["dense", "ours", "ours-mem", "ebag", "torchrec", "widedeep"])
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--warmup-batches", type=int, default=40,
                   help="distinct batches every case trains on before timing: dynamic tables then run in "
                        "their steady state (new ids still arrive) instead of the first steps of a run")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "hugeembed-bench"))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", default="cpu", help="cpu, or cuda: models, tables and batches on the GPU")
    args = p.parse_args(argv)
    dev = args.device
    if dev != "cpu" and "torchrec" in args.cases:  # its DMP here is built for gloo on the CPU
        print("# the TorchRec reference runs on the CPU only in this bench: left out", file=sys.stderr)
        args.cases = [c for c in args.cases if c != "torchrec"]
    if args.quick:
        args.dims, args.batches, args.runs, args.iters, args.warmup_batches = [16], [2048], 3, 2, 4
    torch.set_num_threads(args.threads)
    tune_malloc()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    gen = synthetic(0)
    cards = {f"C{j + 1}": c for j, c in enumerate(gen.cardinalities)}
    where = torch.cuda.get_device_name(dev) if dev != "cpu" else f"threads {args.threads}"
    print(f"# {where}, torch {torch.__version__}, SGD lr {LR}, synthetic Criteo (cards <= {MAX_CARD})")
    rows_out = []
    for batch in args.batches:
        warm = args.warmup_batches
        n_steps = warm + 3 + args.runs * args.iters  # warm-up batches, measure()'s 2, the runs
        total_rows = (n_steps + 2) * batch
        mem = [Batch.from_block(gen.rows(i * batch, batch)).to(dev) for i in range(n_steps + 2)]
        at = lambda i: mem[i % len(mem)]
        shard_dir = shards(total_rows, workdir) if "ours" in args.cases else None
        for dim in args.dims:
            res = {}
            for case in args.cases:
                try:
                    if case == "torchrec":
                        t = bench_torchrec(dim, batch, mem, cards, args.iters, args.runs, warm)
                    elif case == "ours":
                        model, opt = build("dlrm", dim, "ours", batch, cards, dev)
                        it = (b.to(dev, non_blocking=True) for b in Loader(shard_dir, batch, drop_last=True,
                                                                        prefetch=4, pin_memory=dev != "cpu"))
                        t = measure(warmed(step_fn(model, opt, lambda i: next(it)), warm), args.iters, args.runs)
                    elif case == "widedeep":
                        for kind in ("ours", "ebag", "dense"):
                            model, opt = build("widedeep", dim, kind, batch, cards, dev)
                            tt = measure(warmed(step_fn(model, opt, at), warm), args.iters, args.runs)
                            res[f"widedeep-{kind}"] = tt.rate(batch)
                        continue
                    else:
                        kind = "ours" if case == "ours-mem" else case
                        model, opt = build("dlrm", dim, kind, batch, cards, dev)
                        t = measure(warmed(step_fn(model, opt, at), warm), args.iters, args.runs)
                    res[case] = t.rate(batch)
                except Exception as e:  # a reference that cannot run here is reported, not fatal
                    print(f"# {case} d{dim} b{batch} failed: {type(e).__name__}: {e}", file=sys.stderr)
            if shard_dir is not None:
                loader = Loader(shard_dir, batch, drop_last=True, prefetch=4)
                t0 = time.perf_counter()
                n = sum(b.batch_size for b in loader)
                res["loader"] = n / (time.perf_counter() - t0)
            ours = res.get("ours")
            ratio = lambda a, b: f"{res[a] / res[b]:.2f}x" if a in res and b in res else "-"
            rows_out.append([f"d{dim} b{batch}"] + [f"{fmt_rate(res[c])}/s" if c in res else "-" for c in
                            ("ours", "ours-mem", "dense", "ebag", "torchrec", "widedeep-ours", "widedeep-ebag",
                             "widedeep-dense", "loader")]
                            + [ratio("ours", "dense"), ratio("ours", "ebag"), ratio("ours", "torchrec"),
                               ratio("widedeep-ours", "widedeep-ebag"), ratio("widedeep-ours", "widedeep-dense"),
                               ratio("loader", "ours")])
            print_table(["case", "ours", "ours(mem)", "(a) dense", "(b) ebag", "(c) torchrec", "W&D ours", "W&D ebag",
                         "W&D dense", "loader rows", "ours/a", "ours/b", "ours/c", "W&D ours/b", "W&D ours/dense",
                         "loader/ours"], rows_out)
            print()
            del ours
    return 0


if __name__ == "__main__":
    sys.exit(main())
