"""RCSD building blocks: verification traces, the replay store and the RCSD loss."""

import dataclasses
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from relf_jax.models import build_model
from relf_jax.sampling import autoregressive as ar
from relf_jax.sampling import processors
from relf_jax.speculative import generate as spec
from relf_jax.speculative.rcsd import RCSDLossSettings, make_rcsd_loss, rcsd_terms
from relf_jax.speculative.replay import ReplayStore, ReplayWarning
from relf_jax.speculative.trace import examples_from_trace, in_nucleus

PROMPTS = [[2, 5, 6, 7, 5, 6], [2, 9], [2, 3, 4, 5, 6, 7, 8, 3, 4]]
TOP = 8


@pytest.fixture(scope="module")
def draft_model(tiny_model_cfg):
    cfg = dataclasses.replace(tiny_model_cfg, num_layers=1, d_model=16, num_heads=2, num_kv_heads=1, mlp_dim=32)
    return nnx.split(build_model(cfg, nnx.Rngs(7)))


def _generate(tiny_model, draft_model, rule, temperature, trace_top_k, key=3):
    tg, tp = tiny_model
    dg, dp = draft_model
    prompts, lens = ar.pad_prompts(PROMPTS)
    settings = spec.SpecSettings(k=3, rule=rule, max_new_tokens=10, eos_id=-1, trace_top_k=trace_top_k)
    state = spec.generate(tg, tp, prompts, lens, jax.random.key(key), spec.SpecParams.make(temperature), settings,
                          draft_graphdef=dg, draft_params=dp)
    return state, lens


@pytest.mark.parametrize("rule", ["greedy", "standard"])
def test_trace_is_what_the_loop_did(tiny_model, draft_model, rule):
    state, _ = _generate(tiny_model, draft_model, rule, 1.0, TOP)
    plain, _ = _generate(tiny_model, draft_model, rule, 1.0, 0)
    assert plain.trace == ()  # off: nothing recorded
    np.testing.assert_array_equal(np.asarray(state.tokens), np.asarray(plain.tokens))  # and nothing changed
    tr = jax.tree.map(np.asarray, state.trace)
    toks = np.asarray(state.tokens)
    k = tr.draft_tokens.shape[-1]
    committed = 0
    for r in range(int(state.rounds)):
        for b in range(len(PROMPTS)):
            if not tr.active[r, b]:
                continue
            n, c, start = tr.num_accepted[r, b], tr.count[r, b], tr.start[r, b]
            assert n == np.cumprod(tr.accept[r, b]).sum()  # num_accepted is the leading run of accepts
            if rule == "greedy":  # accept counts recomputed from the logged distributions
                assert np.array_equal(tr.accept[r, b], tr.draft_tokens[r, b] == tr.top_ids[r, b, :k, 0])
            emitted = [*tr.draft_tokens[r, b, :n], tr.next_token[r, b]][:c]
            assert toks[b, start:start + c].tolist() == [int(x) for x in emitted]
            committed += c
    assert committed == int(np.asarray(state.num_generated).sum()) - len(PROMPTS)  # prefill emits one each

    # the logged distributions are the target's, recomputed on the final sequences
    ex = examples_from_trace(state.tokens, state.lengths, state.trace)
    tg, tp = tiny_model
    s = toks.shape[1]
    temperature = 0.0 if rule == "greedy" else 1.0  # greedy: one-hot

    @jax.jit  # one program (op by op, the forward compiled each of its ops)
    def target_probs(params, tokens):
        logits, _ = nnx.merge(tg, params)(tokens, jnp.broadcast_to(jnp.arange(s), tokens.shape))
        return jnp.exp(processors.log_probs(logits, temperature))

    p = np.asarray(target_probs(tp, jnp.asarray(toks)))
    rows, cols = np.nonzero(ex["dist_mask"])
    assert len(rows) == committed
    for b, j in zip(rows, cols):
        np.testing.assert_allclose(ex["dist_probs"][b, j], p[b, j, ex["dist_ids"][b, j]], atol=1e-5)
    if rule == "standard":  # (the tiny random models agree on every greedy draft)
        assert ex["pref_mask"].sum() > 0
    for b, j in zip(*np.nonzero(ex["pref_mask"])):
        assert ex["chosen"][b, j] == toks[b, j + 1] and ex["rejected"][b, j] != ex["chosen"][b, j]


def test_in_nucleus_on_compressed_distributions():
    ids, probs = np.array([4, 1, 7]), np.array([0.5, 0.3, 0.15])
    assert in_nucleus(ids, probs, 4, 0.6) and in_nucleus(ids, probs, 1, 0.6)
    assert not in_nucleus(ids, probs, 7, 0.6)
    assert not in_nucleus(ids, probs, 9, 0.9)  # outside the logged top 3, whose mass 0.95 covers the nucleus
    assert not in_nucleus(ids, probs, 9, 0.99)  # below all logged tokens: judged outside


