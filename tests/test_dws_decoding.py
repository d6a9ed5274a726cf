"""Block-diffusion network and confidence-threshold decoding."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from relf_jax.config import make_config
from relf_jax.dws import decoding as dec
from relf_jax.dws.surface import check_surface, empirical_surface
from relf_jax.models import build_model
from relf_jax.models.block_diffusion import decode_mask, training_mask
from relf_jax.sampling import block_diffusion as bds
from relf_jax.train.objectives import masked_diffusion_loss

V, D = 40, 4


@pytest.fixture(scope="module")
def bd():
    cfg = dataclasses.replace(make_config("tiny").model, family="bd", vocab_size=V, block_size=D)
    return cfg, nnx.split(build_model(cfg, nnx.Rngs(0)))


def settings(**kw):
    base = {"block_size": D, "max_blocks": 5, "mask_id": V, "pad_id": 0, "stop_ids": (1,), "threshold": 0.95}
    return bds.BlockDecodeSettings(**{**base, **kw})


def _logits(conf_rows):
    """Logits whose top probability at each position is the given confidence (token = position + 5)."""
    out = np.full((len(conf_rows), len(conf_rows[0]), V), -1e9, np.float32)
    for b, row in enumerate(conf_rows):
        for i, c in enumerate(row):
            out[b, i, i + 5] = np.log(c)
            out[b, i, 30] = np.log(1 - c)
    return jnp.asarray(out)


def test_commit_rule_on_hand_made_logits():
    logits = _logits([[0.99, 0.5, 0.97, 0.2],   # two above the threshold
                      [0.6, 0.9, 0.3, 0.7],     # none above: the single most confident masked one
                      [0.99, 0.99, 0.5, 0.8],   # the confident ones are already committed
                      [0.99, 0.99, 0.99, 0.99]])  # nothing masked
    masked = jnp.asarray([[1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 0]], bool)
    commit, tokens = bds.confidence_commit(logits, masked, 0.95)
    np.testing.assert_array_equal(np.asarray(commit), [[1, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 1], [0, 0, 0, 0]])
    np.testing.assert_array_equal(np.asarray(tokens)[0], [5, 6, 7, 30])  # argmax token (30 where c < 0.5)
    # exactly at the threshold is not above it
    commit, _ = bds.confidence_commit(_logits([[0.95, 0.96, 0.1, 0.1]]), jnp.ones((1, 4), bool), 0.95)
    np.testing.assert_array_equal(np.asarray(commit), [[0, 1, 0, 0]])


def test_sampled_tokens_follow_the_tempered_distribution():
    """With temperature > 0 the committed token is a sample of softmax(logits / T)."""
    p = np.asarray([0.5, 0.3, 0.2] + [0.0] * (V - 3))
    logits = jnp.log(jnp.asarray(np.broadcast_to(p, (4000, 1, V)) + 1e-30, jnp.float32))
    commit, tokens = bds.confidence_commit(logits, jnp.ones((4000, 1), bool), 0.95, temperature=1.0,
                                           key=jax.random.key(3))
    assert np.asarray(commit).all()  # the single masked position is always committed
    freq = np.bincount(np.asarray(tokens)[:, 0], minlength=3)[:3] / 4000
    np.testing.assert_allclose(freq, p[:3], atol=0.03)  # 4000 draws: std <= 0.008
    with pytest.raises(ValueError):
        bds.confidence_commit(logits, jnp.ones((4000, 1), bool), 0.95, temperature=1.0)


def test_training_mask_shape():
    m = np.asarray(training_mask(8, 4))
    # noisy query 5 (block 1): noisy keys 4..7, clean keys 0..3
    assert m[5, :8].tolist() == [0, 0, 0, 0, 1, 1, 1, 1] and m[5, 8:].tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    # clean query 2 (block 0): clean keys 0..3 only
    assert not m[8 + 2, :8].any() and m[8 + 2, 8:].tolist() == [1, 1, 1, 1, 0, 0, 0, 0]


def test_decode_forward_matches_training_pass(bd):
    """A block denoised against the KV cache of the clean text before it gives the training
    pass's logits: the cache, the masks and the refresh follow the BD3-LM training graph."""
    _cfg, (graphdef, params) = bd
    rng = np.random.default_rng(0)
    clean = jnp.asarray(rng.integers(4, V, (2, 12)), jnp.int32)
    noisy = jnp.where(jnp.asarray(rng.random((2, 12)) < 0.5), V, clean)
    s = settings()

    @jax.jit
    def both(p):
        model = nnx.merge(graphdef, p)
        want = model.training_logits(noisy, clean)[:, 8:12]
        # prefill the first 5 tokens, "commit" tokens 5..7 (block 1) and refresh, then denoise block 2
        cache = bds.prefill(model, clean[:, :8], jnp.asarray([5, 5]), 16, s)
        _, cache = bds.forward_block(model, cache, clean[:, 4:8], jnp.asarray([4, 4]), s)
        got, _ = bds.forward_block(model, cache, noisy[:, 8:12], jnp.asarray([8, 8]), s)
        return got, want

    got, want = both(params)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4)


