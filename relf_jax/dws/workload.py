"""Requests for DWS: chat prompts, their decoded workloads (labels) and timed runs.

- `workload_prompts`: first user turns of fresh `synthetic_chat` conversations (whose reply
  length follows the verbosity cue in the prompt) and real user utterances of the
  `chatterbot-corpus` dialogs, each as ``<user> ... <assistant>``.
- `decode_labels`: steps per block and output length of many prompts with the batched jitted
  decoder (cheap labels for training the predictor), optionally cached on disk.
- `timed_runs`: the instrumented decoder over prompts, one at a time (`RequestLog` each).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence

import jax
import numpy as np

from relf_jax.dws.decoding import RequestLog, decode_instrumented
from relf_jax.io import write_json
from relf_jax.sampling.block_diffusion import BlockDecodeSettings, generate, outputs, pad_prompts


@dataclasses.dataclass
class WorkloadPrompt:
    text: str
    source: str  # "synthetic_chat" | "chatterbot"
    ids: list[int]  # BOS + the prompt's token ids


def workload_prompts(tok, *, n_synthetic: int, n_chatterbot: int, seed: int, max_tokens: int = 48,
                     grammar=None) -> list[WorkloadPrompt]:
    """Prompts in a deterministic shuffled order; prompts longer than `max_tokens` are skipped."""
    from relf_jax.data.synthetic_chat import SyntheticChat

    grammar = grammar or SyntheticChat()
    texts = [(info["prompt"], "synthetic_chat") for info in grammar.sample_with_info(n_synthetic, seed)]
    if n_chatterbot:
        from relf_jax.data.builders.chatterbot import first_user_turns

        texts += [(t, "chatterbot") for t in first_user_turns(n_chatterbot, seed)]
    out = []
    for text, source in texts:
        ids = [tok.bos_id] + tok.encode(text)
        if len(ids) <= max_tokens:
            out.append(WorkloadPrompt(text=text, source=source, ids=ids))
    order = np.random.default_rng(seed + 1).permutation(len(out))
    return [out[i] for i in order]


def _labels_key(params, prompts: Sequence[Sequence[int]], settings: BlockDecodeSettings, batch_size: int) -> str:
    h = hashlib.sha256()
    h.update(repr((settings, batch_size)).encode())
    h.update(json.dumps([list(map(int, p)) for p in prompts]).encode())
    for leaf in jax.tree.leaves(params):
        h.update(np.ascontiguousarray(jax.device_get(leaf)).tobytes())
    return h.hexdigest()[:20]


def decode_labels(graphdef, params, prompts: Sequence[Sequence[int]], settings: BlockDecodeSettings, *,
                  batch_size: int = 32, progress: bool = True,
                  cache_dir: str | None = None) -> tuple[list[list[int]], list[int]]:
    """(steps per block, output tokens) of each prompt, decoded `batch_size` at a time.

    With `cache_dir`, the labels are kept in ``<cache_dir>/labels_<key>.json``, the key hashing
    the parameters, prompts and settings: a rerun (say, after an interrupted benchmark) reads them
    instead of decoding again.
    """
    path = None
    if cache_dir is not None:
        path = os.path.join(cache_dir, f"labels_{_labels_key(params, prompts, settings, batch_size)}.json")
        if os.path.isfile(path):
            with open(path) as f:
                cached = json.load(f)
            return cached["steps"], cached["lens"]
    steps, lens = _decode_labels(graphdef, params, prompts, settings, batch_size, progress)
    if path is not None:
        write_json(path, {"steps": steps, "lens": lens}, indent=None)
    return steps, lens


def _decode_labels(graphdef, params, prompts, settings, batch_size, progress):
    from tqdm.auto import tqdm

    longest = max(len(p) for p in prompts)
    bucket = -(-longest // settings.block_size) * settings.block_size  # one compilation for all batches
    steps, lens = [], []
    for i in tqdm(range(0, len(prompts), batch_size), desc="decode labels", disable=not progress):
        chunk = list(prompts[i:i + batch_size])
        rows = chunk + [chunk[0]] * (batch_size - len(chunk))
        arr, plen = pad_prompts(rows, settings.pad_id, settings.block_size, bucket)
        state = jax.device_get(generate(graphdef, params, arr, plen, settings))
        outs = outputs(state, plen)
        for r in range(len(chunk)):
            nb = int(state.num_blocks[r])
            steps.append([int(x) for x in state.steps[r, :nb]])
            lens.append(len(outs[r]))
    return steps, lens


def timed_runs(graphdef, params, prompts: Sequence[Sequence[int]], settings: BlockDecodeSettings, *,
               warmup: bool = True, progress: bool = True, desc: str = "timed runs") -> list[RequestLog]:
    """Instrumented decoding of each prompt in turn; with `warmup`, every prompt bucket is compiled
    (by decoding one prompt of that bucket) before any clock starts."""
    from tqdm.auto import tqdm

    from relf_jax.sampling.block_diffusion import prompt_bucket

    if warmup:
        seen = {}
        for p in prompts:
            seen.setdefault(prompt_bucket(len(p), settings.block_size), p)
        for p in seen.values():
            decode_instrumented(graphdef, params, p, settings)
    return [decode_instrumented(graphdef, params, p, settings)
            for p in tqdm(prompts, desc=desc, disable=not progress)]


def with_dtype(lm, dtype: str):
    """(graphdef, params) of a loaded model computing in `dtype` (same float32 parameters):
    the "other hardware" of the transfer experiment."""
    from relf_jax.models.registry import abstract_params

    graphdef, _ = abstract_params(dataclasses.replace(lm.model_cfg, dtype=dtype))
    return graphdef, lm.params
