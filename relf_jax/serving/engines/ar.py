"""`AREngine`: one token per step (the sampler of `relf_jax.sampling.autoregressive`)."""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from relf_jax.data.tokenizer import turn_stop_ids
from relf_jax.errors import UserError
from relf_jax.serving.engine_api import LOGPROBS_TOP, SAMPLING_FEATURES, Engine, Pending, RequestParams, StepOutput
from relf_jax.serving.engines.slots import (Held, Leaves, Slot, Spans, SpanSized, bucket_for, check_steps_per_call,
                                            collect_rows, done_at_stop_only, engine_context, first_prefix, float_bits,
                                            free_all_slots, lp_entry, pad_one, request_knobs, request_sampling,
                                            resize_cache, run_parked, set_slot, sparse_bias, stack_slots,
                                            static_sampling, step_subset, subset_slots)


class AREngine(SpanSized, Engine):
    """One token per sampler step per slot, with `relf_jax.sampling.autoregressive`'s prefill and
    step; `steps_per_call` steps per `generate` (see `check_steps_per_call`). Implements every
    `SAMPLING_FEATURES` entry per request."""

    supported = frozenset(SAMPLING_FEATURES)

    def __init__(self, lm, num_slots: int = 8, *, top_k: int = 0, steps_per_call: int = 1, name: str = "ar",
                 max_context: int | None = None):
        from relf_jax.sampling import autoregressive as ar

        if num_slots < 1:
            raise UserError(f"num_slots must be >= 1, got {num_slots}")
        self._ar = ar
        self.lm, self.name, self.num_slots, self.top_k = lm, name, num_slots, top_k
        self.steps_per_call = self.tokens_per_step = check_steps_per_call(steps_per_call)
        self.tokenizer = lm.tokenizer
        self.vocab_size = lm.model_cfg.vocab_size
        self.max_context = engine_context(lm.model_cfg.max_seq_len, max_context)
        self.stop_ids = turn_stop_ids(lm.tokenizer)
        # the step never stops a slot on length (the server does, per request)
        self._step_settings = ar.DecodeSettings(max_new_tokens=self.max_context, eos_id=lm.tokenizer.eos_id,
                                                pad_id=lm.tokenizer.pad_id, track_tokens=True)
        self.compact = True  # step only the occupied slots when few are (`subset_slots`)
        self._spans = Spans(num_slots, self.max_context, self.tokens_per_step)
        self._weights = Leaves(lm.params)
        self._jit_step = jax.jit(self._step_all, donate_argnums=(1,), static_argnames=("features",))
        self._jit_step_subset = jax.jit(functools.partial(step_subset, self._step_all), donate_argnums=(1,),
                                        static_argnames=("features",))
        self._jit_resize = jax.jit(lambda s, span: s.replace(state=s.state.replace(cache=resize_cache(
            s.state.cache, span))), static_argnums=(1,))
        self._jit_insert = jax.jit(set_slot, donate_argnums=(0,))
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
        ids, vals = sparse_bias(p)
        return {"seed": np.uint32(p.seed), "knobs": request_knobs(p, self.top_k), "bias_ids": ids, "bias_vals": vals}

    def init_state(self):
        return free_all_slots(self, Held(stack_slots(self.prefill([self.tokenizer.bos_id], RequestParams(1, 0.0)).data,
                                                    self.num_slots)))

    def _padded(self, prompt):
        bucket = bucket_for(len(prompt), self.max_context - 1)
        return (*pad_one(prompt, self.tokenizer.pad_id, bucket), self._settings(bucket))

    def _prefix_data(self, params, prompts, lengths, seed, knobs, bias_ids, bias_vals, settings, features):
        """(slot data, first token, done, its log-probs or None) of one padded prompt: traced,
        the seed's key made inside."""
        sampling = request_sampling(self._ar, knobs, bias_ids, bias_vals, self.vocab_size)
        st, lp = self._ar.prefill_scored(self.lm.graphdef, self._weights.tree(params), prompts, lengths,
                                         jax.random.key(seed), static_sampling(sampling, features, self.top_k),
                                         settings, log_probs=LOGPROBS_TOP if "logprobs" in features else 0)
        st = done_at_stop_only(st, lengths, self.tokenizer.eos_id)
        return Slot(state=st, sampling=sampling), st.tokens[0, lengths[0]], st.done[0], lp

    def prefill(self, prompt, params):
        arr, lens, settings = self._padded(prompt)
        t0 = time.perf_counter()
        data, first, done, lp = self._jit_prefill(self._weights.leaves, arr, lens, **self._request(params),
                                                  settings=settings, features=params.features())
        return first_prefix(self, params, t0, first, done, len(prompt), data=data, lp=lp)

    def _span(self, state) -> int:
        return state.slots.state.cache[0][0].shape[-2]

    def _prefill_into(self, params, slots, prompts, lengths, seed, knobs, bias_ids, bias_vals, slot, settings,
                      features):
        data, first, done, lp = self._prefix_data(params, prompts, lengths, seed, knobs, bias_ids, bias_vals,
                                                  settings, features)
        return set_slot(slots, data, slot), first, done, lp

    def prefill_insert(self, prompt, params, state, slot):
        arr, lens, settings = self._padded(prompt)
        state = self._fit(state, extra=len(prompt) + 1)
        t0 = time.perf_counter()
        slots, first, done, lp = self._jit_prefill_insert(self._weights.leaves, state.slots, arr, lens,
                                                          **self._request(params), slot=slot, settings=settings,
                                                          features=params.features())
        prefix = first_prefix(self, params, t0, first, done, len(prompt), lp=lp)
        self._spans.admit(slot, len(prompt))
        return state.insert(slots, slot, prefix.features), prefix

    def free(self, state, slot, stopped=False):
        self._spans.free(slot)
        return state.free(state.slots if stopped else self._jit_free(state.slots, slot), slot)

    def _step_all(self, params, slots: Slot, features: frozenset):
        ar, settings = self._ar, self._step_settings
        params = self._weights.tree(params)
        n_lp = LOGPROBS_TOP if "logprobs" in features else 0

        def one(st, sp):
            # Python values switch the unused features off at trace time (see `Held`)
            return ar.step(self.lm.graphdef, params, st, static_sampling(sp, features, self.top_k), settings,
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
                row = jnp.concatenate([row, float_bits(lp[:, 0])], axis=1)
            return dataclasses.replace(slots, state=new), row

        # [slots, steps, (token, emitted, done[, log-prob, top ids, top log-probs])]
        return run_parked(step, slots, self.steps_per_call, 3 + (1 + 2 * n_lp if n_lp else 0), features)

    def dispatch(self, state):
        t0 = time.perf_counter()
        state = self._fit(state)
        idx = subset_slots(state, self.num_slots) if self.compact else None
        if idx is None:
            slots, out = self._jit_step(self._weights.leaves, state.slots, features=state.features)
        else:
            slots, out = self._jit_step_subset(self._weights.leaves, state.slots, idx=idx, features=state.features)
        return dataclasses.replace(state, slots=slots), Pending(out, idx, t0, time.perf_counter())

    def collect(self, pending):
        out, model_s, early = collect_rows(pending, self.num_slots)
        toks = [[r[0] for r in row if r[1]] for row in out]
        lps = None
        if len(out[0][0]) > 3:  # the log-probs' bit patterns follow (token, emitted, done)
            lps = [[lp_entry(np.asarray(r[3:], np.int32).view(np.float32)) for r in row if r[1]] for row in out]
        self._spans.advance_by(toks)
        return StepOutput(tokens=toks, done=[any(r[2] for r in row) for row in out], model_s=model_s,
                          steps=[len(t) for t in toks], ready_early=early, log_probs=lps)

    def generate(self, state):
        state, pending = self.dispatch(state)
        return state, self.collect(pending)
