"""Parameters as a flat ``{"blocks.0.attn.wq": array}`` dict, and back (placed on a mesh).

Every exporter and importer goes through these two functions, so a name means the same thing
in the safetensors files, the HuggingFace mapping and the jax.export artifact.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import jax
import numpy as np
from flax import nnx

from relf_jax.config import ModelConfig
from relf_jax.errors import UserError
from relf_jax.models.registry import abstract_params
from relf_jax.runtime import sharding as shd


def _name(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def flat_params(params: Any) -> dict[str, np.ndarray]:
    """Host copies of every parameter of an nnx.State, keyed by dotted path."""
    out = {}
    for path, var in nnx.to_flat_state(params):
        value = var.get_value() if isinstance(var, nnx.Variable) else var
        out[_name(path)] = np.asarray(jax.device_get(value))
    return out


def params_from_flat(model_cfg: ModelConfig, flat: Mapping[str, np.ndarray], *, mesh=None,
                     what: str = "the weights"):
    """(graphdef, params) with every leaf taken from `flat`, placed on `mesh` by logical axes.

    Missing, unexpected or mis-shaped names are one `UserError` that lists them. Values keep
    their dtype unless the model's parameter dtype differs (then they are cast).
    """
    graphdef, abstract = abstract_params(model_cfg)
    mesh = mesh or shd.make_mesh(1, 1, 1, devices=jax.local_devices()[:1])
    shardings = dict((_name(p), s) for p, s in nnx.to_flat_state(shd.state_shardings(abstract, mesh)))
    leaves = list(nnx.to_flat_state(abstract))
    names = [_name(p) for p, _ in leaves]
    missing = [n for n in names if n not in flat]
    extra = sorted(set(flat) - set(names))
    if missing or extra:
        raise UserError(f"{what} do not match the model: missing {missing[:6]}{'...' if len(missing) > 6 else ''}, "
                        f"unexpected {extra[:6]}{'...' if len(extra) > 6 else ''}")
    out = []
    for (path, var), name in zip(leaves, names):
        want = var.get_value()
        arr = np.asarray(flat[name])
        if tuple(arr.shape) != tuple(want.shape):
            raise UserError(f"{what}: {name} has shape {tuple(arr.shape)}, the model needs {tuple(want.shape)}")
        if arr.dtype != want.dtype:
            arr = arr.astype(want.dtype)
        sh = shardings[name]
        sh = sh.get_value() if isinstance(sh, nnx.Variable) else sh
        out.append((path, var.replace(jax.device_put(arr, sh))))
    return graphdef, nnx.from_flat_state(out)


def save_checkpoint(lm, model_dir: str, *, extra_meta: Optional[dict] = None) -> str:
    """Write a `LoadedModel` as a relf_jax checkpoint (fresh optimizer state) in `model_dir`.

    Every `relf-jax` command and `relf_jax.loading.load_model` then read it like a trained model; training
    from it (fine-tuning) starts at its step.
    """
    from relf_jax.checkpoint import Checkpointer
    from relf_jax.train.optimizers import make_optimizer

    opt_state = jax.jit(make_optimizer(lm.cfg.train).init)(lm.params)
    meta = {"family": lm.model_cfg.family, "config": lm.cfg.to_dict(),
            "model": dataclasses.asdict(lm.model_cfg), **(extra_meta or {})}
    ckpt = Checkpointer(model_dir, keep=1, async_save=False)
    try:
        ckpt.save(lm.step, {"params": lm.params, "opt_state": opt_state}, meta=meta,
                  tokenizer_bytes=lm.tokenizer.to_bytes(), force=True)
    finally:
        ckpt.close()
    return model_dir
