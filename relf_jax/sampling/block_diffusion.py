"""Confidence-threshold decoding of a block-diffusion LM: the one block loop.

A reply is written block by block. Blocks are aligned on absolute positions (block j covers
``j*d .. j*d + d - 1``), so the first output block is the rest of the block the prompt ends in:
``d - P mod d`` positions when P mod d != 0 (the prompt remainder caps it), else d. Inside a
block every output position starts as the mask token; each *step* (`denoise_step`) is one
forward pass over the block (attending to the cached blocks before it) that commits every masked
position whose top probability exceeds ``threshold`` (default 0.95), or else the single most
confident one, with its argmax token. So a block takes 1..d steps. When nothing is masked the
block is committed (`close_block`) and one more *refresh* forward writes its clean keys/values
into the KV cache. Decoding stops after the block in which a stop token (EOS, and e.g. the
``<user>`` marker that starts the next turn) is committed, or after ``max_blocks`` blocks.

The public block-step functions (`prefill`, `block_start`, `open_block`, `denoise_step`,
`forward_block`, `close_block`, and `decode_block`, which runs one whole block) are what every
driver composes: `generate` (the batched sampler: one jitted ``lax.while_loop`` over blocks, rows
in lockstep per block, each at its own positions; a row whose block is finished idles until the
others finish theirs), the serving engine (one block per slot per step) and the instrumented
decoder of `relf_jax.dws.decoding` (the same functions driven from Python, timed).

Token choice is greedy (argmax) at temperature 0, and every number that decides a commit is
float32.
"""

from __future__ import annotations

import dataclasses
import functools
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


def forward_block(model, cache, block, start, settings: BlockDecodeSettings):
    """One forward pass over the blocks [B, d] at positions start [B] .. start + d - 1, attending to
    the cache before them: (logits [B, d, V], cache with the block's keys/values written)."""
    d = settings.block_size
    positions = start[:, None] + jnp.arange(d, dtype=jnp.int32)[None]
    mask = decode_mask(positions, cache[0][0].shape[2], d)
    return model(block, positions, mask, cache=cache, cache_index=start)


def prefill(model, prompts, prompt_len, canvas_len: int, settings: BlockDecodeSettings):
    """KV cache [B, canvas_len] holding the prompts (padded prompts [B, P_bucket], lengths [B])."""
    b, pb = prompts.shape
    cache = init_cache(model.cfg, b, canvas_len)
    positions = jnp.broadcast_to(jnp.arange(pb, dtype=jnp.int32), (b, pb))
    slots = jnp.arange(canvas_len, dtype=jnp.int32)
    mask = decode_mask(positions, canvas_len, settings.block_size) & (slots[None, :] < prompt_len[:, None])[:, None]
    _, cache = model(prompts, positions, mask, cache=cache, cache_index=jnp.zeros((b,), jnp.int32))
    return cache


@functools.partial(jax.jit, static_argnames=("graphdef", "canvas_len", "settings"))
def prefill_jit(graphdef, params, prompts, prompt_len, *, canvas_len, settings):
    """`prefill`, jitted, on a split model (graphdef, params)."""
    return prefill(nnx.merge(graphdef, params), prompts, prompt_len, canvas_len, settings)


def denoise_step(model, cache, block, start, is_masked, key, settings: BlockDecodeSettings, temperature=None):
    """One denoising step: forward over the block, commit by `confidence_commit`.
    temperature: None -> settings.temperature; a traced scalar (one per serving slot) also works.
    Returns (cache, block, is_masked)."""
    temperature = settings.temperature if temperature is None else temperature
    logits, cache = forward_block(model, cache, block, start, settings)
    commit, tokens = confidence_commit(logits, is_masked, settings.threshold, temperature=temperature,
                                       key=key, confidence=settings.confidence)
    return cache, jnp.where(commit, tokens, block), is_masked & ~commit


