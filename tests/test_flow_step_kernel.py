"""Pallas flow-step kernel vs its plain-jnp reference (and the reference vs relf_jax.flow.singular's formulas).

Tolerance. The kernel and the reference evaluate the same float32 formulas; they differ only in
the summation order of the two matmuls and of the softmax normaliser (online, per vocabulary
tile, vs one global pass). x1_hat is a convex combination of embedding rows, so its rounding
error scales with max|E|, not with |x1_hat| (an entry can cancel to ~0): we check
|diff| <= 1e-5 * (|want| + max|E|). z_next = z + dt (x1_hat - z) / (1 - t) with dt <= 1 - t in
every case here, so its error is bounded by the same scale plus |z|.
Near t = 1 the logits are ~1e6 with gaps of the same order: the posterior is one-hot in both and
the online softmax must drop the earlier tiles exactly (exp(m_old - m_new) underflows to 0).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import flow_step as kf

B, L, V, D = 2, 5, 37, 8
BLOCKS = kf.BlockSizes(block_rows=4, block_v=16)  # B*L = 10 rows -> padded to 12; V 37 -> 48
RTOL = 1e-5


def _problem(seed, dtype, t, t_next, *, v=V, d=D, b=B, l=L):
    rng = np.random.default_rng(seed)
    e = rng.standard_normal((v, d)) / np.sqrt(d) * 2.0
    tokens = rng.integers(0, v, (b, l))
    tb = np.asarray(t, np.float64)
    tb = tb.reshape(tb.shape + (1,) * (3 - tb.ndim))  # scalar / [B] / [B, L] -> broadcasts
    z = tb * e[tokens] + (1.0 - tb) * rng.standard_normal((b, l, d))
    f = 3.0 * rng.standard_normal((b, l, v))
    cast = lambda x: jnp.asarray(x, dtype)
    return (cast(z), cast(f), jnp.asarray(e, jnp.float32), jnp.asarray(t, jnp.float32),
            jnp.asarray(t_next, jnp.float32))


_ref = jax.jit(kf.ref_flow_step, static_argnames=("c", "t_eps", "use_singular"))


def _assert_close(got, want, scale, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == np.float32 and got.shape == want.shape, what
    bound = RTOL * (np.abs(want) + scale)
    err = np.abs(got - want)
    assert np.all(err <= bound), f"{what}: max err {err.max()}, worst ratio {(err / bound).max()}"


class TestFlowStepKernel:
    """Compiled kernel vs reference; runs where a TPU/GPU is present."""

    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _needs_backend(self):
        if not self.INTERPRET and jax.default_backend() not in ("tpu", "gpu"):
            pytest.skip("the compiled kernel needs a TPU or GPU; see the interpret subclass")

    def _blocks(self, bs):
        """Interpret mode takes any tiles; compiled Triton needs powers of two >= 16 (tl.dot)."""
        if self.INTERPRET or jax.default_backend() != "gpu":
            return bs
        return kf.BlockSizes(max(16, bs.block_rows), max(16, bs.block_v))

    def _check(self, args, *, block_sizes=BLOCKS, **settings):
        want = _ref(*args, **settings)
        got = kf.flow_step(*args, block_sizes=self._blocks(block_sizes),
                           interpret=self.INTERPRET, **settings)
        z, e = np.asarray(args[0], np.float32), np.asarray(args[2])
        e_scale = np.abs(e).max()
        _assert_close(got[1], want[1], e_scale, f"x1_hat {settings}")
        _assert_close(got[0], want[0], e_scale + np.abs(z).max(), f"z_next {settings}")
        return want

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize("use_singular", [True, False])
    def test_matches_reference(self, dtype, use_singular):
        # Per-batch t (traced: one compilation for all), from noise to very near data.
        for seed, (t, t_next) in enumerate([([0.0, 0.1], [0.05, 0.2]), ([0.5, 0.3], [0.6, 0.45]),
                                            ([0.9, 0.999], [0.95, 1.0])]):
            args = _problem(seed, dtype, t, t_next)
            self._check(args, c=4.0, use_singular=use_singular)

    def test_near_one_is_one_hot_and_exact(self):
        # t = 0.999: logits ~ 1e6; z sits near its token's embedding, so the posterior is one-hot
        # on it and the flow lands on it. The max moves across tiles (tokens in every tile).
        args = _problem(3, jnp.float32, [0.999, 0.999], [1.0, 1.0])
        z_next, x1_hat = self._check(args, c=2.0)
        e = np.asarray(args[2])
        nearest = e[np.argmax(np.asarray(x1_hat) @ e.T, axis=-1)]
        np.testing.assert_allclose(np.asarray(x1_hat), nearest, rtol=0, atol=1e-6)
        np.testing.assert_allclose(np.asarray(z_next), nearest, rtol=0, atol=1e-5)

    def test_unbounded_residual_t_shapes_and_blocks(self):
        # c=None (f unbounded), scalar and [B, L] t, odd d (padded to 16), rows = 3*7 = 21.
        b, l, v, d = 3, 7, 21, 5
        args = _problem(5, jnp.float32, 0.4, 0.55, v=v, d=d, b=b, l=l)
        self._check(args, c=None, block_sizes=kf.BlockSizes(block_rows=8, block_v=8))
        t = np.random.default_rng(6).uniform(0.0, 0.99, (b, l))
        args = _problem(6, jnp.float32, t, np.minimum(t + 0.1, 1.0), v=v, d=d, b=b, l=l)
        self._check(args, c=3.0, block_sizes=kf.BlockSizes(block_rows=16, block_v=32))

    def test_single_token_vocabulary(self):
        args = _problem(7, jnp.float32, [0.2, 0.7], [0.3, 0.8], v=1)
        _, x1_hat = self._check(args, c=1.0)
        np.testing.assert_allclose(np.asarray(x1_hat),
                                   np.broadcast_to(np.asarray(args[2])[0], x1_hat.shape), atol=1e-6)

    def test_rejects_bad_inputs(self):
        z, f, e, t, t_next = _problem(0, jnp.float32, [0.1, 0.2], [0.2, 0.3])
        run = functools.partial(kf.flow_step, interpret=True, block_sizes=BLOCKS)
        with pytest.raises(ValueError, match="residual_logits"):
            run(z, f[..., :5], e, t, t_next, c=1.0)
        with pytest.raises(ValueError, match="embeddings"):
            run(z, f, e[:, :3], t, t_next, c=1.0)
        with pytest.raises(ValueError, match="vocabulary size"):
            run(z, f[..., :0], e[:0], t, t_next, c=1.0)
        with pytest.raises(ValueError, match="t_next"):
            run(z, f, e, t, t_next[:1], c=1.0)
        with pytest.raises(ValueError, match="floating"):
            run(z, f, e.astype(jnp.int32), t, t_next, c=1.0)
        with pytest.raises(ValueError, match="positive"):
            run(z, f, e, t, t_next, c=0.0)
        with pytest.raises(ValueError, match="block_v"):
            kf.BlockSizes(block_rows=4, block_v=0)


class TestFlowStepKernelInterpret(TestFlowStepKernel):
    INTERPRET = True


@pytest.mark.parametrize("c,use_singular", [(4.0, True), (None, True), (2.0, False), (3.0, None)])
def test_reference_composes_relf_flow_formulas(c, use_singular):
    """ref_flow_step == singular.posterior_logits -> softmax -> posterior_mean -> velocity, bit for
    bit (use_singular None here: no residual at all)."""
    from relf_jax.flow import singular

    def composed(z, t, t_next, f, e, *, c, use_singular):
        logits = singular.posterior_logits(z, t, e, f, c=c, use_singular=use_singular)
        x1_hat = singular.posterior_mean(jax.nn.softmax(logits, axis=-1), e)
        t_col, t_next_col = t[:, None, None], t_next[:, None, None]
        return z + (t_next_col - t_col) * singular.velocity(z, t, x1_hat), x1_hat

    no_residual = use_singular is None
    use_singular = True if no_residual else use_singular
    for seed, (t, t_next) in enumerate([([0.1, 0.6], [0.2, 0.7]), ([0.99, 0.9999], [1.0, 1.0])]):
        z, f, e, t, t_next = _problem(seed, jnp.float32, t, t_next)
        f = None if no_residual else f
        want = jax.jit(composed, static_argnames=("c", "use_singular"))(
            z, t, t_next, f, e, c=c, use_singular=use_singular)
        got = _ref(z, f, e, t, t_next, c=c, use_singular=use_singular)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


def test_sampler_dispatch_kernel_equals_reference():
    """The samplers' entry point gives the same step through the kernel (interpreted here)."""
    from relf_jax.flow.step import flow_step

    key = jax.random.key(0)
    k1, k2, k3 = jax.random.split(key, 3)
    z = jax.random.normal(k1, (2, 3, 4))
    f = jax.random.normal(k2, (2, 3, 19))
    emb = jax.random.normal(k3, (19, 4))
    t, t_next = jnp.asarray([0.3, 0.7]), jnp.asarray([0.4, 0.8])
    ref = flow_step(z, t, t_next, f, emb, c=5.0, use_kernel=False)
    ker = flow_step(z, t, t_next, f, emb, c=5.0, use_kernel=True)
    for a, b in zip(ref, ker):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_default_relf_samples_alike_through_the_kernel_and_the_reference(monkeypatch):
    """The default (context-reading) network on a segment row, self-conditioning and guidance on:
    the sampler gives the same tokens through the fused kernel (interpreted on CPU) as through
    the reference step."""
    import dataclasses

    from flax import nnx

    from kernels_pallas import dispatch
    from relf_jax.config import make_config
    from relf_jax.flow.generate import segment_residual
    from relf_jax.flow.samplers import FlowSamplerSettings, sample
    from relf_jax.models import build_model

    mc = dataclasses.replace(make_config("tiny", ["model=relf"]).model, vocab_size=V, flow_embed_dim=D)
    model = build_model(mc, nnx.Rngs(0))
    model.out[...] = 0.2 * jax.random.normal(jax.random.key(1), model.out.shape)
    model.out_emb[...] = 0.2 * jax.random.normal(jax.random.key(3), model.out_emb.shape)  # the default's tied head
    g, p = nnx.split(model)
    e = jnp.asarray(np.random.default_rng(0).standard_normal((V, D)), jnp.float32)
    seg = jnp.asarray([[1] * 5 + [0] * 2, [1] * 7], jnp.int32)
    residual = segment_residual(nnx.merge(g, p), seg, e)
    out = {}
    for kernel in (False, True):
        monkeypatch.setattr(dispatch, "runs_kernel", lambda name, override=None, k=kernel: k)
        st = FlowSamplerSettings(nfe=4, sampler="stochastic", c=5.0, guidance=1.7, renoise="marginal")
        out[kernel] = sample(jax.random.key(2), residual, e, st, batch=2, length=7)
    np.testing.assert_array_equal(np.asarray(out[False][0]), np.asarray(out[True][0]))
    np.testing.assert_allclose(np.asarray(out[False][1]), np.asarray(out[True][1]), atol=1e-4)
