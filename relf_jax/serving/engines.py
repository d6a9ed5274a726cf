"""Engines: one slot-based interface over every relf_jax generator, for continuous batching.

The interface has the shape of JetStream's: an engine owns a decode state with a fixed number
of *slots*; a request is run through `prefill` on its own, its result is put into a free slot
with `insert`, and every `generate` call advances all occupied slots by one step. Requests
join and leave between steps (`relf_jax.serving.batching`); a slot whose request finished or
was cancelled is released with `free` and may be reused at once. `dispatch` and `collect` are
the two halves of `generate` (start the step; wait for its output), so a caller can do host
work while a step runs.

- `AREngine`: one token per step (the sampler of `relf_jax.sampling.autoregressive`).
- `SpeculativeEngine`: one draft/verify round per step, 1..k+1 tokens (the round of
  `relf_jax.speculative.generate`; standard / NSD / greedy rule; draft model, prompt lookup or
  the corpus n-gram table).
  These two may run several steps per `generate` call (``steps_per_call``, one jitted loop).
- `BlockDiffusionEngine`: one committed block per step (confidence-threshold decoding of
  `relf_jax.dws.decoding`).
- `ReLFEngine`: the whole reply at once (the flow sampler of `relf_jax.flow.samplers`, with the
  prompt's positions held on their embeddings), in one step.
- `MockEngine`: no model; echoes the last user turn one token per step, optionally sleeping a
  fixed time per step. Its outputs are known by hand, for scheduler and server tests.

The model engines reuse the samplers' own prefill and step functions, vmapped over slots: each
slot holds the sampler's state for a batch of one, so per-request settings (temperature,
top-p, top-k, min-p, the penalties and their token counts, the logit bias, seed) are traced per
slot, a slot's tokens do not depend on what the other slots hold,
and the same seed gives the same reply whatever the batch. A prefill's buffers span the model's
whole context, so prefixes of any prompt bucket fit any slot; the prompt is padded to a
power-of-two bucket. The AR and speculative engines cut their slots' KV caches to the span
the occupied slots need (`_Spans`): one compilation of `generate` per span (and per number of
stepped slots, `_subset`), of the fused prefill per bucket and span. Token decisions run in
float32 (the samplers' rule).
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from relf_jax.data.tokenizer import turn_stop_ids
from relf_jax.errors import UserError

LOGPROBS_TOP = 20  # the most probable tokens an engine reports per emitted token (OpenAI's top_logprobs maximum)
LOGIT_BIAS_MAX = 1024  # entries of one request's logit_bias
SAMPLING_FEATURES = ("nucleus", "top_k", "min_p", "penalties", "bias", "logprobs")


@dataclasses.dataclass(frozen=True)
class RequestParams:
    """Per-request generation settings (traced per slot: changing them does not recompile).

    top_k 0: the engine's own (usually off); min_p 0, repetition_penalty 1, frequency_penalty
    and presence_penalty 0, no logit_bias: off (see `relf_jax.sampling.processors` for the
    order they apply in). logprobs None: no log-probabilities; n in 0..20: each emitted token's
    log-probability under the distribution it was drawn from, and the n most probable tokens'.
    stop_token_ids: token ids that end this reply (besides the engine's `stop_ids`; the batcher
    stops at them).
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.max_tokens < 1:
            raise UserError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise UserError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise UserError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (self.repetition_penalty > 0 and np.isfinite(self.repetition_penalty)):
            raise UserError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise UserError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if len(self.logit_bias) > LOGIT_BIAS_MAX:
            raise UserError(f"logit_bias takes at most {LOGIT_BIAS_MAX} tokens, got {len(self.logit_bias)}")
        for tok, bias in self.logit_bias:
            if tok < 0:
                raise UserError(f"logit_bias: token ids are >= 0, got {tok}")
            if not -100 <= bias <= 100:
                raise UserError(f"logit_bias values must be in [-100, 100], got {bias} for token {tok}")
        if self.logprobs is not None and not 0 <= self.logprobs <= LOGPROBS_TOP:
            raise UserError(f"top_logprobs must be in [0, {LOGPROBS_TOP}], got {self.logprobs}")

    def features(self) -> frozenset[str]:
        """The sampling features this request switches on (`SAMPLING_FEATURES`): an engine
        compiles a feature into its step only while a slot it holds uses it."""
        on = {"nucleus": self.top_p < 1, "top_k": self.top_k > 0, "min_p": self.min_p > 0,
              "penalties": self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0,
              "bias": bool(self.logit_bias), "logprobs": self.logprobs is not None}
        return frozenset(name for name, used in on.items() if used)


@dataclasses.dataclass
class Prefix:
    """The result of `Engine.prefill` for one request: what `insert` puts into a slot."""

    data: Any  # engine-specific device arrays
    tokens: list[int]  # tokens already decided by the prefill (AR and speculative: the first one)
    done: bool  # the prefill already finished the request (e.g. its first token is EOS)
    model_s: float = 0.0  # seconds spent in the prefill
    features: frozenset = frozenset()  # the request's sampling features (`RequestParams.features`)
    prompt_len: int = 0  # the prompt's tokens (AR and speculative: for `_Spans`)
    log_probs: list | None = None  # per token of `tokens`: (log-prob, [(id, log-prob), ...]) when asked


@dataclasses.dataclass
class StepOutput:
    """What one `Engine.generate` call produced, per slot (free slots: empty, not done)."""

    tokens: list[list[int]]  # new tokens per slot, in order (a stop token included when decided)
    done: list[bool]  # the engine finished the slot (stop token or context end)
    model_s: float  # seconds in the jitted step (ends with the device-to-host copy; see `Pending`)
    accepted: list[int] | None = None  # speculative: draft tokens accepted per slot this step
    steps: list[int] | None = None  # sampler steps each slot ran while active (None: one per occupied slot)
    ready_early: bool = False  # the step had finished before `collect` was called (see `Pending`)
    log_probs: list[list] | None = None  # per slot, per token: (log-prob, [(id, log-prob), ...]) (see Prefix)


@dataclasses.dataclass
class Pending:
    """A step started by `Engine.dispatch` and not yet collected.

    rows: the step's device output; idx: the slots it computed (None: all); t0 / t1: before and
    after the dispatch returned. `collect` times the step as model seconds from t0 to the end of
    the device-to-host copy when the step was still running at the collect call, so the host
    work done between the two ran while the model did. When the step had already finished
    (`ready_early`), when it finished is not known: the model seconds are then the dispatch and
    the copy only, and the host work in between counts as overhead, never as model time.
    """

    rows: Any
    idx: np.ndarray | None
    t0: float
    t1: float


