"""Per-deployment cost models that turn a workload surface (or a scalar) into a predicted
request cost, fitted to timed requests by weighted least squares (methods.md section 4).

The surface model predicts

    C = intercept + alpha * m + beta * E[N] + sum_{b,s} K[b, s] * S[b, s],
    K = W + delta * (m - m_mean),

with m the prompt length in blocks (prompt tokens / d, may be fractional), E[N] the first-column
sum of S, W >= 0 the per-cell step cost [B_max, d], delta the extra cost of one step per prompt
block of context, and m_mean the mean m of the fitting set (so W is the step cost at an average
prompt). The surface describes the request and the cost model the hardware: only this is refit
when the hardware changes.

Identifiability. S[0, 0] = 1 and the first column is P(N >= b + 1) for every valid surface, so
the data alone cannot tell `intercept` from W[0, 0], nor `beta` from a common shift of W[:, 0]:
moving cost between them leaves every prediction unchanged. The fit settles these directions
with its smoothness penalty, i.e. W[:, 0] is taken to continue W's trend along the step axis
(flat for first differences, linear for second differences) and W[0, 0] its neighbours. When
the true W follows that convention the split is recovered; otherwise predictions are still
right but the split between intercept / beta and W's first column is a convention.

A scalar baseline, `ScalarCostModel`, predicts cost = a + b * x from one number per request
(predicted output length, predicted total steps, prompt length).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from scipy.linalg import solve_triangular
from scipy.optimize import lsq_linear

WEIGHTINGS = ("relative", "uniform")


def _vector(name: str, x: Any) -> np.ndarray:
    a = np.asarray(x, np.float64)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} must be finite")
    return a


def _costs(costs: Any, n: int) -> np.ndarray:
    c = _vector("costs", costs)
    if c.shape != (n,):
        raise ValueError(f"costs must have one value per request ({n}), got {c.shape[0]}")
    if np.any(c <= 0):
        raise ValueError("costs must be positive")
    return c


def _weights(weights: str | np.ndarray, costs: np.ndarray) -> np.ndarray:
    """Per-request WLS weights [n], rescaled so that mean(w * cost^2) = 1 (unit-free rows)."""
    if isinstance(weights, str):
        if weights not in WEIGHTINGS:
            raise ValueError(f"weights must be one of {WEIGHTINGS} or an array, got {weights!r}")
        # "relative": 1 / cost^2 makes each residual a relative error
        w = 1.0 / costs**2 if weights == "relative" else np.ones_like(costs)
    else:
        w = _vector("weights", weights)
        if w.shape != costs.shape or np.any(w <= 0):
            raise ValueError(f"a weights array needs {costs.size} positive values")
    return w / np.mean(w * costs**2)


def _difference_rows(n_blocks: int, block_size: int, order: int) -> np.ndarray:
    """Finite differences of a flattened [n_blocks, block_size] grid along both axes.

    `order` (1 or 2) drops to 1 along an axis of length 2, which has no second difference
    (without it nothing would tie W's first column to the rest along that axis).
    """

    def diff(size: int) -> np.ndarray:
        if size == 1:
            return np.zeros((0, 1))  # np.diff with n=0 would hand back the identity
        return np.diff(np.eye(size), n=min(order, size - 1), axis=0)

    along_blocks = np.kron(diff(n_blocks), np.eye(block_size))
    along_steps = np.kron(np.eye(n_blocks), diff(block_size))
    return np.concatenate([along_blocks, along_steps], axis=0)


@dataclasses.dataclass(frozen=True, eq=False)
class CostModel:
    """C = intercept + alpha * m + beta * E[N] + sum(K * S), K = W + delta * (m - m_mean)."""

    alpha: float
    beta: float
    delta: float
    m_mean: float
    W: np.ndarray
    intercept: float = 0.0

    def __post_init__(self):
        for name in ("alpha", "beta", "delta", "m_mean", "intercept"):
            value = float(getattr(self, name))
            if not np.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value}")
            object.__setattr__(self, name, value)
        W = np.array(self.W, np.float64)
        if W.ndim != 2 or W.size == 0 or not np.all(np.isfinite(W)):
            raise ValueError(f"W must be a finite, non-empty [B_max, d] matrix, got shape {W.shape}")
        W.setflags(write=False)  # frozen means frozen: no edits through model.W[...]
        object.__setattr__(self, "W", W)

    @property
    def max_blocks(self) -> int:
        return self.W.shape[0]

    @property
    def block_size(self) -> int:
        return self.W.shape[1]

    def step_costs(self, prompt_blocks: float | np.ndarray) -> np.ndarray:
        """K = W + delta * (m - m_mean): [..., B_max, d] for prompt_blocks of shape [...]."""
        m = np.asarray(prompt_blocks, np.float64)
        return self.W + self.delta * (m - self.m_mean)[..., None, None]

    def predict(self, prompt_blocks: np.ndarray, surfaces: np.ndarray) -> np.ndarray:
        """Predicted costs [n] of requests with prompt_blocks [n] and surfaces [n, B_max, d].

        Any batch shape works as long as prompt_blocks broadcasts against surfaces[..., 0, 0].
        """
        m = np.asarray(prompt_blocks, np.float64)
        S = np.asarray(surfaces, np.float64)
        if S.ndim < 2 or S.shape[-2:] != self.W.shape:
            raise ValueError(f"surfaces must be [..., {self.max_blocks}, {self.block_size}], got {S.shape}")
        try:
            np.broadcast_shapes(m.shape, S.shape[:-2])
        except ValueError:
            msg = f"prompt_blocks {m.shape} does not match the surfaces' batch shape {S.shape[:-2]}"
            raise ValueError(msg) from None
        expected_blocks = S[..., 0].sum(axis=-1)
        cell_cost = np.einsum("...bs,bs->...", S, self.W)
        growth = self.delta * (m - self.m_mean) * S.sum(axis=(-2, -1))
        return self.intercept + self.alpha * m + self.beta * expected_blocks + cell_cost + growth

    def sample_costs(self, prompt_blocks: np.ndarray, surfaces: np.ndarray, n: int = 512,
                     seed: int = 0) -> np.ndarray:
        """Cost samples [r, n] of requests with prompt_blocks [r] and surfaces [r, B_max, d]: the
        surface read as a distribution (N from its first column, P(N >= b+1) = S[b, 0]; each
        existing block's T_b from its row, P(T_b >= s+1) = S[b, s] / S[b, 0], blocks
        independent), each draw priced like `predict` prices the surface. Their mean is
        `predict`'s value (up to sampling error); quantiles give other point predictions (the
        median is the MAE-optimal one, while `predict`, the mean, is what SJF's expected work
        uses)."""
        m = np.asarray(prompt_blocks, np.float64).reshape(-1)
        S = np.clip(np.asarray(surfaces, np.float64), 0.0, 1.0)
        if S.ndim != 3 or S.shape[1:] != self.W.shape or S.shape[0] != m.shape[0]:
            raise ValueError(f"need prompt_blocks [r] and surfaces [r, {self.max_blocks}, {self.block_size}], "
                             f"got {m.shape} and {S.shape}")
        rng = np.random.default_rng(seed)
        nb, d = self.W.shape
        exists = S[:, :, 0]  # P(N >= b + 1)
        cond = S / np.maximum(exists[..., None], 1e-12)  # P(T_b >= s + 1 | block b exists)
        K = self.step_costs(m)  # [r, B_max, d]
        out = np.empty((m.shape[0], n))
        for i in range(m.shape[0]):
            blocks = (rng.random((n, 1)) < exists[i][None, :]).sum(1)  # [n]
            steps = (rng.random((n, nb, 1)) < cond[i][None]).sum(-1)  # [n, B_max]
            cells = ((np.arange(d)[None, None, :] < steps[..., None])
                     & (np.arange(nb)[None, :, None] < blocks[:, None, None]))  # [n, B_max, d]
            out[i] = self.intercept + self.alpha * m[i] + self.beta * blocks + (cells * K[i][None]).sum((1, 2))
        return out

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (floats and nested lists) that `from_dict` reads back."""
        return {
            "alpha": self.alpha,
            "beta": self.beta,
            "delta": self.delta,
            "m_mean": self.m_mean,
            "intercept": self.intercept,
            "W": self.W.tolist(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostModel:
        return cls(
            alpha=d["alpha"], beta=d["beta"], delta=d["delta"], m_mean=d["m_mean"],
            W=np.asarray(d["W"], np.float64), intercept=d.get("intercept", 0.0),
        )


def fit_cost_model(
    prompt_blocks: np.ndarray,
    surfaces: np.ndarray,
    costs: np.ndarray,
    *,
    smoothness: float = 1e-2,
    weights: str | np.ndarray = "relative",
    fit_intercept: bool = True,
    penalty_order: int = 1,
) -> CostModel:
    """Fit a `CostModel` to n timed requests by penalised weighted least squares, W >= 0.

    prompt_blocks: [n] prompt lengths in blocks; surfaces: [n, B_max, d] (usually the realised
    0/1 executed maps, any surfaces work); costs: [n] positive measured costs, any unit.
    weights: "relative" (1 / cost^2: the fit minimises relative error), "uniform", or [n].

    Objective, in unit-free terms (rows weighted so mean(w * cost^2) = 1; W measured in units of
    c_ref / steps_ref, the typical cost over the typical number of steps):

        sum_i w_i (pred_i - cost_i)^2 + smoothness * ||D W~||^2 + tiny ridge,

    D the differences of W along the block axis and the step axis: first differences
    (penalty_order=1, the default) pull W towards flat, second differences (penalty_order=2)
    towards a plane, so a W linear in block index (cost growing with context) goes unpenalised
    and the intercept / beta split (module docstring) is then exact for such a W. So
    smoothness = 1e-2 makes a jump of one typical per-step cost between two neighbouring cells
    cost as much as a 10 % error on one request, whatever the unit of cost, and its pull fades as
    requests are added. The penalty also gives cells no request executed their W (continuing
    their neighbours); the ridge (1e-6 of the penalty, scaled to each parameter's typical
    contribution) only makes the system non-singular.
    """
    m, S, c = _fit_inputs(prompt_blocks, surfaces, costs, smoothness, penalty_order)
    w = _weights(weights, c)
    n, n_blocks, block_size = S.shape
    total_steps = S.sum(axis=(1, 2))
    steps_ref = float(total_steps.mean())
    if steps_ref <= 0:
        raise ValueError("surfaces are all zero: nothing to fit the step costs to")
    m_mean = float(m.mean())
    c_ref = float(np.sqrt(np.sum(w * c**2) / np.sum(w)))

    # columns: [intercept?], alpha, beta, delta, W cells (row-major)
    head = [m, S[:, :, 0].sum(axis=1), (m - m_mean) * total_steps]
    if fit_intercept:
        head.insert(0, np.ones(n))
    n_head = len(head)
    X = np.concatenate([np.stack(head, axis=1), S.reshape(n, -1)], axis=1)
    A, b, scale = _penalised_system(X, c, w, n_head, (n_blocks, block_size), smoothness, penalty_order,
                                    w_unit=steps_ref / c_ref)
    theta = _solve_nonnegative_cells(A, b, n_head) / scale
    theta[n_head:] = np.maximum(theta[n_head:], 0.0)  # bvls may leave -0.0 / round-off at the bound
    intercept = float(theta[0]) if fit_intercept else 0.0
    alpha, beta, delta = (float(v) for v in theta[n_head - 3 : n_head])
    return CostModel(
        alpha=alpha, beta=beta, delta=delta, m_mean=m_mean,
        W=theta[n_head:].reshape(n_blocks, block_size), intercept=intercept,
    )


def _fit_inputs(prompt_blocks, surfaces, costs, smoothness: float, penalty_order: int):
    """(m [n], S [n, B_max, d], costs [n]) as float64, checked."""
    m = _vector("prompt_blocks", prompt_blocks)
    n = m.size
    if n < 2:
        raise ValueError(f"need at least 2 requests to fit a cost model, got {n}")
    S = np.asarray(surfaces, np.float64)
    if S.ndim != 3 or S.shape[0] != n or 0 in S.shape:
        raise ValueError(f"surfaces must be [n={n}, B_max, d], got shape {S.shape}")
    if not np.all(np.isfinite(S)):
        raise ValueError("surfaces must be finite")
    c = _costs(costs, n)
    if not (np.isfinite(smoothness) and smoothness >= 0):
        raise ValueError(f"smoothness must be a finite number >= 0, got {smoothness}")
    if penalty_order not in (1, 2):
        raise ValueError(f"penalty_order must be 1 or 2, got {penalty_order}")
    return m, S, c


def _penalised_system(X: np.ndarray, c: np.ndarray, w: np.ndarray, n_head: int, grid: tuple[int, int],
                      smoothness: float, penalty_order: int, w_unit: float):
    """(A, b, scale): the weighted data rows, the smoothness rows on the W cells and the ridge,
    for u = theta * scale with every column of unit size (conditioning). A column no request
    touches gets the scale of a typical per-step cost (`w_unit`) instead."""
    n = X.shape[0]
    n_blocks, block_size = grid
    sw = np.sqrt(w)
    A_data, b_data = X * sw[:, None], c * sw
    scale = np.sqrt(np.mean(A_data**2, axis=0))
    fallback = np.concatenate([np.full(n_head, np.sqrt(np.mean(w))), np.full(n_blocks * block_size, w_unit)])
    scale = np.where(scale > 0, scale, fallback)

    D = _difference_rows(n_blocks, block_size, penalty_order)
    A_pen = np.zeros((D.shape[0], X.shape[1]))
    A_pen[:, n_head:] = np.sqrt(smoothness) * w_unit * D
    ridge = 1e-6 * smoothness + 1e-14
    A = np.concatenate([A_data, A_pen], axis=0) / scale[None, :]
    A = np.concatenate([A, np.sqrt(ridge) * np.eye(X.shape[1])], axis=0)
    b = np.concatenate([b_data, np.zeros(A.shape[0] - n)])
    return A, b, scale


def _solve_nonnegative_cells(A: np.ndarray, b: np.ndarray, n_head: int) -> np.ndarray:
    """argmin ||A u - b|| with the first `n_head` entries free and the rest (the W cells) >= 0."""
    n_cols = A.shape[1]
    lower = np.concatenate([np.full(n_head, -np.inf), np.zeros(n_cols - n_head)])
    # ||A u - b|| = ||R u - Q^T b|| + const: solve with the square R, not the tall A; the ridge
    # rows keep R non-singular, and the bounded solver only runs if some W comes out negative
    Q, R = np.linalg.qr(A)
    rhs = Q.T @ b
    u = solve_triangular(R, rhs)
    if np.any(u < lower):
        u = lsq_linear(R, rhs, bounds=(lower, np.full(n_cols, np.inf)), method="bvls").x
    return u


@dataclasses.dataclass(frozen=True)
class ScalarCostModel:
    """cost = a + b * x for one scalar per request (the baselines DWS is compared against)."""

    a: float
    b: float

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Predicted costs, same shape as x."""
        return self.a + self.b * np.asarray(x, np.float64)

    def to_dict(self) -> dict[str, float]:
        return {"a": float(self.a), "b": float(self.b)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ScalarCostModel:
        return cls(a=float(d["a"]), b=float(d["b"]))


def fit_scalar_cost(x: np.ndarray, costs: np.ndarray, weights: str | np.ndarray = "relative") -> ScalarCostModel:
    """Weighted least squares fit of cost ~ a + b * x; x: [n] scalar predictor, costs: [n] > 0."""
    x = _vector("x", x)
    if x.size < 2:
        raise ValueError(f"need at least 2 requests to fit a cost model, got {x.size}")
    c = _costs(costs, x.size)
    if np.all(x == x[0]):
        raise ValueError("x is constant: the slope is undetermined")
    sw = np.sqrt(_weights(weights, c))
    X = np.stack([np.ones_like(x), x], axis=1) * sw[:, None]
    (a, b), *_ = np.linalg.lstsq(X, c * sw, rcond=None)
    return ScalarCostModel(a=float(a), b=float(b))
