"""Small schema data sets for the tests, and a plain-Python reader of them (the oracle).

The oracle reads a CSV/TSV file with the ``csv`` module and applies the schema's rules written out
here, value by value: the ids from ``hash_text``, the missing id ``2**32 + j``, log1p of max(x, 0),
bags split on the separator with their empty items dropped and the last max_length items kept.
"""

from __future__ import annotations

import csv
import gzip
import math
import random
from pathlib import Path

import numpy as np

from hugeembed.data import hash_text

SCHEMA = """
format = "csv"
[label]
column = "clicked"
[dense.age]
transform = "log1p"
[dense.score]
fill = -1.5
[sparse.user_id]
[sparse.movie_id]
[sparse.genres]
separator = "|"
combiner = "mean"
[sparse.history]
separator = " "
table = "movie_id"
max_length = 4
combiner = "mean"
[sparse.city]
"""
HEADER = ["clicked", "user_id", "age", "city", "genres", "history", "movie_id", "score", "unused"]
GENRES = ["Action", "Comedy", "Drama", "Horror", "Sci-Fi", "Film-Noir"]


def write_rows(path: Path, n: int, seed: int = 0, delimiter: str = ",") -> Path:
    """n rows of string ids, numbers (some empty), bags (some empty), sequences, quoted cells."""
    rng = random.Random(seed)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", newline="") as f:
        w = csv.writer(f, delimiter=delimiter, lineterminator="\n")
        w.writerow(HEADER)
        for i in range(n):
            user = rng.choice(["196", "u,7", 'say "hi"', "ünï", "42", ""]) if i % 7 == 0 else f"u{rng.randint(0, 50)}"
            movie = str(rng.randint(0, 80))
            genres = "|".join(rng.sample(GENRES, rng.randint(0, 3)))
            history = " ".join(str(rng.randint(0, 80)) for _ in range(rng.randint(0, 7)))
            age = "" if rng.random() < 0.1 else str(rng.randint(-3, 90))
            score = "" if rng.random() < 0.1 else f"{rng.uniform(-2, 2):.3f}"
            city = rng.choice(["Paris", "New York", "", "São Paulo"])
            w.writerow([str(int(rng.random() < 0.3)), user, age, city, genres, history, movie, score, "x"])
    return path


def oracle(path: Path, delimiter: str = ","):
    """(dense [n, 2], cats [n, 3] (user_id, movie_id, city), labels, bags {genres, history}) of the file."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.DictReader(f, delimiter=delimiter))
    order = ["user_id", "movie_id", "genres", "history", "city"]  # schema order: the missing ids' j

    def one(name, text):
        return hash_text(text) if text != "" else 2**32 + order.index(name)

    def bag(name, text, sep, keep=None):
        items = [t for t in text.split(sep) if t != ""]
        if keep is not None:
            items = items[-keep:]
        return [hash_text(t) for t in items] or [2**32 + order.index(name)]

    dense = np.array([[math.log1p(max(float(r["age"] or 0), 0.0)), float(r["score"]) if r["score"] else -1.5]
                      for r in rows], np.float32)
    cats = np.array([[one("user_id", r["user_id"]), one("movie_id", r["movie_id"]), one("city", r["city"])]
                     for r in rows], np.int64).reshape(-1, 3)
    labels = np.array([float(r["clicked"]) for r in rows], np.float32)
    bags = {"genres": [bag("genres", r["genres"], "|") for r in rows],
            "history": [bag("history", r["history"], " ", 4) for r in rows]}
    return dense, cats, labels, bags