class Engine(abc.ABC):
    """Slot-based generator. Subclasses set the attributes below in ``__init__``."""

    name: str
    num_slots: int
    max_context: int  # prompt + reply tokens one slot can hold
    tokenizer: Any
    stop_ids: tuple[int, ...]  # token ids that end a reply (EOS, the next turn's <user> marker)
    tokens_per_step: int = 1  # the most tokens one `generate` call can add to a slot

    @property
    def overlap_default(self) -> bool:
        """Whether a batcher should overlap host work with this engine's steps by default (see
        `relf_jax.serving.batching`): for an engine whose `dispatch` returns before its step ends."""
        return type(self).dispatch is not Engine.dispatch

    @abc.abstractmethod
    def init_state(self) -> Any:
        """A decode state with every slot free."""

    @abc.abstractmethod
    def prefill(self, prompt: Sequence[int], params: RequestParams) -> Prefix:
        """Process one prompt (token ids, BOS first) on its own."""

    @abc.abstractmethod
    def insert(self, prefix: Prefix, state: Any, slot: int) -> Any:
        """Put a prefilled request into `slot` of `state`; returns the new state."""

    def prefill_insert(self, prompt: Sequence[int], params: RequestParams, state: Any,
                       slot: int) -> tuple[Any, Prefix]:
        """`prefill` then `insert` into `slot`: the batcher's path. An engine may fuse the two
        into one jitted call (one dispatch and no eager set-up ops per request); its Prefix then
        carries no data, and its model_s covers the fused call."""
        prefix = self.prefill(prompt, params)
        return self.insert(prefix, state, slot), prefix

    @abc.abstractmethod
    def generate(self, state: Any) -> tuple[Any, StepOutput]:
        """Advance every occupied slot by one step."""

    def dispatch(self, state: Any) -> tuple[Any, Any]:
        """Start a `generate` step without waiting for it: (new state, a handle for `collect`).

        An engine whose step runs asynchronously (JAX dispatch) returns before the step ends, so
        the caller's host work overlaps it; the state it returns may be used at once (freed
        slots, new prefills queue behind the step). The default runs `generate` to the end."""
        return self.generate(state)

    def collect(self, pending: Any) -> StepOutput:
        """The StepOutput of a step started by `dispatch` (waits for it)."""
        return pending

    @abc.abstractmethod
    def free(self, state: Any, slot: int, stopped: bool = False) -> Any:
        """Release `slot` (its request finished or was cancelled); returns the new state.

        stopped: the slot already stopped on the device (the last `generate` reported it done),
        so only host bookkeeping is left; an engine may then skip the device update (one jitted
        call saved per finished request). False is always correct.
        """

    def request_finished(self, prompt: Sequence[int], reply: Sequence[int]) -> None:
        """Called by the batcher when a request ends with a reply (finish "stop" or "length"),
        with its prompt and reply ids. Does nothing here; a speculative engine with an online
        n-gram table counts them (`SpeculativeEngine.update_ngram_table`)."""

    def reserve(self) -> int:
        """Context positions a request needs beyond prompt + max_tokens (speculative: k + 1)."""
        return 0

    def check_request(self, prompt_len: int, max_tokens: int) -> None:
        """UserError when a prompt of `prompt_len` tokens plus `max_tokens` cannot fit a slot."""
        if prompt_len < 1:
            raise UserError("the prompt needs at least one token (BOS)")
        room = self.max_context - self.reserve()
        if prompt_len + max_tokens > room:
            raise UserError(f"prompt of {prompt_len} tokens + max_tokens={max_tokens} exceeds the model "
                            f"context of {room} tokens")

    supported: frozenset = frozenset()  # the `SAMPLING_FEATURES` this engine implements

    def check_params(self, params: RequestParams) -> None:
        """UserError for a setting this engine does not implement, or a token id out of its vocabulary."""
        names = {"nucleus": "top_p", "top_k": "top_k", "min_p": "min_p", "bias": "logit_bias", "logprobs": "logprobs",
                 "penalties": "repetition_penalty / frequency_penalty / presence_penalty"}
        missing = sorted(params.features() - self.supported)
        if missing:
            raise UserError(f"the {self.name} engine does not implement {', '.join(names[m] for m in missing)}")
        vocab = getattr(self.tokenizer, "vocab_size", None)
        if vocab is not None:
            for tok in [t for t, _ in params.logit_bias] + list(params.stop_token_ids):
                if not 0 <= tok < vocab:
                    raise UserError(f"token id {tok} is outside the vocabulary (0..{vocab - 1})")

    def warmup(self, prompt_lengths: Sequence[int] | None = None, spans: int | None = None) -> None:
        """Compile prefill for the buckets of `prompt_lengths` (default: every power-of-two
        bucket up to half the context), and insert/generate/free, off the clock; for an engine
        that sizes its caches (`_Spans`), at every cache span a prompt of those lengths can meet,
        or at the `spans` shortest ones only (the others compile when first used)."""
        if prompt_lengths is None:
            prompt_lengths, b = [], 8
            while b <= self.max_context // 2:
                prompt_lengths.append(b)
                b *= 2
        prompt_lengths = [max(1, min(n, self.max_context - self.reserve() - 1)) for n in prompt_lengths]
        sizer = getattr(self, "_spans", None)
        if sizer is None:
            return self._warmup_at(prompt_lengths)
        lengths = sizer.lengths if spans is None else sizer.lengths[:max(1, spans)]
        try:
            for span in lengths:
                sizer.pin = span
                # the prompt buckets whose shortest prompt fits this span
                self._warmup_at([n for n in prompt_lengths if _shortest_in_bucket(n) + 1 + sizer.advance <= span]
                                or [1])
        finally:
            sizer.pin = None
        slots = self.init_state().slots
        for a in lengths:  # and every change of span among them
            for b in lengths:
                if a != b:
                    self._jit_resize(self._jit_resize(slots, a), b)

    def _warmup_at(self, prompt_lengths: Sequence[int]) -> None:
        state = self.init_state()
        bos = getattr(self.tokenizer, "bos_id", 2)
        for n in prompt_lengths:
            state, _ = self.prefill_insert([bos] * n, RequestParams(max_tokens=1, temperature=0.0), state, 0)
        state, _ = self.generate(state)
        busy = 1  # and the steps over 2, 4, ... occupied slots (`_subset`), up to all of them
        while busy < self.num_slots:
            for slot in range(busy, min(2 * busy, self.num_slots)):
                state, _ = self.prefill_insert([bos], RequestParams(max_tokens=1, temperature=0.0), state, slot)
            busy = min(2 * busy, self.num_slots)
            state, _ = self.generate(state)
        for slot in range(self.num_slots):
            state = self.free(state, slot)


def bucket_for(length: int, limit: int) -> int:
    """`relf_jax.sampling.autoregressive.prompt_bucket` (power of two), capped at `limit`."""
    from relf_jax.sampling.autoregressive import prompt_bucket

    return max(length, min(prompt_bucket(length), limit))


def _shortest_in_bucket(length: int) -> int:
    """The shortest prompt padded to the same bucket as one of `length` tokens."""
    from relf_jax.sampling.autoregressive import prompt_bucket

    b = prompt_bucket(length)
    return 1 if b == prompt_bucket(1) else b // 2 + 1


def _set_slot(state, new, slot):
    """`state` with `new` (a batch of one) in `slot`; a leaf of `new` longer than the state's
    (a prefill's KV cache over the whole context, `_Spans`) is cut to it."""
    return jax.tree.map(lambda s, n: s.at[slot].set(n[tuple(slice(0, d) for d in s.shape[1:])].astype(s.dtype)),
                        state, new)


def _stack_slots(tree, n: int):
    return jax.tree.map(lambda x: jnp.broadcast_to(jnp.asarray(x)[None], (n,) + jnp.shape(x)).copy(), tree)


def _first_prefix(engine: Engine, params: RequestParams, t0: float, first, done, prompt_len: int,
                  data=None, lp=None) -> Prefix:
    """The Prefix of a prefill that samples the first token (AR, speculative), `t0` its start:
    `first`, `done` (device scalars) and `lp` (the reported log-probs or None) come to the host
    in one copy."""
    first, done, lp = jax.device_get((first, done, lp))
    first, done = int(first), bool(done)
    return Prefix(data=data, tokens=[first], done=done or first in engine.stop_ids,
                  model_s=time.perf_counter() - t0, features=params.features(), prompt_len=prompt_len,
                  log_probs=None if lp is None else [_lp_entry(np.asarray(lp, np.float32).reshape(-1))])


def _done_at_stop_only(st, lengths, eos_id: int):
    """The sampler state of an engine prefill with `done` set by the first token alone (EOS).

    An engine's prefill settings size the cache to the whole context (``max_new_tokens`` =
    context - prompt bucket), so the sampler's own "one new token left" stop would end a prompt
    padded close to the context after its first token. The engines stop on length themselves:
    the step at the context's end, the batcher at the request's ``max_tokens``."""
    first = jnp.take_along_axis(st.tokens, lengths[:, None], axis=1)[:, 0]
    return dataclasses.replace(st, done=first == eos_id)


def _lp_entry(row: np.ndarray) -> tuple[float, list[tuple[int, float]]]:
    """(the token's log-prob, [(id, log-prob)] of the most probable) from a float32 row of
    `processors.top_log_probs`."""
    n = (row.shape[0] - 1) // 2
    return float(row[0]), list(zip(row[1:1 + n].astype(np.int64).tolist(), row[1 + n:].tolist()))


def _bits(x: jax.Array) -> jax.Array:
    """float32 -> int32 bit patterns (log-probs travel in a step's int32 output rows)."""
    return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)


def _sparse_bias(params: RequestParams) -> tuple[np.ndarray, np.ndarray]:
    """A request's logit_bias as (ids, values), padded with zero entries to a power of two >= 8
    (one compilation of a prefill per size)."""
    n = 8
    while n < len(params.logit_bias):
        n *= 2
    ids, vals = np.zeros((n,), np.int32), np.zeros((n,), np.float32)
    for i, (t, b) in enumerate(params.logit_bias):
        ids[i], vals[i] = t, b
    return ids, vals


def _request_knobs(p: RequestParams, engine_top_k: int) -> dict:
    """A request's traced sampling settings as host scalars (what the jitted prefills take)."""
    return {"temperature": np.float32(p.temperature), "top_k": np.int32(p.top_k or engine_top_k),
            "top_p": np.float32(p.top_p), "min_p": np.float32(p.min_p),
            "repetition": np.float32(p.repetition_penalty), "frequency": np.float32(p.frequency_penalty),
            "presence": np.float32(p.presence_penalty)}


