"""Denoising workload surfaces: the per-request [blocks x steps] picture of diffusion decoding
work (methods.md section 4).

A request decoded by a block-diffusion LM emits N >= 1 output blocks, and block b (0-indexed)
takes T_b denoising steps, 1 <= T_b <= d (d = block size). On a grid of B_max blocks x d steps,
cell [b, s] (0-indexed) means "block b exists and took at least s + 1 steps". A realised run is
a 0/1 map of the cells it executed; a surface is the expectation of that map,

    S[b, s] = P(N >= b + 1) * P(T_b >= s + 1 | block b exists),

so S.sum() is the expected total number of steps and the first column sums to E[N].

Invariants of every surface (checked by `check_surface`): values in [0, 1]; each row is
non-increasing along the step axis; the first column is non-increasing along the block axis
(it is P(N >= b + 1)); every cell is at most the first cell of its row (a block is executed at
most as often as it exists). The full surface is NOT monotone along the block axis in general:
one request with T = [1, 5] has S[0, 1] = 0 < S[1, 1] = 1.

Everything here is numpy (float64 unless stated); shapes are [B_max, d] for one surface and
[..., B_max, d] for a batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _steps_array(steps_per_block: Sequence[int] | np.ndarray) -> np.ndarray:
    """`steps_per_block` as a 1-D int64 array; ValueError on non-integer or non-1-D input."""
    a = np.asarray(steps_per_block)
    if a.ndim != 1:
        raise ValueError(f"steps_per_block must be 1-D (one step count per block), got shape {a.shape}")
    whole = np.issubdtype(a.dtype, np.integer) or (
        np.issubdtype(a.dtype, np.floating) and np.all(np.isfinite(a)) and np.all(a == np.round(a))
    )
    if a.size and not whole:
        raise ValueError(f"step counts must be integers, got {a.tolist()}")
    return a.astype(np.int64)


def executed_map(steps_per_block: Sequence[int] | np.ndarray, max_blocks: int, block_size: int) -> np.ndarray:
    """The 0/1 map [max_blocks, block_size] (float64) of the cells one realised run executed.

    steps_per_block: [N] step counts T_b of the N output blocks, each in 1..block_size.
    Row b has its first T_b cells set for b < N; rows b >= N are zero.
    """
    if max_blocks < 1 or block_size < 1:
        raise ValueError(f"max_blocks and block_size must be >= 1, got {max_blocks}, {block_size}")
    t = _steps_array(steps_per_block)
    if t.size == 0:
        raise ValueError("a run has at least one output block (got an empty step list)")
    if t.size > max_blocks:
        raise ValueError(f"run has {t.size} blocks, more than max_blocks={max_blocks}")
    bad = (t < 1) | (t > block_size)
    if np.any(bad):
        raise ValueError(
            f"step counts must lie in 1..{block_size}, got {t[bad].tolist()} at blocks {np.flatnonzero(bad).tolist()}"
        )
    out = np.zeros((max_blocks, block_size), np.float64)
    out[: t.size] = np.arange(block_size)[None, :] < t[:, None]
    return out


def empirical_surface(runs: Sequence[Sequence[int]], max_blocks: int, block_size: int) -> np.ndarray:
    """Mean of the executed maps of `runs` (each a list of step counts): [max_blocks, block_size]."""
    if len(runs) == 0:
        raise ValueError("empirical_surface needs at least one run")
    total = np.zeros((max_blocks, block_size), np.float64)
    for run in runs:
        total += executed_map(run, max_blocks, block_size)
    return total / len(runs)


def _as_surface(S: np.ndarray) -> np.ndarray:
    S = np.asarray(S)
    if S.ndim < 2:
        raise ValueError(f"a surface has shape [..., B_max, d], got shape {S.shape}")
    return S


def surface_stats(S: np.ndarray) -> dict[str, float | np.ndarray]:
    """{"expected_steps": S summed over its last two axes, "expected_blocks": first-column sum}.

    S: [B, d] gives plain floats; [..., B, d] gives arrays of shape [...].
    """
    S = _as_surface(S)
    steps = S.sum(axis=(-2, -1))
    blocks = S[..., 0].sum(axis=-1)
    if S.ndim == 2:
        return {"expected_steps": float(steps), "expected_blocks": float(blocks)}
    return {"expected_steps": steps, "expected_blocks": blocks}


def _horizons(horizons: Sequence[int] | np.ndarray) -> np.ndarray:
    h = np.asarray(horizons)
    if h.ndim != 1:
        raise ValueError(f"horizons must be 1-D, got shape {h.shape}")
    if h.size and (not np.all(np.isfinite(h.astype(np.float64))) or np.any(h != np.round(h)) or np.any(h < 0)):
        raise ValueError(f"horizons must be non-negative integers, got {h.tolist()}")
    return h.astype(np.int64)


def workload_curve(S: np.ndarray, horizons: Sequence[int] | np.ndarray) -> np.ndarray:
    """E[sum_b min(T_b, h)] for each horizon h: sum_b sum_{s < h} S[b, s].

    S: [..., B, d]; horizons: [H] non-negative integers (h >= d counts every step).
    Returns [..., H]; h = 1 gives E[N], h = d gives the expected total steps.
    """
    S = _as_surface(S)
    h = np.minimum(_horizons(horizons), S.shape[-1])
    # column k of the running sum counts the first k steps of every block
    per_block = np.concatenate([np.zeros(S.shape[:-1] + (1,), S.dtype), np.cumsum(S, axis=-1)], axis=-1)
    return per_block.sum(axis=-2)[..., h]


def workload_curve_from_steps(
    steps_per_block: Sequence[int] | np.ndarray, horizons: Sequence[int] | np.ndarray
) -> np.ndarray:
    """sum_b min(T_b, h) of one realised run for each horizon h: [H] float64."""
    t = _steps_array(steps_per_block)
    if t.size == 0 or np.any(t < 1):
        raise ValueError(f"a run has at least one block and every T_b >= 1, got {t.tolist()}")
    h = _horizons(horizons)
    return np.minimum(t[None, :], h[:, None]).sum(axis=1).astype(np.float64)


def check_surface(S: np.ndarray, atol: float = 1e-6) -> list[str]:
    """The invariants `S` ([B, d] or [..., B, d]) violates, as messages; empty if it is valid.

    Checked: finite; values in [0, 1]; non-increasing along the step axis in every row; first
    column non-increasing along the block axis (P(N >= b + 1)); every cell <= the first cell of
    its row. Not checked: S[0, 0] = 1 (true for realised and empirical surfaces, not required of
    predictor output), and monotonicity of columns s > 0 along the block axis, which does not
    hold in general (T = [1, 5] gives S[0, 1] = 0 < S[1, 1] = 1).
    """
    S = _as_surface(S).astype(np.float64)
    if not np.all(np.isfinite(S)):
        return ["surface has non-finite values"]
    problems = []
    lo, hi = S.min(), S.max()
    if lo < -atol or hi > 1 + atol:
        problems.append(f"values outside [0, 1] (min {lo:.6g}, max {hi:.6g})")
    step_rise = np.diff(S, axis=-1).max(initial=-np.inf)
    if step_rise > atol:
        problems.append(f"a row increases along the step axis (by up to {step_rise:.6g})")
    block_rise = np.diff(S[..., 0], axis=-1).max(initial=-np.inf)
    if block_rise > atol:
        problems.append(f"the first column (P(N >= b + 1)) rises along the block axis (by up to {block_rise:.6g})")
    excess = (S - S[..., :1]).max()
    if excess > atol:
        problems.append(f"a cell exceeds the first cell of its row (by up to {excess:.6g})")
    return problems


def surface_from_heads(p_continue: np.ndarray, step_probs: np.ndarray, atol: float = 1e-4) -> np.ndarray:
    """The surface implied by a block head and a step head: [..., B_max, d] float64.

    p_continue: [..., B_max - 1] with p_continue[..., k] = P(N >= k + 2 | N >= k + 1), the chance
      that another block follows block k; P(block 0 exists) = 1 and P(block b exists) is the
      product of the first b continuation probabilities.
    step_probs: [..., B_max, d] with step_probs[..., b, t - 1] = P(T_b = t | block b exists).
    S[..., b, s] = P(block b exists) * P(T_b >= s + 1). Inputs off the simplex by more than
    `atol` raise ValueError; rounding within it is clipped away.
    """
    p = np.asarray(p_continue, np.float64)
    q = np.asarray(step_probs, np.float64)
    if q.ndim < 2 or p.ndim < 1 or p.shape[:-1] != q.shape[:-2] or p.shape[-1] != q.shape[-2] - 1:
        raise ValueError(
            f"p_continue must be [..., B_max - 1] and step_probs [..., B_max, d] with matching batch dims, "
            f"got {p.shape} and {q.shape}"
        )
    if not (np.all(np.isfinite(p)) and np.all(np.isfinite(q))):
        raise ValueError("p_continue and step_probs must be finite")
    if p.size and (p.min() < -atol or p.max() > 1 + atol):
        raise ValueError(f"continuation probabilities must lie in [0, 1], got [{p.min():.6g}, {p.max():.6g}]")
    if q.size and q.min() < -atol:
        raise ValueError(f"step probabilities must be non-negative, got min {q.min():.6g}")
    row_sums = q.sum(axis=-1)
    if row_sums.size and np.abs(row_sums - 1).max() > atol:
        off = np.abs(row_sums - 1).max()
        raise ValueError(f"each block's step distribution must sum to 1, got sums off by up to {off:.6g}")
    p = np.clip(p, 0.0, 1.0)
    q = np.clip(q, 0.0, None)
    exists = np.concatenate([np.ones(p.shape[:-1] + (1,)), np.cumprod(p, axis=-1)], axis=-1)
    # P(T_b >= s + 1) is the tail sum of the step distribution from t = s + 1 on
    tail = np.cumsum(q[..., ::-1], axis=-1)[..., ::-1]
    return np.clip(exists[..., None] * tail, 0.0, 1.0)
