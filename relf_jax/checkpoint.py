"""Orbax checkpoints: model + optimizer state, step, data-iterator state, config and tokenizer.

One `Checkpointer` per run directory wraps an async, keep-N ``ocp.CheckpointManager``. Each
checkpoint holds three items:

- ``state``: the pytree ``{"params": ..., "opt_state": ...}`` (restored into sharded targets),
- ``data``: the input iterator's state (JSON),
- ``meta``: step, model family, the full config and the tokenizer model (base64), so a
  checkpoint is self-contained.

`restore_latest` walks the steps newest first: a checkpoint that fails to restore (truncated,
corrupt) is skipped with a warning and the previous one is used.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import os
import warnings
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

from relf_jax.config import Config, ModelConfig
from relf_jax.config.schema import SAVED_WITHOUT
from relf_jax.errors import UserError

_log = logging.getLogger(__name__)

# A ReLF model directory keeps its fixed token embeddings [V, d] beside the checkpoints.
EMBEDDINGS_FILE = "embeddings.npy"
# ... and, when trained on segment rows, the counts of its training segments' lengths (its prior)
LENGTHS_FILE = "flow_lengths.npy"


class CheckpointWarning(UserWarning):
    """A checkpoint could not be restored and an older one was used instead."""


def _jsonable(state: Any) -> Any:
    if isinstance(state, bytes):
        return {"__bytes_b64__": base64.b64encode(state).decode()}
    if isinstance(state, dict):
        return {k: _jsonable(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return [_jsonable(v) for v in state]
    return state


def _from_jsonable(state: Any) -> Any:
    if isinstance(state, dict):
        if set(state) == {"__bytes_b64__"}:
            return base64.b64decode(state["__bytes_b64__"])
        return {k: _from_jsonable(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_from_jsonable(v) for v in state]
    return state


def abstract_like(tree: Any, shardings: Any = None) -> Any:
    """ShapeDtypeStructs (with shardings) describing `tree`: the restore target."""
    if shardings is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                            tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _drop_read_only_notice(record) -> bool:
    return not str(record.msg).startswith("Given directory is read only")


def _quiet_read_only_notice() -> None:
    """Orbax logs a warning whenever a checkpoint folder is opened read-only, which loading for
    inference does on purpose; drop that one message from absl's logger (once per process)."""
    import logging

    logger = logging.getLogger("absl")
    if _drop_read_only_notice not in logger.filters:
        logger.addFilter(_drop_read_only_notice)


class Checkpointer:
    """Async keep-N checkpoints under ``<workdir>/checkpoints``."""

    def __init__(self, workdir: str, keep: int = 3, async_save: bool = True, read_only: bool = False):
        self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
        if read_only and not os.path.isdir(self.directory):
            raise UserError(f"no checkpoint found in {self.directory}")
        if read_only:  # what orbax would set itself, with a warning each time (3 per load)
            _quiet_read_only_notice()
            options = ocp.CheckpointManagerOptions(max_to_keep=None, save_interval_steps=0, create=False,
                                                   enable_async_checkpointing=async_save, read_only=True)
        else:
            options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: Any, *, data_state: Any = None, meta: Optional[dict] = None,
             tokenizer_bytes: Optional[bytes] = None, force: bool = False) -> bool:
        meta = dict(meta or {})
        meta["step"] = int(step)
        if tokenizer_bytes is not None:
            meta["tokenizer_b64"] = base64.b64encode(tokenizer_bytes).decode()
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(_jsonable({"iterator": data_state})),
            meta=ocp.args.JsonSave(meta),
        )
        return self.manager.save(int(step), args=args, force=force)

    def restore(self, step: int, target: Any) -> tuple[Any, Any, dict]:
        """Restore checkpoint `step` into `target` (abstract pytree with shardings)."""
        out = self.manager.restore(int(step), args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target),
            data=ocp.args.JsonRestore(),
            meta=ocp.args.JsonRestore(),
        ))
        return out["state"], _from_jsonable(out["data"])["iterator"], dict(out["meta"])

    def read_meta(self, step: int) -> dict:
        out = self.manager.restore(int(step), args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(out["meta"])

    def restore_params(self, step: int, params_target: Any) -> tuple[Any, dict]:
        """(params, meta) of checkpoint `step`, restoring the parameters only (for inference: the
        optimizer state is never read). `params_target`: abstract params with shardings."""
        out = self.manager.restore(int(step), args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(item={"params": params_target},
                                         restore_args=ocp.checkpoint_utils.construct_restore_args(
                                             {"params": params_target}),
                                         partial_restore=True),
            meta=ocp.args.JsonRestore(),
        ))
        return out["state"]["params"], dict(out["meta"])

    def restore_latest(self, target: Any, *, family: Optional[str] = None, model: Optional[dict] = None,
                       params_only: bool = False):
        """Restore the newest checkpoint that loads; None when there is none.

        params_only: `target` is the abstract params alone, and only they are restored (state
        ``{"params": ...}``, data state None): loading for inference.

        A checkpoint from another model `family`, or (given `model`, the run's
        ``dataclasses.asdict(ModelConfig)``) one saved with other model settings, is a
        `UserError`: resuming it would not fit, and it is not corrupt. A checkpoint that fails to
        load is reported with a `CheckpointWarning` and the next older one is tried.
        """
        for step in reversed(self.steps()):
            try:
                meta = self.read_meta(step)
            except Exception as e:  # noqa: BLE001 - any read failure means: try the previous one
                warnings.warn(f"checkpoint {step} in {self.directory} is unreadable ({type(e).__name__}); "
                              "trying the previous one", CheckpointWarning, stacklevel=2)
                continue
            if family is not None and meta.get("family") not in (None, family):
                raise UserError(f"checkpoint {step} in {self.directory} holds a {meta.get('family')!r} model, "
                                f"not {family!r}")
            if model is not None and isinstance(meta.get("model"), dict):
                changed = model_settings_changed(meta["model"], model)
                if changed:
                    raise UserError(f"checkpoint {step} in {self.directory} was trained with other model settings ("
                                    + ", ".join(f"model.{k}={old!r}, now {new!r}" for k, old, new in changed)
                                    + "); resume it with the same settings, or train in another workdir")
            try:
                if params_only:
                    params, meta = self.restore_params(step, target)
                    state, data_state = {"params": params}, None
                else:
                    state, data_state, meta = self.restore(step, target)
            except Exception as e:  # noqa: BLE001
                warnings.warn(f"checkpoint {step} in {self.directory} is corrupt or truncated "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); "
                              "restoring the previous one", CheckpointWarning, stacklevel=2)
                continue
            return step, state, data_state, meta
        return None

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