def _request_sampling(ar, knobs: dict, bias_ids, bias_vals, vocab: int):
    """(Traced) `SamplingParams` of one request from `_request_knobs`, every field present (a
    slot's state has one structure whatever its request uses; `_static_sampling` drops the
    unused ones)."""
    from relf_jax.sampling import processors

    pen = processors.Penalties(bias=jnp.zeros((vocab,), jnp.float32).at[bias_ids].add(bias_vals),
                               repetition=knobs["repetition"], frequency=knobs["frequency"],
                               presence=knobs["presence"])
    return ar.SamplingParams(knobs["temperature"], knobs["top_k"], knobs["top_p"], knobs["min_p"], pen)


def _static_sampling(sp, features: frozenset, engine_top_k: int):
    """`sp` with the features no held slot uses replaced by Python off values (left out at
    trace time; see `_Held`)."""
    pen = sp.penalties
    if pen is not None:
        pen = pen.off(bias="bias" not in features, penalties="penalties" not in features)
        if pen.bias is None and not pen.tracks:
            pen = None
    return sp.replace(top_k=sp.top_k if "top_k" in features else engine_top_k,
                      top_p=sp.top_p if "nucleus" in features else None,
                      min_p=sp.min_p if "min_p" in features else None, penalties=pen)


SPAN_MIN = 64  # the shortest cache `_Spans` sizes the slots to


class _Spans:
    """The length of the slots' KV caches in the AR and speculative engines, fitted to what the
    occupied slots need.

    A slot's cache could hold the whole context, but a short conversation fills only its
    start, and every step attends over all of it (the empty tail masked): at a 256-token
    context that attention was about half of a batch-8 NSD round of the `cpu` preset on CPU
    (profile). So the stacked caches are cut to a *span*, the shortest of `lengths` (powers of
    two from `SPAN_MIN`, then the context) that holds every position a step can reach: the host
    keeps an upper bound of each occupied slot's committed length (prompt + 1 at the prefill,
    + every token a step emits for it), and a step adds at most ``tokens_per_step``. The caches
    grow (zero-padded) before a step or an insert that needs more, and shrink (cut) when the
    occupied slots fit in half; a slot's cache beyond its length is masked, so cutting it loses
    nothing. Attending to a narrower cache (an XLA slice of a wider one) would copy the slice
    every step; resizing copies only when the span changes. One compilation of the step per
    span. Masked slots weigh exactly zero, so the logits are the full cache's up to float
    rounding (the sums run over fewer terms); the tests check that the tokens are the sampler's.
    """

    def __init__(self, num_slots: int, max_context: int, advance: int):
        self.advance = advance
        self.ends = [0] * num_slots
        self.pin: int | None = None  # a span `fit` returns whatever the slots need (`Engine.warmup`)
        lengths, n = [], SPAN_MIN
        while n < max_context:
            lengths.append(n)
            n *= 2
        self.lengths = tuple(lengths) + (max_context,)

    def admit(self, slot: int, prompt_len: int) -> None:
        self.ends[slot] = prompt_len + 1  # the prefill commits the first token

    def free(self, slot: int) -> None:
        self.ends[slot] = 0

    def advance_by(self, tokens: list[list[int]]) -> None:
        for slot, toks in enumerate(tokens):
            self.ends[slot] += len(toks)

    def fit(self, current: int, occupied, extra: int = 0) -> int:
        """The span for a step over the `occupied` slots (and a slot about to hold `extra`
        committed tokens): `current` while it holds them and they do not fit in half of it."""
        if self.pin is not None:
            return self.pin
        need = max([self.ends[s] for s in occupied] + [extra]) + self.advance
        best = next((n for n in self.lengths if n >= need), self.lengths[-1])
        return current if best <= current and 2 * best > current else best


def _resize_cache(cache, span: int):
    """Per layer (k, v) [..., S, Dh]: cut or zero-pad the S axis to `span`."""
    def one(x):
        s = x.shape[-2]
        if span <= s:
            return x[..., :span, :]
        return jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, span - s), (0, 0)])
    return jax.tree.map(one, cache)


def _free_slots(engine: Engine, state):
    """`state` with every slot released (an engine's initial state from one stacked prefix)."""
    for slot in range(engine.num_slots):
        state = engine.free(state, slot)
    return state


def _pad_one(prompt: Sequence[int], pad_id: int, bucket: int):
    from relf_jax.sampling.autoregressive import pad_prompts_np

    return pad_prompts_np([list(prompt)], pad_id, bucket)


class _Leaves:
    """A model's parameters as the flat tuple of their arrays, the form the engines pass to their
    jitted calls: flattening an `nnx.State` runs Python for every variable on each call (about
    0.2 ms per call for the `cpu` preset's 38 arrays, measured), a tuple of arrays is flattened
    in C++. `tree` rebuilds the State inside the traced function."""

    def __init__(self, params):
        leaves, self.treedef = jax.tree.flatten(params)
        self.leaves = tuple(leaves)

    def tree(self, leaves):
        """The State of `leaves`; a State (e.g. ``lm.params`` passed directly) is returned as it is."""
        return jax.tree.unflatten(self.treedef, leaves) if isinstance(leaves, tuple) else leaves


@flax.struct.dataclass
class _Slot:
    """Per-slot sampler state (a batch of one) and its traced sampling settings."""

    state: Any
    sampling: Any


@dataclasses.dataclass(frozen=True)
class _Held:
    """The state of an engine that samples with the processors: the device slots, and on the
    host which held slots use which sampling feature (`RequestParams.features`).

    `generate` compiles a feature (the nucleus filter's sort over the vocabulary, top-k, min-p,
    the penalties, the logit bias, the log-probs) only while a slot that uses it is held. The
    samplers skip a filter with a runtime ``lax.cond``, but under the engines' ``vmap`` over
    slots that cond becomes a select that always computes it -- the nucleus sort was measured
    at most of an NSD round's time on CPU.
    """

    slots: Any
    users: frozenset = frozenset()  # (slot, feature) pairs
    occupied: frozenset = frozenset()  # slots holding a request (see `_subset`)

    @property
    def features(self) -> frozenset:
        """The features some held slot uses (a static argument of the engines' steps)."""
        return frozenset(f for _, f in self.users)

    def insert(self, slots, slot: int, features: frozenset) -> _Held:
        return _Held(slots, frozenset((s, f) for s, f in self.users if s != slot) | {(slot, f) for f in features},
                     self.occupied | {slot})

    def free(self, slots, slot: int) -> _Held:
        return _Held(slots, frozenset((s, f) for s, f in self.users if s != slot), self.occupied - {slot})


def _subset(held: _Held, num_slots: int) -> np.ndarray | None:
    """The slots a step should compute when few are occupied: the occupied ones, padded with free
    ones to a power of two (one compilation per size), or None when that size reaches
    `num_slots` (step them all).

    A step costs nearly the same whatever its slots hold (vmapped over all of them), so at low
    load a lone request would pay for a full batch: on the `cpu` preset one busy slot of 8
    decoded at 0.79 ms per AR token against 0.33 ms in a one-slot engine. Free slots are done,
    so stepping one as padding emits nothing."""
    occupied = sorted(held.occupied)
    size = 1
    while size < len(occupied):
        size *= 2
    if size >= num_slots:
        return None
    pad = [s for s in range(num_slots) if s not in held.occupied][:size - len(occupied)]
    return np.asarray(occupied + pad, np.int32)


def _step_subset(step_all, *args, idx, features, **kw):
    """``step_all(*params, slots)`` on the slots `idx` only (gathered, stepped, written back;
    the arrays no held slot uses stay where they are, `_park`)."""
    *params, slots = args
    slots, restore = _park(slots, features)
    sub, out = step_all(*params, jax.tree.map(lambda x: x[idx], slots), features=features, **kw)
    return restore(jax.tree.map(lambda x, y: x.at[idx].set(y), slots, sub)), out


def _expand(rows: list, idx: np.ndarray | None, num_slots: int) -> list:
    """Per-slot output rows of a step over `idx` (None: all slots): the others emit nothing."""
    if idx is None:
        return rows
    blank = [[0] * len(rows[0][0]) for _ in rows[0]]
    full = [blank] * num_slots
    for j, slot in enumerate(idx.tolist()):
        full[slot] = rows[j]
    return full


def _collect_rows(pending: Pending, num_slots: int) -> tuple[list, float, bool]:
    """(per-slot rows as Python ints, model seconds, ready_early) of a dispatched step (see `Pending`)."""
    t2 = time.perf_counter()
    early = pending.rows.is_ready()
    rows = _expand(np.asarray(pending.rows).tolist(), pending.idx, num_slots)  # one device-to-host copy
    t3 = time.perf_counter()
    model_s = (pending.t1 - pending.t0) + (t3 - t2) if early else t3 - pending.t0
    return rows, model_s, early


def _context(model_max: int, max_context: int | None) -> int:
    """An engine's context: the model's, or `max_context` below it (`load_engine`'s docstring)."""
    if max_context is None:
        return model_max
    if not isinstance(max_context, int) or not 2 <= max_context <= model_max:
        raise UserError(f"max_context must be an integer in [2, {model_max}] (the model's context), "
                        f"got {max_context!r}")
    return max_context


