"""Rope scaling (HF rope_type linear / dynamic / llama3): the inverse frequencies equal
transformers' rope-init functions, imported models' logits equal transformers' past the original
context, greedy generation equals transformers', export keeps the settings, and every other
rope_type is refused by name."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from relf_jax.config import ConfigError, ModelConfig  # noqa: E402
from relf_jax.errors import UserError  # noqa: E402
from relf_jax.export import hf  # noqa: E402
from relf_jax.models.layers import Rope, rope_inv_freq  # noqa: E402
from tests.test_hf_interop import greedy_hf, greedy_ours, hf_logits, ours_logits, save_hf_folder  # noqa: E402

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
SCALINGS = {  # rope_type -> (rope parameters, max_position_embeddings)
    "llama3": (LLAMA3, 64),
    "linear": ({"rope_type": "linear", "factor": 4.0}, 64),
    "dynamic": ({"rope_type": "dynamic", "factor": 4.0}, 16),  # 16 = where the base starts to grow
}


def _hf_config(kind, head_dim=16, theta=5000.0, original=None):
    params, max_pos = SCALINGS[kind]
    if original is not None and "original_max_position_embeddings" in params:
        params, max_pos = {**params, "original_max_position_embeddings": original}, 4 * original
    return transformers.LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=head_dim, tie_word_embeddings=False, rms_norm_eps=1e-5,
        max_position_embeddings=max_pos, rope_parameters={**params, "rope_theta": theta},
        bos_token_id=2, eos_token_id=1, pad_token_id=0)


def _rope(kind, theta=5000.0, original=None):
    params, max_pos = SCALINGS[kind]
    if original is not None and "original_max_position_embeddings" in params:
        params = {**params, "original_max_position_embeddings": original}
    return Rope(theta=theta, scaling=kind, factor=params["factor"], low_freq_factor=params.get("low_freq_factor", 1.0),
                high_freq_factor=params.get("high_freq_factor", 4.0),
                original_max_len=params.get("original_max_position_embeddings", max_pos))


@pytest.mark.parametrize("kind", sorted(SCALINGS))
@pytest.mark.parametrize("dim", [16, 64])
def test_inv_freq_equals_transformers_rope_init(kind, dim):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = _hf_config(kind, head_dim=dim, theta=50000.0, original=64)
    rope = _rope(kind, theta=50000.0, original=64)
    lengths = [None, 8, 16, 17, 48, 1000] if kind == "dynamic" else [None]
    for n in lengths:
        theirs, scale = ROPE_INIT_FUNCTIONS[kind](cfg, None, seq_len=None if n is None else torch.tensor(n))
        assert scale == 1.0
        ours = np.asarray(rope_inv_freq(rope, dim, None if n is None else jnp.asarray(n)))
        np.testing.assert_allclose(ours, theirs.numpy(), rtol=2e-6, atol=0)  # a few float32 ulps (pow)
    # scaling changes the frequencies where it should: llama3 keeps the short wavelengths
    # (< 64 / 4), divides the long ones (> 64 / 1) by 8 and blends those between
    plain = np.asarray(rope_inv_freq(Rope(theta=50000.0), dim))
    ours = np.asarray(rope_inv_freq(rope, dim, None if kind != "dynamic" else jnp.asarray(48)))
    if kind == "llama3":
        wavelen = 2 * np.pi / plain
        short, long = wavelen < 16, wavelen > 64
        assert short.any() and long.any() and (~short & ~long).any()
        np.testing.assert_array_equal(ours[short], plain[short])
        np.testing.assert_allclose(ours[long], plain[long] / 8, rtol=1e-6)
        mid = ~short & ~long
        assert np.all((ours[mid] < plain[mid]) & (ours[mid] > plain[mid] / 8))
    else:
        assert np.all(ours[1:] < plain[1:])
    # a batch of lengths at once: one row per length
    if kind == "dynamic":
        both = np.asarray(rope_inv_freq(rope, dim, jnp.asarray([[10], [48]])))
        assert both.shape == (2, 1, dim // 2)
        np.testing.assert_array_equal(both[0, 0], plain)
        np.testing.assert_array_equal(both[1, 0], ours)


NOT_LINEAR = sorted(set(SCALINGS) - {"linear"})


@pytest.fixture(scope="module", params=sorted(SCALINGS))
def scaled_dir(request, tmp_path_factory):
    kind = request.param
    path, model = save_hf_folder(tmp_path_factory.mktemp("rope"), kind, transformers.LlamaForCausalLM, _hf_config(kind))
    return kind, path, model


def test_scaled_import_matches_transformers_past_the_original_context(scaled_dir):
    kind, path, model = scaled_dir
    lm = hf.from_hf(path)
    mc = lm.model_cfg
    assert mc.rope_scaling == kind and mc.rope_factor == SCALINGS[kind][0]["factor"]
    assert mc.rope_original_max_len == (0 if kind == "linear" else 16) and mc.max_seq_len == 64
    tokens = np.random.default_rng(0).integers(3, 61, size=(2, 48))
    tokens[:, 0] = 2
    ours = ours_logits(lm, tokens)
    np.testing.assert_allclose(ours, hf_logits(model, tokens), atol=1e-5, rtol=0)  # measured 1.2e-7
    # and the scaling matters at this length: plain RoPE would miss by 5x the tolerance or more
    import dataclasses

    from flax import nnx

    from relf_jax.models import build_model

    plain_cfg = dataclasses.replace(mc, rope_scaling="none")
    plain = nnx.merge(nnx.graphdef(build_model(plain_cfg, nnx.Rngs(0))), lm.params)
    assert np.abs(np.asarray(plain(jnp.asarray(tokens))[0]) - ours).max() > 5e-4  # measured 1e-3 .. 2.3e-3


# linear frequencies are static like llama3's: covered by the logits test
@pytest.mark.parametrize("scaled_dir", NOT_LINEAR, indirect=True)
def test_scaled_greedy_generation_equals_transformers(scaled_dir):
    """Cached decoding from a prompt past the original context: the AR sampler's greedy tokens
    equal transformers' generate (for dynamic too: prefill at the prompt's length, then one
    length per decode step, as transformers' cache does)."""
    kind, path, _ = scaled_dir
    lm = hf.from_hf(path)
    # a fresh transformers model: its dynamic rope keeps state from earlier calls
    model = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    prompts = np.random.default_rng(1).integers(3, 61, size=(2, 20))
    prompts[:, 0] = 2
    n = 24
    theirs = np.concatenate([greedy_hf(model, prompts[i:i + 1], n) for i in range(2)])
    np.testing.assert_array_equal(greedy_ours(lm, prompts, n), theirs)


