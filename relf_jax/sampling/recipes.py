"""Batch and streaming recipes of the decoder families on a loaded model: autoregressive
replies (`sample_ar`, `stream_reply`) and block-diffusion replies (`sample_bd`), `batch_size`
prompts at a time through `relf_jax.sampling.batch`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import jax

from relf_jax.config import SampleConfig, validate_sampling
from relf_jax.data.tokenizer import encode_prompt
from relf_jax.runtime.sharding import to_host
from relf_jax.sampling import autoregressive as ar
from relf_jax.sampling.batch import Samples, collect, fill_chunk, prompt_ids, strip_stop, timed_chunks


def fit_new_tokens(prompt_len: int, max_new_tokens: int, max_seq_len: int, extra: int = 0) -> tuple[int, str]:
    """`max_new_tokens` cut to the context left after a `prompt_len`-token prompt (and `extra`
    tokens a speculative round may overshoot by), with a one-line note when it was cut ("" when
    not). A prompt that leaves no room at all is a `UserError`."""
    room = max_seq_len - prompt_len - extra
    if room < 1:
        ar.check_context(prompt_len, max(max_new_tokens, 1) + extra, max_seq_len)
    if max_new_tokens <= room:
        return max_new_tokens, ""
    return room, (f"max_new_tokens {max_new_tokens} -> {room}: the prompt takes {prompt_len} of the model's "
                  f"{max_seq_len}-token context")


def ar_batch(lm, sc: SampleConfig):
    """``run(prompts, lengths, key) -> (tokens, lengths, state)`` of AR decoding with `sc`."""
    settings = ar.DecodeSettings.from_tokenizer(lm.tokenizer, sc.max_new_tokens)
    params = ar.TracedSampling.make(sc.temperature, sc.top_k, sc.top_p)

    def run(arr, lens, key):
        state = ar.generate(lm.graphdef, lm.params, arr, lens, key, params, settings)
        return state.tokens, state.lengths, state

    return run


def decode_batches(lm, ids: Sequence[Sequence[int]], sc: SampleConfig, run, *, extra: int = 0,
                   warmup: bool = True, count_forwards: Optional[Callable[[Any, int], int]] = None) -> Samples:
    """Replies to the prompt ids `ids` from a left-to-right decoder ``run(prompts, lengths, key)
    -> (tokens, lengths, state)`` (AR or speculative; `extra`: tokens a round may overshoot by),
    `sc.batch_size` at a time, each cut at EOS. `count_forwards(state, rows)`: the target forward
    passes of a chunk's first `rows` rows (None: one per token)."""
    tok = lm.tokenizer
    longest = max(len(x) for x in ids)
    ar.check_context(longest, sc.max_new_tokens + extra, lm.model_cfg.max_seq_len)
    bucket = min(ar.prompt_bucket(longest), lm.model_cfg.max_seq_len - sc.max_new_tokens - extra)
    bs = sc.batch_size

    def prepare(start):
        chunk = ids[start:start + bs]
        return len(chunk), ar.pad_prompts(fill_chunk(chunk, bs, [tok.bos_id]), tok.pad_id, bucket)

    replies, seconds, forwards = [], 0.0, 0
    for (count, (_, lens)), (tokens, lengths, state), sec in timed_chunks(
            len(ids), bs, jax.random.key(sc.seed), prepare, lambda inputs, key: run(*inputs[1], key),
            warmup=warmup):
        seconds += sec
        toks, lengths, plens = to_host((tokens, lengths, lens))
        if count_forwards is not None:
            forwards += count_forwards(state, count)
        replies.extend(strip_stop(toks[i, plens[i]:lengths[i]].tolist(), {tok.eos_id}) for i in range(count))
    out = collect(tok, replies, seconds=seconds)
    out.target_forwards = forwards if count_forwards is not None else out.tokens
    return out


def sample_ar(lm, prompts: Optional[Sequence[str]] = None, n: Optional[int] = None,
              sample_cfg: Optional[SampleConfig] = None, warmup: bool = True) -> Samples:
    """Autoregressive replies to `prompts` (default: `n` empty prompts, i.e. unconditional
    conversations), `batch_size` at a time. With `warmup`, the batch shape is compiled before the
    clock starts."""
    sc = sample_cfg or lm.cfg.sample
    validate_sampling(sc.temperature, sc.top_k, sc.top_p)
    ids = prompt_ids(lm.tokenizer, prompts, n or sc.num_samples)
    return decode_batches(lm, ids, sc, ar_batch(lm, sc), warmup=warmup)


