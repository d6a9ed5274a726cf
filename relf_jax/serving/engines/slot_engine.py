"""`SlotEngine`: the body the AR and speculative engines share (their state is a `Held`, their
KV caches are sized to the occupied slots' span, `Spans`).

A subclass builds its model-specific parts and calls `setup`; it implements `weight_args` (the
weights the jitted calls take), `padded` (a prompt padded to its bucket, with the prefill's
settings), `prefix_data` (one padded prompt's slot data, traced), `step_all` (a step over the
slots, traced), `cache_span` / `resize_slots` (the caches' span) and `step_output` (a step's
rows as a `StepOutput`).
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import time
from collections.abc import Sequence

import jax
import numpy as np

from relf_jax.serving.engine_api import Engine, Pending, Prefix, RequestParams, StepOutput
from relf_jax.serving.engines.slots import (
    Held,
    Spans,
    collect_rows,
    first_prefix,
    free_all_slots,
    request_knobs,
    set_slot,
    shortest_in_bucket,
    sparse_bias,
    stack_slots,
    step_subset,
    subset_slots,
)


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
        self._jit_step = jax.jit(self.step_all, donate_argnums=(1,), static_argnames=("features",))
        self._jit_step_subset = jax.jit(functools.partial(step_subset, self.step_all), donate_argnums=(1,),
                                        static_argnames=("features",))
        self._jit_resize = jax.jit(self.resize_slots, static_argnums=(1,))
        self._jit_insert = jax.jit(set_slot, donate_argnums=(0,))
        self._jit_prefill = jax.jit(self.prefix_data, static_argnames=("settings", "features"))
        self._jit_prefill_insert = jax.jit(self._prefill_into, donate_argnums=(1,),
                                           static_argnames=("settings", "features"))
        self._jit_free = jax.jit(_mark_free, donate_argnums=(0,))

    # the subclass's parts
    @abc.abstractmethod
    def weight_args(self) -> tuple:
        """The weights the jitted calls take (target, and draft or table where there is one)."""

    @abc.abstractmethod
    def padded(self, prompt: Sequence[int]):
        """(padded prompts [1, bucket], lengths [1], the prefill's static settings)."""

    @abc.abstractmethod
    def prefix_data(self, weights, prompts, lengths, seed, knobs, bias_ids, bias_vals, settings, features):
        """(slot data, first token, done, its log-probs or None) of one padded prompt: traced."""

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
                      features):
        data, first, done, lp = self.prefix_data(weights, prompts, lengths, seed, knobs, bias_ids, bias_vals,
                                                 settings, features)
        return set_slot(slots, data, slot), first, done, lp

    def insert(self, prefix, state, slot):
        state = self._fit(state, extra=prefix.prompt_len + 1)
        state.ends[slot] = prefix.prompt_len + 1  # the prefill commits the first token
        return state.insert(self._jit_insert(state.slots, prefix.data, slot), slot, prefix.features)

    def prefill_insert(self, prompt, params, state, slot) -> tuple[Held, Prefix]:
        arr, lens, settings = self.padded(prompt)
        state = self._fit(state, extra=len(prompt) + 1)
        t0 = time.perf_counter()
        slots, first, done, lp = self._jit_prefill_insert(self.weight_args(), state.slots, arr, lens,
                                                          **self.request_args(params), slot=slot, settings=settings,
                                                          features=params.features())
        prefix = first_prefix(self, params, t0, first, done, len(prompt), lp=lp)
        state.ends[slot] = len(prompt) + 1
        return state.insert(slots, slot, prefix.features), prefix

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
        idx = subset_slots(state, self.num_slots) if self.compact else None
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
        `spans` shortest ones only (the others compile when first used)."""
        prompt_lengths = self.warmup_lengths(prompt_lengths)
        sizer = self.spans
        lengths = sizer.lengths if spans is None else sizer.lengths[:max(1, spans)]
        try:
            for span in lengths:
                sizer.pin = span
                # the prompt buckets whose shortest prompt fits this span
                self.warmup_at([n for n in prompt_lengths if shortest_in_bucket(n) + 1 + sizer.advance <= span]
                               or [1])
        finally:
            sizer.pin = None
        slots = self.init_state().slots
        for a in lengths:  # and every change of span among them
            for b in lengths:
                if a != b:
                    self._jit_resize(self._jit_resize(slots, a), b)
