"""Block-diffusion decoding, instrumented: the measured runs the DWS surface and cost model fit.

`decode_instrumented` drives the block-step functions of `relf_jax.sampling.block_diffusion`
(the one block loop: confidence-threshold decoding, jitted) from Python for one request at a
time, timing the prefill, every denoising step and every refresh (`RequestLog`). The batched
decoder and its settings are `relf_jax.sampling.block_diffusion`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from relf_jax.sampling.block_diffusion import (
    BlockDecodeSettings,
    block_start,
    close_block,
    denoise_step,
    forward_block,
    make_canvas,
    open_block,
    prefill_jit,
    prompt_bucket,
)


@dataclasses.dataclass
class RequestLog:
    """One decoded request, timed: what the workload surface and cost model are fitted on."""

    prompt_len: int
    steps_per_block: list[int]
    output: list[int]  # output token ids up to and including the stop token
    stopped: bool  # a stop token ended it (else max_blocks did)
    prefill_s: float
    step_s: list[list[float]]  # per block, per step
    refresh_s: list[float]  # per block
    first_block_s: float  # prefill + the first block's steps and refresh: time to first block

    @property
    def num_blocks(self) -> int:
        return len(self.steps_per_block)

    @property
    def total_steps(self) -> int:
        return int(sum(self.steps_per_block))

    @property
    def total_s(self) -> float:
        return self.prefill_s + sum(map(sum, self.step_s)) + sum(self.refresh_s)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "num_blocks": self.num_blocks, "total_s": self.total_s}


@functools.partial(jax.jit, static_argnames=("graphdef", "settings"), donate_argnames=("cache",))
def _step_jit(graphdef, params, cache, block, start, is_masked, key, *, settings):
    return denoise_step(nnx.merge(graphdef, params), cache, block, start, is_masked, key, settings)


@functools.partial(jax.jit, static_argnames=("graphdef", "settings"), donate_argnames=("cache",))
def _refresh_jit(graphdef, params, cache, block, start, *, settings):
    return forward_block(nnx.merge(graphdef, params), cache, block, start, settings)[1]


def _placement(params):
    from jax.sharding import NamedSharding, PartitionSpec

    leaf = jax.tree.leaves(params)[0]
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding):
        return lambda x: jax.device_put(x, NamedSharding(sharding.mesh, PartitionSpec()))
    return jnp.asarray


def decode_instrumented(graphdef, params, prompt: Sequence[int], settings: BlockDecodeSettings,
                        key: jax.Array | None = None) -> RequestLog:
    """Decode one prompt (token ids, BOS first) step by step from Python, timing every forward.

    Uses the same prefill / step / refresh functions as `generate` (`relf_jax.sampling.block_diffusion`),
    so the tokens are the same (up to float reassociation across batch shapes; sampled tokens
    differ, since the noise's shape follows the batch). Each timed call ends with
    ``block_until_ready``; the first call of a shape compiles, so warm up before measuring.
    """
    p = len(prompt)
    if p < 1:
        raise ValueError("the prompt must hold at least one token (BOS)")
    d = settings.block_size
    pb = prompt_bucket(p, d)
    c = settings.canvas_len(pb)
    # host arrays placed like the parameters: eager ops on them then give arrays of the same
    # sharding type as the jitted step's outputs, so a block's first step does not recompile
    put = _placement(params)
    prompts = put(np.asarray([list(prompt) + [settings.pad_id] * (pb - p)], np.int32))
    plen = put(np.asarray([p], np.int32))
    t0 = time.perf_counter()
    cache = jax.block_until_ready(prefill_jit(graphdef, params, prompts, plen, canvas_len=c, settings=settings))
    prefill_s = time.perf_counter() - t0
    canvas = make_canvas(prompts, c, settings.pad_id)
    active = jnp.ones((1,), bool)
    key = jax.random.key(0) if key is None else key
    if put is not jnp.asarray:
        key = put(key)
    steps, step_s, refresh_s, output = [], [], [], []
    stopped, first_block_s = False, 0.0
    for j in range(settings.max_blocks):
        start = block_start(plen, j, settings)
        block, is_masked = open_block(canvas, plen, start, settings)
        times = []
        while bool(is_masked.any()):
            key, sub = jax.random.split(key)
            t0 = time.perf_counter()
            cache, block, is_masked = _step_jit(graphdef, params, cache, block, start, is_masked, sub,
                                                settings=settings)
            jax.block_until_ready(is_masked)
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        cache = jax.block_until_ready(_refresh_jit(graphdef, params, cache, block, start, settings=settings))
        refresh_s.append(time.perf_counter() - t0)
        steps.append(len(times))
        step_s.append(times)
        if j == 0:
            first_block_s = prefill_s + sum(times) + refresh_s[0]
        canvas, stop_pos = close_block(canvas, block, start, plen, active, settings)
        s0, sp = int(start[0]), int(stop_pos[0])
        lo = max(s0, p)
        if sp >= 0:
            output += np.asarray(canvas[0, lo:sp + 1]).tolist()
            stopped = True
            break
        output += np.asarray(canvas[0, lo:s0 + d]).tolist()
    return RequestLog(prompt_len=p, steps_per_block=steps, output=output, stopped=stopped, prefill_s=prefill_s,
                      step_s=step_s, refresh_s=refresh_s, first_block_s=first_block_s)