# dynamic is the one whose frequencies depend on the call
@pytest.mark.parametrize("scaled_dir", ["dynamic"], indirect=True)
def test_speculative_verify_uses_the_same_rope_as_ar(scaled_dir):
    """The speculative loop builds the same CausalLM: greedy speculative decoding (prompt lookup)
    gives the AR sampler's tokens."""
    kind, path, _ = scaled_dir
    from relf_jax.sampling import autoregressive as ar
    from relf_jax.speculative import generate as spec

    lm = hf.from_hf(path)
    prompts = np.random.default_rng(1).integers(3, 61, size=(2, 20))
    prompts[:, 0] = 2
    arr, lens = ar.pad_prompts([list(r) for r in prompts], pad_id=0)
    settings = spec.SpecSettings(k=3, rule="greedy", proposer="prompt_lookup", max_new_tokens=20, eos_id=-1,
                                 pad_id=0)
    st = spec.generate(lm.graphdef, lm.params, arr, lens, jax.random.key(0), spec.SpecParams.make(0.0, 1.0, 0.9),
                       settings)
    got = np.asarray(st.tokens)[:, 20:40]
    np.testing.assert_array_equal(got, greedy_ours(lm, prompts, 20))


def test_export_writes_the_scaling_back(scaled_dir, tmp_path):
    kind, path, model = scaled_dir
    lm = hf.from_hf(path)
    out = hf.export_hf(lm, str(tmp_path / "out"))
    with open(f"{out}/config.json") as f:
        cfg = json.load(f)
    assert cfg["rope_parameters"]["rope_type"] == kind and cfg["rope_scaling"]["rope_type"] == kind
    assert cfg["max_position_embeddings"] == SCALINGS[kind][1]
    back = hf.from_hf(out)
    assert back.model_cfg == lm.model_cfg
    # fresh models both (transformers' dynamic rope keeps the longest length it has seen)
    again, orig = (transformers.LlamaForCausalLM.from_pretrained(p).eval() for p in (out, path))
    tokens = np.random.default_rng(2).integers(3, 61, size=(1, 40))
    np.testing.assert_allclose(hf_logits(again, tokens), hf_logits(orig, tokens), atol=1e-5, rtol=0)


