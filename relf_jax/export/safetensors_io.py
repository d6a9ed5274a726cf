"""Any relf_jax model as one ``.safetensors`` file, and back, bit for bit.

The file holds every parameter under its flat name (`relf_jax.export.flat`), in its own dtype,
plus the arrays a family keeps beside its parameters (ReLF: ``flow.embeddings``, the fixed token
embeddings). The header metadata carries a small config: family, `ModelConfig`, the run `Config`,
the step and the tokenizer (base64), so the file alone rebuilds the model::

    save_safetensors(lm, "model.safetensors")
    lm2 = load_safetensors("model.safetensors")      # params equal bitwise
    import_safetensors("model.safetensors", "runs/imported")   # a checkpoint relf-jax commands read
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os

import numpy as np

from relf_jax.checkpoint import EMBEDDINGS_FILE, LoadedModel
from relf_jax.config import Config, saved_model_config
from relf_jax.data.tokenizer import tokenizer_from_bytes
from relf_jax.errors import UserError
from relf_jax.export.flat import flat_params, params_from_flat, save_checkpoint

FORMAT = "relf_jax/1"
EMBEDDINGS = "flow.embeddings"
LENGTHS = "flow.lengths"


def _extras_from_dir(lm: LoadedModel) -> dict[str, np.ndarray]:
    from relf_jax.checkpoint import LENGTHS_FILE

    extras = dict(lm.extras)
    path = os.path.join(lm.model_dir, EMBEDDINGS_FILE) if lm.model_dir else ""
    if lm.model_cfg.family == "relf" and EMBEDDINGS not in extras:
        if not (path and os.path.exists(path)):
            raise UserError(f"a ReLF model needs its fixed embeddings; {path or 'the model directory'} has none")
        extras[EMBEDDINGS] = np.load(path)
    lengths = os.path.join(lm.model_dir, LENGTHS_FILE) if lm.model_dir else ""
    if lm.model_cfg.family == "relf" and LENGTHS not in extras and lengths and os.path.exists(lengths):
        extras[LENGTHS] = np.load(lengths)  # a model trained on segment rows: its segment-length prior
    return extras


def save_safetensors(lm: LoadedModel, path: str) -> str:
    """Write `lm` (any family) to `path`; returns `path`."""
    from safetensors.numpy import save_file

    tensors = flat_params(lm.params)
    extras = _extras_from_dir(lm)
    for name, arr in extras.items():
        if name in tensors:
            raise UserError(f"extra array {name!r} collides with a parameter name")
        tensors[name] = np.asarray(arr)
    meta = {"format": FORMAT, "family": lm.model_cfg.family, "step": str(lm.step),
            "model": json.dumps(dataclasses.asdict(lm.model_cfg)), "config": lm.cfg.to_json(),
            "tokenizer": base64.b64encode(lm.tokenizer.to_bytes()).decode(),
            "extras": json.dumps(sorted(extras))}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file({n: np.ascontiguousarray(v) for n, v in tensors.items()}, path, metadata=meta)
    return path


def load_safetensors(path: str, *, mesh=None) -> LoadedModel:
    """Rebuild the model saved by `save_safetensors` (parameters placed on `mesh`)."""
    from safetensors import safe_open

    if not os.path.isfile(path):
        raise UserError(f"no such file: {path}")
    try:
        with safe_open(path, framework="flax") as f:
            meta = f.metadata() or {}
            tensors = {k: np.asarray(f.get_tensor(k)) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - the library raises several types for a bad file
        raise UserError(f"{path} is not a readable safetensors file ({type(e).__name__}: {e})") from None
    if meta.get("format") != FORMAT:
        raise UserError(f"{path} was not written by relf_jax (format {meta.get('format')!r}); for a HuggingFace "
                        "directory use from_hf / relf-jax import-hf")
    model_cfg = saved_model_config(json.loads(meta["model"]))
    cfg = Config.from_dict(json.loads(meta["config"]))
    extra_names = json.loads(meta.get("extras", "[]"))
    extras = {n: tensors.pop(n) for n in extra_names}
    graphdef, params = params_from_flat(model_cfg, tensors, mesh=mesh, what=f"the tensors in {path}")
    tok = tokenizer_from_bytes(base64.b64decode(meta["tokenizer"]))
    return LoadedModel(cfg=cfg, model_cfg=model_cfg, graphdef=graphdef, params=params, tokenizer=tok,
                       step=int(meta.get("step", 0)), extras=extras)


def import_safetensors(path: str, out: str, *, mesh=None) -> LoadedModel:
    """`load_safetensors`, then write a relf_jax checkpoint in ``<out>/<family>`` (plus ReLF's
    embeddings.npy) that `relf-jax sample --workdir out` and `relf_jax.loading.load_model` read."""
    lm = load_safetensors(path, mesh=mesh)
    model_dir = os.path.join(out, lm.model_cfg.family)
    os.makedirs(model_dir, exist_ok=True)
    if EMBEDDINGS in lm.extras:
        np.save(os.path.join(model_dir, EMBEDDINGS_FILE), lm.extras[EMBEDDINGS])
    if LENGTHS in lm.extras:
        from relf_jax.checkpoint import LENGTHS_FILE

        np.save(os.path.join(model_dir, LENGTHS_FILE), lm.extras[LENGTHS])
    lm = dataclasses.replace(lm, cfg=dataclasses.replace(lm.cfg, workdir=out), model_dir=model_dir)
    save_checkpoint(lm, model_dir, extra_meta={"source": f"safetensors:{os.path.abspath(path)}"})
    return lm
