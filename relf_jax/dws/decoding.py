"""Confidence-threshold decoding of a block-diffusion LM, jitted and instrumented.

A reply is written block by block. Blocks are aligned on absolute positions (block j covers
``j*d .. j*d + d - 1``), so the first output block is the rest of the block the prompt ends in:
``d - P mod d`` positions when P mod d != 0 (the prompt remainder caps it), else d. Inside a
block every output position starts as the mask token; each *step* is one forward pass over the
block (attending to the cached blocks before it) that commits every masked position whose top
probability exceeds ``threshold`` (default 0.95), or else the single most confident one, with
its argmax token. So a block takes 1..d steps. When nothing is masked the block is committed and
one more *refresh* forward writes its clean keys/values into the KV cache. Decoding stops after
the block in which a stop token (EOS, and e.g. the ``<user>`` marker that starts the next turn)
is committed, or after ``max_blocks`` blocks.

- `generate`: the whole loop as one jitted ``lax.while_loop`` over blocks with an inner
  ``lax.while_loop`` over steps, batched (rows in lockstep per block, each at its own
  positions; a row whose block is finished idles until the others finish theirs).
- `decode_instrumented`: the same jitted prefill / step / refresh functions driven from Python
  for one request at a time, timing each (`RequestLog`): the measured runs that the workload
  surface and the cost model of `relf_jax.dws` are fitted on.

Token choice is greedy (argmax) and every number that decides a commit is float32.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from relf_jax.models.block_diffusion import decode_mask
from relf_jax.models.causal_lm import init_cache
from relf_jax.sampling import processors

CONFIDENCE_RULES = ("max", "sampled")


@dataclasses.dataclass(frozen=True)
class BlockDecodeSettings:
    """Static settings of the decoder (hashable: one compilation per settings and shape)."""

    block_size: int
    max_blocks: int
    mask_id: int
    pad_id: int
    stop_ids: tuple[int, ...]
    threshold: float = 0.95
    temperature: float = 0.0  # 0: greedy tokens; > 0: tokens sampled from softmax(logits / T)
    # what a position's confidence is (`confidence_commit`): "max", its top probability, so the
    # choice of positions does not look at the sampled tokens; "sampled", the sampled token's
    # probability (the old rule: it prefers positions whose draw happened to be likely)
    confidence: str = "max"

    def __post_init__(self):
        if self.block_size < 1 or self.max_blocks < 1:
            raise ValueError("block_size and max_blocks must be >= 1")
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not self.stop_ids:
            raise ValueError("stop_ids must name at least one token (EOS)")
        if self.confidence not in CONFIDENCE_RULES:
            raise ValueError(f"confidence must be one of {CONFIDENCE_RULES}, got {self.confidence!r}")

    def canvas_len(self, prompt_bucket: int) -> int:
        """Positions the canvas and KV cache need for prompts padded to `prompt_bucket`."""
        return (prompt_bucket // self.block_size + self.max_blocks) * self.block_size


def confidence_commit(logits: jax.Array, is_masked: jax.Array, threshold: float, *, temperature: float = 0.0,
                      key: jax.Array | None = None, confidence: str = "max"):
    """The commit rule on one step's logits.

    logits [B, d, V], is_masked [B, d] bool -> (commit [B, d] bool, tokens [B, d] int32):
    commit every masked position whose confidence is > threshold; a row with masked positions
    but none above it commits its single most confident masked position. Greedy (temperature
    0): the token is the argmax. With temperature > 0 the token is sampled from
    softmax(logits / T) (`sampling.processors.sample` with `key`). A position's confidence is its
    top probability under that distribution (``confidence="max"``) or the sampled token's
    probability (``"sampled"``; the same when greedy). "max" decides *where* to commit from the
    distributions alone, so each committed token is an unbiased draw at its position; "sampled"
    picks, among the positions' draws, the luckiest, which skews samples towards frequent tokens.
    `temperature` may be a traced scalar (0 then means greedy, as above).
    """
    if confidence not in CONFIDENCE_RULES:
        raise ValueError(f"confidence must be one of {CONFIDENCE_RULES}, got {confidence!r}")
    logits = logits.astype(jnp.float32)
    if not isinstance(temperature, (int, float)):  # traced (one value per request, e.g. a server slot)
        if key is None:
            raise ValueError("a traced temperature needs a key")
        t = jnp.asarray(temperature, jnp.float32)
        tokens = processors.sample(logits, key, t)  # argmax where t <= 0
        logits = logits / jnp.where(t > 0, t, 1.0)
    elif temperature > 0:
        if key is None:
            raise ValueError("sampling (temperature > 0) needs a key")
        tokens = processors.sample(logits, key, temperature)
        logits = logits / temperature
    else:
        tokens = processors.first_argmax(logits)
    probs = jax.nn.softmax(logits, axis=-1)
    if confidence == "max":
        conf = probs.max(axis=-1)
    else:
        conf = jnp.take_along_axis(probs, tokens[..., None], axis=-1)[..., 0]
    above = is_masked & (conf > threshold)
    best = processors.first_argmax(jnp.where(is_masked, conf, -1.0))
    fallback = jax.nn.one_hot(best, is_masked.shape[1], dtype=bool) & is_masked
    commit = above | (fallback & ~above.any(axis=1, keepdims=True))
    return commit, tokens


def _forward(model, cache, block, start, settings: BlockDecodeSettings):
    d = settings.block_size
    positions = start[:, None] + jnp.arange(d, dtype=jnp.int32)[None]
    mask = decode_mask(positions, cache[0][0].shape[2], d)
    return model(block, positions, mask, cache=cache, cache_index=start)


def _prefill(model, prompts, prompt_len, canvas_len: int, settings: BlockDecodeSettings):
    """KV cache [B, canvas_len] holding the prompt (padded prompts [B, P_bucket])."""
    b, pb = prompts.shape
    cache = init_cache(model.cfg, b, canvas_len)
    positions = jnp.broadcast_to(jnp.arange(pb, dtype=jnp.int32), (b, pb))
    slots = jnp.arange(canvas_len, dtype=jnp.int32)
    mask = decode_mask(positions, canvas_len, settings.block_size) & (slots[None, :] < prompt_len[:, None])[:, None]
    _, cache = model(prompts, positions, mask, cache=cache, cache_index=jnp.zeros((b,), jnp.int32))
    return cache


def _step(model, cache, block, start, is_masked, key, settings: BlockDecodeSettings):
    """One denoising step: forward over the block, commit by the rule. Returns (cache, block, is_masked)."""
    logits, cache = _forward(model, cache, block, start, settings)
    commit, tokens = confidence_commit(logits, is_masked, settings.threshold, temperature=settings.temperature,
                                       key=key, confidence=settings.confidence)
    return cache, jnp.where(commit, tokens, block), is_masked & ~commit


def _block_start(prompt_len, j, settings: BlockDecodeSettings):
    d = settings.block_size
    return (prompt_len // d + j) * d


def _open_block(canvas, prompt_len, start, settings: BlockDecodeSettings):
    """The block at `start`: prompt tokens where position < prompt_len, mask tokens after."""
    d = settings.block_size
    prev = jax.vmap(lambda c, s: jax.lax.dynamic_slice(c, (s,), (d,)))(canvas, start)
    pos = start[:, None] + jnp.arange(d, dtype=jnp.int32)[None]
    is_out = pos >= prompt_len[:, None]
    return jnp.where(is_out, settings.mask_id, prev), is_out


def _close_block(canvas, block, start, prompt_len, active, settings: BlockDecodeSettings):
    """Write the committed block into the canvas; (canvas, stop position or -1) per row."""
    d = settings.block_size
    old = jax.vmap(lambda c, s: jax.lax.dynamic_slice(c, (s,), (d,)))(canvas, start)
    new = jnp.where(active[:, None], block, old)
    canvas = jax.vmap(lambda c, u, s: jax.lax.dynamic_update_slice(c, u, (s,)))(canvas, new, start)
    pos = start[:, None] + jnp.arange(d, dtype=jnp.int32)[None]
    is_stop = jnp.isin(block, jnp.asarray(settings.stop_ids, jnp.int32)) & (pos >= prompt_len[:, None]) & active[:, None]
    first = processors.first_argmax(is_stop)
    stop_pos = jnp.where(is_stop.any(axis=1), start + first, -1)
    return canvas, stop_pos


@struct.dataclass
class BlockDecodeState:
    tokens: jax.Array  # [B, C] prompt + committed output (pad after)
    length: jax.Array  # [B] end of the output: one past the stop token, or the last block's end
    steps: jax.Array  # [B, max_blocks] denoising steps each output block took (0: not decoded)
    num_blocks: jax.Array  # [B] output blocks decoded
    done: jax.Array  # [B]


def _canvas(prompts, canvas_len: int, pad_id: int):
    b, pb = prompts.shape
    return jnp.concatenate([prompts, jnp.full((b, canvas_len - pb), pad_id, jnp.int32)], axis=1)


@functools.partial(jax.jit, static_argnames=("graphdef", "settings"))
def generate(graphdef, params, prompts: jax.Array, prompt_len: jax.Array,
             settings: BlockDecodeSettings, key: jax.Array | None = None) -> BlockDecodeState:
    """Decode replies for padded prompts [B, P_bucket] (int32) with lengths [B] (>= 1); `key`
    seeds the token sampling when ``settings.temperature > 0``."""
    model = nnx.merge(graphdef, params)
    key = jax.random.key(0) if key is None else key
    b, pb = prompts.shape
    c = settings.canvas_len(pb)
    cache = _prefill(model, prompts, prompt_len, c, settings)
    state = BlockDecodeState(tokens=_canvas(prompts, c, settings.pad_id),
                             length=jnp.zeros((b,), jnp.int32),
                             steps=jnp.zeros((b, settings.max_blocks), jnp.int32),
                             num_blocks=jnp.zeros((b,), jnp.int32), done=jnp.zeros((b,), bool))

    def block_body(carry):
        j, cache, st, key = carry
        active = ~st.done
        start = _block_start(prompt_len, j, settings)
        block, is_masked = _open_block(st.tokens, prompt_len, start, settings)
        is_masked &= active[:, None]

        def step_body(inner):
            cache, block, is_masked, steps, key = inner
            key, sub = jax.random.split(key)
            stepping = is_masked.any(axis=1)
            cache, block, is_masked = _step(model, cache, block, start, is_masked, sub, settings)
            return cache, block, is_masked, steps + stepping.astype(jnp.int32), key

        cache, block, _, steps, key = jax.lax.while_loop(
            lambda x: x[2].any(), step_body, (cache, block, is_masked, jnp.zeros((b,), jnp.int32), key))
        _, cache = _forward(model, cache, block, start, settings)  # refresh: clean keys/values
        tokens, stop_pos = _close_block(st.tokens, block, start, prompt_len, active, settings)
        last = j + 1 >= settings.max_blocks
        ends = active & ((stop_pos >= 0) | last)
        length = jnp.where(ends, jnp.where(stop_pos >= 0, stop_pos + 1, start + settings.block_size), st.length)
        st = BlockDecodeState(tokens=tokens, length=length, steps=st.steps.at[:, j].set(jnp.where(active, steps, 0)),
                              num_blocks=st.num_blocks + active.astype(jnp.int32), done=st.done | ends)
        return j + 1, cache, st, key

    _, _, state, _ = jax.lax.while_loop(lambda x: (x[0] < settings.max_blocks) & ~x[2].done.all(), block_body,
                                        (jnp.int32(0), cache, state, key))
    return state


# ----------------------------------------------------------------------------- instrumented

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


@functools.partial(jax.jit, static_argnames=("graphdef", "canvas_len", "settings"))
def _prefill_jit(graphdef, params, prompts, prompt_len, *, canvas_len, settings):
    return _prefill(nnx.merge(graphdef, params), prompts, prompt_len, canvas_len, settings)


@functools.partial(jax.jit, static_argnames=("graphdef", "settings"), donate_argnames=("cache",))
def _step_jit(graphdef, params, cache, block, start, is_masked, key, *, settings):
    return _step(nnx.merge(graphdef, params), cache, block, start, is_masked, key, settings)


@functools.partial(jax.jit, static_argnames=("graphdef", "settings"), donate_argnames=("cache",))
def _refresh_jit(graphdef, params, cache, block, start, *, settings):
    return _forward(nnx.merge(graphdef, params), cache, block, start, settings)[1]


def _placement(params):
    from jax.sharding import NamedSharding, PartitionSpec

    leaf = jax.tree.leaves(params)[0]
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding):
        return lambda x: jax.device_put(x, NamedSharding(sharding.mesh, PartitionSpec()))
    return jnp.asarray


def prompt_bucket(prompt_len: int, block_size: int) -> int:
    """Prompt padding for one request: whole blocks, so prefill cost follows the prompt's blocks."""
    return -(-prompt_len // block_size) * block_size


def decode_instrumented(graphdef, params, prompt: Sequence[int], settings: BlockDecodeSettings,
                        key: jax.Array | None = None) -> RequestLog:
    """Decode one prompt (token ids, BOS first) step by step from Python, timing every forward.

    Uses the same prefill / step / refresh functions as `generate`, so the tokens are the same
    (up to float reassociation across batch shapes; sampled tokens differ, since the noise's
    shape follows the batch). Each timed call ends with
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
    cache = jax.block_until_ready(_prefill_jit(graphdef, params, prompts, plen, canvas_len=c, settings=settings))
    prefill_s = time.perf_counter() - t0
    canvas = _canvas(prompts, c, settings.pad_id)
    active = jnp.ones((1,), bool)
    key = jax.random.key(0) if key is None else key
    if put is not jnp.asarray:
        key = put(key)
    steps, step_s, refresh_s, output = [], [], [], []
    stopped, first_block_s = False, 0.0
    for j in range(settings.max_blocks):
        start = _block_start(plen, j, settings)
        block, is_masked = _open_block(canvas, plen, start, settings)
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
        canvas, stop_pos = _close_block(canvas, block, start, plen, active, settings)
        s0, sp = int(start[0]), int(stop_pos[0])
        lo = max(s0, p)
        if sp >= 0:
            output += np.asarray(canvas[0, lo:sp + 1]).tolist()
            stopped = True
            break
        output += np.asarray(canvas[0, lo:s0 + d]).tolist()
    return RequestLog(prompt_len=p, steps_per_block=steps, output=output, stopped=stopped, prefill_s=prefill_s,
                      step_s=step_s, refresh_s=refresh_s, first_block_s=first_block_s)


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int, block_size: int,
                bucket: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token lists to a whole number of blocks (or `bucket`): (int32 [B, P], lengths [B])."""
    if not prompts or any(len(p) < 1 for p in prompts):
        raise ValueError("every prompt must hold at least one token (BOS)")
    longest = max(len(p) for p in prompts)
    pb = bucket or prompt_bucket(longest, block_size)
    if pb < longest:
        raise ValueError(f"bucket {pb} is shorter than the longest prompt ({longest} tokens)")
    arr = np.full((len(prompts), pb), pad_id, np.int32)
    for i, p in enumerate(prompts):
        arr[i, :len(p)] = p
    return arr, np.asarray([len(p) for p in prompts], np.int32)


def outputs(state: BlockDecodeState, prompt_len: np.ndarray) -> list[list[int]]:
    """The output token ids of each row of a `generate` result (stop token included)."""
    toks, length = np.asarray(state.tokens), np.asarray(state.length)
    return [toks[i, int(prompt_len[i]):int(length[i])].tolist() for i in range(toks.shape[0])]
