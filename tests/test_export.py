"""safetensors round trips (AR and ReLF, bitwise) and the jax.export artifact run in a process
that never imports relf_jax."""

import dataclasses
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("safetensors")

from relf_jax.checkpoint import LoadedModel  # noqa: E402
from relf_jax.config import Config  # noqa: E402
from relf_jax.data.tokenizer import train_tokenizer  # noqa: E402
from relf_jax.errors import UserError  # noqa: E402
from relf_jax.export import jax_export, safetensors_io  # noqa: E402
from relf_jax.export.flat import flat_params  # noqa: E402
from relf_jax.models import build_model  # noqa: E402

TEXTS = [f"<user> hello number {i} <assistant> fine thanks {i % 7}" for i in range(120)]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(TEXTS, 64)


def _lm(tok, model_cfg, family="ar", seed=0):
    mcfg = dataclasses.replace(model_cfg, vocab_size=tok.vocab_size, family=family)
    graphdef, params = nnx.split(build_model(mcfg, nnx.Rngs(seed)))
    return LoadedModel(cfg=Config(), model_cfg=mcfg, graphdef=graphdef, params=params, tokenizer=tok, step=7)


def test_safetensors_round_trip_is_bitwise(tmp_path, tok, tiny_model_cfg):
    for family, extra in (("ar", {}), ("relf", {}), ("relf", {"flow_blind_spot": True})):
        lm = _lm(tok, dataclasses.replace(tiny_model_cfg, **extra), family)
        if family == "relf":
            table = np.random.default_rng(0).normal(size=(tok.vocab_size, lm.model_cfg.flow_embed_dim))
            lm = dataclasses.replace(lm, extras={"flow.embeddings": table.astype(np.float32)})
        path = safetensors_io.save_safetensors(lm, str(tmp_path / f"{family}{len(extra)}.safetensors"))
        back = safetensors_io.load_safetensors(path)
        assert back.model_cfg == lm.model_cfg and back.step == 7
        a, b = flat_params(lm.params), flat_params(back.params)
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k
        assert back.tokenizer.encode(TEXTS[3]) == tok.encode(TEXTS[3])
        if family == "relf":
            np.testing.assert_array_equal(back.extras["flow.embeddings"], lm.extras["flow.embeddings"])
    with pytest.raises(UserError, match="not a readable safetensors"):
        (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
        safetensors_io.load_safetensors(str(tmp_path / "junk.safetensors"))


def test_imported_safetensors_checkpoint_loads_as_a_trained_model(tmp_path, tok, tiny_model_cfg):
    from relf_jax.loading import load_model

    lm = _lm(tok, tiny_model_cfg)
    path = safetensors_io.save_safetensors(lm, str(tmp_path / "m.safetensors"))
    safetensors_io.import_safetensors(path, str(tmp_path / "run"))
    back = load_model(str(tmp_path / "run"))
    a, b = flat_params(lm.params), flat_params(back.params)
    assert all(a[k].tobytes() == b[k].tobytes() for k in a)


RUNNER = r"""
import json, sys
import jax, numpy as np
from safetensors.numpy import load_file
jax.config.update("jax_default_matmul_precision", "highest")
d, tokens, lengths, nxt = sys.argv[1], np.load(sys.argv[2]), np.load(sys.argv[3]), np.load(sys.argv[4])
m = json.load(open(f"{d}/manifest.json"))
prefill = jax.export.deserialize(bytearray(open(f"{d}/prefill.jax_export", "rb").read()))
decode = jax.export.deserialize(bytearray(open(f"{d}/decode.jax_export", "rb").read()))
params = load_file(f"{d}/params.safetensors")
last, cache = prefill.call(params, tokens, lengths)
step, cache = decode.call(params, nxt, lengths, cache)
assert not [k for k in sys.modules if k.startswith("relf_jax")], "the runner imported relf_jax"
np.save(sys.argv[5], np.stack([np.asarray(last), np.asarray(step)]))
"""


def test_jax_export_artifact_reproduces_decode_logits_without_relf_jax(tmp_path, tok, tiny_model_cfg):
    # out_in weights and 2 rows a decode step: on CPU the model would take the FFI small-matmul
    # kernel, which the export must leave out (a portable artifact holds no custom call)
    lm = _lm(tok, dataclasses.replace(tiny_model_cfg, weight_layout="out_in"), seed=1)
    out = jax_export.export_decode(lm, str(tmp_path / "art"), batch=2, prompt_len=8, max_len=16)
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    assert manifest["cache"]["k_shape"] == [2, lm.model_cfg.num_kv_heads, 16, lm.model_cfg.resolved_head_dim]
    rows = [[tok.bos_id] + tok.encode(t)[:7] for t in TEXTS[:2]]
    rows[1] = rows[1][:5]
    lengths = np.array([len(r) for r in rows], np.int32)
    tokens = np.zeros((2, 8), np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
    nxt = np.array([5, 9], np.int32)
    files = [str(tmp_path / f) for f in ("t.npy", "l.npy", "n.npy", "o.npy")]
    for f, a in zip(files, (tokens, lengths, nxt)):
        np.save(f, a)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-c", RUNNER, out, *files], check=True, env=env, cwd=str(tmp_path),
                   timeout=300)
    got = np.load(files[3])
    # reference: relf_jax's model on the full unpadded sequences (no cache)
    model = nnx.merge(lm.graphdef, lm.params)
    for i, r in enumerate(rows):
        logits, _ = model(jnp.asarray([r + [int(nxt[i])]]))
        np.testing.assert_allclose(got[0, i], np.asarray(logits[0, len(r) - 1]), atol=1e-4, rtol=0)
        np.testing.assert_allclose(got[1, i], np.asarray(logits[0, len(r)]), atol=1e-4, rtol=0)
    with pytest.raises(UserError, match="AR prefill/decode"):
        jax_export.export_decode(_lm(tok, tiny_model_cfg, "relf"), str(tmp_path / "x"))
