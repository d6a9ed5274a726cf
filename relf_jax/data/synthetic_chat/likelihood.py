"""Exact likelihoods under a `Grammar`: the scaled forward algorithm, sparse in the state.

The forward pass never materialises ``k x e x v x r``: topics are independent blocks, ``e`` is a
deterministic function of the observed text (only the ``<user>`` state emits ``<user>``), and
after a word ``w`` only the flat states ``f = v * R + r`` that can emit ``w`` are alive (at most
32 of 440 for a known word), so each step is a batched ``[M_t, M_{t-1}] @ [M_{t-1}, K]`` product
over texts. Runs of ``<unk>`` are folded into powers of the transition matrix. Exact, not an
approximation.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from relf_jax.data.synthetic_chat.grammar import Grammar


@dataclasses.dataclass
class _Chunk:
    """Inputs and running state of the forward pass over one batch of texts."""

    ids: np.ndarray  # [B, Tm] word ids, padded with the pad word W
    lens: np.ndarray  # [B]
    marks: np.ndarray  # [B] prefix lengths whose probability is also wanted
    is_unk: np.ndarray  # [B, Tm]
    factor: np.ndarray  # [B, Tm] P(another exchange) at each <user>, else 1
    p_end: np.ndarray  # [B] P(no further exchange) after the text's last one
    alpha: np.ndarray  # [B, Mmax, K] normalised forward values on `prev`
    prev: np.ndarray  # [B, Mmax] their flat states (F = dummy)
    wid: np.ndarray  # [B] live width of `prev`
    pend: np.ndarray  # [B] <unk> words since the last known word
    logz: np.ndarray  # [B] log normaliser so far
    full: np.ndarray  # [B] log p(complete text)
    pre: np.ndarray  # [B] log p(prefix)
    at_mark: np.ndarray  # [B] log p(prefix of marks words)


class ForwardScorer:
    """The forward algorithm's layouts over flat local states ``f = v * R + r`` of `grammar`,
    plus one dummy state ``F`` (all zeros) used for padding and one pad word ``W`` (emits nothing).
    """

    def __init__(self, grammar: Grammar):
        g = grammar
        V, R, K, W = g.V, g.R, g.K, g.W
        T, eot, E = g.trans, g.eot, g.emission
        self.K, self.W, self.unk_id, self.user_id = K, W, g.unk_id, g.user_id
        self.p_more = g.p_more
        F = V * R
        Tf = np.zeros((F + 1, F + 1))
        for v in range(V):
            Tf[v * R : (v + 1) * R, v * R : (v + 1) * R] = T[v]
            for v2 in range(V):  # end of turn -> next exchange's <user> (times p_more)
                Tf[v * R : (v + 1) * R, v2 * R + g.start_state] = eot[v] * g.verbosity_prior[v2]
        self._TfT = np.ascontiguousarray(Tf.T)  # [F+1, F+1], TfT[to, from]
        E2 = np.zeros((W + 1, F + 1, K))
        E2[:W, :F] = E.reshape(K, F, W).transpose(2, 1, 0)
        self._E2 = E2  # [W+1, F+1, K]
        self._eot_f = np.concatenate([eot.reshape(F), [0.0]])
        self._init_f = np.zeros((F + 1, K))
        for v in range(V):
            self._init_f[v * R + g.start_state] = g.verbosity_prior[v] * g.topic_prior
        # Support of each known word: flat states that can emit it (padded with
        # F). <unk> (emitted by every content state) is never expanded: runs of
        # <unk> are folded into powers of (Tf D), see _forward_chunk.
        can = E2.any(axis=2)  # [W+1, F+1]
        can[g.unk_id] = False
        sizes = np.maximum(can.sum(1), 1)
        sup = np.full((W + 1, int(sizes.max())), F, np.int64)
        for w in range(W + 1):
            nz = np.nonzero(can[w])[0]
            sup[w, : nz.size] = nz
        self._sup, self._sup_len = sup, sizes
        self.F = F
        self._Tf = Tf
        content = np.zeros(F + 1)
        content[:F] = (E[0, :, :, g.unk_id] > 0).reshape(F)
        self._TfD = Tf * content[None, :]  # one step that ends in an <unk>-emitting state
        self._log_unk = float(np.log(g.config.unk_prob))
        self._pow2 = [self._TfD]  # (Tf D)^(2^j)
        self._GT_cache: dict[int, np.ndarray] = {}
        self._h_tab = np.ones((1, F + 1))  # h_u = (Tf D)^u 1
        self._g_tab = self._eot_f[None].copy()  # g_u = (Tf D)^u eot

    def forward(self, seqs: list[np.ndarray], marks: np.ndarray | None = None, chunk: int = 256):
        """Scaled forward pass. Returns (log p complete [n], log p prefix [n],
        log p prefix of the first marks[i] words [n])."""
        n = len(seqs)
        full = np.full(n, -np.inf)
        pre = np.full(n, -np.inf)
        at_mark = np.zeros(n)
        lens = np.array([len(s) for s in seqs], np.int64)
        marks = np.zeros(n, np.int64) if marks is None else marks
        pre[lens == 0] = 0.0  # empty prefix; full stays -inf (no empty conversations)
        order = np.argsort(lens, kind="stable")
        order = order[lens[order] > 0]
        for i in range(0, len(order), chunk):
            idx = order[i : i + chunk]
            f, p, m = self._forward_chunk([seqs[j] for j in idx], marks[idx])
            full[idx], pre[idx], at_mark[idx] = f, p, m
        return full, pre, at_mark

    def _GT(self, u: int) -> np.ndarray:
        """``((Tf D)^u Tf)^T`` [F+1, F+1]: transition across ``u`` <unk> words
        (without the ``unk_prob^u`` factor), transposed (``[to, from]``)."""
        if u == 0:
            return self._TfT
        got = self._GT_cache.get(u)
        if got is None:
            while (1 << len(self._pow2)) <= u:
                self._pow2.append(self._pow2[-1] @ self._pow2[-1])
            m = self._Tf
            for j in range(len(self._pow2)):
                if u >> j & 1:
                    m = self._pow2[j] @ m
            got = np.ascontiguousarray(m.T)
            if len(self._GT_cache) >= 16:
                self._GT_cache.clear()
            self._GT_cache[u] = got
        return got

    def _hg(self, u: np.ndarray):
        """Vectors h_u = (Tf D)^u 1 and g_u = (Tf D)^u eot, rows [len(u), F+1]."""
        need = int(u.max())
        while self._h_tab.shape[0] <= need:
            n = self._h_tab.shape[0]
            h, g = [self._h_tab], [self._g_tab]
            for _ in range(n):  # double the tables
                h.append((self._TfD @ h[-1][-1])[None])
                g.append((self._TfD @ g[-1][-1])[None])
            self._h_tab, self._g_tab = np.concatenate(h), np.concatenate(g)
        return self._h_tab[u], self._g_tab[u]

    def _start_chunk(self, seqs, marks) -> _Chunk:
        W, F, K = self.W, self.F, self.K
        B = len(seqs)
        lens = np.array([len(s) for s in seqs])
        Tm = int(lens.max())
        ids = np.full((B, Tm), W, np.int64)  # pad word W (emits nothing)
        for b, s in enumerate(seqs):
            ids[b, : len(s)] = s
        ids[ids[:, 0] == self.unk_id, 0] = W  # a text cannot start with <unk>
        is_user = ids == self.user_id
        e_before = np.cumsum(is_user, axis=1) - is_user  # exchanges completed before t
        cap = len(self.p_more) - 1
        Mmax = self._sup.shape[1]
        return _Chunk(
            ids=ids, lens=lens, marks=marks, is_unk=ids == self.unk_id,
            factor=np.where(is_user, self.p_more[np.minimum(e_before, cap)], 1.0),
            p_end=1.0 - self.p_more[np.minimum(is_user.sum(1), cap)],
            alpha=np.zeros((B, Mmax, K)), prev=np.full((B, Mmax), F, np.int64),
            wid=np.ones(B, np.int64), pend=np.zeros(B, np.int64), logz=np.zeros(B),
            full=np.full(B, -np.inf), pre=np.full(B, -np.inf),
            at_mark=np.where(marks == 0, 0.0, -np.inf),
        )

    def _forward_chunk(self, seqs, marks):
        """Forward pass over one batch of texts, sparse in the state.

        After a known word w only the flat states in support(w) are alive
        (<= 32 of V*R), so a step is a batched ``[M_t, M_{t-1}] @ [M_{t-1}, K]``
        product. ``<unk>`` (emitted by every content state with probability
        ``unk_prob``) is not expanded: a run of ``u`` unknown words is folded
        into the next transition as ``unk_prob^u (Tf D)^u Tf`` (D = content
        states), and prefix / end probabilities inside a run use
        ``(Tf D)^u 1`` and ``(Tf D)^u eot``. Exact, not an approximation.
        """
        s = self._start_chunk(seqs, marks)
        last = s.lens - 1
        for t in range(s.ids.shape[1]):
            active = t < s.lens
            s.pend[s.is_unk[:, t] & active] += 1
            rows = np.nonzero(~s.is_unk[:, t] & active)[0]
            if rows.size:
                self._step(s, rows, t)
            hit = np.nonzero((marks == t + 1) | (last == t))[0]
            if hit.size:
                self._record(s, hit, t)
        return s.full, s.pre, s.at_mark

    def _step(self, s: _Chunk, rows: np.ndarray, t: int) -> None:
        """Advance `rows` (whose word at `t` is known) by one word."""
        F = self.F
        w = s.ids[rows, t]
        mc = int(self._sup_len[w].max())
        cur = self._sup[w, :mc]  # [n, Mc]
        emit = self._E2[w[:, None], cur]  # [n, Mc, K]
        if t == 0:
            a = self._init_f[cur] * emit
        else:
            mp = int(s.wid[rows].max())
            pv = s.prev[rows, :mp]
            u = s.pend[rows]
            if not u.any():
                tsub = self._TfT[cur[:, :, None], pv[:, None, :]]
            else:
                tsub = np.empty((rows.size, mc, mp))
                for uu in np.unique(u):
                    sel = u == uu
                    tsub[sel] = self._GT(int(uu))[cur[sel][:, :, None], pv[sel][:, None, :]]
                s.logz[rows] += u * self._log_unk
                s.pend[rows] = 0
            a = np.matmul(tsub, s.alpha[rows, :mp]) * emit
            a *= s.factor[rows, t, None, None]
        sa = a.sum(axis=(1, 2))
        with np.errstate(divide="ignore"):
            s.logz[rows] += np.log(sa)
        a /= np.where(sa > 0, sa, 1.0)[:, None, None]
        s.alpha[rows, :mc] = a
        s.alpha[rows, mc:] = 0.0
        s.prev[rows, :mc] = cur
        s.prev[rows, mc:] = F
        s.wid[rows] = mc

    def _record(self, s: _Chunk, hit: np.ndarray, t: int) -> None:
        """Prefix (and, at a text's end, complete) log-probabilities of `hit` after word `t`."""
        u = s.pend[hit]
        h, g = self._hg(u)  # [d, F+1]
        st = s.prev[hit]
        a = s.alpha[hit].sum(-1)  # [d, Mmax]
        mass = (a * np.take_along_axis(h, st, 1)).sum(1)
        end = (a * np.take_along_axis(g, st, 1)).sum(1) * s.p_end[hit]
        base = s.logz[hit] + u * self._log_unk
        with np.errstate(divide="ignore"):
            lpre = base + np.log(mass)
            lfull = base + np.log(end)
        m = s.marks[hit] == t + 1
        s.at_mark[hit[m]] = lpre[m]
        f = s.lens[hit] - 1 == t
        s.pre[hit[f]] = lpre[f]
        s.full[hit[f]] = lfull[f]
