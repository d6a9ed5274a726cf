"""Metric writers (JSONL + TensorBoard event files) and the loss-curve plot."""

from __future__ import annotations

import json
import os
from typing import Any

import jax


def _summary_writer(logdir: str):
    """tensorboardX's SummaryWriter. Its writer module imports torch when torch is installed
    (seconds of start-up, at every `relf-jax train`) only to accept torch tensors; the scalars
    written here are floats, so the first import runs with torch hidden from it, and torch stays
    importable afterwards."""
    import sys

    if "tensorboardX" not in sys.modules and "torch" not in sys.modules:
        sys.modules["torch"] = None  # `import torch` raises ImportError during this import only
        try:
            import tensorboardX  # noqa: F401
        finally:
            del sys.modules["torch"]
    from tensorboardX import SummaryWriter

    return SummaryWriter(logdir)


class MetricsWriter:
    """Appends one JSON object per call to ``metrics.jsonl`` and mirrors scalars to TensorBoard.

    Only process 0 writes, so every host of a pod can call it.
    """

    def __init__(self, workdir: str, tensorboard: bool = True):
        self.enabled = jax.process_index() == 0
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._tb = None
        if self.enabled:
            os.makedirs(workdir, exist_ok=True)
            if tensorboard:
                self._tb = _summary_writer(os.path.join(workdir, "tensorboard"))

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": int(step), **{k: float(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in row.items():
                if k != "step":
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None


def read_metrics(path: str) -> list[dict[str, float]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_loss_curve(metrics_path: str, out_png: str, title: str = "training loss") -> str | None:
    """Plot train (and eval) loss against step from a metrics.jsonl; returns the PNG path."""
    rows = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    if not train:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(*zip(*train), label="train")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png
