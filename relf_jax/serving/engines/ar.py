"""`AREngine`: one token per step (the sampler of `relf_jax.sampling.autoregressive`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from relf_jax.data.tokenizer import turn_stop_ids
from relf_jax.errors import UserError
from relf_jax.sampling.prefill import CachedPrefix
from relf_jax.serving.engine_api import LOGPROBS_TOP, SAMPLING_FEATURES, StepOutput
from relf_jax.serving.engines.on_mesh import vmap_slots
from relf_jax.serving.engines.slot_engine import SlotEngine
from relf_jax.serving.engines.slots import (
    Leaves,
    Slot,
    check_steps_per_call,
    done_at_stop_only,
    engine_context,
    float_bits,
    lp_entry,
    request_sampling,
    resize_cache,
    run_parked,
    static_sampling,
)
from relf_jax.serving.prefix_cache import gather_cache, model_layout


class AREngine(SlotEngine):
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
        self._step_settings = ar.DecodeSettings.from_tokenizer(lm.tokenizer, self.max_context, track_tokens=True)
        self._weights = Leaves(lm.params)
        self.setup()

    def bucket_settings(self, bucket: int):
        return self._ar.DecodeSettings.from_tokenizer(self.tokenizer, self.max_context - bucket, track_tokens=True)

    def weight_args(self) -> tuple:
        return (self._weights.leaves,)

    def kv_caches(self, slots) -> tuple:
        return (slots.state.cache,)

    def kv_layouts(self) -> list:
        return [model_layout(self.lm.model_cfg)]

    def prefix_data(self, weights, prompts, lengths, seed, knobs, bias_ids, bias_vals, settings, features,
                    cached=None):
        """(slot data, first token, done, its log-probs or None) of one padded prompt: traced,
        the seed's key made inside."""
        (params,) = weights
        sampling = request_sampling(self._ar, knobs, bias_ids, bias_vals, self.vocab_size)
        prefix = None
        if cached is not None:
            pool, ids, start, suffix = cached
            prefix = CachedPrefix(gather_cache(pool[0], ids, prompts.shape[1] + settings.max_new_tokens), start,
                                  suffix)
        st, lp = self._ar.prefill_scored(self.lm.graphdef, self._weights.tree(params), prompts, lengths,
                                         jax.random.key(seed), static_sampling(sampling, features, self.top_k),
                                         settings, log_probs=LOGPROBS_TOP if "logprobs" in features else 0,
                                         prefix=prefix)
        st = done_at_stop_only(st, lengths, self.tokenizer.eos_id)
        return Slot(state=st, sampling=sampling), st.tokens[0, lengths[0]], st.done[0], lp

    def cache_span(self, state) -> int:
        return state.slots.state.cache[0][0].shape[-2]

    def resize_slots(self, slots, span: int):
        return slots.replace(state=slots.state.replace(cache=resize_cache(slots.state.cache, span)))

    def step_all(self, weights, slots: Slot, features: frozenset):
        (params,) = weights
        ar, settings = self._ar, self._step_settings
        params = self._weights.tree(params)
        n_lp = LOGPROBS_TOP if "logprobs" in features else 0

        def one(st, sp):
            # Python values switch the unused features off at trace time (see `Held`)
            return ar.step(self.lm.graphdef, params, st, static_sampling(sp, features, self.top_k), settings,
                           log_probs=n_lp)

        stops = jnp.asarray(self.stop_ids, jnp.int32)

        def step(slots):
            new, lp = vmap_slots(one, self.mesh)(slots.state, slots.sampling)
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

    def step_output(self, out, model_s, early):
        toks = [[r[0] for r in row if r[1]] for row in out]
        lps = None
        if len(out[0][0]) > 3:  # the log-probs' bit patterns follow (token, emitted, done)
            lps = [[lp_entry(np.asarray(r[3:], np.int32).view(np.float32)) for r in row if r[1]] for row in out]
        return StepOutput(tokens=toks, done=[any(r[2] for r in row) for row in out], model_s=model_s,
                          steps=[len(t) for t in toks], ready_early=early, log_probs=lps)
