"""A draft with no network: next-token statistics of the training corpus, with back-off.

`build_ngram_draft` counts, over token rows of the training data, which token follows each
context of c = 1 .. order - 1 tokens, keeps each context's `top_m` most frequent next tokens
(contexts seen fewer than `min_count` times are dropped), and stores them as sorted tables.
`propose` drafts K tokens on device: at each step it looks up the longest context that the
table knows (one gather in a direct-address index where the V ** c contexts of that length
fit, else a binary search on hashed keys), builds that context's distribution q over the
vocabulary (the kept counts, normalised; every other token has probability 0) and samples
from it after the same temperature / top-k / top-p transform the target gets. The verifier
receives q as the draft's logits, so the standard rule stays exact: q is a distribution like
any draft model's, only cheaper (a few gathers instead of K forward passes).

Keys: a context t_1..t_c hashes to ``h = h * 1_000_003 + (t + 1)`` in wrapping int32
arithmetic (numpy and XLA wrap alike). Two contexts of one length that collide share a row
(their counts merged): the draft gets worse there, never inexact.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from relf_jax.errors import UserError

HASH_MULT = 1_000_003
FILE_NAME = "ngram_draft.npz"
# Context lengths whose V ** c possible contexts fit in this many entries get a direct-address
# index (context -> row, one gather) next to the sorted keys, instead of a binary search that
# XLA:CPU runs as a while loop of ~17 tiny steps (rounds 1.03-1.05x faster at order 3, V = 1024)
DENSE_LIMIT = 1 << 22


@flax.struct.dataclass
class NgramDraft:
    """Per context length c = 1 .. order - 1 (index c - 1): sorted keys [N_c], next tokens
    [N_c, M] and their log-probabilities [N_c, M] (-inf where a row has fewer than M tokens);
    plus the unigram row (c = 0) used when no context is known."""

    keys: tuple
    tokens: tuple
    logp: tuple
    uni_tokens: jax.Array  # [M]
    uni_logp: jax.Array  # [M]
    vocab_size: int = flax.struct.field(pytree_node=False, default=0)
    # per context length: int32 [V ** c], row of the context with base-V code sum t_j V^(c-1-j),
    # -1 when unknown (`with_dense_index`); an empty array where V ** c is too large
    dense: tuple = ()

    @property
    def order(self) -> int:
        return len(self.keys) + 1

    @property
    def top_m(self) -> int:
        return int(self.uni_tokens.shape[0])

    def save(self, path: str) -> None:
        arrays = {"vocab_size": np.int64(self.vocab_size), "uni_tokens": np.asarray(self.uni_tokens),
                  "uni_logp": np.asarray(self.uni_logp)}
        for c, (k, t, lp) in enumerate(zip(self.keys, self.tokens, self.logp), start=1):
            arrays[f"keys_{c}"], arrays[f"tokens_{c}"], arrays[f"logp_{c}"] = map(np.asarray, (k, t, lp))
        tmp = path + ".tmp.npz"
        np.savez(tmp, **arrays)
        import os

        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> "NgramDraft":
        with np.load(path) as z:
            n = sum(1 for name in z.files if name.startswith("keys_"))
            return with_dense_index(cls(
                keys=tuple(jnp.asarray(z[f"keys_{c}"]) for c in range(1, n + 1)),
                tokens=tuple(jnp.asarray(z[f"tokens_{c}"]) for c in range(1, n + 1)),
                logp=tuple(jnp.asarray(z[f"logp_{c}"]) for c in range(1, n + 1)),
                uni_tokens=jnp.asarray(z["uni_tokens"]), uni_logp=jnp.asarray(z["uni_logp"]),
                vocab_size=int(z["vocab_size"])))


def with_dense_index(table: NgramDraft) -> NgramDraft:
    """`table` with a direct-address index for every context length c whose V ** c contexts fit
    in `DENSE_LIMIT` and whose hashed keys do not wrap (then a key's base-HASH_MULT digits are
    the context's tokens + 1, so each stored row maps back to its context exactly)."""
    v = table.vocab_size
    dense = []
    for c, keys in enumerate(table.keys, start=1):
        if v ** c > DENSE_LIMIT or v * sum(HASH_MULT ** j for j in range(c)) >= 2 ** 31:
            dense.append(jnp.zeros((0,), jnp.int32))
            continue
        k = np.asarray(keys, np.int64)
        code = np.zeros_like(k)
        for j in range(c):  # most significant digit first: t_1 .. t_c
            code = code * v + (k // HASH_MULT ** (c - 1 - j)) % HASH_MULT - 1
        index = np.full(v ** c, -1, np.int32)
        index[code] = np.arange(k.size, dtype=np.int32)
        dense.append(jnp.asarray(index))
    return table.replace(dense=tuple(dense))


def context_keys(ctx: np.ndarray) -> np.ndarray:
    """Hashed keys (int32) of contexts ctx [N, c] (numpy; `_keys` is the traced twin)."""
    h = np.zeros(ctx.shape[0], np.int32)
    with np.errstate(over="ignore"):
        for j in range(ctx.shape[1]):
            h = h * np.int32(HASH_MULT) + (ctx[:, j].astype(np.int32) + np.int32(1))
    return h


def _keys(ctx: jax.Array) -> jax.Array:
    h = jnp.zeros(ctx.shape[:-1], jnp.int32)
    for j in range(ctx.shape[-1]):
        h = h * jnp.int32(HASH_MULT) + (ctx[..., j].astype(jnp.int32) + 1)
    return h


def _top_rows(keys: np.ndarray, nxt: np.ndarray, top_m: int, min_count: int):
    """Group (key, next) pairs: sorted unique keys, their top-M next tokens and log-probs."""
    pair = np.stack([keys.astype(np.int64), nxt.astype(np.int64)], axis=1)
    uniq, counts = np.unique(pair, axis=0, return_counts=True)  # sorted by key, then next token
    k, t = uniq[:, 0], uniq[:, 1]
    order = np.lexsort((t, -counts, k))  # per key: most frequent first, ties by token id
    k, t, counts = k[order], t[order], counts[order]
    starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
    totals = np.add.reduceat(counts, starts)
    rank = np.arange(len(k)) - np.repeat(starts, np.diff(np.r_[starts, len(k)]))
    keep_ctx = totals >= min_count
    n_ctx = int(keep_ctx.sum())
    tokens = np.zeros((n_ctx, top_m), np.int32)
    cnt = np.zeros((n_ctx, top_m), np.float64)
    row_of = np.cumsum(keep_ctx) - 1  # context index -> output row
    ctx_id = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(k)]))
    sel = (rank < top_m) & keep_ctx[ctx_id]
    tokens[row_of[ctx_id[sel]], rank[sel]] = t[sel]
    cnt[row_of[ctx_id[sel]], rank[sel]] = counts[sel]
    with np.errstate(divide="ignore"):
        logp = np.log(cnt / np.maximum(cnt.sum(axis=1, keepdims=True), 1)).astype(np.float32)
    return k[starts][keep_ctx].astype(np.int32), tokens, logp


