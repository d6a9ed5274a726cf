"""The speculative sampler's types: static settings, traced knobs, the decode state, and the
small helpers its round and its proposers share."""

from __future__ import annotations

import dataclasses
import numbers

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from relf_jax.config import PROPOSERS, validate_sampling
from relf_jax.errors import UserError
from relf_jax.methods import PromptLookup, Speculative, proposer_name
from relf_jax.sampling import processors
from relf_jax.speculative.verify import RULES


@dataclasses.dataclass(frozen=True)
class SpecSettings:
    """Static settings of one compiled speculative sampler."""

    k: int = 4
    rule: str = "standard"
    proposer: str = "draft"
    max_new_tokens: int = 64
    eos_id: int = 1
    pad_id: int = 0
    ngram: int = 3  # prompt lookup: longest n-gram to match
    top_k: int = 0  # static: the verification kernel has no top-k, so it selects the code path
    use_kernel: bool | None = None
    trace_top_k: int = 0  # > 0: record every round (`relf_jax.speculative.trace`) with the target's top-T
    track_tokens: bool = False  # keep per-row token counts (`SpecState.counts`) for the penalties

    def __post_init__(self):
        if self.k < 1:
            raise UserError(f"speculative k must be >= 1, got {self.k}")
        if self.rule not in RULES:
            raise UserError(f"unknown verification rule {self.rule!r}; choose one of: {', '.join(RULES)}")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0, got {self.top_k}")
        if self.proposer not in PROPOSERS:
            raise UserError(f"unknown proposer {self.proposer!r}; choose one of: {', '.join(PROPOSERS)}")
        if self.trace_top_k < 0:
            raise UserError(f"trace_top_k must be >= 0, got {self.trace_top_k}")

    @classmethod
    def from_method(cls, method: Speculative, tokenizer, max_new_tokens: int, **kw) -> SpecSettings:
        """The settings of `method` (a `relf_jax.methods.Speculative`) for a model with `tokenizer`
        (its EOS and pad ids); `kw`: the other fields (top_k, use_kernel, trace_top_k, track_tokens).
        The rule and proposer become this module's static tags (jit keys)."""
        p = method.proposer
        return cls(k=method.k, rule=method.rule, proposer=proposer_name(p), max_new_tokens=max_new_tokens,
                   eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                   ngram=p.ngram if isinstance(p, PromptLookup) else PromptLookup().ngram, **kw)


@flax.struct.dataclass
class SpecParams:
    """Traced sampling knobs. The shared top_k is static, on `SpecSettings`; a traced per-row
    `top_k`, `min_p` and `penalties` (`processors.Penalties`; their token state lives in the
    `SpecState`) are None when off, and switch the round to processed verification (module
    docstring)."""

    temperature: jax.Array
    top_p: jax.Array
    nsd_top_p: jax.Array
    top_k: jax.Array | None = None
    min_p: jax.Array | None = None
    penalties: processors.Penalties | None = None
    # the draft samples at temperature x this (None: 1, the target's temperature); the verifier is
    # given the distribution it sampled, so the standard rule stays exact
    draft_temperature_scale: jax.Array | None = None

    @property
    def processed(self) -> bool:
        """Whether the round verifies processed log-probabilities (some extra processor is on)."""
        pen = self.penalties
        return self.top_k is not None or self.min_p is not None or (
            pen is not None and (pen.bias is not None or pen.tracks))

    @classmethod
    def make(cls, temperature=1.0, top_p=1.0, nsd_top_p=0.9, draft_temperature_scale=1.0) -> SpecParams:
        validate_sampling(temperature, 0, top_p)
        if not 0 < nsd_top_p <= 1:
            raise UserError(f"nsd_top_p must be in (0, 1], got {nsd_top_p}")
        check_draft_temperature_scale(draft_temperature_scale)
        return cls(jnp.float32(temperature), jnp.float32(top_p), jnp.float32(nsd_top_p),
                   draft_temperature_scale=None if draft_temperature_scale == 1.0
                   else jnp.float32(draft_temperature_scale))


def check_draft_temperature_scale(scale) -> None:
    """A clear error unless the draft's temperature scale is a number > 0."""
    if not isinstance(scale, numbers.Real) or isinstance(scale, bool) or not scale > 0:
        raise UserError(f"draft_temperature_scale must be a number > 0, got {scale!r}")


def draft_logits_scaled(logits: jax.Array, sp: SpecParams) -> jax.Array:
    """A proposer's raw logits as it samples them: divided by `SpecParams.draft_temperature_scale`
    (the sampling transform then divides by the temperature), unchanged without one."""
    s = sp.draft_temperature_scale
    return logits if s is None else logits / s


@flax.struct.dataclass
class SpecState:
    tokens: jax.Array  # [B, S]
    lengths: jax.Array  # [B] committed tokens per row
    done: jax.Array  # [B]
    num_generated: jax.Array  # [B]
    target_cache: tuple
    draft_cache: tuple  # () for prompt lookup and the corpus n-gram table
    key: jax.Array
    rounds: jax.Array  # scalar: rounds run
    target_forwards: jax.Array  # [B] target forward passes while the row was active (prefill included)
    accepted: jax.Array  # [B] accepted draft tokens
    accepted_at: jax.Array  # [K] active rounds whose accepted prefix reached position i
    active_rounds: jax.Array  # scalar: sum over rows of active rounds
    trace: object = ()  # a `RoundTrace` when settings.trace_top_k > 0, else ()
    counts: jax.Array | None = None  # [B, V] int32 generated tokens per id (settings.track_tokens)
    seen: jax.Array | None = None  # [B, V] bool: the id occurs in the prompt or the reply


def temperature_for(sp: SpecParams, settings: SpecSettings):
    """The greedy rule emits argmax tokens only, so its first token and drafts are greedy too."""
    return jnp.float32(0.0) if settings.rule == "greedy" else sp.temperature


def sampling_knobs(sp: SpecParams, settings: SpecSettings) -> tuple:
    """(temperature, top_k, top_p, min_p) of `processors.log_probs` / `sample`."""
    return (temperature_for(sp, settings), settings.top_k if sp.top_k is None else sp.top_k, sp.top_p, sp.min_p)


def penalties(sp: SpecParams, state: SpecState) -> processors.Penalties | None:
    """The request's penalties with the state's token counts (None when none is on)."""
    pen = sp.penalties
    if pen is None or (pen.bias is None and not pen.tracks):
        return None
    return pen.replace(counts=state.counts, seen=state.seen) if pen.tracks else pen


def call_model(graphdef, params, tokens, positions, cache, index, attend_len=None, logits_at=None):
    """A split causal LM on tokens [B, T] at positions [B, T], writing its cache at index [B]."""
    return nnx.merge(graphdef, params)(tokens, positions, cache=cache, cache_index=index, attend_len=attend_len,
                                       logits_at=logits_at)


def take(tokens, positions):
    """tokens [B, S] at positions [B, n] (clipped into the row)."""
    return jnp.take_along_axis(tokens, jnp.clip(positions, 0, tokens.shape[1] - 1), axis=1)
