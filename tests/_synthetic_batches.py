"""A deterministic, checkpointable batch iterator for train-loop tests (no data pipeline)."""

import numpy as np


class CountingBatches:
    """Batch i is a function of i only; state is {"i": i}, like a grain iterator's."""

    def __init__(self, batch=8, length=33, vocab=61, nan_at=None):
        self.i, self.batch, self.length, self.vocab, self.nan_at = 0, batch, length, vocab, nan_at

    def __iter__(self):
        return self

    def __next__(self):
        rng = np.random.default_rng(self.i)
        start = rng.integers(0, self.vocab, (self.batch, 1))
        tokens = ((np.arange(self.length)[None] * 3 + start) % self.vocab).astype(np.int32)
        seg = np.ones_like(tokens)
        out = {"tokens": tokens, "segment_ids": seg}
        if self.nan_at is not None:
            out["poison"] = np.full((self.batch,), float(self.i + 1 >= self.nan_at), np.float32)
        self.i += 1
        return out

    def get_state(self):
        return {"i": self.i}

    def set_state(self, state):
        self.i = int(state["i"])