def _check_steps_per_call(n: int) -> int:
    """Sampler steps (AR tokens, speculative rounds) one `generate` call runs, in one jitted loop.

    More than one cuts the per-step host work (dispatch, the host copy, the batcher's
    bookkeeping, one streamed chunk per call) at the cost of a coarser stream and of requests
    joining or leaving only between calls. A slot stops inside the call at a stop token or the
    context end; tokens past a request's own end (max_tokens, a stop string) are dropped by the
    batcher. Every step is the sampler's own, so a request's tokens do not change.
    """
    if not isinstance(n, int) or n < 1:
        raise UserError(f"steps_per_call must be an integer >= 1, got {n!r}")
    return n


def _park(slots: _Slot, features: frozenset):
    """(slots without the per-slot vocabulary-sized arrays no held slot uses -- the penalties'
    token counts, the logit bias --, a function that puts them back unchanged). Carried through
    a step's ``while_loop`` (or gathered for `_step_subset`) they would cost copies per call."""
    state, pen = slots.state, slots.sampling.penalties
    drop_counts = "penalties" not in features and state.counts is not None
    drop_bias = "bias" not in features and pen is not None and pen.bias is not None
    if drop_counts:
        slots = slots.replace(state=state.replace(counts=None, seen=None))
    if drop_bias:
        slots = slots.replace(sampling=slots.sampling.replace(penalties=pen.replace(bias=None)))

    def restore(new: _Slot) -> _Slot:
        if drop_counts:
            new = new.replace(state=new.state.replace(counts=state.counts, seen=state.seen))
        if drop_bias:
            new = new.replace(sampling=new.sampling.replace(penalties=new.sampling.penalties.replace(bias=pen.bias)))
        return new

    return slots, restore


def _run_parked(step, slots: _Slot, n: int, width: int, features: frozenset):
    """`_run_steps` with the arrays no held slot uses left out of the loop (`_park`)."""
    slots, restore = _park(slots, features)
    slots, rows = _run_steps(step, slots, n, width)
    return restore(slots), rows


def _run_steps(step, slots: _Slot, n: int, width: int):
    """Up to `n` calls of ``step(slots) -> (slots, row [num_slots, width] int32)`` in one
    ``lax.while_loop`` that stops early once no slot is active (so a request that ends does not
    pay for the rest of the call). Returns (slots, rows [num_slots, n, width]); rows of steps
    not run are zero (nothing emitted)."""
    num = slots.state.done.shape[0]

    def cond(c):
        i, sl, _ = c
        return (i < n) & jnp.any(~sl.state.done)

    def body(c):
        i, sl, out = c
        sl, row = step(sl)
        return i + 1, sl, out.at[i].set(row)

    _, slots, out = jax.lax.while_loop(cond, body, (jnp.int32(0), slots, jnp.zeros((n, num, width), jnp.int32)))
    return slots, jnp.moveaxis(out, 0, 1)


class _SpanSized:
    """`insert` and the span fitting (`_Spans`) shared by the AR and speculative engines, whose
    state is a `_Held` and which set ``_spans``, ``_jit_insert``, ``_jit_resize`` and `_span`."""

    def insert(self, prefix, state, slot):
        state = self._fit(state, extra=prefix.prompt_len + 1)
        self._spans.admit(slot, prefix.prompt_len)
        return state.insert(self._jit_insert(state.slots, prefix.data, slot), slot, prefix.features)

    def _fit(self, state, extra: int = 0):
        """`state` with its caches resized to the span the next step (or insert) needs."""
        span = self._spans.fit(self._span(state), state.occupied, extra)
        return state if span == self._span(state) else dataclasses.replace(state, slots=self._jit_resize(
            state.slots, span))


# ------------------------------------------------------------------------------ autoregressive

class AREngine(_SpanSized, Engine):
    """One token per sampler step per slot, with `relf_jax.sampling.autoregressive`'s prefill and
    step; `steps_per_call` steps per `generate` (see `_check_steps_per_call`). Implements every
    `SAMPLING_FEATURES` entry per request."""

    supported = frozenset(SAMPLING_FEATURES)

    def __init__(self, lm, num_slots: int = 8, *, top_k: int = 0, steps_per_call: int = 1, name: str = "ar",
                 max_context: int | None = None):
        from relf_jax.sampling import autoregressive as ar

        if num_slots < 1:
            raise UserError(f"num_slots must be >= 1, got {num_slots}")
        self._ar = ar
        self.lm, self.name, self.num_slots, self.top_k = lm, name, num_slots, top_k
        self.steps_per_call = self.tokens_per_step = _check_steps_per_call(steps_per_call)
        self.tokenizer = lm.tokenizer
        self.vocab_size = lm.model_cfg.vocab_size
        self.max_context = _context(lm.model_cfg.max_seq_len, max_context)
        self.stop_ids = turn_stop_ids(lm.tokenizer)
        # the step never stops a slot on length (the server does, per request)
        self._step_settings = ar.DecodeSettings(max_new_tokens=self.max_context, eos_id=lm.tokenizer.eos_id,
                                                pad_id=lm.tokenizer.pad_id, track_tokens=True)
        self.compact = True  # step only the occupied slots when few are (`_subset`)
        self._spans = _Spans(num_slots, self.max_context, self.tokens_per_step)
        self._weights = _Leaves(lm.params)
        self._jit_step = jax.jit(self._step_all, donate_argnums=(1,), static_argnames=("features",))
        self._jit_step_subset = jax.jit(functools.partial(_step_subset, self._step_all), donate_argnums=(1,),
                                        static_argnames=("features",))
        self._jit_resize = jax.jit(lambda s, span: s.replace(state=s.state.replace(cache=_resize_cache(
            s.state.cache, span))), static_argnums=(1,))
        self._jit_insert = jax.jit(_set_slot, donate_argnums=(0,))
        self._jit_prefill = jax.jit(self._prefix_data, static_argnames=("settings", "features"))
        self._jit_prefill_insert = jax.jit(self._prefill_into, donate_argnums=(1,),
                                           static_argnames=("settings", "features"))
        self._jit_free = jax.jit(lambda s, slot: dataclasses.replace(
            s, state=dataclasses.replace(s.state, done=s.state.done.at[slot].set(True))), donate_argnums=(0,))

    def _settings(self, bucket: int):
        return self._ar.DecodeSettings(max_new_tokens=self.max_context - bucket, eos_id=self.tokenizer.eos_id,
                                       pad_id=self.tokenizer.pad_id, track_tokens=True)

    def _request(self, p: RequestParams):
        """The request's settings as the jitted prefills take them (host arrays; the rest static)."""
        ids, vals = _sparse_bias(p)
        return {"seed": np.uint32(p.seed), "knobs": _request_knobs(p, self.top_k), "bias_ids": ids, "bias_vals": vals}

    def init_state(self):
        return _free_slots(self, _Held(_stack_slots(self.prefill([self.tokenizer.bos_id], RequestParams(1, 0.0)).data,
                                                    self.num_slots)))

    def _padded(self, prompt):
        bucket = bucket_for(len(prompt), self.max_context - 1)
        return (*_pad_one(prompt, self.tokenizer.pad_id, bucket), self._settings(bucket))

    def _prefix_data(self, params, prompts, lengths, seed, knobs, bias_ids, bias_vals, settings, features):
        """(slot data, first token, done, its log-probs or None) of one padded prompt: traced,
        the seed's key made inside."""
        sampling = _request_sampling(self._ar, knobs, bias_ids, bias_vals, self.vocab_size)
        st, lp = self._ar.prefill_scored(self.lm.graphdef, self._weights.tree(params), prompts, lengths,
                                         jax.random.key(seed), _static_sampling(sampling, features, self.top_k),
                                         settings, log_probs=LOGPROBS_TOP if "logprobs" in features else 0)
        st = _done_at_stop_only(st, lengths, self.tokenizer.eos_id)
        return _Slot(state=st, sampling=sampling), st.tokens[0, lengths[0]], st.done[0], lp

    def prefill(self, prompt, params):
        arr, lens, settings = self._padded(prompt)
        t0 = time.perf_counter()
        data, first, done, lp = self._jit_prefill(self._weights.leaves, arr, lens, **self._request(params),
                                                  settings=settings, features=params.features())
        return _first_prefix(self, params, t0, first, done, len(prompt), data=data, lp=lp)

    def _span(self, state) -> int:
        return state.slots.state.cache[0][0].shape[-2]

    def _prefill_into(self, params, slots, prompts, lengths, seed, knobs, bias_ids, bias_vals, slot, settings,
                      features):
        data, first, done, lp = self._prefix_data(params, prompts, lengths, seed, knobs, bias_ids, bias_vals,
                                                  settings, features)
        return _set_slot(slots, data, slot), first, done, lp

    def prefill_insert(self, prompt, params, state, slot):
        arr, lens, settings = self._padded(prompt)
        state = self._fit(state, extra=len(prompt) + 1)
        t0 = time.perf_counter()
        slots, first, done, lp = self._jit_prefill_insert(self._weights.leaves, state.slots, arr, lens,
                                                          **self._request(params), slot=slot, settings=settings,
                                                          features=params.features())
        prefix = _first_prefix(self, params, t0, first, done, len(prompt), lp=lp)
        self._spans.admit(slot, len(prompt))
        return state.insert(slots, slot, prefix.features), prefix

    def free(self, state, slot, stopped=False):
        self._spans.free(slot)
        return state.free(state.slots if stopped else self._jit_free(state.slots, slot), slot)

    def _step_all(self, params, slots: _Slot, features: frozenset):
        ar, settings = self._ar, self._step_settings
        params = self._weights.tree(params)
        n_lp = LOGPROBS_TOP if "logprobs" in features else 0

        def one(st, sp):
            # Python values switch the unused features off at trace time (see `_Held`)
            return ar.step(self.lm.graphdef, params, st, _static_sampling(sp, features, self.top_k), settings,
                           log_probs=n_lp)

        stops = jnp.asarray(self.stop_ids, jnp.int32)

        def step(slots):
            new, lp = jax.vmap(one)(slots.state, slots.sampling)
            emitted = new.lengths[:, 0] > slots.state.lengths[:, 0]
            last = jnp.take_along_axis(new.tokens[:, 0], (new.lengths[:, 0] - 1)[:, None], axis=1)[:, 0]
            # a slot stops at any stop token (the sampler itself only at EOS) or when full
            done = new.done[:, 0] | (new.lengths[:, 0] >= self.max_context) | (emitted & jnp.isin(last, stops))
            new = dataclasses.replace(new, done=done[:, None])
            row = jnp.stack([last, emitted, done & emitted], axis=1).astype(jnp.int32)
            if n_lp:
                row = jnp.concatenate([row, _bits(lp[:, 0])], axis=1)
            return dataclasses.replace(slots, state=new), row

        # [slots, steps, (token, emitted, done[, log-prob, top ids, top log-probs])]
        return _run_parked(step, slots, self.steps_per_call, 3 + (1 + 2 * n_lp if n_lp else 0), features)

    def dispatch(self, state):
        t0 = time.perf_counter()
        state = self._fit(state)
        idx = _subset(state, self.num_slots) if self.compact else None
        if idx is None:
            slots, out = self._jit_step(self._weights.leaves, state.slots, features=state.features)
        else:
            slots, out = self._jit_step_subset(self._weights.leaves, state.slots, idx=idx, features=state.features)
        return dataclasses.replace(state, slots=slots), Pending(out, idx, t0, time.perf_counter())

    def collect(self, pending):
        out, model_s, early = _collect_rows(pending, self.num_slots)
        toks = [[r[0] for r in row if r[1]] for row in out]
        lps = None
        if len(out[0][0]) > 3:  # the log-probs' bit patterns follow (token, emitted, done)
            lps = [[_lp_entry(np.asarray(r[3:], np.int32).view(np.float32)) for r in row if r[1]] for row in out]
        self._spans.advance_by(toks)
        return StepOutput(tokens=toks, done=[any(r[2] for r in row) for row in out], model_s=model_s,
                          steps=[len(t) for t in toks], ready_early=early, log_probs=lps)

    def generate(self, state):
        state, pending = self.dispatch(state)
        return state, self.collect(pending)



