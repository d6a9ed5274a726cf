"""`SpeculativeEngine`: one draft/verify round per step, 1..k+1 tokens (the round of
`relf_jax.speculative.generate`; the `relf_jax.methods.Speculative` method's standard / NSD /
greedy rule; draft model, prompt lookup or the corpus n-gram table)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from relf_jax.data.tokenizer import turn_stop_ids
from relf_jax.errors import UserError
from relf_jax.methods import DraftModel, NgramTable, Speculative
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
)
from relf_jax.serving.prefix_cache import gather_cache, model_layout


class SpeculativeEngine(SlotEngine):
    """One draft/verify round per step per slot (`relf_jax.speculative.generate`'s round).

    method: a `relf_jax.methods.Speculative` (its rule, k, nsd_top_p and proposer). Its proposer
    `DraftModel` needs the draft, a loaded AR model with the same tokenizer: `draft`, or the
    proposer's own loaded model; `NgramTable` needs `ngram_table`, an `NgramDraft`, or
    `ngram_online`, an `relf_jax.speculative.ngram_draft.OnlineNgram` that counts the requests
    served and whose new tables `request_finished` swaps in (`update_ngram_table`); `PromptLookup`
    needs neither (`relf_jax.serving.loading.engine_for` resolves them from a checkpoint).
    Implements every `SAMPLING_FEATURES` entry per request, on the target's distribution (the
    round's processed verification, `relf_jax.speculative.generate`).
    """

    supported = frozenset(SAMPLING_FEATURES)

    def __init__(self, lm, num_slots: int = 8, *, method: Speculative, draft=None, ngram_table=None,
                 ngram_online=None, steps_per_call: int = 1, name: str | None = None,
                 max_context: int | None = None):
        from relf_jax.speculative import generate as spec

        if num_slots < 1:
            raise UserError(f"num_slots must be >= 1, got {num_slots}")
        if not isinstance(method, Speculative):
            raise UserError(f"the speculative engine decodes a Speculative(...) method, got {method!r}")
        p = method.proposer
        if isinstance(p, DraftModel):
            draft = draft if draft is not None else (None if isinstance(p.path_or_model, (str, type(None)))
                                                     else p.path_or_model)
            if draft is None:
                raise UserError("the speculative engine with a DraftModel proposer needs a loaded draft model")
        if isinstance(p, NgramTable):
            if ngram_table is None and ngram_online is not None:
                ngram_table = ngram_online.table
            spec.check_ngram_table(ngram_table, lm.model_cfg.vocab_size)
        self.ngram_table = ngram_table if isinstance(p, NgramTable) else None
        self.ngram_online = ngram_online if isinstance(p, NgramTable) else None
        self._spec = spec
        self.method = method
        self.lm, self.draft, self.num_slots = lm, (draft if isinstance(p, DraftModel) else None), num_slots
        self.k, self.nsd_top_p = method.k, method.nsd_top_p
        self.name = name or f"spec-{method.rule}"
        self.tokenizer = lm.tokenizer
        self.vocab_size = lm.model_cfg.vocab_size
        model_max = lm.model_cfg.max_seq_len
        if self.draft is not None:
            model_max = min(model_max, self.draft.model_cfg.max_seq_len)
        self.max_context = engine_context(model_max, max_context)
        self.stop_ids = turn_stop_ids(lm.tokenizer)
        self.steps_per_call = check_steps_per_call(steps_per_call)
        self.tokens_per_step = (self.k + 1) * self.steps_per_call
        self._step_settings = self._settings(self.max_context)
        self._target_w = Leaves(lm.params)
        self._draft_w = Leaves(self.draft.params) if self.draft is not None else None
        self.setup()

    def _settings(self, max_new_tokens: int):
        return self._spec.SpecSettings.from_method(self.method, self.tokenizer, max_new_tokens, track_tokens=True)

    def update_ngram_table(self, table) -> None:
        """Use `table` (an `NgramDraft`) from the next prefill / step on. It must have the current
        table's shapes (`ngram_draft.same_shapes`), so the jitted calls do not recompile. Safe
        between steps and exact: the table is only the proposal distribution."""
        from relf_jax.speculative import ngram_draft

        if self.ngram_table is None:
            raise ValueError(f"the {self.name} engine has no n-gram table (proposer {self.method.proposer!r})")
        if not ngram_draft.same_shapes(self.ngram_table, table):
            raise ValueError("the new n-gram table's shapes differ from the current one's (a recompile)")
        self.ngram_table = table

    def request_finished(self, prompt, reply) -> None:
        if self.ngram_online is not None and self.ngram_online.add([*prompt, *reply]):
            self.update_ngram_table(self.ngram_online.table)

    def reserve(self) -> int:
        return self.k + 1

    def _spec_params(self, knobs, bias_ids, bias_vals):
        """(Traced) `SpecParams` of one request, every field present (see `request_sampling`)."""
        from relf_jax.sampling import autoregressive as ar

        sp = request_sampling(ar, knobs, bias_ids, bias_vals, self.vocab_size)
        scale = self.method.draft_temperature_scale
        return self._spec.SpecParams(sp.temperature, sp.top_p, jnp.float32(self.nsd_top_p), sp.top_k, sp.min_p,
                                     sp.penalties, None if scale == 1.0 else jnp.float32(scale))

    @staticmethod
    def _static_params(sp, features: frozenset):
        """`sp` with the features no held slot uses switched off at trace time (see `Held`)."""
        pen = sp.penalties.off(bias="bias" not in features, penalties="penalties" not in features)
        return sp.replace(top_k=sp.top_k if "top_k" in features else None,
                          top_p=sp.top_p if "nucleus" in features else None,
                          min_p=sp.min_p if "min_p" in features else None,
                          penalties=pen if pen.bias is not None or pen.tracks else None)

    def weight_args(self) -> tuple:
        """The target's and the draft's weights as the jitted calls take them (`Leaves`; the
        n-gram table or None in the draft's place without a draft model)."""
        return self._target_w.leaves, (self._draft_w.leaves if self._draft_w is not None else self.ngram_table)

    def _weights(self, weights):
        """Inside a traced call: the States of what `weight_args` passed."""
        target_params, draft_params = weights
        return (self._target_w.tree(target_params),
                self._draft_w.tree(draft_params) if self._draft_w is not None else draft_params)

    def bucket_settings(self, bucket: int):
        return self._settings(self.max_context - bucket - self.k - 1)

    def kv_models(self) -> list:
        return [self.lm] + ([self.draft] if self.draft is not None else [])

    def kv_caches(self, slots) -> tuple:
        st = slots.state
        return (st.target_cache, st.draft_cache) if self.draft is not None else (st.target_cache,)

    def kv_layouts(self) -> list:
        return [model_layout(m.model_cfg) for m in self.kv_models()]

    @property
    def kv_lag(self) -> int:
        # the draft model re-feeds the last two committed tokens each round: its keys/values of
        # the one before the last may not be written yet
        return 2 if self.draft is not None else 1

    def prefix_data(self, weights, prompts, lengths, seed, knobs, bias_ids, bias_vals, settings, features,
                    cached=None):
        """(slot data, first token, done, its log-probs or None) of one padded prompt: traced,
        the seed's key made inside."""
        dg = self.draft.graphdef if self.draft is not None else None
        target_params, draft_params = self._weights(weights)
        sp = self._spec_params(knobs, bias_ids, bias_vals)
        prefix = draft_cache = None
        if cached is not None:
            pool, ids, start, suffix = cached
            total = prompts.shape[1] + settings.max_new_tokens + settings.k + 1
            prefix = CachedPrefix(gather_cache(pool[0], ids, total), start, suffix)
            draft_cache = gather_cache(pool[1], ids, total) if self.draft is not None else None
        st, lp = self._spec.prefill_scored(self.lm.graphdef, target_params, dg, draft_params, prompts, lengths,
                                           jax.random.key(seed), self._static_params(sp, features), settings,
                                           log_probs=LOGPROBS_TOP if "logprobs" in features else 0,
                                           prefix=prefix, draft_prefix_cache=draft_cache)
        st = done_at_stop_only(st, lengths, self.tokenizer.eos_id)
        return Slot(state=st, sampling=sp), st.tokens[0, lengths[0]], st.done[0], lp

    def cache_span(self, state) -> int:
        return state.slots.state.target_cache[0][0].shape[-2]

    def resize_slots(self, slots, span: int):
        return slots.replace(state=slots.state.replace(target_cache=resize_cache(slots.state.target_cache, span),
                                                       draft_cache=resize_cache(slots.state.draft_cache, span)))

    def step_all(self, weights, slots: Slot, features: frozenset):
        spec, settings = self._spec, self._step_settings
        dg = self.draft.graphdef if self.draft is not None else None
        target_params, draft_params = self._weights(weights)
        n_lp = LOGPROBS_TOP if "logprobs" in features else 0

        def one(st, sp):
            # Python values switch the unused features off at trace time (see `Held`)
            return spec.round_scored(self.lm.graphdef, target_params, dg, draft_params, st,
                                     self._static_params(sp, features), settings, log_probs=n_lp)

        stops = jnp.asarray(self.stop_ids, jnp.int32)

        def round_(slots):
            old = slots.state
            new, lp = vmap_slots(one, self.mesh)(old, slots.sampling)
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
                parts.append(float_bits(lp[:, 0].reshape(lp.shape[0], -1)))
            return dataclasses.replace(slots, state=new), jnp.concatenate(parts, axis=1)

        # [slots, rounds, (k + 1 tokens, count, done, accepted[, (k + 1) * (1 + 2 * top)])]
        return run_parked(round_, slots, self.steps_per_call,
                           self.k + 4 + (self.k + 1) * (1 + 2 * n_lp if n_lp else 0), features)

    def step_output(self, out, model_s, early):
        w = self.k + 1
        toks = [[t for r in row for t in r[:r[w]]] for row in out]
        lps = None
        if len(out[0][0]) > w + 3:  # each position's log-probs (bit patterns) follow
            def entries(r):
                per = np.asarray(r[w + 3:], np.int32).view(np.float32).reshape(w, -1)
                return [lp_entry(per[j]) for j in range(r[w])]
            lps = [[e for r in row for e in entries(r)] for row in out]
        return StepOutput(tokens=toks, done=[any(r[w + 1] for r in row) for row in out], model_s=model_s,
                          accepted=[sum(r[w + 2] for r in row) for row in out],
                          steps=[sum(r[w] > 0 for r in row) for row in out], ready_early=early, log_probs=lps)