def test_rope_config_spellings_and_refusals():
    base = {"model_type": "llama", "vocab_size": 61, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 64}
    # transformers < 5: rope_theta + rope_scaling ("type" or "rope_type"); >= 5: rope_parameters
    old = {**base, "rope_theta": 5e5, "rope_scaling": {**LLAMA3, "rope_type": None, "type": "llama3"}}
    new = {**base, "rope_parameters": {**LLAMA3, "rope_theta": 5e5}}
    a, b = hf.model_config_from_hf(old), hf.model_config_from_hf(new)
    assert a == b and a.rope_scaling == "llama3" and a.rope_theta == 5e5 and a.rope_high_freq_factor == 4.0
    lin = hf.model_config_from_hf({**base, "rope_scaling": {"type": "linear", "factor": 2}})
    assert (lin.rope_scaling, lin.rope_factor, lin.rope_theta) == ("linear", 2.0, 10000.0)
    dyn = hf.model_config_from_hf({**base, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    assert (dyn.rope_original_max_len, dyn.max_seq_len) == (64, 128)
    assert hf.model_config_from_hf({**base, "rope_scaling": None}).rope_scaling == "none"
    for kind in ("yarn", "longrope", "su", "mrope"):
        with pytest.raises(UserError, match=f"rope scaling '{kind}'"):
            hf.model_config_from_hf({**base, "rope_scaling": {"rope_type": kind, "factor": 4.0}})
    with pytest.raises(UserError, match="needs 'low_freq_factor'"):
        hf.model_config_from_hf({**base, "rope_parameters": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(UserError, match="factor >= 1"):
        hf.model_config_from_hf({**base, "rope_scaling": {"rope_type": "linear", "factor": 0.5}})
    with pytest.raises(UserError, match="partial_rotary_factor"):
        hf.model_config_from_hf({**base, "partial_rotary_factor": 0.5})


def test_model_config_rope_validation():
    from relf_jax.config import make_config

    cfg = make_config("tiny", ["model.rope_scaling=llama3", "model.rope_factor=8", "model.rope_original_max_len=32"])
    assert cfg.model.rope_scaling == "llama3"
    with pytest.raises(ConfigError, match="rope_original_max_len"):
        make_config("tiny", ["model.rope_scaling=dynamic", "model.rope_factor=2"])
    with pytest.raises(ConfigError, match="rope_high_freq_factor"):
        ModelConfig(rope_scaling="llama3", rope_factor=8, rope_original_max_len=8, rope_low_freq_factor=4.0,
                    rope_high_freq_factor=1.0).check_rope()
    with pytest.raises(ConfigError, match="not valid"):
        make_config("tiny", ["model.rope_scaling=yarn"])


@pytest.mark.parametrize("scaled_dir", NOT_LINEAR, indirect=True)  # linear is static like llama3
def test_jax_export_steps_use_the_scaled_rope(scaled_dir):
    """jax_export's prefill (a padded prompt) + decode steps: greedy tokens equal transformers'."""
    kind, path, _ = scaled_dir
    from relf_jax.export import jax_export
    from relf_jax.export.flat import flat_params

    lm = hf.from_hf(path)
    model = transformers.LlamaForCausalLM.from_pretrained(path).eval()  # fresh (dynamic rope state)
    prompt = np.random.default_rng(3).integers(3, 61, size=(1, 20))
    prompt[:, 0] = 2
    prefill, decode = (jax.jit(f) for f in jax_export.step_functions(lm.model_cfg, 64))
    params = {k: jnp.asarray(v) for k, v in flat_params(lm.params).items()}
    padded = np.zeros((1, 32), np.int32)
    padded[:, :20] = prompt  # padded past the prompt: the prefill's rope length is still 20
    logits, cache = prefill(params, jnp.asarray(padded), jnp.asarray([20], jnp.int32))
    fresh = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    np.testing.assert_allclose(np.asarray(logits)[0], hf_logits(fresh, prompt)[0, -1], atol=1e-5, rtol=0)
    got = []
    for pos in range(20, 36):
        tok = int(np.argmax(np.asarray(logits)[0]))
        got.append(tok)
        logits, cache = decode(params, jnp.asarray([tok], jnp.int32), jnp.asarray([pos], jnp.int32), cache)
    assert got == list(greedy_hf(model, prompt, 16)[0])


def test_rope_scaling_is_for_the_decoder_families():
    from relf_jax.config import make_config

    with pytest.raises(ConfigError, match="ar and bd families"):
        make_config("tiny", ["model.family=relf", "model.rope_scaling=linear", "model.rope_factor=2"])
    assert make_config("tiny", ["model.family=bd", "model.rope_scaling=linear", "model.rope_factor=2"])