# ------------------------------------------------------------------------------ speculative

class SpeculativeEngine(_SpanSized, Engine):
    """One draft/verify round per step per slot (`relf_jax.speculative.generate`'s round).

    rule: "standard" (exact), "nsd" (nucleus relaxation, `nsd_top_p`) or "greedy"; proposer:
    "draft" (needs `draft`, a loaded AR model with the same tokenizer), "prompt_lookup" or
    "corpus_ngram" (needs `ngram_table`, an `NgramDraft`, or `ngram_online`, an
    `relf_jax.speculative.ngram_draft.OnlineNgram` that counts the requests served and whose
    new tables `request_finished` swaps in, `update_ngram_table`).
    Implements every `SAMPLING_FEATURES` entry per request, on the target's distribution (the
    round's processed verification, `relf_jax.speculative.generate`).
    """

    supported = frozenset(SAMPLING_FEATURES)

    def __init__(self, lm, draft=None, num_slots: int = 8, *, rule: str = "nsd", k: int = 4,
                 proposer: str = "draft", nsd_top_p: float = 0.9, ngram: int = 3, steps_per_call: int = 1,
                 name: str | None = None, max_context: int | None = None, ngram_table=None,
                 ngram_online=None):
        from relf_jax.speculative import generate as spec

        if num_slots < 1:
            raise UserError(f"num_slots must be >= 1, got {num_slots}")
        if proposer == "draft" and draft is None:
            raise UserError("the speculative engine with proposer 'draft' needs a draft model")
        if proposer == "corpus_ngram" and ngram_table is None and ngram_online is not None:
            ngram_table = ngram_online.table
        if proposer == "corpus_ngram":
            spec.check_ngram_table(ngram_table, lm.model_cfg.vocab_size)
        self.ngram_table = ngram_table if proposer == "corpus_ngram" else None
        self.ngram_online = ngram_online if proposer == "corpus_ngram" else None
        self._spec = spec
        self.lm, self.draft, self.num_slots = lm, (draft if proposer == "draft" else None), num_slots
        self.rule, self.k, self.proposer, self.nsd_top_p, self.ngram = rule, k, proposer, nsd_top_p, ngram
        self.name = name or f"spec-{rule}"
        self.tokenizer = lm.tokenizer
        self.vocab_size = lm.model_cfg.vocab_size
        model_max = lm.model_cfg.max_seq_len
        if self.draft is not None:
            model_max = min(model_max, self.draft.model_cfg.max_seq_len)
        self.max_context = _context(model_max, max_context)
        self.stop_ids = turn_stop_ids(lm.tokenizer)
        self.steps_per_call = _check_steps_per_call(steps_per_call)
        self.tokens_per_step = (k + 1) * self.steps_per_call
        self._step_settings = self._settings(self.max_context)
        self.compact = True  # step only the occupied slots when few are (`_subset`)
        self._spans = _Spans(num_slots, self.max_context, self.tokens_per_step)
        self._target_w = _Leaves(lm.params)
        self._draft_w = _Leaves(self.draft.params) if self.draft is not None else None
        self._jit_step = jax.jit(self._step_all, donate_argnums=(2,), static_argnames=("features",))
        self._jit_step_subset = jax.jit(functools.partial(_step_subset, self._step_all), donate_argnums=(2,),
                                        static_argnames=("features",))
        self._jit_resize = jax.jit(lambda s, span: s.replace(state=s.state.replace(
            target_cache=_resize_cache(s.state.target_cache, span),
            draft_cache=_resize_cache(s.state.draft_cache, span))), static_argnums=(1,))
        self._jit_insert = jax.jit(_set_slot, donate_argnums=(0,))
        self._jit_prefill = jax.jit(self._prefix_data, static_argnames=("settings", "features"))
        self._jit_prefill_insert = jax.jit(self._prefill_into, donate_argnums=(2,),
                                           static_argnames=("settings", "features"))
        self._jit_free = jax.jit(lambda s, slot: dataclasses.replace(
            s, state=dataclasses.replace(s.state, done=s.state.done.at[slot].set(True))), donate_argnums=(0,))

    def _settings(self, max_new_tokens: int):
        tok = self.tokenizer
        return self._spec.SpecSettings(k=self.k, rule=self.rule, proposer=self.proposer,
                                       max_new_tokens=max_new_tokens, eos_id=tok.eos_id, pad_id=tok.pad_id,
                                       ngram=self.ngram, track_tokens=True)

    def update_ngram_table(self, table) -> None:
        """Use `table` (an `NgramDraft`) from the next prefill / step on. It must have the current
        table's shapes (`ngram_draft.same_shapes`), so the jitted calls do not recompile. Safe
        between steps and exact: the table is only the proposal distribution."""
        from relf_jax.speculative import ngram_draft

        if self.ngram_table is None:
            raise ValueError(f"the {self.name} engine has no n-gram table (proposer {self.proposer!r})")
        if not ngram_draft.same_shapes(self.ngram_table, table):
            raise ValueError("the new n-gram table's shapes differ from the current one's (a recompile)")
        self.ngram_table = table

    def request_finished(self, prompt, reply) -> None:
        if self.ngram_online is not None and self.ngram_online.add([*prompt, *reply]):
            self.update_ngram_table(self.ngram_online.table)

    def reserve(self) -> int:
        return self.k + 1

    def _request(self, p: RequestParams):
        """The request's settings as the jitted prefills take them (host arrays; the rest static)."""
        ids, vals = _sparse_bias(p)
        return {"seed": np.uint32(p.seed), "knobs": _request_knobs(p, 0), "bias_ids": ids, "bias_vals": vals}

    def _spec_params(self, knobs, bias_ids, bias_vals):
        """(Traced) `SpecParams` of one request, every field present (see `_request_sampling`)."""
        from relf_jax.sampling import autoregressive as ar

        sp = _request_sampling(ar, knobs, bias_ids, bias_vals, self.vocab_size)
        return self._spec.SpecParams(sp.temperature, sp.top_p, jnp.float32(self.nsd_top_p), sp.top_k, sp.min_p,
                                     sp.penalties)

    @staticmethod
    def _static_params(sp, features: frozenset):
        """`sp` with the features no held slot uses switched off at trace time (see `_Held`)."""
        pen = sp.penalties.off(bias="bias" not in features, penalties="penalties" not in features)
        return sp.replace(top_k=sp.top_k if "top_k" in features else None,
                          top_p=sp.top_p if "nucleus" in features else None,
                          min_p=sp.min_p if "min_p" in features else None,
                          penalties=pen if pen.bias is not None or pen.tracks else None)

    def _weight_args(self):
        """The target's and the draft's weights as the jitted calls take them (`_Leaves`; the
        n-gram table or None in the draft's place without a draft model)."""
        return self._target_w.leaves, (self._draft_w.leaves if self._draft_w is not None else self.ngram_table)

    def _weights(self, target_params, draft_params):
        """Inside a traced call: the States of what `_weight_args` passed."""
        return (self._target_w.tree(target_params),
                self._draft_w.tree(draft_params) if self._draft_w is not None else draft_params)

    def init_state(self):
        return _free_slots(self, _Held(_stack_slots(self.prefill([self.tokenizer.bos_id], RequestParams(1, 0.0)).data,
                                                    self.num_slots)))

    def _padded(self, prompt):
        bucket = bucket_for(len(prompt), self.max_context - self.reserve() - 1)
        return (*_pad_one(prompt, self.tokenizer.pad_id, bucket), self._settings(self.max_context - bucket - self.k - 1))

    def _prefix_data(self, target_params, draft_params, prompts, lengths, seed, knobs, bias_ids, bias_vals,
                     settings, features):
        """(slot data, first token, done, its log-probs or None) of one padded prompt: traced,
        the seed's key made inside."""
        dg = self.draft.graphdef if self.draft is not None else None
        target_params, draft_params = self._weights(target_params, draft_params)
        sp = self._spec_params(knobs, bias_ids, bias_vals)
        st, lp = self._spec.prefill_scored(self.lm.graphdef, target_params, dg, draft_params, prompts, lengths,
                                           jax.random.key(seed), self._static_params(sp, features), settings,
                                           log_probs=LOGPROBS_TOP if "logprobs" in features else 0)
        st = _done_at_stop_only(st, lengths, self.tokenizer.eos_id)
        return _Slot(state=st, sampling=sp), st.tokens[0, lengths[0]], st.done[0], lp

    def prefill(self, prompt, params):
        arr, lens, settings = self._padded(prompt)
        t0 = time.perf_counter()
        data, first, done, lp = self._jit_prefill(*self._weight_args(), arr, lens, **self._request(params),
                                                  settings=settings, features=params.features())
        return _first_prefix(self, params, t0, first, done, len(prompt), data=data, lp=lp)

    def _span(self, state) -> int:
        return state.slots.state.target_cache[0][0].shape[-2]

    def _prefill_into(self, target_params, draft_params, slots, prompts, lengths, seed, knobs, bias_ids, bias_vals,
                      slot, settings, features):
        data, first, done, lp = self._prefix_data(target_params, draft_params, prompts, lengths, seed, knobs,
                                                  bias_ids, bias_vals, settings, features)
        return _set_slot(slots, data, slot), first, done, lp

    def prefill_insert(self, prompt, params, state, slot):
        arr, lens, settings = self._padded(prompt)
        state = self._fit(state, extra=len(prompt) + 1)
        t0 = time.perf_counter()
        slots, first, done, lp = self._jit_prefill_insert(*self._weight_args(), state.slots, arr, lens,
                                                          **self._request(params), slot=slot, settings=settings,
                                                          features=params.features())
        prefix = _first_prefix(self, params, t0, first, done, len(prompt), lp=lp)
        self._spans.admit(slot, len(prompt))
        return state.insert(slots, slot, prefix.features), prefix

    def free(self, state, slot, stopped=False):
        self._spans.free(slot)
        return state.free(state.slots if stopped else self._jit_free(state.slots, slot), slot)

    def _step_all(self, target_params, draft_params, slots: _Slot, features: frozenset):
        spec, settings = self._spec, self._step_settings
        dg = self.draft.graphdef if self.draft is not None else None
        target_params, draft_params = self._weights(target_params, draft_params)
        n_lp = LOGPROBS_TOP if "logprobs" in features else 0

        def one(st, sp):
            # Python values switch the unused features off at trace time (see `_Held`)
            return spec.round_scored(self.lm.graphdef, target_params, dg, draft_params, st,
                                     self._static_params(sp, features), settings, log_probs=n_lp)

        stops = jnp.asarray(self.stop_ids, jnp.int32)

        def round_(slots):
            old = slots.state
            new, lp = jax.vmap(one)(old, slots.sampling)
            start, count = old.lengths[:, 0], new.lengths[:, 0] - old.lengths[:, 0]
            window = jax.vmap(lambda row, s: jax.lax.dynamic_slice(row, (s,), (self.k + 1,)))(
                new.tokens[:, 0], jnp.minimum(start, new.tokens.shape[-1] - self.k - 1))
            accepted = new.accepted[:, 0] - old.accepted[:, 0]
            # a slot stops at any stop token it committed (the sampler itself only at EOS) or when full
            stopped = jnp.any(jnp.isin(window, stops) & (jnp.arange(self.k + 1)[None, :] < count[:, None]), axis=1)
            done = new.done[:, 0] | stopped | (new.lengths[:, 0] + self.k + 1 > self.max_context)
            new = dataclasses.replace(new, done=done[:, None])
            cols = [count, done & (count > 0), accepted]
            parts = [window, jnp.stack(cols, axis=1).astype(window.dtype)]
            if n_lp:  # per position: the log-prob, top ids, top log-probs (bit patterns)
                parts.append(_bits(lp[:, 0].reshape(lp.shape[0], -1)))
            return dataclasses.replace(slots, state=new), jnp.concatenate(parts, axis=1)

        # [slots, rounds, (k + 1 tokens, count, done, accepted[, (k + 1) * (1 + 2 * top)])]
        return _run_parked(round_, slots, self.steps_per_call,
                           self.k + 4 + (self.k + 1) * (1 + 2 * n_lp if n_lp else 0), features)

    def dispatch(self, state):
        t0 = time.perf_counter()
        state = self._fit(state)
        idx = _subset(state, self.num_slots) if self.compact else None
        args = (*self._weight_args(), state.slots)
        if idx is None:
            slots, out = self._jit_step(*args, features=state.features)
        else:
            slots, out = self._jit_step_subset(*args, idx=idx, features=state.features)
        return dataclasses.replace(state, slots=slots), Pending(out, idx, t0, time.perf_counter())

    def collect(self, pending):
        out, model_s, early = _collect_rows(pending, self.num_slots)
        w = self.k + 1
        toks = [[t for r in row for t in r[:r[w]]] for row in out]
        lps = None
        if len(out[0][0]) > w + 3:  # each position's log-probs (bit patterns) follow
            def entries(r):
                per = np.asarray(r[w + 3:], np.int32).view(np.float32).reshape(w, -1)
                return [_lp_entry(per[j]) for j in range(r[w])]
            lps = [[e for r in row for e in entries(r)] for row in out]
        self._spans.advance_by(toks)
        return StepOutput(tokens=toks, done=[any(r[w + 1] for r in row) for row in out], model_s=model_s,
                          accepted=[sum(r[w + 2] for r in row) for row in out],
                          steps=[sum(r[w] > 0 for r in row) for row in out], ready_early=early, log_probs=lps)

    def generate(self, state):
        state, pending = self.dispatch(state)
        return state, self.collect(pending)