def build_ngram_draft(rows: Iterable[Sequence[int]], vocab_size: int, *, order: int = 3, top_m: int = 16,
                      min_count: int = 1) -> NgramDraft:
    """Count next tokens after every context of 1 .. order - 1 tokens in `rows` (token id lists)."""
    if order < 2:
        raise UserError(f"an n-gram draft needs order >= 2, got {order}")
    if top_m < 1 or min_count < 1:
        raise UserError(f"top_m and min_count must be >= 1, got {top_m} and {min_count}")
    rows = [np.asarray(r, np.int64) for r in rows if len(r) >= 1]
    if not rows:
        raise UserError("an n-gram draft needs at least one token row")
    flat = np.concatenate(rows)
    if flat.min() < 0 or flat.max() >= vocab_size:
        raise UserError(f"token ids must lie in [0, {vocab_size}), got {flat.min()}..{flat.max()}")
    keys, tokens, logps = [], [], []
    for c in range(1, order):
        ctx = [np.lib.stride_tricks.sliding_window_view(r[:-1], c) for r in rows if len(r) > c]
        nxt = [r[c:] for r in rows if len(r) > c]
        if not ctx:
            k, t, lp = np.zeros(0, np.int32), np.zeros((0, top_m), np.int32), np.zeros((0, top_m), np.float32)
        else:
            k, t, lp = _top_rows(context_keys(np.concatenate(ctx)), np.concatenate(nxt), top_m, min_count)
        keys.append(jnp.asarray(k))
        tokens.append(jnp.asarray(t))
        logps.append(jnp.asarray(lp))
    _, ut, ulp = _top_rows(np.zeros(len(flat), np.int32), flat, top_m, 1)
    return with_dense_index(NgramDraft(keys=tuple(keys), tokens=tuple(tokens), logp=tuple(logps),
                                       uni_tokens=jnp.asarray(ut[0]), uni_logp=jnp.asarray(ulp[0]),
                                       vocab_size=int(vocab_size)))


def next_logits(table: NgramDraft, context: jax.Array, valid: jax.Array) -> jax.Array:
    """Draft logits [B, V] after the last tokens `context` [B, order - 1] (oldest first).

    valid [B]: how many of those tokens exist (a row may have fewer than order - 1). The longest
    known context wins; with none, the unigram row. Log-probabilities of the kept tokens, -inf
    elsewhere.
    """
    return candidate_logits(table, *next_candidates(table, context, valid))


def candidate_logits(table: NgramDraft, toks: jax.Array, lp: jax.Array) -> jax.Array:
    """The vocabulary logits [..., V] of candidates toks / lp [..., M] (-inf off the candidates)."""
    logits = jnp.full(toks.shape[:-1] + (table.vocab_size,), -jnp.inf, jnp.float32)
    rows = jnp.unravel_index(jnp.arange(toks[..., 0].size), toks.shape[:-1])
    index = tuple(r.reshape(toks.shape[:-1] + (1,)) for r in rows)
    # scatter-max: padded entries (-inf) never overwrite a kept token that shares their id
    return logits.at[(*index, toks)].max(lp)


def next_candidates(table: NgramDraft, context: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The distribution of `next_logits` as its M candidates: token ids [B, M] and their
    log-probabilities [B, M] (-inf on padding), most frequent first, ties by token id. Every
    other token has probability 0, so a sampler can draw over these M instead of V."""
    b = context.shape[0]
    toks = jnp.broadcast_to(table.uni_tokens, (b, table.top_m))
    lp = jnp.broadcast_to(table.uni_logp, (b, table.top_m))
    for c in range(1, table.order):  # shortest first: a longer hit overrides
        keys = table.keys[c - 1]
        if keys.shape[0] == 0:
            continue
        if c <= len(table.dense) and table.dense[c - 1].shape[0]:
            code = jnp.zeros((b,), jnp.int32)
            for j in range(c):
                code = code * table.vocab_size + context[:, j - c]
            row = table.dense[c - 1][code]
            idx, hit = jnp.maximum(row, 0), (row >= 0) & (valid >= c)
        else:
            key = _keys(context[:, -c:])
            idx = jnp.clip(jnp.searchsorted(keys, key), 0, keys.shape[0] - 1)
            hit = (keys[idx] == key) & (valid >= c)
        toks = jnp.where(hit[:, None], table.tokens[c - 1][idx], toks)
        lp = jnp.where(hit[:, None], table.logp[c - 1][idx], lp)
    return toks, lp
