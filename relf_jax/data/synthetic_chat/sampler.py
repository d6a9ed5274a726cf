"""Sampling conversations from a `Grammar`, vectorised over conversations.

Every conversation is one walk of the automaton: emit a word from ``E[k, v, r]``, move with
``T[v, r]`` (the end of a turn is a move to ``<user>``'s state), and at the end of an assistant
turn continue with another exchange (a fresh verbosity class) or stop. Draws use inverse-CDF
lookups in two cumulative tables whose rows are offset by their index, so one `searchsorted`
samples every conversation at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from relf_jax.data.synthetic_chat.grammar import Grammar


class Sampler:
    """Draws word-id sequences from `grammar`; deterministic given ``(n, seed, topics)``."""

    def __init__(self, grammar: Grammar):
        self.grammar = grammar
        self._tables = None

    def tables(self) -> tuple[np.ndarray, np.ndarray]:
        """(cumulative emissions over [K*V*R, W], cumulative transitions over [V*R, R]), each
        row offset by its index and flattened; built on first use."""
        if self._tables is None:
            g = self.grammar
            K, V, R, W = g.K, g.V, g.R, g.W
            # local T with the end-of-turn mass in the U_START column
            t_fwd = g.trans.copy()
            t_fwd[:, :, g.start_state] = g.eot
            ce = np.cumsum(g.emission.reshape(K * V * R, W), axis=1)
            ce /= ce[:, -1:]
            ce += np.arange(K * V * R)[:, None]  # row offsets -> globally sorted keys
            ct = np.cumsum(t_fwd.reshape(V * R, R), axis=1)
            ct /= ct[:, -1:]
            ct += np.arange(V * R)[:, None]
            self._tables = (ce.ravel(), ct.ravel())
        return self._tables

    def _topics(self, rng, n: int, topics: Sequence[int] | None) -> np.ndarray:
        K = self.grammar.K
        if topics is None:
            allowed = np.arange(K)
        else:
            allowed = np.asarray(sorted({int(t) for t in topics}), np.int64)
            if allowed.size == 0 or allowed.min() < 0 or allowed.max() >= K:
                raise ValueError(f"topics must be a non-empty subset of range({K})")
        prior = self.grammar.topic_prior[allowed] / self.grammar.topic_prior[allowed].sum()
        return allowed[rng.choice(allowed.size, size=n, p=prior)]

    def sample_ids(self, n: int, seed: int, topics: Sequence[int] | None):
        """(list of ``n`` word-id arrays, topic [n], verbosity [n, max_exchanges] (-1 where
        unused))."""
        g = self.grammar
        V, R, W = g.V, g.R, g.W
        p_more = g.p_more
        rng = np.random.default_rng(np.random.SeedSequence([seed, 0xC4A7]))
        topic = self._topics(rng, n, topics)
        ce, ct = self.tables()
        u = g.start_state
        verb = np.full((n, g.max_exchanges), -1, np.int64)
        v = rng.choice(V, size=n, p=g.verbosity_prior)
        verb[:, 0] = v
        e = np.ones(n, np.int64)
        r = np.full(n, u, np.int64)
        alive = np.arange(n)
        k = topic.copy()
        rec_conv, rec_word = [], []
        while alive.size:
            # emit
            row = (k * V + v) * R + r
            w = np.searchsorted(ce, row + rng.random(alive.size), side="right") - row * W
            rec_conv.append(alive)
            rec_word.append(np.minimum(w, W - 1))
            # transition
            row = v * R + r
            r = np.searchsorted(ct, row + rng.random(alive.size), side="right") - row * R
            r = np.minimum(r, R - 1)
            eot = r == u
            if eot.any():
                more = eot & (rng.random(alive.size) < p_more[np.minimum(e, len(p_more) - 1)])
                if more.any():
                    e = e + more
                    v = np.where(more, rng.choice(V, size=alive.size, p=g.verbosity_prior), v)
                    verb[alive[more], e[more] - 1] = v[more]
                keep = ~(eot & ~more)
                alive, k, v, e, r = alive[keep], k[keep], v[keep], e[keep], r[keep]
        conv = np.concatenate(rec_conv)
        words = np.concatenate(rec_word)
        order = np.argsort(conv, kind="stable")
        counts = np.bincount(conv, minlength=n)
        seqs = np.split(words[order], np.cumsum(counts)[:-1])
        return seqs, topic, verb