# model settings a run may change when it resumes: they leave every parameter's shape and
# meaning as it was (the compute dtype)
RESUMABLE_MODEL_CHANGES = frozenset({"dtype"})


def model_settings_changed(saved: dict, current: dict) -> list[tuple[str, Any, Any]]:
    """[(field, saved value, current value)] for the model settings that differ, except
    `RESUMABLE_MODEL_CHANGES` and, outside the relf family, the ReLF network's ``flow_*`` fields.
    A field the checkpoint predates counts as the value it had then
    (`relf_jax.config.schema.SAVED_WITHOUT`), else as its current default."""
    defaults = {**dataclasses.asdict(ModelConfig()), **SAVED_WITHOUT}
    out = []
    for k, now in current.items():
        if k in RESUMABLE_MODEL_CHANGES:
            continue
        if k.startswith("flow_") and current.get("family") != "relf":
            continue  # the ReLF network's own switches build nothing in another family
        before = saved.get(k, defaults.get(k))
        if isinstance(before, list):
            before = tuple(before)
        if before != (tuple(now) if isinstance(now, list) else now):
            out.append((k, before, now))
    return out


def tokenizer_bytes_from_meta(meta: dict) -> Optional[bytes]:
    b64 = meta.get("tokenizer_b64")
    return base64.b64decode(b64) if b64 else None


def latest_meta(model_dir: str) -> dict:
    """The metadata of the newest readable checkpoint in `model_dir` (UserError if none)."""
    ckpt = Checkpointer(model_dir, async_save=False, read_only=True)
    for step in reversed(ckpt.steps()):
        try:
            return ckpt.read_meta(step)
        except Exception:  # noqa: BLE001 - unreadable: fall back to the previous one
            continue
    raise UserError(f"no checkpoint found in {os.path.join(os.path.abspath(model_dir), 'checkpoints')}; "
                    "train one first (relf-jax train ...)")


@dataclasses.dataclass
class LoadedModel:
    """A restored model: config, network (graphdef + params), tokenizer, checkpoint step.

    Produced by `relf_jax.loading.load_model` (relf_jax checkpoints) and by
    `relf_jax.export.hf.from_hf` / `relf_jax.export.safetensors_io.load_safetensors`.
    """

    cfg: Config
    model_cfg: ModelConfig
    graphdef: Any
    params: Any
    tokenizer: Any  # relf_jax.data.tokenizer.Tokenizer or HFTokenizer
    step: int
    model_dir: str = ""
    # arrays a family keeps beside its parameters, by name (ReLF: "flow.embeddings", the fixed
    # token embeddings); filled by `load_safetensors`, empty for checkpoints read from a run dir
    extras: dict = dataclasses.field(default_factory=dict)
    # the device mesh its parameters are placed on (`on_mesh`); None: one device
    mesh: Any = None

    def on_mesh(self, mesh) -> LoadedModel:
        """This model with its parameters (and extras) placed on `mesh` by their logical axes
        (`relf_jax.runtime.sharding.shard_params`): sampling, evaluation and the serving engines
        then run split over its devices (rows over data x fsdp, heads, MLP and vocabulary over
        tensor) and give the tokens they give on one device."""
        from relf_jax.runtime.sharding import put_on, replicated, shard_params

        extras = put_on(self.extras, jax.tree.map(lambda _: replicated(mesh), self.extras), mesh)
        return dataclasses.replace(self, params=shard_params(self.params, mesh), extras=extras, mesh=mesh)
