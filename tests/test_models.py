import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from relf_jax.models.causal_lm import init_cache
from relf_jax.models.layers import TransformerBlock, block_causal_mask, causal_mask


def _jitted(graphdef, params):
    """The model as one compiled function (eager op-by-op dispatch is slow on CPU)."""
    return jax.jit(lambda *a, **k: nnx.merge(graphdef, params)(*a, **k))


def test_kv_cache_decoding_equals_full_recompute(tiny_model, tiny_model_cfg):
    model = _jitted(*tiny_model)
    b, t = 3, 12
    toks = jax.random.randint(jax.random.key(1), (b, t), 0, tiny_model_cfg.vocab_size)
    full, _ = model(toks)
    # ragged prompts: rows start decoding at different lengths
    starts = np.array([2, 5, 7])
    cache = init_cache(tiny_model_cfg, b, 16)
    pos = jnp.broadcast_to(jnp.arange(7), (b, 7))
    logits, cache = model(toks[:, :7], pos, cache=cache, cache_index=jnp.zeros(b, jnp.int32))
    for r in range(b):
        np.testing.assert_allclose(logits[r, :starts[r]], full[r, :starts[r]], atol=1e-5)
    # continue one token at a time per row from its own length; garbage slots beyond are masked
    lengths = jnp.asarray(starts)
    for _ in range(t - 7):
        cur = jnp.take_along_axis(toks, lengths[:, None], axis=1)
        step_logits, cache = model(cur, lengths[:, None], cache=cache, cache_index=lengths)
        for r in range(b):
            np.testing.assert_allclose(step_logits[r, 0], full[r, int(lengths[r])], atol=1e-5)
        lengths = lengths + 1


