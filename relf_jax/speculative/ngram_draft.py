"""A draft with no network: next-token statistics of a corpus, with back-off.

`build_ngram_draft` counts, over token rows (a model's training data, text the user names, or
the traffic served: `relf_jax.speculative.recipes.corpus_ngram_table`, `OnlineNgram`), which token follows each
context of c = 1 .. order - 1 tokens, keeps each context's `top_m` most frequent next tokens
(contexts seen fewer than `min_count` times are dropped), and stores them as sorted tables.
The proposer (`relf_jax.speculative.proposers.ngram_table`) drafts K tokens on device: at each
step it looks up the longest context that the table knows (one gather in a direct-address index
where the V ** c contexts of that length fit, else a binary search on hashed keys), builds that
context's distribution q over the vocabulary (the kept counts, normalised; every other token has
probability 0) and samples from it after the same temperature / top-k / top-p transform the
target gets. The verifier receives q as the draft's logits, so the standard rule stays exact: q
is a distribution like any draft model's, only cheaper (a few gathers instead of K forward
passes).

Fixed shapes: with `capacity`, every context length keeps exactly that many rows (the most
frequent contexts; empty rows pad the rest and never match), so a table rebuilt from new text
has the shapes of the old one and a jitted step that takes it does not recompile. `OnlineNgram`
uses this to count the traffic a server answers (prompts and replies, bounded in memory) and
swap the new table in between engine steps: the table is only a proposal distribution, so any
table, old or new, keeps the standard rule exact.

Keys: a context t_1..t_c hashes to ``h = h * 1_000_003 + (t + 1)`` in wrapping int32
arithmetic (numpy and XLA wrap alike). Two contexts of one length that collide share a row
(their counts merged): the draft gets worse there, never inexact.
"""

from __future__ import annotations

import collections
import threading
from typing import Iterable, Optional, Sequence

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
EMPTY_KEY = np.iinfo(np.int32).max  # the key of a padding row (its log-probabilities are all -inf)


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
        filled = np.flatnonzero(np.isfinite(np.asarray(table.logp[c - 1])[:, 0]))  # padding rows: none
        k = np.asarray(keys, np.int64)[filled]
        code = np.zeros_like(k)
        for j in range(c):  # most significant digit first: t_1 .. t_c
            code = code * v + (k // HASH_MULT ** (c - 1 - j)) % HASH_MULT - 1
        index = np.full(v ** c, -1, np.int32)
        index[code] = filled.astype(np.int32)
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


def _top_rows(keys: np.ndarray, nxt: np.ndarray, top_m: int, min_count: int, capacity: Optional[int] = None):
    """Group (key, next) pairs: sorted unique keys, their top-M next tokens and log-probs.

    capacity: keep the `capacity` most frequent contexts (ties: smaller key) and pad to exactly
    that many rows with empty ones (key `EMPTY_KEY`, token 0, log-probability -inf)."""
    # one int64 per pair, key in the high half (signed), next token in the low: sorts by key, then
    # token (a 1-D sort: much faster than np.unique over rows)
    pair = (keys.astype(np.int64) << 32) | nxt.astype(np.int64)
    uniq, counts = np.unique(pair, return_counts=True)
    k, t = uniq >> 32, uniq & 0xFFFFFFFF
    order = np.lexsort((t, -counts, k))  # per key: most frequent first, ties by token id
    k, t, counts = k[order], t[order], counts[order]
    starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]]) if k.size else np.zeros(0, np.int64)
    totals = np.add.reduceat(counts, starts) if k.size else np.zeros(0, np.int64)
    rank = np.arange(len(k)) - np.repeat(starts, np.diff(np.r_[starts, len(k)]))
    keep_ctx = totals >= min_count
    if capacity is not None and keep_ctx.sum() > capacity:
        by_count = np.argsort(np.where(keep_ctx, -totals, 1), kind="stable")  # contexts are in key order
        keep_ctx = np.zeros_like(keep_ctx)
        keep_ctx[by_count[:capacity]] = True
    n_ctx = int(keep_ctx.sum())
    rows = n_ctx if capacity is None else capacity
    tokens = np.zeros((rows, top_m), np.int32)
    cnt = np.zeros((rows, top_m), np.float64)
    row_of = np.cumsum(keep_ctx) - 1  # context index -> output row
    ctx_id = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(k)]))
    sel = (rank < top_m) & keep_ctx[ctx_id]
    tokens[row_of[ctx_id[sel]], rank[sel]] = t[sel]
    cnt[row_of[ctx_id[sel]], rank[sel]] = counts[sel]
    with np.errstate(divide="ignore"):
        logp = np.log(cnt / np.maximum(cnt.sum(axis=1, keepdims=True), 1)).astype(np.float32)
    out_keys = np.full(rows, EMPTY_KEY, np.int32)
    out_keys[:n_ctx] = k[starts][keep_ctx]
    return out_keys, tokens, logp


