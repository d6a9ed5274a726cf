"""Baselines a generator is read against: the positional-unigram reference (no model at all) and
the AR quality curve at a matched entropy."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np


def positional_unigram_rows(builder, tok, n: int, length: int, *, docs: int = 5000, seed: int = 0) -> np.ndarray:
    """[n, length] token ids, each position drawn independently from the token frequencies at that
    position in (up to `docs`) training documents laid out as ReLF's training rows (BOS, the
    conversation, EOS, then pad)."""
    from relf_jax.data import sources

    counts = np.zeros((length, tok.vocab_size), np.float64)
    cols = np.arange(length)
    for text in itertools.islice(sources.iter_texts(builder, "train"), docs):
        ids = ([tok.bos_id] + tok.encode(text) + [tok.eos_id] + [tok.pad_id] * length)[:length]
        counts[cols, ids] += 1
    cdf = np.cumsum(counts / counts.sum(1, keepdims=True), axis=1)
    u = np.random.default_rng(seed).random((n, length, 1))
    return np.minimum((u > cdf[None]).sum(-1), tok.vocab_size - 1)


def positional_unigram_samples(builder, tok, n: int, length: int, *, docs: int = 5000, seed: int = 0):
    """`positional_unigram_rows` decoded like ReLF samples (`Samples`). A whole-sequence model
    whose samples score no better has learned nothing beyond per-position statistics."""
    from relf_jax.sampling.batch import samples_from_rows

    return samples_from_rows(tok, positional_unigram_rows(builder, tok, n, length, docs=docs, seed=seed))


def ar_ppl_at_entropy(ar_rows: Sequence[dict], entropy: float, key: str = "entropy") -> tuple[float, float]:
    """AR gen PPL at `entropy` by linear interpolation of log gen PPL over the AR sweep (rows with
    `key` (``entropy``, or ``pooled_entropy``) and ``gen_ppl``), and the distance (nats) from
    `entropy` to the nearest AR point (0 inside the swept range)."""
    pts = sorted((r[key], math.log(r["gen_ppl"])) for r in ar_rows if r["gen_ppl"])
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    if entropy <= xs[0]:
        return math.exp(ys[0]), xs[0] - entropy
    if entropy >= xs[-1]:
        return math.exp(ys[-1]), entropy - xs[-1]
    return math.exp(float(np.interp(entropy, xs, ys))), 0.0


def ar_ppl_at_entropy_fitted(ar_rows: Sequence[dict], entropy: float, degree: int = 2,
                             grid: int = 2001, key: str = "entropy") -> tuple[float, float, float] | None:
    """AR gen PPL at `entropy` read off smooth fits of the sweep: entropy and log gen PPL each a
    least-squares polynomial of degree `degree` in the temperature (rows with ``temperature``,
    `key` (``entropy`` or ``pooled_entropy``) and ``gen_ppl``), solved for the temperature whose
    fitted entropy is `entropy`. Returns (gen PPL, the entropy's distance outside the fitted
    range, that temperature), or None for a sweep of fewer than degree + 2 temperatures.

    Why next to `ar_ppl_at_entropy`: one sweep row's entropy carries sampling noise comparable to
    the step between neighbouring temperatures (the `cpu` preset at 600 steps: T = 0.8 and 0.9 both
    at 3.24-3.25 nats with gen PPL 110 and 181), so a line through the two points nearest a
    ReLF row's entropy can move the read-off by tens of percent; a fit over the whole sweep
    averages that noise out."""
    pts = sorted((r["temperature"], r[key], math.log(r["gen_ppl"])) for r in ar_rows
                 if r.get("gen_ppl") and r.get("temperature") is not None)
    if len({p[0] for p in pts}) < degree + 2:
        return None
    ts, es, ls = (np.array(c, np.float64) for c in zip(*pts))
    fit_e, fit_l = np.polyfit(ts, es, degree), np.polyfit(ts, ls, degree)
    tt = np.linspace(ts[0], ts[-1], grid)
    ee = np.polyval(fit_e, tt)
    i = int(np.argmin(np.abs(ee - entropy)))
    gap = max(0.0, float(ee.min()) - entropy, entropy - float(ee.max()))
    return float(np.exp(np.polyval(fit_l, tt[i]))), gap, float(tt[i])