def test_generate_invariants_and_instrumented_agree(bd):
    _, (graphdef, params) = bd
    prompts = [[2, 5, 6, 7, 8, 9], [2, 5, 6], [2, 5, 6, 7], [2]]
    s = settings(threshold=0.5)
    arr, plen = bds.pad_prompts(prompts, 0, D)
    st = jax.device_get(bds.generate(graphdef, params, arr, plen, s))
    outs = bds.outputs(st, plen)
    logs = []
    for i, p in enumerate(prompts):
        nb = int(st.num_blocks[i])
        steps = st.steps[i, :nb]
        cap = D - len(p) % D if len(p) % D else D
        assert 1 <= steps[0] <= cap  # the first block is capped by the prompt remainder
        assert all(1 <= x <= D for x in steps)
        assert (st.steps[i, nb:] == 0).all()
        # output length = the first block's capacity + whole blocks
        assert len(outs[i]) == cap + D * (nb - 1) or outs[i][-1] in s.stop_ids
        log = dec.decode_instrumented(graphdef, params, p, s)
        assert log.steps_per_block == steps.tolist()
        assert log.output == outs[i]
        assert len(log.step_s) == nb and [len(t) for t in log.step_s] == steps.tolist()
        assert log.total_s >= log.first_block_s >= log.prefill_s > 0
        logs.append(log)
    # the workload surface of the logged runs: invariants and its two sums
    surf = empirical_surface([lg.steps_per_block for lg in logs], s.max_blocks, D)
    assert check_surface(surf) == []
    assert surf.sum() == pytest.approx(np.mean([lg.total_steps for lg in logs]))
    assert surf[:, 0].sum() == pytest.approx(np.mean([lg.num_blocks for lg in logs]))


def test_stop_token_ends_decoding(bd):
    _, (graphdef, params) = bd
    prompts = [[2, 5, 6], [2, 7, 8, 9, 10]]
    arr, plen = bds.pad_prompts(prompts, 0, D)
    free = jax.device_get(bds.generate(graphdef, params, arr, plen, settings(stop_ids=(V - 1,), threshold=0.5)))
    assert (free.num_blocks == 5).all()  # nothing stops it: max_blocks
    first = bds.outputs(free, plen)[0]
    stop = first[2]  # make the third output token a stop token
    st = jax.device_get(bds.generate(graphdef, params, arr, plen, settings(stop_ids=(stop,), threshold=0.5)))
    out = bds.outputs(st, plen)[0]
    assert out[-1] == stop and stop not in out[:-1]
    assert out == first[: first.index(stop) + 1]
    assert st.num_blocks[0] == 1 + (first.index(stop) >= D - 3)


def test_masked_diffusion_loss_masks_and_grads(bd):
    _cfg, (graphdef, params) = bd
    rng = np.random.default_rng(1)
    batch = {"tokens": jnp.asarray(rng.integers(4, V, (3, 13)), jnp.int32),
             "segment_ids": jnp.ones((3, 13), jnp.int32)}

    def value(p):
        return masked_diffusion_loss(nnx.merge(graphdef, p), batch, jax.random.key(0))

    (loss, aux), grads = jax.jit(jax.value_and_grad(value, has_aux=True))(params)
    assert np.isfinite(float(loss)) and 0 < float(aux["tokens"]) < 3 * 12
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def test_bad_settings():
    with pytest.raises(ValueError):
        settings(threshold=1.5)
    with pytest.raises(ValueError):
        settings(temperature=-1.0)
    with pytest.raises(ValueError):
        settings(stop_ids=())
    with pytest.raises(ValueError):
        bds.pad_prompts([[]], 0, D)


def test_decode_mask_block_causal():
    m = np.asarray(decode_mask(jnp.asarray([[4, 5, 6, 7]]), 12, 4))
    assert m[0, 0].tolist() == [1] * 8 + [0] * 4


@pytest.mark.entry
def test_bd_cli_train_sample_eval(tmp_path, capsys):
    """`relf-jax train/sample/eval model=bd` end to end on a few-step tiny model."""
    from experiments.launch import main

    wd = str(tmp_path)
    assert main(["train", "--preset", "tiny", "--workdir", wd, "model=bd",
                 "model.block_size=4", "train.steps=4", "train.progress=false"]) == 0
    common = ["--workdir", wd, "model=bd", "sample.num_samples=2", "sample.batch_size=2", "sample.max_new_tokens=8"]
    assert main(["sample", *common, "--prompt", "<user> hello there <assistant>"]) == 0
    assert "tokens per forward" in capsys.readouterr().err
    assert main(["eval", *common, "--judge", "exact"]) == 0
    assert '"gen_ppl"' in capsys.readouterr().out


def test_decode_labels_cache(bd, tmp_path, monkeypatch):
    """Labels cached under a key of parameters, prompts and settings: a rerun reads them back, and
    other prompts or other parameters decode afresh."""
    from relf_jax.dws import workload

    _, (graphdef, params) = bd
    prompts = [[2, 5, 6, 7, 8, 9], [2, 5, 6], [2]]
    s = settings(threshold=0.5)
    first = workload.decode_labels(graphdef, params, prompts, s, batch_size=2, progress=False, cache_dir=str(tmp_path))
    files = list(tmp_path.glob("labels_*.json"))
    assert len(files) == 1
    assert first == workload.decode_labels(graphdef, params, prompts, s, batch_size=2, progress=False)

    calls = []
    monkeypatch.setattr(workload, "_decode_labels", lambda *a: calls.append(a) or ([[1]] * len(a[2]), [1] * len(a[2])))
    again = workload.decode_labels(graphdef, params, prompts, s, batch_size=2, progress=False, cache_dir=str(tmp_path))
    assert again == tuple(json.loads(files[0].read_text()).values()) == first and calls == []
    workload.decode_labels(graphdef, params, prompts[:2], s, batch_size=2, progress=False, cache_dir=str(tmp_path))
    other = jax.tree.map(lambda x: x + 1e-3, params)
    workload.decode_labels(graphdef, other, prompts, s, batch_size=2, progress=False, cache_dir=str(tmp_path))
    assert len(calls) == 2 and len(list(tmp_path.glob("labels_*.json"))) == 3
