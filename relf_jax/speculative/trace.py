"""Verification traces of speculative decoding: what RCSD learns from.

With ``SpecSettings.trace_top_k = T > 0`` the speculative loop records, for every round r and
row b (fixed-size buffers in the loop state, so tracing stays inside the one jitted
``while_loop``; with T = 0 nothing is allocated or computed):

- ``start`` [R, B]: the row's committed length before the round: the round's context is
  ``tokens[b, :start]`` of the final state (a reference, not a copy);
- ``active`` [R, B]: the row was still generating;
- ``draft_tokens`` [R, B, K], ``accept`` [R, B, K] (each position's decision before the prefix
  cut), ``num_accepted`` [R, B], ``next_token`` [R, B] (the token emitted at the first
  rejection, or the bonus token), ``count`` [R, B] (tokens committed: num_accepted + 1, or fewer
  at EOS / the token budget);
- ``top_ids`` / ``top_probs`` [R, B, K+1, T]: the target's distribution at each verified
  position after the sampling transform (temperature / top-k / top-p), compressed to its top T
  tokens; the rest of the mass is ``1 - sum(top_probs)``.

`examples_from_trace` turns a finished generation into per-sequence training examples aligned
with the final token sequence (host-side numpy), which the replay store keeps.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from relf_jax.sampling import processors


@flax.struct.dataclass
class RoundTrace:
    start: jax.Array  # [R, B] int32
    active: jax.Array  # [R, B] bool
    draft_tokens: jax.Array  # [R, B, K] int32
    accept: jax.Array  # [R, B, K] bool
    num_accepted: jax.Array  # [R, B] int32
    next_token: jax.Array  # [R, B] int32
    count: jax.Array  # [R, B] int32
    top_ids: jax.Array  # [R, B, K+1, T] int32
    top_probs: jax.Array  # [R, B, K+1, T] float32


def empty_trace(rounds: int, batch: int, k: int, top: int) -> RoundTrace:
    def zi(*shape):
        return jnp.zeros(shape, jnp.int32)

    return RoundTrace(start=zi(rounds, batch), active=jnp.zeros((rounds, batch), bool),
                      draft_tokens=zi(rounds, batch, k), accept=jnp.zeros((rounds, batch, k), bool),
                      num_accepted=zi(rounds, batch), next_token=zi(rounds, batch), count=zi(rounds, batch),
                      top_ids=zi(rounds, batch, k + 1, top),
                      top_probs=jnp.zeros((rounds, batch, k + 1, top), jnp.float32))


def record_round(trace: RoundTrace, r, *, start, active, draft_tokens, accept, num_accepted, next_token, count,
                 target_logits, temperature, top_k: int, top_p) -> RoundTrace:
    """Write round `r` (a traced scalar) into the buffers."""
    top = trace.top_ids.shape[-1]
    p = jnp.exp(processors.log_probs(target_logits, temperature, top_k, top_p))  # [B, K+1, V] float32
    probs, ids = jax.lax.top_k(p, top)

    def put(buf, value):
        return jax.lax.dynamic_update_index_in_dim(buf, value.astype(buf.dtype), r, axis=0)

    return RoundTrace(start=put(trace.start, start), active=put(trace.active, active),
                      draft_tokens=put(trace.draft_tokens, draft_tokens), accept=put(trace.accept, accept),
                      num_accepted=put(trace.num_accepted, num_accepted), next_token=put(trace.next_token, next_token),
                      count=put(trace.count, count), top_ids=put(trace.top_ids, ids),
                      top_probs=put(trace.top_probs, probs))


EXAMPLE_KEYS = ("tokens", "length", "dist_ids", "dist_probs", "dist_mask", "pref_mask", "chosen", "rejected",
                "rejected_in_nucleus")


def in_nucleus(ids: np.ndarray, probs: np.ndarray, token: int, top_p: float) -> bool:
    """Is `token` inside the top-p nucleus of a top-T compressed distribution (sorted ids/probs)?

    Judged on the logged top T: a token outside them counts as outside the nucleus (exact when
    the logged mass reaches top_p; otherwise the unlogged tokens are the least probable ones,
    and a rejected draft token there is one the target rates below all T logged tokens).
    """
    before = np.cumsum(probs) - probs
    where = np.flatnonzero(ids == token)
    return bool(where.size and before[where[0]] < top_p)


def examples_from_trace(tokens, lengths, trace: RoundTrace, *, nucleus_top_p: float = 0.9,
                        rows: int | None = None) -> dict[str, np.ndarray]:
    """Per-sequence RCSD examples [N, S, ...] from a finished traced generation.

    Position j of an example refers to the prediction of token j + 1 from ``tokens[:j + 1]``:
    - ``dist_mask[j]``: the target's (top-T) distribution for that prediction was logged
      (``dist_ids`` / ``dist_probs`` [S, T]); only verified positions whose context was
      committed are kept;
    - ``pref_mask[j]``: the first rejection of a round happened there: ``chosen[j]`` is the token
      the target emitted, ``rejected[j]`` the draft token it replaced;
      ``rejected_in_nucleus[j]``: that token is inside the target's `nucleus_top_p` nucleus
      (RCSD does not push such tokens down).
    """
    tokens, lengths = np.asarray(tokens), np.asarray(lengths)
    tr = jax.tree.map(np.asarray, trace)
    n_rows = tokens.shape[0] if rows is None else rows
    s = tokens.shape[1]
    top = tr.top_ids.shape[-1]
    out = {"tokens": tokens[:n_rows].astype(np.int32), "length": lengths[:n_rows].astype(np.int32),
           "dist_ids": np.zeros((n_rows, s, top), np.int32), "dist_probs": np.zeros((n_rows, s, top), np.float32),
           "dist_mask": np.zeros((n_rows, s), bool), "pref_mask": np.zeros((n_rows, s), bool),
           "chosen": np.zeros((n_rows, s), np.int32), "rejected": np.zeros((n_rows, s), np.int32),
           "rejected_in_nucleus": np.zeros((n_rows, s), bool)}
    k = tr.draft_tokens.shape[-1]
    for r in range(tr.start.shape[0]):
        for b in range(n_rows):
            if not tr.active[r, b]:
                continue
            start, n, c = int(tr.start[r, b]), int(tr.num_accepted[r, b]), int(tr.count[r, b])
            for i in range(c):  # verified position i predicts token start + i from a committed context
                j = start + i - 1
                out["dist_ids"][b, j] = tr.top_ids[r, b, i]
                out["dist_probs"][b, j] = tr.top_probs[r, b, i]
                out["dist_mask"][b, j] = True
            if n < k and n < c:  # a rejection, and the emitted token was committed
                j = start + n - 1
                rejected = int(tr.draft_tokens[r, b, n])
                out["pref_mask"][b, j] = True
                out["chosen"][b, j] = int(tr.next_token[r, b])
                out["rejected"][b, j] = rejected
                out["rejected_in_nucleus"][b, j] = in_nucleus(tr.top_ids[r, b, n], tr.top_probs[r, b, n], rejected,
                                                              nucleus_top_p)
    return out
