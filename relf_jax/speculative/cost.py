"""What verification costs on this hardware: the target's cached forward over K + 1 tokens
against one token (speculative decoding pays off only when the first is far below K + 1 times the
second)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from relf_jax.models.causal_lm import init_cache


def forward_costs(lm, k: int, batches: Sequence[int] = (1, 8), context: int = 64, reps: int = 10) -> dict:
    """Median ms of the target's cached forward over 1 token and over K + 1 tokens, per batch.

    Speculative decoding pays off only when verifying K + 1 tokens costs much less than K + 1
    one-token steps (memory-bound hardware); on a compute-bound CPU the ratio is close to K + 1.
    """
    loops = 16

    @jax.jit
    def fwd(params, tokens, cache, index):
        # `loops` forwards in one while_loop, as inside the decoding loops (no dispatch cost);
        # each depends on the previous one, so nothing is hoisted out of the loop
        model = nnx.merge(lm.graphdef, params)
        t = tokens.shape[1]
        positions = index[:, None] + jnp.arange(t, dtype=jnp.int32)[None]

        def body(_, carry):
            toks, acc = carry
            logits = model(toks, positions, cache=cache, cache_index=index)[0]
            nxt = (toks + (jnp.argmax(logits, -1) > 10 ** 9).astype(jnp.int32))
            return nxt, acc + logits[:, -1, 0].sum()

        return jax.lax.fori_loop(0, loops, body, (tokens, jnp.float32(0)))[1]

    out = {}
    for b in batches:
        cache = init_cache(lm.model_cfg, b, context + k + 1)
        index = jnp.full((b,), context, jnp.int32)
        ms = {}
        for t in (1, k + 1):
            tokens = jnp.full((b, t), 5, jnp.int32)
            jax.block_until_ready(fwd(lm.params, tokens, cache, index))
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                jax.block_until_ready(fwd(lm.params, tokens, cache, index))
                times.append(time.perf_counter() - t0)
            ms[t] = 1e3 * float(np.median(times)) / loops
        out[f"b{b}"] = {"one_token_ms": ms[1], f"{k + 1}_tokens_ms": ms[k + 1],
                        "ratio": ms[k + 1] / ms[1]}
    return out
