"""An AR model's prefill and decode steps as serialized `jax.export` artifacts.

The artifact directory runs with JAX alone (no relf_jax model code): StableHLO for two jitted
functions, the weights as safetensors, and a manifest with the shapes::

    prefill(params, tokens [B, P] int32, lengths [B] int32) -> (logits [B, V] f32, cache)
        logits of each row's last prompt token (index lengths - 1); cache holds the prompt
    decode(params, tokens [B] int32, positions [B] int32, cache) -> (logits [B, V] f32, cache)
        one token per row at `positions` (slot `positions` of the cache is written)

``params`` is the flat dict read from ``params.safetensors``; ``cache`` is a tuple of
(k, v) per layer, each [B, num_kv_heads, S, head_dim] (``manifest["cache"]``). Loading::

    import json, jax, numpy as np
    from safetensors.numpy import load_file
    m = json.load(open(f"{d}/manifest.json"))
    prefill = jax.export.deserialize(open(f"{d}/prefill.jax_export", "rb").read())
    decode = jax.export.deserialize(open(f"{d}/decode.jax_export", "rb").read())
    params = load_file(f"{d}/params.safetensors")
    logits, cache = prefill.call(params, tokens, lengths)

B, P and S are fixed at export time (`batch`, `prompt_len`, `max_len`); a prompt shorter than P is
right-padded with any id. Slots past a row's length are masked, as in relf_jax's own cache.
"""

from __future__ import annotations

import json
import os
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels_pallas import dispatch
from relf_jax.checkpoint import LoadedModel
from relf_jax.data.tokenizer import HFTokenizer
from relf_jax.errors import UserError
from relf_jax.export.flat import flat_params
from relf_jax.models.causal_lm import init_cache
from relf_jax.models.registry import abstract_params
from relf_jax.sampling.prefill import prefill_cache

FORMAT = "relf_jax.jax_export/1"


def _rebuild(model_cfg, flat: dict):
    graphdef, abstract = abstract_params(model_cfg)
    leaves = [(p, v.replace(flat[".".join(str(x) for x in p)])) for p, v in nnx.to_flat_state(abstract)]
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def step_functions(model_cfg, max_len: int):
    """The two pure functions that get exported (also callable directly, for tests): the prefill
    is the samplers' own (`relf_jax.sampling.prefill.prefill_cache`)."""

    def prefill(params, tokens, lengths):
        return prefill_cache(_rebuild(model_cfg, params), tokens, lengths, max_len)

    def decode(params, tokens, positions, cache):
        model = _rebuild(model_cfg, params)
        logits, cache = model(tokens[:, None], positions[:, None], cache=cache, cache_index=positions)
        return logits[:, 0], cache

    return prefill, decode


def export_decode(lm: LoadedModel, out: str, *, batch: int = 1, prompt_len: int = 64,
                  max_len: Optional[int] = None, platforms: Optional[Sequence[str]] = None) -> str:
    """Write the artifact directory for `lm` (an AR model); returns `out`.

    `platforms`: lower for these backends (e.g. ``("cpu", "cuda", "tpu")``); default: this one.
    """
    from safetensors.numpy import save_file

    mc = lm.model_cfg
    if mc.family != "ar":
        raise UserError(f"--format jax-export exports AR prefill/decode steps; this is a {mc.family!r} model")
    max_len = max_len or mc.max_seq_len
    if not 0 < prompt_len <= max_len:
        raise UserError(f"prompt_len must be in 1..max_len ({max_len}); got {prompt_len}")
    if batch < 1:
        raise UserError(f"batch must be >= 1; got {batch}")
    flat = flat_params(lm.params)
    spec = {n: jax.ShapeDtypeStruct(v.shape, v.dtype) for n, v in flat.items()}
    cache_spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                              jax.eval_shape(lambda: init_cache(mc, batch, max_len)))
    i32 = jnp.int32
    prefill, decode = step_functions(mc, max_len)
    kw = {"platforms": tuple(platforms)} if platforms else {}
    with dispatch.references():  # portable StableHLO: no host-specific custom call (CPU kernels)
        exp_prefill = jax.export.export(jax.jit(prefill), **kw)(
            spec, jax.ShapeDtypeStruct((batch, prompt_len), i32), jax.ShapeDtypeStruct((batch,), i32))
        exp_decode = jax.export.export(jax.jit(decode), **kw)(
            spec, jax.ShapeDtypeStruct((batch,), i32), jax.ShapeDtypeStruct((batch,), i32), cache_spec)
    os.makedirs(out, exist_ok=True)
    for name, exp in (("prefill", exp_prefill), ("decode", exp_decode)):
        with open(os.path.join(out, f"{name}.jax_export"), "wb") as f:
            f.write(exp.serialize())
    save_file({n: np.ascontiguousarray(v) for n, v in flat.items()}, os.path.join(out, "params.safetensors"))
    tok = lm.tokenizer
    if isinstance(tok, HFTokenizer):
        tok_file = "tokenizer.json"
        with open(os.path.join(out, tok_file), "w", encoding="utf-8") as f:
            f.write(tok.backend.to_str())
    else:
        tok_file = "tokenizer.model"  # SentencePiece
        tok.save(os.path.join(out, tok_file))
    k_shape = list(cache_spec[0][0].shape)
    manifest = {
        "format": FORMAT, "platforms": list(exp_decode.platforms), "batch": batch, "prompt_len": prompt_len,
        "max_len": max_len, "vocab_size": mc.vocab_size,
        "cache": {"num_layers": mc.num_layers, "k_shape": k_shape, "v_shape": k_shape,
                  "dtype": str(cache_spec[0][0].dtype)},
        "tokenizer": tok_file, "bos_id": tok.bos_id, "eos_id": tok.eos_id, "pad_id": tok.pad_id,
        "functions": {
            "prefill": "(params, tokens[B,P] int32, lengths[B] int32) -> (logits[B,V] f32, cache)",
            "decode": "(params, tokens[B] int32, positions[B] int32, cache) -> (logits[B,V] f32, cache)",
        },
    }
    with open(os.path.join(out, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
    return out
