"""Loading a trained model for inference: the newest good checkpoint's parameters (never its
optimizer state), config and tokenizer, as a `LoadedModel`.

`load` reads the model family from the checkpoint; `load_model` names the family it expects
(and refuses another). A HuggingFace Llama / Qwen2 folder loads in place as an AR model, and a
``.safetensors`` file written by `relf-jax export` as the model it holds.
"""

from __future__ import annotations

import os
from typing import Optional

import jax

from relf_jax.checkpoint import Checkpointer, LoadedModel, latest_meta, tokenizer_bytes_from_meta
from relf_jax.config import Config, ModelConfig, saved_model_config
from relf_jax.data.tokenizer import tokenizer_from_bytes
from relf_jax.errors import UserError

FAMILIES = ("ar", "relf", "bd", "dws")


def restore_params(model_dir: str, model_cfg: ModelConfig, train_cfg, mesh=None):
    """(graphdef, params, meta) of the newest good checkpoint in `model_dir`, restoring the
    parameters only. Raises `UserError` if there is none or it holds another model family."""
    from relf_jax.runtime.sharding import make_mesh
    from relf_jax.train.loop import plan_state
    from relf_jax.train.optimizers import make_optimizer

    mesh = mesh or make_mesh(1, 1, 1, devices=jax.local_devices()[:1])
    plan = plan_state(model_cfg, make_optimizer(train_cfg), mesh)
    restored = Checkpointer(model_dir, async_save=False, read_only=True).restore_latest(
        plan.restore_target()["params"], family=model_cfg.family, params_only=True)
    if restored is None:
        raise UserError(f"no checkpoint found in {os.path.join(os.path.abspath(model_dir), 'checkpoints')}")
    _, state, _, meta = restored
    return plan.graphdef, state["params"], meta


def _has_checkpoints(path: str) -> bool:
    return os.path.isdir(os.path.join(path, "checkpoints"))


def load_model(workdir: str, family: str = "ar") -> LoadedModel:
    """Restore the newest good `family` checkpoint from ``<workdir>/<family>`` (or `workdir`).

    A HuggingFace Llama / Qwen2 folder (config.json + safetensors) is read in place as an AR
    model (`relf_jax.export.hf.from_hf`)."""
    from relf_jax.export import hf

    if hf.is_hf_dir(workdir) and not _has_checkpoints(os.path.join(workdir, family)):
        if family != "ar":
            raise UserError(f"{workdir} is a HuggingFace folder: it holds an AR model, not a {family!r} one")
        return hf.from_hf(workdir)
    model_dir = os.path.join(workdir, family)
    if not _has_checkpoints(model_dir):
        model_dir = workdir
    meta = latest_meta(model_dir)
    if meta.get("family") != family:
        raise UserError(f"the checkpoint in {model_dir} holds a {meta.get('family')!r} model, not {family!r}")
    cfg = Config.from_dict(meta["config"])
    model_cfg = saved_model_config(meta["model"])
    graphdef, params, meta = restore_params(model_dir, model_cfg, cfg.train)
    tok_bytes = tokenizer_bytes_from_meta(meta)
    if tok_bytes is None:
        raise UserError(f"the checkpoint in {model_dir} carries no tokenizer")
    return LoadedModel(cfg=cfg, model_cfg=model_cfg, graphdef=graphdef, params=params,
                       tokenizer=tokenizer_from_bytes(tok_bytes), step=int(meta["step"]), model_dir=model_dir)


def checkpoint_family(path: str) -> str:
    """The model family stored at `path`: a model folder (``<path>/checkpoints``), a run folder
    holding one family's ``<path>/<family>`` folder, or a HuggingFace folder ("ar")."""
    from relf_jax.export import hf

    if _has_checkpoints(path):
        return str(latest_meta(path).get("family", "ar"))
    found = [f for f in FAMILIES if _has_checkpoints(os.path.join(path, f))]
    if len(found) == 1:
        return found[0]
    if found:
        raise UserError(f"{path} holds {', '.join(found)} models; load one of "
                        + ", ".join(os.path.join(path, f) for f in found))
    if hf.is_hf_dir(path):
        return "ar"
    raise UserError(f"no checkpoint found in {os.path.abspath(path)}; train one first (relf-jax train ...)")


def load(path: str, family: Optional[str] = None) -> LoadedModel:
    """The model at `path` for inference: a run or model folder (family read from its checkpoint
    unless given), a HuggingFace folder, or a ``.safetensors`` file of `relf-jax export`."""
    if path.endswith(".safetensors") and os.path.isfile(path):
        from relf_jax.export.safetensors_io import load_safetensors

        return load_safetensors(path)
    return load_model(path, family or checkpoint_family(path))
