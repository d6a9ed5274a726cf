"""Sampling a loaded ReLF model: the jitted whole-row sampler (`relf_tokens`) and the batch
recipe (`sample_relf`): `nfe` network calls per row, all positions in parallel."""

from __future__ import annotations

import functools
import os
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from relf_jax.checkpoint import EMBEDDINGS_FILE
from relf_jax.data.tokenizer import turn_stop_ids
from relf_jax.errors import UserError
from relf_jax.flow.lengths import draw_segment_lengths, flow_lengths, segment_rows
from relf_jax.flow.samplers import FlowSamplerSettings
from relf_jax.flow.samplers import sample as flow_sample
from relf_jax.flow.singular import network_residual
from relf_jax.methods import Flow
from relf_jax.runtime.sharding import to_host
from relf_jax.sampling.batch import Samples, collect, cut_at_stop, prompt_ids, samples_from_rows, timed_chunks


def segment_residual(model, segment_ids, table=None):
    """The samplers' ``residual_fn(z, t, sc[, known])`` of the ReLF network `model` on rows with
    `segment_ids` [B, L] (None: one segment); guidance's doubled batch gets them twice. `table`:
    the fixed embeddings (read by the default's embedding-tied head, ``flow_embed_head``, and the
    evidence input of a model with ``flow_evidence_input``; `relf_jax.flow.singular.network_residual`)."""
    def residual(z, t, sc, known=None):
        seg = segment_ids
        if seg is not None and seg.shape[0] != z.shape[0]:
            seg = jnp.concatenate([seg] * (z.shape[0] // seg.shape[0]))
        return network_residual(model, z, sc, t, known, seg, table)
    return residual


@functools.partial(jax.jit, static_argnames=("graphdef", "settings", "batch", "length"))
def relf_tokens(graphdef, params, key, table, prompt_tokens=None, prompt_mask=None, segment_ids=None, *,
                settings, batch: int, length: int):
    """Token ids [batch, length] from the ReLF sampler, conditioned on the positions of
    `prompt_mask` [batch, length] holding `prompt_tokens` when given, on rows of `segment_ids`
    (one segment per row, then pad; None: the whole row); compiled once per settings and shape."""
    from flax import nnx

    residual = segment_residual(nnx.merge(graphdef, params), segment_ids, table)
    known = None if prompt_mask is None else (prompt_mask, jnp.take(table, prompt_tokens, axis=0))
    out = flow_sample(key, residual, table, settings, batch=batch, length=length, known=known)[0]
    return out if prompt_mask is None else jnp.where(prompt_mask, prompt_tokens, out)


def flow_table(lm) -> np.ndarray:
    """A loaded ReLF model's fixed token embeddings (from the file, or from `lm.extras`)."""
    if "flow.embeddings" in lm.extras:
        return np.asarray(lm.extras["flow.embeddings"])
    return np.load(os.path.join(lm.model_dir, EMBEDDINGS_FILE))


def flow_prompt_mode(lm) -> str:
    """How a ReLF model is conditioned on a prompt: "clean" when it was trained with clean,
    flagged prompts (``flow.prompt_prob`` > 0), else "renoise" (see `relf_jax.flow.samplers`)."""
    return "clean" if lm.model_cfg.flow_prompt_input else "renoise"


def sampler_settings(lm, method: Flow) -> FlowSamplerSettings:
    """The flow sampler's settings for `lm` decoding with `method` (a `relf_jax.methods.Flow`):
    its fields, else the model's ``cfg.flow``; its prompt mode, else `flow_prompt_mode(lm)`."""
    mode = method.prompt_mode or flow_prompt_mode(lm)
    if mode == "clean" and not lm.model_cfg.flow_prompt_input:
        raise UserError("prompt_mode='clean' needs a ReLF model trained with flow.prompt_prob > 0")
    return FlowSamplerSettings.from_method(method, lm.cfg.flow, prompt=mode)


def length_prior(lm, length: int) -> Optional[np.ndarray]:
    """`flow_lengths(lm)` padded or cut to rows of `length` (None: the model samples whole rows)."""
    counts = flow_lengths(lm)
    if counts is not None and len(counts) - 1 < length:  # room beyond the training rows: pad up
        counts = np.pad(counts, (0, length + 1 - len(counts)))
    return None if counts is None else counts[:length + 1]


def prompt_rows(ids: Sequence[Sequence[int]], batch: int, length: int, pad_id: int):
    """(tokens, mask) [batch, length] of the prompts `ids` (the first one repeats to fill the batch)."""
    chunk = list(ids) + [ids[0]] * (batch - len(ids))
    toks = np.full((batch, length), pad_id, np.int32)
    mask = np.zeros((batch, length), bool)
    for i, row in enumerate(chunk):
        toks[i, :len(row)], mask[i, :len(row)] = row, True
    return jnp.asarray(toks), jnp.asarray(mask)


def sample_relf(lm, n: Optional[int] = None, *, prompts: Optional[Sequence[str]] = None,
                nfe: Optional[int] = None, sampler: Optional[str] = None,
                guidance: Optional[float] = None, length: Optional[int] = None, batch_size: Optional[int] = None,
                seed: int = 0, warmup: bool = True, renoise: Optional[str] = None,
                prompt_mode: Optional[str] = None, grid: Optional[str] = None) -> Samples:
    """Whole sequences from a ReLF model: `nfe` network calls each, all positions in parallel.

    Without `prompts`: `n` unconditional rows. With `prompts`: one row per prompt, the flow
    conditioned on the prompt's positions (`prompt_mode`: "clean" or "renoise", default
    `flow_prompt_mode(lm)`), and the sample is the reply: what follows the prompt up to the end
    of the turn (EOS or the next ``<user>``, `complete` when one is reached).
    Sampler settings (`nfe`, `sampler`, `guidance`, `renoise`, the time `grid`) default to the
    model's ``cfg.flow``; length to ``data.seq_len``. A model
    trained on segment rows (`flow_lengths`) writes one segment per row, of a length drawn from
    its training segments' lengths (with a prompt: longer than the prompt), and pad after it.
    """
    settings = sampler_settings(lm, Flow(nfe=nfe, sampler=sampler, guidance=guidance, renoise=renoise,
                                         prompt_mode=prompt_mode, grid=grid))
    table = jnp.asarray(flow_table(lm))
    length = length or lm.cfg.data.seq_len
    bs = batch_size or lm.cfg.sample.batch_size
    tok = lm.tokenizer
    ids = None
    if prompts is not None:
        ids = prompt_ids(tok, prompts, 0)
        longest = max(len(x) for x in ids)
        if longest >= length:
            raise UserError(f"a prompt of {longest} tokens leaves no room in a ReLF row of {length}")
        n = len(ids)
    elif not n:
        raise UserError("sample_relf needs n > 0 or prompts")
    counts = length_prior(lm, length)
    len_rng = np.random.default_rng([seed, 0x5E6])

    def prepare(start):
        if counts is None:
            return start, None
        low = 1 if ids is None else [len(x) + 1 for x in (ids[start:start + bs] + [ids[start]] * bs)[:bs]]
        return start, jnp.asarray(segment_rows(draw_segment_lengths(counts, len_rng, bs, low), length))

    def run(inputs, key):
        start, seg = inputs
        toks = mask = None
        if ids is not None:
            toks, mask = prompt_rows(ids[start:start + bs], bs, length, tok.pad_id)
        return relf_tokens(lm.graphdef, lm.params, key, table, toks, mask, seg, settings=settings, batch=bs,
                           length=length)

    rows, seconds = [], 0.0
    for (start, seg), out, sec in timed_chunks(n, bs, jax.random.key(seed), prepare, run, warmup=warmup):
        seconds += sec
        out = to_host(out)
        if seg is not None:
            out = np.where(np.asarray(seg) != 0, out, tok.pad_id)
        rows.extend(out[: min(bs, n - start)])
    if ids is None:
        return samples_from_rows(tok, rows, seconds=seconds, target_forwards=settings.nfe * len(rows))
    stops = set(turn_stop_ids(tok))
    replies = [cut_at_stop(row[len(prompt):].tolist(), stops, (tok.pad_id, tok.bos_id))
               for row, prompt in zip(rows, ids)]
    return collect(tok, replies, seconds=seconds, target_forwards=settings.nfe * len(rows))