# ------------------------------------------------------------------------------ block diffusion

@flax.struct.dataclass
class _BDSlot:
    canvas: jax.Array  # [1, C]
    cache: Any  # per layer (k, v) [1, heads, C, hd]
    prompt_len: jax.Array  # [1]
    blocks: jax.Array  # [] output blocks decoded
    done: jax.Array  # [1]
    key: jax.Array  # [2] uint32 key data
    temperature: jax.Array  # []


class BlockDiffusionEngine(Engine):
    """One committed block per step per slot (`relf_jax.dws.decoding`'s confidence-threshold rule).

    Each step runs, for every occupied slot in lockstep, the denoising steps its current block
    needs (a slot whose block is done idles until the others finish theirs), then the refresh
    forward; the step's output is each slot's committed block. Temperature 0 is greedy; > 0
    samples tokens (inverse CDF, `processors.sample`) per slot. `top_p` does not apply.
    """

    def __init__(self, lm, num_slots: int = 8, *, threshold: float = 0.95, name: str = "bd"):
        from relf_jax.dws import decoding as bdd
        from relf_jax.models.block_diffusion import mask_id

        if lm.model_cfg.family != "bd":
            raise UserError(f"the block-diffusion engine needs a 'bd' model, got {lm.model_cfg.family!r}")
        self._bdd = bdd
        self.lm, self.num_slots, self.name = lm, num_slots, name
        self.tokenizer = lm.tokenizer
        d = lm.model_cfg.block_size
        self.block_size = d
        self.max_context = (lm.model_cfg.max_seq_len // d) * d
        self.stop_ids = turn_stop_ids(lm.tokenizer, pad=True)
        self.tokens_per_step = d
        self.settings = bdd.BlockDecodeSettings(block_size=d, max_blocks=1, mask_id=mask_id(lm.model_cfg),
                                                pad_id=lm.tokenizer.pad_id, stop_ids=self.stop_ids,
                                                threshold=threshold)
        self._weights = _Leaves(lm.params)
        self._jit_step = jax.jit(self._step_all, donate_argnums=(1,))
        self._jit_insert = jax.jit(_set_slot, donate_argnums=(0,))
        self._jit_prefill = jax.jit(self._prefix_data)
        self._jit_prefill_insert = jax.jit(self._prefill_into, donate_argnums=(1,))
        self._jit_free = jax.jit(lambda s, slot: s.replace(done=s.done.at[slot].set(True)), donate_argnums=(0,))

    def reserve(self) -> int:
        return self.block_size  # the last block may run past max_tokens

    def init_state(self):
        return _free_slots(self, _stack_slots(self.prefill([self.tokenizer.bos_id], RequestParams(1, 0.0)).data,
                                              self.num_slots))

    def prefill(self, prompt, params):
        arr, plen = self._padded(prompt)
        t0 = time.perf_counter()
        data = jax.block_until_ready(self._jit_prefill(self._weights.leaves, arr, plen, np.uint32(params.seed),
                                                       np.float32(params.temperature)))
        return Prefix(data=data, tokens=[], done=False, model_s=time.perf_counter() - t0)

    def insert(self, prefix, state, slot):
        return self._jit_insert(state, prefix.data, slot)

    def _padded(self, prompt):
        bdd, d = self._bdd, self.block_size
        pb = bucket_for(bdd.prompt_bucket(len(prompt), d), self.max_context - d)
        return bdd.pad_prompts([list(prompt)], self.tokenizer.pad_id, d, -(-pb // d) * d)

    def _prefix_data(self, params, prompts, prompt_len, seed, temperature):
        """One padded prompt's slot data (its prefilled cache): traced, the seed's key made inside."""
        bdd = self._bdd
        cache = bdd._prefill_jit(self.lm.graphdef, self._weights.tree(params), prompts, prompt_len, canvas_len=self.max_context,
                                 settings=self.settings)
        return _BDSlot(canvas=bdd._canvas(prompts, self.max_context, self.tokenizer.pad_id), cache=cache,
                       prompt_len=prompt_len, blocks=jnp.int32(0), done=jnp.zeros((1,), bool),
                       key=jax.random.key_data(jax.random.key(seed)), temperature=temperature)

    def _prefill_into(self, params, slots, prompts, prompt_len, seed, temperature, slot):
        return _set_slot(slots, self._prefix_data(params, prompts, prompt_len, seed, temperature), slot)

    def prefill_insert(self, prompt, params, state, slot):
        arr, plen = self._padded(prompt)
        t0 = time.perf_counter()
        state = jax.block_until_ready(self._jit_prefill_insert(self._weights.leaves, state, arr, plen,
                                                               np.uint32(params.seed),
                                                               np.float32(params.temperature), slot))
        return state, Prefix(data=None, tokens=[], done=False, model_s=time.perf_counter() - t0)

    def free(self, state, slot, stopped=False):
        return state if stopped else self._jit_free(state, slot)

    def _step_all(self, params, slots: _BDSlot):
        bdd, settings, d = self._bdd, self.settings, self.block_size
        model = nnx.merge(self.lm.graphdef, self._weights.tree(params))

        def one(sl: _BDSlot):
            active = ~sl.done
            start = bdd._block_start(sl.prompt_len, sl.blocks, settings)
            block, is_masked = bdd._open_block(sl.canvas, sl.prompt_len, start, settings)
            is_masked &= active[:, None]

            def body(c):
                cache, block, is_masked, key = c
                key, sub = jax.random.split(key)
                logits, cache = bdd._forward(model, cache, block, start, settings)
                commit, toks = bdd.confidence_commit(logits, is_masked, settings.threshold,
                                                     temperature=sl.temperature, key=sub,
                                                     confidence=settings.confidence)
                return cache, jnp.where(commit, toks, block), is_masked & ~commit, key

            key = jax.random.wrap_key_data(sl.key)
            cache, block, _, key = jax.lax.while_loop(lambda c: c[2].any(), body,
                                                      (sl.cache, block, is_masked, key))
            _, cache = bdd._forward(model, cache, block, start, settings)
            canvas, stop_pos = bdd._close_block(sl.canvas, block, start, sl.prompt_len, active, settings)
            lo = jnp.maximum(start, sl.prompt_len) - start
            hi = jnp.where(stop_pos >= 0, stop_pos + 1 - start, d)
            full = start + 2 * d > self.max_context
            done = sl.done | (active & ((stop_pos >= 0) | full))
            new = _BDSlot(canvas=canvas, cache=cache, prompt_len=sl.prompt_len,
                          blocks=sl.blocks + active[0].astype(jnp.int32), done=done,
                          key=jax.random.key_data(key), temperature=sl.temperature)
            row = jnp.stack([jnp.where(active, lo, 0)[0], jnp.where(active, hi, 0)[0], (active & done)[0]])
            return new, jnp.concatenate([block[0], row.astype(block.dtype)])

        return jax.vmap(one)(slots)  # (state, [slots, (d block tokens, lo, hi, done)])

    def generate(self, state):
        t0 = time.perf_counter()
        state, out = self._jit_step(self._weights.leaves, state)
        out = np.asarray(out).tolist()  # one device-to-host copy; Python ints from here on
        model_s = time.perf_counter() - t0
        d = self.block_size
        toks = [row[row[d]:row[d + 1]] for row in out]
        return state, StepOutput(tokens=toks, done=[bool(row[d + 2]) for row in out], model_s=model_s)


# ------------------------------------------------------------------------------ ReLF

@flax.struct.dataclass
class _FlowSlot:
    tokens: jax.Array  # [L] the prompt, then pad
    prompt_len: jax.Array  # []
    key: jax.Array  # [2] uint32 key data
    active: jax.Array  # [] bool
    segment_len: jax.Array  # [] the row's one segment (a model trained on segment rows; else L)


class ReLFEngine(Engine):
    """The whole reply in one step: the ReLF flow sampler over the model's full length.

    The flow fills in the positions after the prompt conditioned on it; the reply is what
    follows the prompt up to the first stop token. A model trained with clean, flagged prompts
    (``flow.prompt_prob`` > 0) sees the prompt as it is; any other model sees it redrawn on the
    path of its token embeddings (``t * e + (1 - t) * eps``, fresh eps) before every call (see
    `relf_jax.flow.samplers`). `nfe` network calls per reply; temperature and top_p do not apply
    (the sampler's own noise, seeded per request, makes the choice). A model trained on segment
    rows writes one segment of a length drawn (seeded per request) from its training segments'
    lengths, longer than the prompt (`relf_jax.workflows.flow_lengths`).
    """

    def __init__(self, lm, num_slots: int = 8, *, nfe: int | None = None, name: str = "relf"):
        from relf_jax.flow.samplers import FlowSamplerSettings
        from relf_jax.workflows import flow_lengths, flow_table

        if lm.model_cfg.family != "relf":
            raise UserError(f"the ReLF engine needs a 'relf' model, got {lm.model_cfg.family!r}")
        f = lm.cfg.flow
        self.lm, self.num_slots, self.name = lm, num_slots, name
        self.flow_settings = FlowSamplerSettings(nfe=nfe or f.nfe, grid=f.grid, sampler=f.sampler,
                                                 c=f.residual_bound, guidance=f.guidance,
                                                 use_singular=f.use_singular, t_eps=f.t_eps, gamma=f.gamma,
                                                 renoise=f.renoise,
                                                 prompt="clean" if lm.model_cfg.flow_prompt_input else "renoise")
        self.table = jnp.asarray(flow_table(lm), jnp.float32)
        self.tokenizer = lm.tokenizer
        self.length = lm.cfg.data.seq_len
        self.max_context = self.length
        self.stop_ids = turn_stop_ids(lm.tokenizer)
        self.tokens_per_step = self.length
        counts = flow_lengths(lm)
        self.length_counts = None if counts is None else np.pad(counts, (0, max(0, self.length + 1 - len(counts))))[
            :self.length + 1]
        self._weights = _Leaves(lm.params)
        self._jit_step = jax.jit(self._step_all, donate_argnums=(1,))
        self._jit_insert = jax.jit(_set_slot, donate_argnums=(0,))
        self._jit_prefill = jax.jit(self._prefix_data)
        self._jit_prefill_insert = jax.jit(self._prefill_into, donate_argnums=(0,))
        self._jit_free = jax.jit(lambda s, slot: s.replace(active=s.active.at[slot].set(False)),
                                 donate_argnums=(0,))

    def init_state(self):
        one = self.prefill([self.tokenizer.bos_id], RequestParams(1, 0.0)).data
        return _stack_slots(one.replace(active=jnp.bool_(False)), self.num_slots)

    def _row(self, prompt):
        row = np.full((self.length,), self.tokenizer.pad_id, np.int32)
        row[:len(prompt)] = prompt
        return row

    def _segment_len(self, prompt, seed) -> np.int32:
        from relf_jax.workflows import draw_segment_lengths

        if self.length_counts is None:
            return np.int32(self.length)
        rng = np.random.default_rng([seed, 0x5E6])
        return np.int32(draw_segment_lengths(self.length_counts, rng, 1, len(prompt) + 1)[0])

    @staticmethod
    def _prefix_data(row, prompt_len, seed, segment_len):
        return _FlowSlot(tokens=row, prompt_len=prompt_len, key=jax.random.key_data(jax.random.key(seed)),
                         active=jnp.bool_(True), segment_len=segment_len)

    def prefill(self, prompt, params):  # no model call: the whole reply is one step
        data = self._jit_prefill(self._row(prompt), np.int32(len(prompt)), np.uint32(params.seed),
                                 self._segment_len(prompt, params.seed))
        return Prefix(data=data, tokens=[], done=False)

    def insert(self, prefix, state, slot):
        return self._jit_insert(state, prefix.data, slot)

    def _prefill_into(self, slots, row, prompt_len, seed, segment_len, slot):
        return _set_slot(slots, self._prefix_data(row, prompt_len, seed, segment_len), slot)

    def prefill_insert(self, prompt, params, state, slot):
        return (self._jit_prefill_insert(state, self._row(prompt), np.int32(len(prompt)), np.uint32(params.seed),
                                         self._segment_len(prompt, params.seed), slot),
                Prefix(data=None, tokens=[], done=False))

    def free(self, state, slot, stopped=False):
        return state if stopped else self._jit_free(state, slot)

    def _step_all(self, params, slots: _FlowSlot):
        from relf_jax.flow.samplers import sample as flow_sample
        from relf_jax.workflows import segment_residual

        graphdef, table, settings = self.lm.graphdef, self.table, self.flow_settings
        weights = self._weights.tree(params)

        def one(sl: _FlowSlot):
            known = jnp.arange(self.length) < sl.prompt_len
            inside = jnp.arange(self.length) < sl.segment_len
            residual = segment_residual(lambda *a: nnx.merge(graphdef, weights)(*a), inside[None].astype(jnp.int32),
                                        table)
            toks, _ = flow_sample(jax.random.wrap_key_data(sl.key), residual, table, settings, batch=1,
                                  length=self.length, known=(known[None], table[sl.tokens][None]))
            return jnp.where(known, sl.tokens, jnp.where(inside, toks[0], self.tokenizer.pad_id))

        out = jax.vmap(one)(slots)
        return slots.replace(active=jnp.zeros_like(slots.active)), out, slots.active

    def generate(self, state):
        t0 = time.perf_counter()
        plen = np.asarray(state.prompt_len)
        state, out, active = self._jit_step(self._weights.leaves, state)
        out, active = jax.device_get((out, active))
        model_s = time.perf_counter() - t0
        toks, done = [], []
        for i in range(self.num_slots):
            if not active[i]:
                toks.append([]), done.append(False)
                continue
            reply = []
            for t in out[i, plen[i]:].tolist():
                if t in (self.tokenizer.pad_id, self.tokenizer.bos_id):
                    continue
                reply.append(t)
                if t in self.stop_ids:
                    break
            toks.append(reply), done.append(True)
        return state, StepOutput(tokens=toks, done=done, model_s=model_s)


# ------------------------------------------------------------------------------ mock

class ByteTokenizer:
    """UTF-8 bytes as tokens, for the mock engine: pad 0, eos 1, bos 2, unk 3, ``<user>`` 4,
    ``<assistant>`` 5, byte b -> 6 + b."""

    pad_id, eos_id, bos_id, unk_id = 0, 1, 2, 3
    MARKERS: ClassVar[dict[str, int]] = {"<user>": 4, "<assistant>": 5}
    vocab_size = 6 + 256

    def encode(self, text: str) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise UserError(f"the text holds a lone surrogate at character {e.start}: not valid Unicode") from None
        out: list[int] = []
        rest = text
        while rest:
            hits = [(rest.find(m), m) for m in self.MARKERS if m in rest]
            if not hits:
                out += [6 + b for b in rest.encode("utf-8")]
                break
            i, m = min(hits)
            out += [6 + b for b in rest[:i].encode("utf-8")] + [self.MARKERS[m]]
            rest = rest[i + len(m):]
        return out

    def decode(self, ids) -> str:
        names = {v: k for k, v in self.MARKERS.items()}
        parts, buf = [], bytearray()
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i >= 6:
                buf.append(i - 6)
            elif i in names:
                parts.append(buf.decode("utf-8", "replace") + names[i])
                buf = bytearray()
        return "".join(parts) + buf.decode("utf-8", "replace")

    def piece_to_id(self, piece: str) -> int:
        return self.MARKERS.get(piece, self.unk_id)


class MockEngine(Engine):
    """No model: the reply is the last user turn of the prompt (between the last ``<user>`` and
    the ``<assistant>`` after it, spaces trimmed), one token per step, then EOS, or the prompt's
    bytes after BOS when it has no ``<user>``. Each step sleeps `step_s` seconds (simulated
    model time, counted as model time), so tests can hold requests in slots for a known time.
    """

    def __init__(self, num_slots: int = 4, *, step_s: float = 0.0, max_context: int = 512, name: str = "mock"):
        self.name, self.num_slots, self.step_s, self.max_context = name, num_slots, step_s, max_context
        self.tokenizer = ByteTokenizer()
        self.stop_ids = (self.tokenizer.eos_id,)

    def reply_for(self, prompt: Sequence[int]) -> list[int]:
        """The tokens the mock answers `prompt` with (EOS last)."""
        ids = [i for i in prompt if i != self.tokenizer.bos_id]
        user, asst = ByteTokenizer.MARKERS["<user>"], ByteTokenizer.MARKERS["<assistant>"]
        if user in ids:
            ids = ids[len(ids) - ids[::-1].index(user):]
            if asst in ids:
                ids = ids[:ids.index(asst)]
        space = 6 + ord(" ")
        while ids and ids[0] == space:
            ids = ids[1:]
        while ids and ids[-1] == space:
            ids = ids[:-1]
        return ids + [self.tokenizer.eos_id]

    def init_state(self):
        return [None] * self.num_slots

    def prefill(self, prompt, params):
        reply = self.reply_for(prompt)
        return Prefix(data=reply[1:], tokens=reply[:1], done=len(reply) == 1)

    def insert(self, prefix, state, slot):
        state = list(state)
        state[slot] = list(prefix.data)
        return state

    def free(self, state, slot, stopped=False):
        state = list(state)
        state[slot] = None
        return state

    def generate(self, state):
        t0 = time.perf_counter()
        if self.step_s:
            time.sleep(self.step_s)
        toks, done, new = [], [], []
        for rest in state:
            if not rest:
                toks.append([]), done.append(False), new.append(None)
                continue
            toks.append(rest[:1]), done.append(len(rest) == 1), new.append(rest[1:] or None)
        return new, StepOutput(tokens=toks, done=done, model_s=time.perf_counter() - t0)