def block_start(prompt_len, j, settings: BlockDecodeSettings):
    """First position [B] of output block j (0: the block the prompt ends in)."""
    d = settings.block_size
    return (prompt_len // d + j) * d


def open_block(canvas, prompt_len, start, settings: BlockDecodeSettings):
    """The block at `start` [B]: prompt tokens where position < prompt_len, mask tokens after.
    Returns (block [B, d], is_masked [B, d])."""
    d = settings.block_size
    prev = jax.vmap(lambda c, s: jax.lax.dynamic_slice(c, (s,), (d,)))(canvas, start)
    pos = start[:, None] + jnp.arange(d, dtype=jnp.int32)[None]
    is_out = pos >= prompt_len[:, None]
    return jnp.where(is_out, settings.mask_id, prev), is_out


def close_block(canvas, block, start, prompt_len, active, settings: BlockDecodeSettings):
    """Write the committed block into the canvas (active rows); (canvas, stop position or -1) per row."""
    d = settings.block_size
    old = jax.vmap(lambda c, s: jax.lax.dynamic_slice(c, (s,), (d,)))(canvas, start)
    new = jnp.where(active[:, None], block, old)
    canvas = jax.vmap(lambda c, u, s: jax.lax.dynamic_update_slice(c, u, (s,)))(canvas, new, start)
    pos = start[:, None] + jnp.arange(d, dtype=jnp.int32)[None]
    is_stop = (jnp.isin(block, jnp.asarray(settings.stop_ids, jnp.int32)) & (pos >= prompt_len[:, None])
               & active[:, None])
    first = processors.first_argmax(is_stop)
    stop_pos = jnp.where(is_stop.any(axis=1), start + first, -1)
    return canvas, stop_pos


def make_canvas(prompts, canvas_len: int, pad_id: int):
    """The token canvas [B, canvas_len]: the padded prompts, pad after."""
    b, pb = prompts.shape
    return jnp.concatenate([prompts, jnp.full((b, canvas_len - pb), pad_id, jnp.int32)], axis=1)


@struct.dataclass
class DecodedBlock:
    """One block decoded by `decode_block`."""

    cache: object  # the KV cache, the block's clean keys/values written (refresh)
    canvas: jax.Array  # [B, C] with the block written (active rows)
    block: jax.Array  # [B, d] the committed block
    start: jax.Array  # [B] its first position
    stop_pos: jax.Array  # [B] position of the first stop token in it, or -1
    steps: jax.Array  # [B] denoising steps it took (0 for inactive rows)
    key: jax.Array


def decode_block(model, cache, canvas, prompt_len, j, active, key, settings: BlockDecodeSettings,
                 temperature=None) -> DecodedBlock:
    """Decode output block j of the active rows [B]: denoising steps until nothing is masked (a
    row whose block is done idles), the refresh forward, the block written into the canvas.
    temperature as in `denoise_step`."""
    start = block_start(prompt_len, j, settings)
    block, is_masked = open_block(canvas, prompt_len, start, settings)
    is_masked &= active[:, None]

    def step_body(inner):
        cache, block, is_masked, steps, key = inner
        key, sub = jax.random.split(key)
        stepping = is_masked.any(axis=1)
        cache, block, is_masked = denoise_step(model, cache, block, start, is_masked, sub, settings, temperature)
        return cache, block, is_masked, steps + stepping.astype(jnp.int32), key

    steps = jnp.zeros(prompt_len.shape, jnp.int32)
    cache, block, _, steps, key = jax.lax.while_loop(lambda x: x[2].any(), step_body,
                                                     (cache, block, is_masked, steps, key))
    _, cache = forward_block(model, cache, block, start, settings)  # refresh: clean keys/values
    canvas, stop_pos = close_block(canvas, block, start, prompt_len, active, settings)
    return DecodedBlock(cache=cache, canvas=canvas, block=block, start=start, stop_pos=stop_pos, steps=steps, key=key)


@struct.dataclass
class BlockDecodeState:
    tokens: jax.Array  # [B, C] prompt + committed output (pad after)
    length: jax.Array  # [B] end of the output: one past the stop token, or the last block's end
    steps: jax.Array  # [B, max_blocks] denoising steps each output block took (0: not decoded)
    num_blocks: jax.Array  # [B] output blocks decoded
    done: jax.Array  # [B]


@functools.partial(jax.jit, static_argnames=("graphdef", "settings"))
def generate(graphdef, params, prompts: jax.Array, prompt_len: jax.Array,
             settings: BlockDecodeSettings, key: jax.Array | None = None) -> BlockDecodeState:
    """Decode replies for padded prompts [B, P_bucket] (int32) with lengths [B] (>= 1); `key`
    seeds the token sampling when ``settings.temperature > 0``."""
    model = nnx.merge(graphdef, params)
    key = jax.random.key(0) if key is None else key
    b, pb = prompts.shape
    c = settings.canvas_len(pb)
    cache = prefill(model, prompts, prompt_len, c, settings)
    state = BlockDecodeState(tokens=make_canvas(prompts, c, settings.pad_id),
                             length=jnp.zeros((b,), jnp.int32),
                             steps=jnp.zeros((b, settings.max_blocks), jnp.int32),
                             num_blocks=jnp.zeros((b,), jnp.int32), done=jnp.zeros((b,), bool))

    def block_body(carry):
        j, cache, st, key = carry
        active = ~st.done
        out = decode_block(model, cache, st.tokens, prompt_len, j, active, key, settings)
        last = j + 1 >= settings.max_blocks
        ends = active & ((out.stop_pos >= 0) | last)
        length = jnp.where(ends, jnp.where(out.stop_pos >= 0, out.stop_pos + 1, out.start + settings.block_size),
                           st.length)
        st = BlockDecodeState(tokens=out.canvas, length=length,
                              steps=st.steps.at[:, j].set(jnp.where(active, out.steps, 0)),
                              num_blocks=st.num_blocks + active.astype(jnp.int32), done=st.done | ends)
        return j + 1, out.cache, st, out.key

    _, _, state, _ = jax.lax.while_loop(lambda x: (x[0] < settings.max_blocks) & ~x[2].done.all(), block_body,
                                        (jnp.int32(0), cache, state, key))
    return state


def decode_settings(lm, *, max_blocks: int, threshold: float = 0.95, temperature: float = 0.0,
                    block_size: int | None = None, confidence: str = "max") -> BlockDecodeSettings:
    """Settings for a loaded "bd" model: its block size, stop at EOS, ``<user>`` or pad (it trains on
    document rows, where pad only follows the end of a conversation), greedy by default."""
    from relf_jax.data.tokenizer import turn_stop_ids

    tok = lm.tokenizer
    return BlockDecodeSettings(block_size=block_size or lm.model_cfg.block_size, max_blocks=max_blocks,
                               mask_id=lm.model_cfg.vocab_size, pad_id=tok.pad_id,
                               stop_ids=turn_stop_ids(tok, pad=True),
                               threshold=threshold, temperature=temperature, confidence=confidence)


def prompt_bucket(prompt_len: int, block_size: int) -> int:
    """Prompt padding for one request: whole blocks, so prefill cost follows the prompt's blocks."""
    return -(-prompt_len // block_size) * block_size


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
