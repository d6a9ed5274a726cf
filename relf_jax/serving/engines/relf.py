"""`ReLFEngine`: the whole reply at once (the flow sampler of `relf_jax.flow.samplers`, with
the prompt's positions held on their embeddings), in one step."""

from __future__ import annotations

import time

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from relf_jax.data.tokenizer import turn_stop_ids
from relf_jax.errors import UserError
from relf_jax.methods import Flow
from relf_jax.serving.engine_api import Engine, Prefix, RequestParams, StepOutput
from relf_jax.serving.engines.on_mesh import bind_slot_calls, vmap_slots
from relf_jax.serving.engines.slots import Leaves, set_slot, stack_slots


@flax.struct.dataclass
class _FlowSlot:
    tokens: jax.Array  # [L] the prompt, then pad
    prompt_len: jax.Array  # []
    key: jax.Array  # [2] uint32 key data
    active: jax.Array  # [] bool
    segment_len: jax.Array  # [] the row's one segment (a model trained on segment rows; else L)


def _release_slot(slots, slot):
    return slots.replace(active=slots.active.at[slot].set(False))


class ReLFEngine(Engine):
    """The whole reply in one step: the ReLF flow sampler over the model's full length.

    The flow fills in the positions after the prompt conditioned on it; the reply is what
    follows the prompt up to the first stop token. A model trained with clean, flagged prompts
    (``flow.prompt_prob`` > 0) sees the prompt as it is; any other model sees it redrawn on the
    path of its token embeddings (``t * e + (1 - t) * eps``, fresh eps) before every call (see
    `relf_jax.flow.samplers`). `method`: a `relf_jax.methods.Flow` (fields left None: the
    model's ``cfg.flow``; its `length` does not apply, a row is ``data.seq_len`` long), `nfe`
    network calls per reply; temperature and top_p do not apply (the sampler's own noise, seeded
    per request, makes the choice). A model trained on segment
    rows writes one segment of a length drawn (seeded per request) from its training segments'
    lengths, longer than the prompt (`relf_jax.flow.lengths.flow_lengths`).
    """

    def __init__(self, lm, num_slots: int = 8, *, method: Flow = Flow(), name: str = "relf"):
        from relf_jax.flow.generate import flow_table, sampler_settings
        from relf_jax.flow.lengths import flow_lengths

        if lm.model_cfg.family != "relf":
            raise UserError(f"the ReLF engine needs a 'relf' model, got {lm.model_cfg.family!r}")
        self.lm, self.num_slots, self.name = lm, num_slots, name
        self.flow_settings = sampler_settings(lm, method)
        self.table = jnp.asarray(flow_table(lm), jnp.float32)
        self.tokenizer = lm.tokenizer
        self.length = lm.cfg.data.seq_len
        self.max_context = self.length
        self.stop_ids = turn_stop_ids(lm.tokenizer)
        self.tokens_per_step = self.length
        counts = flow_lengths(lm)
        self.length_counts = None if counts is None else np.pad(counts, (0, max(0, self.length + 1 - len(counts))))[
            :self.length + 1]
        self._weights = Leaves(lm.params)
        bind_slot_calls(self, _release_slot, slots_arg=0)  # on the model's mesh, if it has one

    def init_state(self):
        one = self.prefill([self.tokenizer.bos_id], RequestParams(1, 0.0)).data
        return stack_slots(one.replace(active=jnp.bool_(False)), self.num_slots)

    def _row(self, prompt):
        row = np.full((self.length,), self.tokenizer.pad_id, np.int32)
        row[:len(prompt)] = prompt
        return row

    def _segment_len(self, prompt, seed) -> np.int32:
        from relf_jax.flow.lengths import draw_segment_lengths

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
        return set_slot(slots, self._prefix_data(row, prompt_len, seed, segment_len), slot)

    def prefill_insert(self, prompt, params, state, slot):
        return (self._jit_prefill_insert(state, self._row(prompt), np.int32(len(prompt)), np.uint32(params.seed),
                                         self._segment_len(prompt, params.seed), slot),
                Prefix(data=None, tokens=[], done=False))

    def free(self, state, slot, stopped=False):
        return state if stopped else self._jit_free(state, slot)

    def _step_all(self, params, slots: _FlowSlot):
        from relf_jax.flow.generate import segment_residual
        from relf_jax.flow.samplers import sample as flow_sample

        graphdef, table, settings = self.lm.graphdef, self.table, self.flow_settings
        weights = self._weights.tree(params)

        def one(sl: _FlowSlot):
            known = jnp.arange(self.length) < sl.prompt_len
            inside = jnp.arange(self.length) < sl.segment_len
            residual = segment_residual(nnx.merge(graphdef, weights), inside[None].astype(jnp.int32), table)
            toks, _ = flow_sample(jax.random.wrap_key_data(sl.key), residual, table, settings, batch=1,
                                  length=self.length, known=(known[None], table[sl.tokens][None]))
            return jnp.where(known, sl.tokens, jnp.where(inside, toks[0], self.tokenizer.pad_id))

        out = vmap_slots(one, self.mesh)(slots)
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
