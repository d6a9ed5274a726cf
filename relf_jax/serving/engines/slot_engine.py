"""`SlotEngine`: the body the AR and speculative engines share (their state is a `Held`, their
KV caches are sized to the occupied slots' span, `Spans`).

A subclass builds its model-specific parts and calls `setup`; it implements `weight_args` (the
weights the jitted calls take), `bucket_settings` (the prefill's settings for a prompt bucket),
`prefix_data` (one padded prompt's slot data, traced), `step_all` (a step over the slots,
traced), `cache_span` / `resize_slots` (the caches' span), `kv_caches` / `kv_layouts` (its
models' KV caches, for the prefix cache) and `step_output` (a step's rows as a `StepOutput`).

With a prefix cache (`enable_prefix_cache`, `relf_jax.serving.prefix_cache`), a prompt whose
first blocks are cached is prefilled from them: its cached blocks are gathered into the first
slots of a fresh cache and only the rest of the prompt runs (one compilation per suffix bucket
and span); a finished request's blocks are kept (`keep_prefix`).
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import time
from collections.abc import Sequence

import numpy as np

from relf_jax.errors import UserError
from relf_jax.sampling.autoregressive import prompt_bucket
from relf_jax.serving.engine_api import Engine, Pending, Prefix, RequestParams, StepOutput
from relf_jax.serving.engines.on_mesh import check_slot_groups, engine_jit
from relf_jax.serving.engines.slots import (
    Held,
    Spans,
    bucket_for,
    collect_rows,
    first_prefix,
    free_all_slots,
    pad_one,
    request_knobs,
    set_slot,
    shortest_in_bucket,
    sparse_bias,
    stack_slots,
    step_subset,
    subset_slots,
)
from relf_jax.serving.prefix_cache import BLOCK


@dataclasses.dataclass
class SlotPending(Pending):
    ends: list[int] = dataclasses.field(default_factory=list)  # the dispatched state's `Held.ends`


def _mark_free(slots, slot):
    return dataclasses.replace(slots, state=dataclasses.replace(slots.state, done=slots.state.done.at[slot].set(True)))


class SlotEngine(Engine):
    """Prefill, insert, free, dispatch / collect and warm-up over `Held` slots of span-sized caches."""

    top_k: int = 0  # the top-k of a request that sets none (0: off)

    def setup(self) -> None:
        """The span record and the jitted calls (after the subclass set ``num_slots``,
        ``max_context`` and ``tokens_per_step``)."""
        self.compact = True  # step only the occupied slots when few are (`subset_slots`)
        self.spans = Spans(self.max_context, self.tokens_per_step)
        # a model placed on a mesh (`LoadedModel.on_mesh`): slot groups over data, heads over tensor
        self.mesh = self.lm.mesh
        self.slot_groups = check_slot_groups(self.num_slots, self.mesh)
        mesh = self.mesh
        self._jit_step = engine_jit(self.step_all, mesh, slots_out=0, donate_argnums=(1,),
                                    static_argnames=("features",))
        self._jit_step_subset = engine_jit(functools.partial(step_subset, self.step_all), mesh, slots_out=0,
                                           donate_argnums=(1,), static_argnames=("features",))
        self._jit_resize = engine_jit(self.resize_slots, mesh, slots_out="all", static_argnums=(1,))
        self._jit_insert = engine_jit(set_slot, mesh, slots_out="all", donate_argnums=(0,))
        self._jit_prefill = engine_jit(self.prefix_data, mesh, static_argnames=("settings", "features"))
        self._jit_prefill_insert = engine_jit(self._prefill_into, mesh, slots_out=0, donate_argnums=(1,),
                                              static_argnames=("settings", "features"))
        self._jit_free = engine_jit(_mark_free, mesh, slots_out="all", donate_argnums=(0,))

    # the subclass's parts
    @abc.abstractmethod
    def weight_args(self) -> tuple:
        """The weights the jitted calls take (target, and draft or table where there is one)."""

    @abc.abstractmethod
    def bucket_settings(self, bucket: int):
        """The prefill's static settings for prompts padded to `bucket` (their cache spans the context)."""

    @abc.abstractmethod
    def prefix_data(self, weights, prompts, lengths, seed, knobs, bias_ids, bias_vals, settings, features,
                    cached=None):
        """(slot data, first token, done, its log-probs or None) of one padded prompt: traced.
        cached: None, or (pool, ids, start, suffix) of a prompt whose first `start` tokens are in the
        prefix cache's pool blocks `ids` (`relf_jax.serving.prefix_cache.gather_cache`), `suffix`
        [1, T] the rest of the prompt."""

    @abc.abstractmethod
    def kv_caches(self, slots) -> tuple:
        """The slots' KV caches per model (target, then draft model if any): per layer (k, v)."""

    @abc.abstractmethod
    def kv_layouts(self) -> list:
        """`relf_jax.serving.prefix_cache.model_layout` of each model of `kv_caches`."""

    kv_lag: int = 1  # a finished slot holds the keys/values of all but its last `kv_lag` committed tokens

    @abc.abstractmethod
    def step_all(self, weights, slots, features: frozenset):
        """(slots, rows [slots, steps, width] int32) of one `generate` call: traced."""

    @abc.abstractmethod
    def cache_span(self, state) -> int:
        """The KV positions the live slots of `state` occupy."""

    @abc.abstractmethod
    def resize_slots(self, slots, span: int):
        """`slots` with its caches cut or grown to `span` positions."""

    @abc.abstractmethod
    def step_output(self, rows: list, model_s: float, ready_early: bool) -> StepOutput:
        """The `StepOutput` of one collected call's rows."""

    # the shared body
    def padded(self, prompt: Sequence[int]):
        """(padded prompts [1, bucket], lengths [1], the prefill's static settings)."""
        bucket = bucket_for(len(prompt), self.max_context - self.reserve() - 1)
        return (*pad_one(prompt, self.tokenizer.pad_id, bucket), self.bucket_settings(bucket))

    def enable_prefix_cache(self, budget_mb: float, block: int = BLOCK) -> None:
        """Keep finished requests' KV blocks in a prefix cache of `budget_mb` MiB (0: none)."""
        from relf_jax.serving.prefix_cache import PrefixCache

        if not budget_mb:
            self.prefix_cache = None
            return
        if budget_mb < 0:
            raise UserError(f"the prefix cache's memory must be >= 0 MiB, got {budget_mb}")
        if any(getattr(m.model_cfg, "rope_scaling", None) == "dynamic" for m in self.kv_models()):
            raise UserError("the prefix cache cannot serve a model with a dynamic rope (its cached keys depend on "
                            "the prompt's length)")
        self.prefix_cache = PrefixCache(self.kv_layouts(), int(budget_mb * 2**20), self.max_context, block)

    def kv_models(self) -> list:
        """The loaded models whose caches `kv_caches` returns."""
        return [self.lm]

    def keep_prefix(self, state, slot, tokens, committed):
        if self.prefix_cache is None:
            return
        n = min(len(tokens), committed - self.kv_lag, self.cache_span(state))
        if n >= self.prefix_cache.block:
            self.prefix_cache.keep(self.kv_caches(state.slots), slot, tokens[:n])

    def request_args(self, p: RequestParams) -> dict:
        """The request's settings as the jitted prefills take them (host arrays; the rest static)."""
        ids, vals = sparse_bias(p)
        return {"seed": np.uint32(p.seed), "knobs": request_knobs(p, self.top_k), "bias_ids": ids, "bias_vals": vals}

    def init_state(self):
        one = self.prefill([self.tokenizer.bos_id], RequestParams(1, 0.0)).data
        return free_all_slots(self, Held(stack_slots(one, self.num_slots), ends=[0] * self.num_slots))

    def prefill(self, prompt, params):
        arr, lens, settings = self.padded(prompt)
        t0 = time.perf_counter()
        data, first, done, lp = self._jit_prefill(self.weight_args(), arr, lens, **self.request_args(params),
                                                  settings=settings, features=params.features())
        return first_prefix(self, params, t0, first, done, len(prompt), data=data, lp=lp)

    def _prefill_into(self, weights, slots, prompts, lengths, seed, knobs, bias_ids, bias_vals, slot, settings,
                      features, cached=None):
        data, first, done, lp = self.prefix_data(weights, prompts, lengths, seed, knobs, bias_ids, bias_vals,
                                                 settings, features, cached=cached)
        return set_slot(slots, data, slot), first, done, lp

    def insert(self, prefix, state, slot):
        state = self._fit(state, extra=prefix.prompt_len + 1)
        state.ends[slot] = prefix.prompt_len + 1  # the prefill commits the first token
        return state.insert(self._jit_insert(state.slots, prefix.data, slot), slot, prefix.features)

    def prefill_insert(self, prompt, params, state, slot) -> tuple[Held, Prefix]:
        start, ids = 0, None
        if self.prefix_cache is not None:
            start, ids = self.prefix_cache.lookup(prompt)
            # the suffix runs padded to its power-of-two bucket, which must end inside the cache:
            # near the context's end, fewer cached blocks (a longer suffix) rather than a bucket
            # of another size (a compilation while serving); none at all if no bucket fits
            while start and start + prompt_bucket(len(prompt) - start) > self.max_context:
                start -= self.prefix_cache.block
            self.prefix_cache.record(len(prompt), start)
        state = self._fit(state, extra=len(prompt) + 1)
        t0 = time.perf_counter()
        if start:
            slots, first, done, lp = self._prefill_cached(state, prompt, params, slot, start, ids)
        else:
            slots, first, done, lp = self._prefill_whole(state, prompt, params, slot)
        prefix = first_prefix(self, params, t0, first, done, len(prompt), lp=lp)
        prefix.cached_tokens = start
        state.ends[slot] = len(prompt) + 1
        return state.insert(slots, slot, prefix.features), prefix

    def _prefill_whole(self, state, prompt, params, slot):
        """The fused prefill + insert of the whole `prompt`: (slots, first token, done, log-probs)."""
        arr, lens, settings = self.padded(prompt)
        return self._jit_prefill_insert(self.weight_args(), state.slots, arr, lens, **self.request_args(params),
                                        slot=slot, settings=settings, features=params.features())

    def _prefill_cached(self, state, prompt, params, slot, start, ids):
        """The fused prefill + insert of `prompt` whose first `start` tokens are in the prefix
        cache's blocks `ids`: (slots, first token, done, log-probs)."""
        # the whole prompt padded to the widest bucket (its cache spans the context whatever the
        # prompt, so the compilations are per suffix bucket and span only); the suffix after `start`
        width = self.max_context - self.reserve() - 1
        arr, lens = pad_one(prompt, self.tokenizer.pad_id, width)
        suffix, _ = pad_one(prompt[start:], self.tokenizer.pad_id, prompt_bucket(len(prompt) - start))
        cached = (self.prefix_cache.pool, ids, np.asarray([start], np.int32), suffix)
        return self._jit_prefill_insert(self.weight_args(), state.slots, arr, lens, **self.request_args(params),
                                        slot=slot, settings=self.bucket_settings(width), features=params.features(),
                                        cached=cached)

    def _warmup_prefix_cache(self, prompt_lengths: Sequence[int]) -> None:
        """Compile the cached prefill at each suffix bucket of `prompt_lengths` (after one cached
        block) and the prefix cache's store, at the current span (`Spans.pin`)."""
        pc, bos = self.prefix_cache, self.tokenizer.bos_id
        state = self._fit(self.init_state())
        params = RequestParams(max_tokens=1, temperature=0.0)
        # the slots as serving holds them, the output of a jitted call (a fresh state's arrays are
        # placed otherwise, and a call on them compiles a program serving would not use)
        slots, *_ = self._prefill_whole(state, [bos], params, 0)
        state = dataclasses.replace(state, slots=slots)
        # the suffix buckets of these lengths that fit after one cached block (`prefill_insert`),
        # each with its shortest suffix
        room = self.max_context - self.reserve() - 1
        for b in sorted({prompt_bucket(n) for n in prompt_lengths}):
            if pc.block + b > self.max_context or pc.block + shortest_in_bucket(b) > room:
                continue
            prompt = [bos] * (pc.block + shortest_in_bucket(b))
            slots, *_ = self._prefill_cached(state, prompt, params, 0, pc.block,
                                             np.zeros((pc.max_blocks,), np.int32))
            state = dataclasses.replace(state, slots=slots)
        pc.warmup(self.kv_caches(state.slots))

    def free(self, state, slot, stopped=False):
        return state.free(state.slots if stopped else self._jit_free(state.slots, slot), slot)

    def _fit(self, state, extra: int = 0):
        """`state` with its caches resized to the span the next step (or insert) needs."""
        span = self.spans.fit(self.cache_span(state), state.ends, state.occupied, extra)
        return state if span == self.cache_span(state) else dataclasses.replace(state, slots=self._jit_resize(
            state.slots, span))

    def dispatch(self, state):
        t0 = time.perf_counter()
        state = self._fit(state)
        idx = subset_slots(state, self.num_slots, self.slot_groups) if self.compact else None
        if idx is None:
            slots, out = self._jit_step(self.weight_args(), state.slots, features=state.features)
        else:
            slots, out = self._jit_step_subset(self.weight_args(), state.slots, idx=idx, features=state.features)
        return dataclasses.replace(state, slots=slots), SlotPending(out, idx, t0, time.perf_counter(), state.ends)

    def collect(self, pending):
        out = self.step_output(*collect_rows(pending, self.num_slots))
        for slot, toks in enumerate(out.tokens):
            pending.ends[slot] += len(toks)
        return out

    def generate(self, state):
        state, pending = self.dispatch(state)
        return state, self.collect(pending)

    def warmup(self, prompt_lengths: Sequence[int] | None = None, spans: int | None = None) -> None:
        """`Engine.warmup` at every cache span a prompt of `prompt_lengths` can meet, or at the
        `spans` shortest ones only (the others compile when first used). The default lengths
        include the longest prompt a slot holds (the last bucket, capped at it: a conversation
        past half the context lands there)."""
        if prompt_lengths is None:
            prompt_lengths = [*self.warmup_lengths(None), self.max_context]
        prompt_lengths = self.warmup_lengths(prompt_lengths)
        sizer = self.spans
        lengths = sizer.lengths if spans is None else sizer.lengths[:max(1, spans)]
        try:
            for span in lengths:
                sizer.pin = span
                # the prompt buckets whose shortest prompt fits this span
                fit = [n for n in prompt_lengths if shortest_in_bucket(n) + 1 + sizer.advance <= span] or [1]
                self.warmup_at(fit)
                if self.prefix_cache is not None:
                    self._warmup_prefix_cache(fit)
        finally:
            sizer.pin = None
        slots = self.init_state().slots
        for a in lengths:  # and every change of span among them
            for b in lengths:
                if a != b:
                    self._jit_resize(self._jit_resize(slots, a), b)
