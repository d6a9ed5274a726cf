"""The CPU small-matmul kernel (`kernels_cpu.small_matmul`, C++ through the XLA FFI): against
XLA's dot, bitwise across row counts, its gradient, the dispatch policy, the fallback where it
cannot be built, and a model step with the kernel on and off."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_cpu import small_matmul as sm
from kernels_pallas import dispatch

needs_kernel = pytest.mark.skipif(not sm.available(), reason=f"kernel not built: {sm.unavailable_reason()}")


def _operands(rows_shape, n=37, k=53, seed=0):
    # n and k off every vector width and row step, so the tails run too
    kx, kw = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (*rows_shape, k), jnp.float32), jax.random.normal(kw, (n, k), jnp.float32)


@needs_kernel
@pytest.mark.parametrize("rows_shape", [(1,), (2,), (5,), (8,), (1, 5), (2, 3), (2, 1, 4)])
def test_kernel_matches_xla_dot(rows_shape):
    x, w = _operands(rows_shape)
    got = jax.jit(sm.small_matmul)(x, w)
    assert got.shape == (*rows_shape, w.shape[0])
    np.testing.assert_allclose(got, sm.reference(x, w), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_rows_agree_bitwise_whatever_the_row_count():
    """Row i of an M-row product equals the 1-row product of row i exactly, for every M: a
    verification pass scores a token as the one-token step of the kernel would."""
    x, w = _operands((8,), n=70, k=300, seed=1)
    f = jax.jit(sm.small_matmul)
    ones = np.stack([np.asarray(f(x[i:i + 1], w))[0] for i in range(8)])
    for m in range(2, 9):
        np.testing.assert_array_equal(np.asarray(f(x[:m], w)), ones[:m])


@needs_kernel
def test_gradient_is_xla_dots_gradient():
    x, w = _operands((5,), seed=2)

    def loss(f):
        return lambda x, w: jnp.sum(jnp.tanh(f(x, w)))

    gx, gw = jax.jit(jax.grad(loss(sm.small_matmul), argnums=(0, 1)))(x, w)
    rx, rw = jax.grad(loss(sm.reference), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(gx, rx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gw, rw, rtol=1e-5, atol=1e-5)


def test_bad_operands_are_clear_errors():
    x, w = _operands((5,))
    with pytest.raises(ValueError, match="float32"):
        sm.small_matmul(x.astype(jnp.bfloat16), w)
    with pytest.raises(ValueError, match=r"\[out, in\]"):
        sm.small_matmul(x, w.T)
    with pytest.raises(ValueError, match="rows"):
        sm.small_matmul(jnp.zeros((9, w.shape[1])), w)


@needs_kernel
def test_dispatch_policy(monkeypatch):
    """2-8 float32 rows on one CPU device take the kernel; 1 row, 9 rows, bfloat16,
    RELF_JAX_FORCE_REFERENCE=1 and use_kernel=False take XLA's dot; use_kernel=True takes 1 row."""
    monkeypatch.delenv(dispatch.FORCE_REFERENCE_ENV, raising=False)
    x, w = _operands((9,))
    assert [dispatch.runs_small_matmul(x[:m], w) for m in (1, 2, 5, 8, 9)] == [False, True, True, True, False]
    assert not dispatch.runs_small_matmul(x[:5].astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    assert not dispatch.runs_small_matmul(x[:5], w, override=False)
    assert dispatch.runs_small_matmul(x[:1], w, override=True)
    monkeypatch.setenv(dispatch.FORCE_REFERENCE_ENV, "1")
    assert not dispatch.runs_small_matmul(x[:5], w)
    np.testing.assert_allclose(dispatch.small_matmul(x[:5], w), sm.reference(x[:5], w), rtol=1e-5, atol=1e-5)


def test_no_compiler_falls_back_to_xla(monkeypatch, tmp_path, caplog):
    """Without a compiler the kernel is unavailable, the reason is logged once, and dispatch takes
    XLA's dot (the model still runs)."""
    monkeypatch.setattr(sm, "_state", {})
    monkeypatch.setenv(sm.CXX_ENV, str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv(sm.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(dispatch.FORCE_REFERENCE_ENV, raising=False)
    with caplog.at_level("WARNING", logger=sm.__name__):
        assert not sm.available() and not sm.available()
    assert "no C++ compiler" in sm.unavailable_reason()
    assert sum("unavailable" in r.getMessage() for r in caplog.records) == 1
    x, w = _operands((5,))
    assert not dispatch.runs_small_matmul(x, w)
    np.testing.assert_array_equal(dispatch.small_matmul(x, w), sm.reference(x, w))
    with pytest.raises(RuntimeError, match="unavailable"):
        sm.small_matmul(x, w)


@needs_kernel
def test_builds_into_the_cache_once(monkeypatch, tmp_path):
    monkeypatch.setattr(sm, "_state", {})
    monkeypatch.setenv(sm.CACHE_ENV, str(tmp_path))
    assert sm.available()
    built = sorted(tmp_path.glob("small_matmul-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(sm, "_state", {})
    assert sm.available() and built[0].stat().st_mtime_ns == stamp  # reused, not rebuilt


@needs_kernel
def test_model_step_with_the_kernel_on_and_off(tiny_model_cfg, monkeypatch):
    """An out_in model's batch-1 5-token cached step (a K = 4 verification) gives the same logits
    through the kernel as through XLA's dot."""
    from flax import nnx

    from relf_jax.models import build_model
    from relf_jax.models.causal_lm import init_cache

    cfg = dataclasses.replace(tiny_model_cfg, weight_layout="out_in", tie_embeddings=False)
    graph, params = nnx.split(build_model(cfg, nnx.Rngs(4)))
    toks = jax.random.randint(jax.random.key(5), (1, 9), 0, cfg.vocab_size)

    def run():
        @jax.jit
        def step(params):
            model = nnx.merge(graph, params)
            cache = model(toks[:, :4], cache=init_cache(cfg, 1, 12), cache_index=jnp.zeros(1, jnp.int32))[1]
            return model(toks[:, 4:], jnp.arange(4, 9)[None], cache=cache, cache_index=jnp.full((1,), 4))[0]

        return step(params)

    monkeypatch.delenv(dispatch.FORCE_REFERENCE_ENV, raising=False)
    assert dispatch.runs_small_matmul(jnp.zeros((1, 5, cfg.d_model)), jnp.zeros((cfg.mlp_dim, cfg.d_model)))
    on = run()
    monkeypatch.setenv(dispatch.FORCE_REFERENCE_ENV, "1")
    np.testing.assert_allclose(on, run(), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_references_block_keeps_the_kernel_out_of_what_is_traced(monkeypatch):
    monkeypatch.delenv(dispatch.FORCE_REFERENCE_ENV, raising=False)
    x, w = _operands((5,))

    def hlo():  # a new function each time: jit reuses the trace of a function it has seen
        return jax.jit(lambda x, w: dispatch.small_matmul(x, w)).lower(x, w).as_text()

    assert sm.TARGET in hlo()
    with dispatch.references():
        assert sm.TARGET not in hlo()
    assert sm.TARGET in hlo()