def test_attend_len_skips_the_cache_tail_with_the_same_logits_and_cache(tiny_model, tiny_model_cfg):
    """`attend_len` attends to the first slots of a longer cache only: the same logits up to float
    rounding (the tail is masked anyway), and the keys/values are still written into the whole
    cache."""
    graphdef, params = tiny_model
    model = jax.jit(lambda *a, attend_len=None: nnx.merge(graphdef, params)(*a[:2], cache=a[2], cache_index=a[3],
                                                                            attend_len=attend_len),
                    static_argnames=("attend_len",))
    b, t = 2, 6
    toks = jax.random.randint(jax.random.key(2), (b, t), 0, tiny_model_cfg.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    zero = jnp.zeros(b, jnp.int32)
    cache = jax.tree.map(lambda x: x + 1.0, init_cache(tiny_model_cfg, b, 32))  # non-zero tail: must stay unseen
    want, want_cache = model(toks, pos, cache, zero)
    got, got_cache = model(toks, pos, cache, zero, attend_len=8)
    np.testing.assert_allclose(got, want, atol=1e-6)
    for x, y in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
        assert x.shape == y.shape == (b, tiny_model_cfg.num_kv_heads, 32, tiny_model_cfg.resolved_head_dim)
        np.testing.assert_allclose(x, y, atol=1e-6)
    # a span too short for the queries sees less than the causal mask allows: different logits
    short, _ = model(toks, pos, cache, zero, attend_len=3)
    assert not np.allclose(short[:, 3:], want[:, 3:], atol=1e-3)


def test_logits_at_gives_one_row_of_the_full_logits_and_the_same_cache(tiny_model, tiny_model_cfg):
    """`logits_at` (a prefill's last prompt position per row): the full logits at those positions,
    up to float rounding, as [B, 1, V]; the cache is the one the full call writes."""
    graphdef, params = tiny_model
    model = jax.jit(lambda toks, pos, cache, at: nnx.merge(graphdef, params)(
        toks, pos, cache=cache, cache_index=jnp.zeros(toks.shape[0], jnp.int32), attend_len=toks.shape[1],
        logits_at=at))
    b, t = 3, 8
    toks = jax.random.randint(jax.random.key(3), (b, t), 0, tiny_model_cfg.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    cache = init_cache(tiny_model_cfg, b, 16)
    want, want_cache = model(toks, pos, cache, None)
    at = jnp.array([7, 2, 4], jnp.int32)
    got, got_cache = model(toks, pos, cache, at)
    assert got.shape == (b, 1, tiny_model_cfg.vocab_size)
    np.testing.assert_allclose(got[:, 0], want[np.arange(b), np.asarray(at)], atol=1e-5)
    for x, y in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
        np.testing.assert_allclose(x, y, atol=1e-6)


def test_segment_mask_isolates_documents(tiny_model, tiny_model_cfg):
    model = _jitted(*tiny_model)
    a = jax.random.randint(jax.random.key(2), (1, 6), 0, tiny_model_cfg.vocab_size)
    c = jax.random.randint(jax.random.key(3), (1, 5), 0, tiny_model_cfg.vocab_size)
    packed = jnp.concatenate([a, c], axis=1)
    seg = jnp.asarray([[1] * 6 + [2] * 5])
    pos = jnp.asarray([list(range(6)) + list(range(5))])
    logits, _ = model(packed, pos, segment_ids=seg)
    alone, _ = model(c)
    np.testing.assert_allclose(logits[0, 6:], alone[0], atol=1e-5)


def test_masks():
    idx = jnp.arange(4)[None]
    np.testing.assert_array_equal(causal_mask(idx, idx)[0], np.tril(np.ones((4, 4), bool)))
    m = block_causal_mask(idx, idx, 2)[0]
    np.testing.assert_array_equal(m, np.array([[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]], bool))


def test_conditioned_block_starts_equal_to_unconditioned():
    kw = dict(d_model=16, num_heads=2, num_kv_heads=1, head_dim=8, mlp_dim=32)
    plain = TransformerBlock(**kw, rngs=nnx.Rngs(0))
    cond = TransformerBlock(**kw, cond_dim=4, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (2, 5, 16))
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    mask = causal_mask(pos, pos)
    run = nnx.jit(lambda blk, c: blk(x, pos, mask, cond=c)[0])
    y0 = run(plain, None)
    y1 = run(cond, jax.random.normal(jax.random.key(1), (2, 4)))
    np.testing.assert_allclose(y0, y1, atol=1e-6)
    # and the conditioning is live: a non-zero modulation changes the output
    cond.modulation[...] = jnp.ones_like(cond.modulation[...]) * 0.1
    y2 = run(cond, jnp.ones((2, 4)))
    assert float(jnp.abs(y2 - y0).max()) > 1e-3


def test_block_attending_to_a_context_equals_attention_over_the_concatenation():
    """A block's `context` (keys and values from another sequence, no output for it) computes,
    for its own positions, what the block computes on [context; x] with the same mask rows."""
    kw = dict(d_model=16, num_heads=2, num_kv_heads=2, head_dim=8, mlp_dim=32, cond_dim=4)
    blk = TransformerBlock(**kw, rngs=nnx.Rngs(0))
    blk.modulation[...] = 0.1 * jax.random.normal(jax.random.key(2), blk.modulation.shape)
    b, s, t = 2, 6, 4
    ctx, x = jax.random.normal(jax.random.key(0), (b, s, 16)), jax.random.normal(jax.random.key(1), (b, t, 16))
    ctx_pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    pos = jnp.broadcast_to(jnp.arange(t) + 1, (b, t))
    mask = jax.random.bernoulli(jax.random.key(3), 0.6, (b, t, s + t)).at[:, :, s:].set(jnp.eye(t, dtype=bool))
    cond = jax.random.normal(jax.random.key(4), (b, 4))
    y = nnx.jit(lambda blk: blk(x, pos, mask, cond=cond, context=(ctx, ctx_pos, cond))[0])(blk)
    full_mask = jnp.concatenate([jnp.ones((b, s, s + t), bool), mask], axis=1)
    full = nnx.jit(lambda blk: blk(jnp.concatenate([ctx, x], 1), jnp.concatenate([ctx_pos, pos], 1), full_mask,
                                   cond=cond)[0])(blk)
    np.testing.assert_allclose(y, full[:, s:], atol=1e-5)
    # the context is read: moving it moves the output
    y2 = nnx.jit(lambda blk: blk(x, pos, mask, cond=cond, context=(ctx + 1.0, ctx_pos, cond))[0])(blk)
    assert float(jnp.abs(y2 - y).max()) > 1e-3


def test_parameters_carry_logical_axes(tiny_model):
    _, params = tiny_model
    axes = [v.get_metadata().get("logical_axes") for v in jax.tree.leaves(
        params, is_leaf=lambda x: isinstance(x, nnx.Variable))]
    assert axes and all(a is not None for a in axes)


def test_out_in_weight_layout_computes_the_same_model(tiny_model_cfg):
    """`model.weight_layout=out_in` stores the dense weights [out, in] (permuted logical axes
    too); with the in_out model's weights moved over by `convert_layout` it gives the same logits,
    full and cached, the conversion goes back exactly, and HF export sees in_out weights."""
    import dataclasses

    import pytest

    from relf_jax.config import ConfigError, make_config
    from relf_jax.export.flat import flat_params, params_from_flat
    from relf_jax.export.hf_export import hf_tensors_from_params
    from relf_jax.models import build_model
    from relf_jax.models.layers import convert_layout

    cfg = dataclasses.replace(tiny_model_cfg, tie_embeddings=False, qkv_bias=True, num_kv_heads=1)
    ref_graph, ref_params = nnx.split(build_model(cfg, nnx.Rngs(3)))
    out_cfg = dataclasses.replace(cfg, weight_layout="out_in")
    flat = flat_params(ref_params)
    moved = convert_layout(flat, "in_out", "out_in")
    graph, params = params_from_flat(out_cfg, moved)
    d, h, dh, f = cfg.d_model, cfg.num_heads, cfg.resolved_head_dim, cfg.mlp_dim
    stored = {v.get_metadata()["logical_axes"]: v.shape for v in jax.tree.leaves(
        nnx.state(build_model(out_cfg, nnx.Rngs(0))), is_leaf=lambda x: isinstance(x, nnx.Variable))}
    assert stored[("heads", "head_dim", "embed")] == (h, dh, d)  # wq
    assert stored[("embed", "heads", "head_dim")] == (d, h, dh)  # wo
    assert stored[("mlp", "embed")] == (f, d) and stored[("embed", "mlp")] == (d, f)  # gate/up, down
    assert stored[("vocab", "embed")] == (cfg.vocab_size, d)  # the embedding and the untied head
    toks = jax.random.randint(jax.random.key(2), (2, 9), 0, cfg.vocab_size)
    ref, got = _jitted(ref_graph, ref_params), _jitted(graph, params)
    np.testing.assert_allclose(got(toks)[0], ref(toks)[0], atol=1e-5)
    pos = jnp.broadcast_to(jnp.arange(4, 9), (2, 5))  # a 5-token cached step (K = 4 verification)
    idx = jnp.full((2,), 4, jnp.int32)
    a = ref(toks[:, 4:], pos, cache=ref(toks[:, :4], cache=init_cache(cfg, 2, 12),
                                        cache_index=jnp.zeros(2, jnp.int32))[1], cache_index=idx)[0]
    b = got(toks[:, 4:], pos, cache=got(toks[:, :4], cache=init_cache(out_cfg, 2, 12),
                                        cache_index=jnp.zeros(2, jnp.int32))[1], cache_index=idx)[0]
    np.testing.assert_allclose(b, a, atol=1e-5)
    back = convert_layout(flat_params(params), "out_in", "in_out")
    assert all(np.array_equal(np.asarray(back[n]), np.asarray(flat[n])) for n in flat)
    hf_ref, hf_out = hf_tensors_from_params(cfg, flat), hf_tensors_from_params(out_cfg, flat_params(params))
    assert hf_ref.keys() == hf_out.keys() and all(np.array_equal(hf_ref[n], hf_out[n]) for n in hf_ref)
    with pytest.raises(ConfigError, match="weight_layout"):
        make_config("tiny", ["model.family=relf", "model.weight_layout=out_in"])
