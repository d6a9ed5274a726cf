"""Error metrics for cost predictions: absolute, relative and rank agreement (a scheduler only
needs the order of predicted costs to be right, so Kendall's tau is the one SJF cares about).
"""

from __future__ import annotations

import numpy as np
from scipy import stats


def _pair(pred: np.ndarray, true: np.ndarray, min_size: int = 1) -> tuple[np.ndarray, np.ndarray]:
    p = np.asarray(pred, np.float64).reshape(-1)
    t = np.asarray(true, np.float64).reshape(-1)
    if p.shape != t.shape:
        raise ValueError(f"pred and true must have the same number of values, got {p.size} and {t.size}")
    if p.size < min_size:
        raise ValueError(f"need at least {min_size} values, got {p.size}")
    if not (np.all(np.isfinite(p)) and np.all(np.isfinite(t))):
        raise ValueError("pred and true must be finite")
    return p, t


def mae(pred: np.ndarray, true: np.ndarray) -> float:
    """Mean absolute error, mean |pred - true|."""
    p, t = _pair(pred, true)
    return float(np.mean(np.abs(p - t)))


def mape(pred: np.ndarray, true: np.ndarray) -> float:
    """Mean absolute relative error, mean |pred - true| / true (a fraction, not a percentage).

    `true` must be positive (costs are).
    """
    p, t = _pair(pred, true)
    if np.any(t <= 0):
        raise ValueError("mape needs positive true values")
    return float(np.mean(np.abs(p - t) / t))


def kendall_tau(a: np.ndarray, b: np.ndarray) -> float:
    """Kendall's tau-b between two rankings (ties handled); nan if either input is constant."""
    x, y = _pair(a, b, min_size=2)
    if np.all(x == x[0]) or np.all(y == y[0]):
        return float("nan")  # tau-b is 0/0 with no untied pair; say so rather than guess
    return float(stats.kendalltau(x, y, variant="b").statistic)


def cost_errors(pred: np.ndarray, true: np.ndarray) -> dict[str, float]:
    """{"mae", "mape", "kendall_tau"} of predicted against measured costs, as plain floats."""
    return {"mae": mae(pred, true), "mape": mape(pred, true), "kendall_tau": kendall_tau(pred, true)}