def _examples(n=3, s=6, top=2, seed=0):
    rng = np.random.default_rng(seed)
    return {"tokens": rng.integers(0, 61, (n, s)).astype(np.int32), "length": np.full(n, s, np.int32),
            "dist_ids": rng.integers(0, 61, (n, s, top)).astype(np.int32),
            "dist_probs": rng.random((n, s, top)).astype(np.float32) / top,
            "dist_mask": rng.random((n, s)) < 0.7, "pref_mask": rng.random((n, s)) < 0.3,
            "chosen": rng.integers(0, 61, (n, s)).astype(np.int32),
            "rejected": rng.integers(0, 61, (n, s)).astype(np.int32),
            "rejected_in_nucleus": rng.random((n, s)) < 0.3}


def test_replay_store_round_trip_and_torn_shards(tmp_path):
    store = ReplayStore(str(tmp_path / "replay"))
    a, b, c = _examples(seed=1), _examples(seed=2), _examples(seed=3)
    assert [store.append(x) for x in (a, b, c)] == [0, 1, 2]
    got = store.read(1)
    for key in a:
        np.testing.assert_array_equal(got[key], b[key])
    # a shard torn by something else (a partial copy), a corrupted one, and a stray temporary file
    path1 = Path(store.path) / "shard-00000001.npz"
    path1.write_bytes(path1.read_bytes()[: path1.stat().st_size // 2])
    path2 = Path(store.path) / "shard-00000002.npz"
    data = bytearray(path2.read_bytes())
    data[len(data) // 3] ^= 0xFF
    path2.write_bytes(bytes(data))
    (Path(store.path) / ".tmp-1-00000003.npz").write_bytes(b"partial")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        everything = store.read_all()
    assert sum(issubclass(w.category, ReplayWarning) for w in caught) == 2
    for key in a:
        np.testing.assert_array_equal(everything[key], a[key])  # only the intact shard
    assert store.append(a) == 3  # appending goes on after the damaged shards
    with pytest.raises(ValueError, match="lack"):
        store.append({"tokens": a["tokens"]})


def _logits(seed, shape=(3, 6, 61)):
    return jax.random.normal(jax.random.key(seed), shape) * 2.0


def test_rcsd_loss_terms_masks_and_gradients():
    batch = {k: jnp.asarray(v) for k, v in _examples(seed=4).items()}
    draft, ref = _logits(1), _logits(2)
    s = RCSDLossSettings(beta=0.5)
    terms = jax.jit(rcsd_terms, static_argnums=3)  # op by op, each call compiles ~15 small programs
    t = terms(draft, ref, batch, s)
    assert float(t["pairs"]) == float((batch["pref_mask"] & ~batch["rejected_in_nucleus"]).sum()) > 0
    # pure distillation when the preference weight is 0
    only = terms(draft, ref, batch, dataclasses.replace(s, pref_weight=0.0))
    assert float(only["loss"]) == pytest.approx(float(t["distill"]), rel=1e-6)

    def pref_grad(b):
        return jax.jit(jax.grad(lambda d, b: rcsd_terms(d, ref, b, s)["preference"]))(draft, b)

    g = pref_grad(batch)
    valid = np.asarray(batch["pref_mask"] & ~batch["rejected_in_nucleus"])
    norms = np.abs(np.asarray(g)).sum(-1)
    assert (norms[valid] > 0).all() and (norms[~valid] == 0).all()  # zero at masked positions
    # fully accepted rounds produce no pair: no preference gradient at all
    no_pairs = dict(batch, pref_mask=jnp.zeros_like(batch["pref_mask"]))
    assert float(jnp.abs(pref_grad(no_pairs)).max()) == 0.0
    # the draft equal to the reference: margin 0, loss log 2 per pair
    same = terms(ref, ref, batch, s)
    assert float(same["preference"]) == pytest.approx(np.log(2.0), rel=1e-6)
    # HASS-style top-K distillation is a different, finite objective
    hass = terms(draft, ref, batch, dataclasses.replace(s, distill="hass_topk"))
    assert np.isfinite(float(hass["distill"])) and float(hass["distill"]) != float(t["distill"])
    with pytest.raises(ValueError):
        RCSDLossSettings(distill="kl")


def test_rcsd_loss_in_the_train_loop_signature(tiny_model, draft_model):
    dg, dp = draft_model
    loss_fn = make_rcsd_loss(dg, RCSDLossSettings(kl_weight=0.1))
    batch = {k: jnp.asarray(v) for k, v in _examples(seed=5).items()}
    loss, aux = jax.jit(lambda p, b: loss_fn(nnx.merge(dg, p), b, jax.random.key(0), p))(dp, batch)
    assert np.isfinite(float(loss)) and float(aux["anchor"]) == pytest.approx(0.0, abs=1e-6)  # draft == reference
    assert float(aux["preference"]) == pytest.approx(np.log(2.0), rel=1e-5)