def build_ngram_draft(rows: Iterable[Sequence[int]], vocab_size: int, *, order: int = 3, top_m: int = 16,
                      min_count: int = 1, capacity: Optional[int] = None) -> NgramDraft:
    """Count next tokens after every context of 1 .. order - 1 tokens in `rows` (token id lists).

    capacity: exactly this many rows per context length (the most frequent contexts; empty rows
    pad the rest), so tables built from different text have equal shapes. With a capacity,
    `rows` may be empty: the table then proposes token 0 (any proposal keeps the rule exact).
    """
    if order < 2:
        raise UserError(f"an n-gram draft needs order >= 2, got {order}")
    if top_m < 1 or min_count < 1:
        raise UserError(f"top_m and min_count must be >= 1, got {top_m} and {min_count}")
    if capacity is not None and capacity < 1:
        raise UserError(f"an n-gram table's capacity must be >= 1, got {capacity}")
    rows = [np.asarray(r, np.int64).reshape(-1) for r in rows if len(r) >= 1]
    if not rows and capacity is None:
        raise UserError("an n-gram draft needs at least one token row")
    flat = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    if flat.size and (flat.min() < 0 or flat.max() >= vocab_size):
        raise UserError(f"token ids must lie in [0, {vocab_size}), got {flat.min()}..{flat.max()}")
    lengths = np.array([len(r) for r in rows], np.int64)
    pos = np.arange(flat.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)  # index inside its row
    keys, tokens, logps = [], [], []
    for c in range(1, order):
        at = np.flatnonzero(pos >= c)  # tokens with c earlier tokens in their row
        ctx = np.stack([flat[at - c + j] for j in range(c)], axis=1)
        k, t, lp = _top_rows(context_keys(ctx), flat[at], top_m, min_count, capacity)
        keys.append(jnp.asarray(k))
        tokens.append(jnp.asarray(t))
        logps.append(jnp.asarray(lp))
    if flat.size:
        _, ut, ulp = _top_rows(np.zeros(len(flat), np.int32), flat, top_m, 1)
        ut, ulp = ut[0], ulp[0]
    else:  # nothing counted yet: a point mass on token 0
        ut, ulp = np.zeros(top_m, np.int32), np.full(top_m, -np.inf, np.float32)
        ulp[0] = 0.0
    return with_dense_index(NgramDraft(keys=tuple(keys), tokens=tuple(tokens), logp=tuple(logps),
                                       uni_tokens=jnp.asarray(ut), uni_logp=jnp.asarray(ulp),
                                       vocab_size=int(vocab_size)))


def same_shapes(a: NgramDraft, b: NgramDraft) -> bool:
    """True when `b` can replace `a` in a jitted call without a recompile (same tree, shapes, dtypes)."""
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    return ta == tb and all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(la, lb))


class OnlineNgram:
    """An n-gram table counted from served traffic, bounded in memory.

    `add` takes a finished request's tokens (its prompt and reply, one row); the newest rows
    holding at most `max_tokens` tokens are kept (the oldest leave first; a longer row keeps its
    last `max_tokens`), next to fixed `seed_rows` (e.g. the user's corpus, not counted against
    the bound). The table is rebuilt from the seed and the kept rows, with `capacity` rows per
    context length (`build_ngram_draft`, so every table has the first one's shapes), once the
    new tokens reach `refresh_tokens` (default ``max_tokens // 16``) or the number of tokens
    the last build counted, whichever is smaller: early traffic is taken in at once, and a
    rebuild (~60 ms for 32k tokens on a CPU core, in the batcher's thread) costs a bounded
    share of the tokens served. Memory: the kept tokens plus the fixed-size table. Thread-safe.
    """

    def __init__(self, vocab_size: int, *, order: int = 3, top_m: int = 16, max_tokens: int = 32768,
                 capacity: int = 16384, refresh_tokens: Optional[int] = None,
                 seed_rows: Sequence[Sequence[int]] = ()):
        refresh_tokens = max(1, max_tokens // 16) if refresh_tokens is None else refresh_tokens
        if max_tokens < 1 or refresh_tokens < 1:
            raise UserError(f"the online n-gram table needs max_tokens and refresh_tokens >= 1, got {max_tokens} "
                            f"and {refresh_tokens}")
        self.vocab_size, self.order, self.top_m = int(vocab_size), order, top_m
        self.max_tokens, self.capacity, self.refresh_tokens = int(max_tokens), int(capacity), int(refresh_tokens)
        self.seed_rows = [np.asarray(r, np.int32).reshape(-1) for r in seed_rows if len(r)]
        self.rows: collections.deque[np.ndarray] = collections.deque()
        self.tokens = 0  # kept traffic tokens (<= max_tokens)
        self.pending = 0  # tokens added since the last build
        self.counted = 0  # kept traffic tokens the last build counted
        self.builds = 0
        self._lock = threading.Lock()
        self.table = self._build()

    def _build(self) -> NgramDraft:
        self.builds += 1
        return build_ngram_draft([*self.seed_rows, *self.rows], self.vocab_size, order=self.order, top_m=self.top_m,
                                 capacity=self.capacity)

    def add(self, tokens: Sequence[int]) -> bool:
        """Count one row of traffic; True when the table was rebuilt (then read `table`)."""
        row = np.asarray(tokens, np.int64).reshape(-1)[-self.max_tokens:]
        if not row.size:
            return False
        if row.min() < 0 or row.max() >= self.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size})")
        with self._lock:
            self.rows.append(row.astype(np.int32))
            self.tokens += row.size
            while self.tokens > self.max_tokens:
                self.tokens -= self.rows.popleft().size
            self.pending += row.size
            if self.pending < min(self.refresh_tokens, max(self.counted, 1)):
                return False
            self.pending, self.counted = 0, self.tokens
            self.table = self._build()
            return True


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
        row_lp = table.logp[c - 1][idx]
        hit = hit & (row_lp[:, 0] > -jnp.inf)  # an empty (padding) row is no hit
        toks = jnp.where(hit[:, None], table.tokens[c - 1][idx], toks)
        lp = jnp.where(hit[:, None], row_lp, lp)
    return toks, lp
