"""The engine interface: one slot-based generator API over every relf_jax sampler, for
continuous batching (JetStream's `engine_api`: the abstract `Engine` and its request and step
types; the implementations live in `relf_jax.serving.engines`).

An engine owns a decode state with a fixed number of *slots*; a request is run through
`prefill` on its own, its result is put into a free slot with `insert`, and every `generate`
call advances all occupied slots by one step. Requests join and leave between steps
(`relf_jax.serving.batching`); a slot whose request finished or was cancelled is released with
`free` and may be reused at once. `dispatch` and `collect` are the two halves of `generate`
(start the step; wait for its output), so a caller can do host work while a step runs.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

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
    prompt_len: int = 0  # the prompt's tokens (AR and speculative: for `Spans`)
    log_probs: list | None = None  # per token of `tokens`: (log-prob, [(id, log-prob), ...]) when asked
    cached_tokens: int = 0  # prompt tokens whose keys/values came from the prefix cache (not prefilled)


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

    prefix_cache = None  # a `relf_jax.serving.prefix_cache.PrefixCache` where the engine keeps prefixes

    def keep_prefix(self, state: Any, slot: int, tokens: Sequence[int], committed: int) -> None:
        """Called by the batcher when the request in `slot` ends (before `free`), with its prompt
        and reply ids (`tokens`) and the tokens the slot committed (`committed`, a stop token
        included). An engine with a prefix cache keeps the keys and values of `tokens` there;
        this one does nothing."""

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
        bucket up to half the context), and insert/generate/free, off the clock. `spans`: for an
        engine that sizes its caches (`relf_jax.serving.engines.slot_engine.SlotEngine.warmup`)."""
        self.warmup_at(self.warmup_lengths(prompt_lengths))

    def warmup_lengths(self, prompt_lengths: Sequence[int] | None = None) -> list[int]:
        """The prompt lengths `warmup` compiles for (default: every power-of-two bucket up to
        half the context), each cut to what a slot can hold."""
        if prompt_lengths is None:
            prompt_lengths, b = [], 8
            while b <= self.max_context // 2:
                prompt_lengths.append(b)
                b *= 2
        return [max(1, min(n, self.max_context - self.reserve() - 1)) for n in prompt_lengths]

    def warmup_at(self, prompt_lengths: Sequence[int]) -> None:
        """Compile prefill+insert at each of `prompt_lengths`, and generate over 1, 2, 4, ... occupied slots."""
        state = self.init_state()
        bos = getattr(self.tokenizer, "bos_id", 2)
        for n in prompt_lengths:
            state, _ = self.prefill_insert([bos] * n, RequestParams(max_tokens=1, temperature=0.0), state, 0)
        state, _ = self.generate(state)
        busy = 1  # and the steps over 2, 4, ... occupied slots (`engines.slots.subset_slots`), up to all of them
        while busy < self.num_slots:
            for slot in range(busy, min(2 * busy, self.num_slots)):
                state, _ = self.prefill_insert([bos], RequestParams(max_tokens=1, temperature=0.0), state, slot)
            busy = min(2 * busy, self.num_slots)
            state, _ = self.generate(state)
        for slot in range(self.num_slots):
            state = self.free(state, slot)