def stream_reply(lm, prompt: str, sample_cfg: Optional[SampleConfig] = None) -> Iterator[str]:
    """Yield the reply to `prompt` piece by piece (text deltas) as it is generated."""
    sc = sample_cfg or lm.cfg.sample
    tok = lm.tokenizer
    ids = encode_prompt(tok, prompt)
    ar.check_context(len(ids), sc.max_new_tokens, lm.model_cfg.max_seq_len)
    arr, lens = ar.pad_prompts([ids], tok.pad_id, min(ar.prompt_bucket(len(ids)),
                                                      lm.model_cfg.max_seq_len - sc.max_new_tokens))
    settings = ar.DecodeSettings.from_tokenizer(tok, sc.max_new_tokens)
    out: list[int] = []
    shown = ""
    for toks, emitted in ar.stream(lm.graphdef, lm.params, arr, lens, jax.random.key(sc.seed),
                                   ar.TracedSampling.make(sc.temperature, sc.top_k, sc.top_p), settings):
        if not emitted[0] or int(toks[0]) == tok.eos_id:
            continue
        out.append(int(toks[0]))
        text = tok.decode(out)
        if len(text) > len(shown):
            yield text[len(shown):]
            shown = text


def sample_bd(lm, prompts: Optional[Sequence[str]] = None, n: Optional[int] = None,
              sample_cfg: Optional[SampleConfig] = None, warmup: bool = True) -> Samples:
    """Replies from a block-diffusion model by confidence-threshold decoding (`relf_jax.sampling.block_diffusion`),
    `batch_size` prompts at a time: tokens sampled at ``sample.temperature`` (0: greedy), commits by
    ``sample.threshold`` and ``sample.confidence``, at most
    ceil(``sample.max_new_tokens`` / block size) blocks, stopping at EOS or (when every prompt is
    non-empty, i.e. a reply is wanted) at the ``<user>`` marker of the next turn.
    ``target_forwards`` counts denoising steps plus one cache refresh per block."""
    from relf_jax.sampling import block_diffusion as bdd

    sc = sample_cfg or lm.cfg.sample
    tok = lm.tokenizer
    prompts = list(prompts) if prompts is not None else None
    ids = prompt_ids(tok, prompts, n or sc.num_samples)
    d = lm.model_cfg.block_size
    settings = bdd.decode_settings(lm, max_blocks=-(-sc.max_new_tokens // d), threshold=sc.threshold,
                                   temperature=sc.temperature, confidence=sc.confidence)
    if prompts is None or not all(prompts):  # a fresh conversation starts with <user>: only EOS (or pad) ends it
        settings = dataclasses.replace(settings, stop_ids=tuple(i for i in settings.stop_ids
                                                                if i in (tok.eos_id, tok.pad_id)))
    bucket = bdd.prompt_bucket(max(len(x) for x in ids), d)
    bs = sc.batch_size

    def prepare(start):
        chunk = ids[start:start + bs]
        return len(chunk), bdd.pad_prompts(fill_chunk(chunk, bs, [tok.bos_id]), tok.pad_id, d, bucket)

    def run(inputs, key):
        arr, plen = inputs[1]
        return to_host(bdd.generate(lm.graphdef, lm.params, arr, plen, settings, key))

    replies, seconds, forwards, steps, commits = [], 0.0, 0, 0, 0
    for (count, (_, plen)), state, sec in timed_chunks(len(ids), bs, jax.random.key(sc.seed), prepare, run,
                                                       warmup=warmup):
        seconds += sec
        for i, out in enumerate(bdd.outputs(state, plen)[:count]):
            replies.append(strip_stop(out, settings.stop_ids))
            forwards += int(state.steps[i].sum() + state.num_blocks[i])
            steps += int(state.steps[i].sum())
            commits += d - int(plen[i]) % d + d * (int(state.num_blocks[i]) - 1)  # first block: the prompt's rest
    return collect(tok, replies, seconds=seconds, target_forwards=forwards, denoise_steps=steps,
                   denoise_commits=commits)
