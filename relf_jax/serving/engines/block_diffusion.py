"""`BlockDiffusionEngine`: one committed block per step (confidence-threshold decoding of
`relf_jax.sampling.block_diffusion`)."""

from __future__ import annotations

import time
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from relf_jax.data.tokenizer import turn_stop_ids
from relf_jax.errors import UserError
from relf_jax.methods import BlockDiffusion
from relf_jax.serving.engine_api import Engine, Prefix, RequestParams, StepOutput
from relf_jax.serving.engines.on_mesh import bind_slot_calls, vmap_slots
from relf_jax.serving.engines.slots import Leaves, bucket_for, free_all_slots, set_slot, stack_slots


@flax.struct.dataclass
class _BDSlot:
    canvas: jax.Array  # [1, C]
    cache: Any  # per layer (k, v) [1, heads, C, hd]
    prompt_len: jax.Array  # [1]
    blocks: jax.Array  # [] output blocks decoded
    done: jax.Array  # [1]
    key: jax.Array  # [2] uint32 key data
    temperature: jax.Array  # []


def _finish_slot(slots, slot):
    return slots.replace(done=slots.done.at[slot].set(True))


class BlockDiffusionEngine(Engine):
    """One committed block per step per slot (`relf_jax.sampling.block_diffusion`'s confidence-threshold rule).

    Each step runs, for every occupied slot in lockstep, the denoising steps its current block
    needs (a slot whose block is done idles until the others finish theirs), then the refresh
    forward; the step's output is each slot's committed block. Temperature 0 is greedy; > 0
    samples tokens (inverse CDF, `processors.sample`) per slot. `top_p` does not apply.
    `method`: a `relf_jax.methods.BlockDiffusion` (a threshold left None: 0.95; a confidence, "max").
    """

    def __init__(self, lm, num_slots: int = 8, *, method: BlockDiffusion = BlockDiffusion(), name: str = "bd"):
        from relf_jax.sampling import block_diffusion as bdd

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
        self.settings = bdd.decode_settings(lm, max_blocks=1, threshold=0.95 if method.threshold is None
                                            else method.threshold, confidence=method.confidence or "max")
        self._weights = Leaves(lm.params)
        bind_slot_calls(self, _finish_slot, slots_arg=1)  # on the model's mesh, if it has one

    def reserve(self) -> int:
        return self.block_size  # the last block may run past max_tokens

    def init_state(self):
        return free_all_slots(self, stack_slots(self.prefill([self.tokenizer.bos_id], RequestParams(1, 0.0)).data,
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
        cache = bdd.prefill_jit(self.lm.graphdef, self._weights.tree(params), prompts, prompt_len,
                                canvas_len=self.max_context, settings=self.settings)
        return _BDSlot(canvas=bdd.make_canvas(prompts, self.max_context, self.tokenizer.pad_id), cache=cache,
                       prompt_len=prompt_len, blocks=jnp.int32(0), done=jnp.zeros((1,), bool),
                       key=jax.random.key_data(jax.random.key(seed)), temperature=temperature)

    def _prefill_into(self, params, slots, prompts, prompt_len, seed, temperature, slot):
        return set_slot(slots, self._prefix_data(params, prompts, prompt_len, seed, temperature), slot)

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
            out = bdd.decode_block(model, sl.cache, sl.canvas, sl.prompt_len, sl.blocks, active,
                                   jax.random.wrap_key_data(sl.key), settings, temperature=sl.temperature)
            canvas, block, start, stop_pos = out.canvas, out.block, out.start, out.stop_pos
            lo = jnp.maximum(start, sl.prompt_len) - start
            hi = jnp.where(stop_pos >= 0, stop_pos + 1 - start, d)
            full = start + 2 * d > self.max_context
            done = sl.done | (active & ((stop_pos >= 0) | full))
            new = _BDSlot(canvas=canvas, cache=out.cache, prompt_len=sl.prompt_len,
                          blocks=sl.blocks + active[0].astype(jnp.int32), done=done,
                          key=jax.random.key_data(out.key), temperature=sl.temperature)
            row = jnp.stack([jnp.where(active, lo, 0)[0], jnp.where(active, hi, 0)[0], (active & done)[0]])
            return new, jnp.concatenate([block[0], row.astype(block.dtype)])

        return vmap_slots(one, self.mesh)(slots)  # (state, [slots, (d block tokens, lo, hi, done)])

    def generate(self, state):
        t0 = time.perf_counter()
        state, out = self._jit_step(self._weights.leaves, state)
        out = np.asarray(out).tolist()  # one device-to-host copy; Python ints from here on
        model_s = time.perf_counter() - t0
        d = self.block_size
        toks = [row[row[d]:row[d + 1]] for row in out]
        return state, StepOutput(tokens=toks, done=[bool(row[d + 2]) for row in out], model_s=model_s)


# ------------------------------------------------------------------------------ ReLF
