"""The segment-length prior of a ReLF model trained on segment rows (``data.rows=segments``):
its sampler writes one segment per row, of a length drawn from the lengths its training
segments had, and pad after it."""

from __future__ import annotations

import itertools
import os
from typing import Optional, Sequence

import jax
import numpy as np

from relf_jax.checkpoint import LENGTHS_FILE
from relf_jax.data import sources

__all__ = ["LENGTHS_FILE", "draw_segment_lengths", "flow_lengths", "flow_segment_lengths", "segment_rows"]
LENGTH_DOCS = 20_000


def flow_segment_lengths(cfg, builder, tok, model_dir: str) -> np.ndarray:
    """counts [seq_len + 1] int64 of the segment lengths a ReLF model trained on
    ``data.rows="segments"`` saw (documents ``[bos, *ids, eos]``, long ones cut into rows of
    ``seq_len`` as `pipeline.SegmentRows` does), from up to 20k training documents: the length
    prior its sampler draws one segment per row from. Loaded from `model_dir`, or built and saved."""
    path = os.path.join(model_dir, LENGTHS_FILE)
    if os.path.exists(path):
        return np.load(path)
    cap = cfg.data.seq_len
    counts = np.zeros(cap + 1, np.int64)
    for text in itertools.islice(sources.iter_texts(builder, "train"), LENGTH_DOCS):
        n = len(tok.encode(text)) + 2
        counts[cap] += n // cap
        counts[n % cap] += n % cap > 0
    if jax.process_index() == 0:
        os.makedirs(model_dir, exist_ok=True)
        np.save(path, counts)
    return counts


def flow_lengths(lm) -> Optional[np.ndarray]:
    """The segment-length counts of a loaded ReLF model trained on segment rows
    (`flow_segment_lengths`), or None for a model trained on whole rows (it samples one segment
    over the full length)."""
    if "flow.lengths" in lm.extras:
        return np.asarray(lm.extras["flow.lengths"])
    path = os.path.join(lm.model_dir, LENGTHS_FILE) if lm.model_dir else ""
    return np.load(path) if path and os.path.exists(path) else None


def draw_segment_lengths(counts: np.ndarray, rng: np.random.Generator, n: int,
                         min_len: Sequence[int] | int = 1) -> np.ndarray:
    """`n` segment lengths [n] int32 drawn from `counts` (index = length), each at least its
    ``min_len`` (e.g. a prompt's length + 1; a minimum no training segment reached gets the
    longest length, ``len(counts) - 1``)."""
    lengths = np.arange(len(counts))
    out = np.empty(n, np.int32)
    lows = np.broadcast_to(np.asarray(min_len, np.int64), (n,))
    for i, low in enumerate(lows):
        w = np.where(lengths >= max(int(low), 1), counts, 0).astype(np.float64)
        out[i] = rng.choice(lengths, p=w / w.sum()) if w.sum() > 0 else len(counts) - 1
    return out


def segment_rows(lengths: np.ndarray, length: int) -> np.ndarray:
    """segment ids [B, length] int32: 1 on the first lengths[b] positions of row b, 0 (pad) after."""
    return (np.arange(length)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32)
