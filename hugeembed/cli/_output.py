"""Printing for the CLI: progress bar, summary tables, JSON, plots (stderr for progress, stdout for results)."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from .._durable import atomic_write_text
from .._format import human_bytes, human_count

__all__ = ["Progress", "print_summary", "write_json", "plot_history", "human_bytes", "human_rate",
           "check_output_paths"]


def check_output_paths(**flags: str | None) -> None:
    """Fails before any work on an output path that cannot be a file (``--summary-json DIR``), so a run is
    not lost at its end.  Keys are flag names without the dashes (``summary_json=...``)."""
    from ..errors import ConfigError

    for flag, value in flags.items():
        if value is None:
            continue
        path, name = Path(value), "--" + flag.replace("_", "-")
        if path.is_dir():
            raise ConfigError(f"{name} {value} is a directory; give a file path")
        parent = next((p for p in path.parents if p.exists()), None)
        if parent is not None and not parent.is_dir():
            raise ConfigError(f"{name} {value}: {parent} is a file, not a directory")


def human_rate(x: float) -> str:
    return human_count(x).rstrip()


class Progress:
    """A progress bar on stderr: tqdm when installed and stderr is a terminal, else plain lines."""

    def __init__(self, enabled: bool = True, every_s: float = 5.0, notes: bool = True) -> None:
        self.enabled, self.notes = enabled, notes
        self.every_s = every_s
        self._bar = None
        self._last = 0.0
        self._total: int | None = None

    def __call__(self, event: str, info: dict[str, Any]) -> None:
        if event == "note":  # something the user should know (a warning): shown even when quiet
            if self.notes:
                (self._bar.write if self._bar is not None else _eprint)(f"note: {info['message']}")
            return
        if not self.enabled:
            return
        if event == "start":
            self._total = info.get("total_steps")
            print(f"training {info['model']} on {info['device']}: {info['data']}"
                  + (f" (resumed at step {info['resumed_at']})" if info.get("resumed_at") else ""), file=sys.stderr)
            self._open(info.get("resumed_at", 0))
        elif event == "step":
            text = f"loss {info['loss']:.4f}, {human_rate(info['samples_per_s'])} samples/s" + (
                f", auc {info['auc']:.4f}" if info.get("auc") is not None else "") + (
                f", cache hits {info['cache_hit_rate']:.1%}" if info.get("cache_hit_rate") is not None else "")
            if self._bar is not None:
                self._bar.n = info["step"]
                self._bar.set_postfix_str(text, refresh=True)
            elif time.monotonic() - self._last >= self.every_s:
                self._last = time.monotonic()
                total = f"/{self._total}" if self._total else ""
                print(f"step {info['step']}{total}: {text}", file=sys.stderr, flush=True)
        elif event == "eval":
            msg = (f"eval at step {info['step']}: auc {info['auc']:.4f}, logloss {info['logloss']:.4f}, "
                   f"copc {info['copc']:.3f}")
            (self._bar.write if self._bar is not None else _eprint)(msg)
        elif event == "checkpoint":
            msg = f"snapshot {info['path']}" + (" (delta)" if info.get("kind") == "delta" else "")
            (self._bar.write if self._bar is not None else _eprint)(msg)
        elif event == "end" and self._bar is not None:
            self._bar.close()
            self._bar = None

    def _open(self, start: int) -> None:
        if not sys.stderr.isatty():
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=self._total, initial=start, unit="step", file=sys.stderr, dynamic_ncols=True)


def _eprint(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4f}" if abs(v) < 100 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def print_summary(title: str, rows: list[tuple[str, Any]]) -> None:
    """A two-column table on stdout."""
    width = max(len(k) for k, _ in rows)
    print(title)
    print("-" * (width + 20))
    for k, v in rows:
        print(f"{k.ljust(width)}  {_fmt(v)}")
    sys.stdout.flush()


def write_json(path: str | Path, data: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def plot_history(path: str | Path, history: dict[str, list[float]], title: str,
                 best_auc: float | None = None) -> None:
    """The run's curves to a PNG (needs matplotlib: pip install "hugeembed[plot]"):

    * log loss: training (mean since the previous point) and held-out, on one axis, so
      overfitting shows as the two parting;
    * held-out AUC, with the best possible AUC dashed when it is known (synthetic data);
    * COPC (observed / predicted clicks) with 1 dashed: calibration drift over the run.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError('--plot needs matplotlib: pip install "hugeembed[plot]"') from None
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    a.plot(history["step"], history["loss"], label="training")
    a.plot(history["eval_step"], history["logloss"], marker="o", label="held-out")
    a.set_ylabel("log loss")
    a.legend()
    b.plot(history["eval_step"], history["auc"], marker="o", label="held-out")
    if best_auc is not None:
        b.axhline(best_auc, linestyle="--", color="gray", label=f"best possible ({best_auc:.4f})")
    b.set_ylabel("held-out AUC")
    b.legend()
    c.plot(history["eval_step"], history.get("copc", []), marker="o")
    c.axhline(1.0, linestyle="--", color="gray")
    c.set_ylabel("held-out COPC (clicks / predicted)")
    for ax in (a, b, c):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
