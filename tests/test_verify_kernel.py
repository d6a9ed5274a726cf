"""Pallas verify kernel vs its plain-jnp reference: identical decisions for identical noise.

Inputs are continuous random logits, so no probability sits within float rounding of a top-p /
nucleus boundary (the only place where the kernel's bisection and the reference's sort could
disagree); bf16 logits do produce exact ties, which both sides treat alike.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import verify as kv
from relf_jax.sampling import processors

B, V = 3, 37
BLOCKS = kv.BlockSizes(block_b=1, block_v=16)  # V = 37 is not a multiple of 16: padded tiles
# (temperature, top_p, nsd_top_p): traced settings, so they share one compilation.
SETTINGS = [(1.0, 1.0, 0.9), (0.7, 0.8, 0.5), (1.3, 0.95, 0.95), (0.0, 0.9, 0.9),
            (1.0, 0.6, 1.0), (2.0, 1.0, 0.0)]


def _problem(seed, k, dtype):
    rng = np.random.default_rng(seed)
    target = 2.0 * rng.standard_normal((B, k + 1, V))
    draft = target[:, :k] + rng.standard_normal((B, k, V))
    draft[0] = target[0, :k]  # row 0: p == q, so the residual floor is exercised too
    # Draft tokens: mostly the draft's own favourites (accepts), some random ones (rejects).
    tokens = np.where(rng.random((B, k)) < 0.7, np.argmax(draft, -1), rng.integers(0, V, (B, k)))
    uniforms = rng.random((B, k))
    exponentials = rng.exponential(size=(B, V))
    return (jnp.asarray(target, dtype), jnp.asarray(draft, dtype), jnp.asarray(tokens, jnp.int32),
            jnp.asarray(uniforms, jnp.float32), jnp.asarray(exponentials, jnp.float32))


_ref = jax.jit(kv.ref_verify, static_argnames=("rule", "top_k"))


class TestVerifyKernel:
    """Compiled kernel vs reference; runs where a TPU/GPU is present."""

    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _needs_backend(self):
        if not self.INTERPRET and jax.default_backend() not in ("tpu", "gpu"):
            pytest.skip("the compiled kernel needs a TPU or GPU; see the interpret subclass")

    def _kernel(self, *args, **kwargs):
        kwargs.setdefault("block_sizes", BLOCKS)
        return kv.verify(*args, interpret=self.INTERPRET, **kwargs)

    @pytest.mark.parametrize("rule,k,dtype", [
        ("standard", 1, jnp.float32), ("standard", 4, jnp.float32), ("standard", 4, jnp.bfloat16),
        ("nsd", 1, jnp.bfloat16), ("nsd", 4, jnp.float32),
        ("greedy", 1, jnp.float32), ("greedy", 4, jnp.bfloat16)])
    def test_matches_reference(self, rule, k, dtype):
        seen_accepts = seen_rejects = 0
        for seed, (temperature, top_p, nsd_top_p) in enumerate(SETTINGS):
            args = _problem(seed, k, dtype)
            settings = {"rule": rule, "temperature": temperature, "top_p": top_p,
                        "nsd_top_p": nsd_top_p}
            want = _ref(*args, **settings)
            got = self._kernel(*args, **settings)
            for name, w, g in zip(("num_accepted", "next_token", "accept"), want, got):
                assert g.dtype == w.dtype, name
                np.testing.assert_array_equal(g, w, err_msg=f"{name} {settings}")
            seen_accepts += int(want[2].sum())
            seen_rejects += int((~want[2]).sum())
        assert seen_accepts and seen_rejects  # both branches were exercised

    def test_rows_padded_to_block_b(self):
        args = _problem(99, 2, jnp.float32)
        settings = {"rule": "nsd", "temperature": 0.9, "top_p": 0.85, "nsd_top_p": 0.7}
        got = self._kernel(*args, block_sizes=kv.BlockSizes(block_b=2, block_v=32), **settings)
        for w, g in zip(_ref(*args, **settings), got):
            np.testing.assert_array_equal(g, w)

    def test_rejects_top_k_and_bad_inputs(self):
        args = _problem(0, 1, jnp.float32)
        with pytest.raises(ValueError, match="top_k"):
            self._kernel(*args, top_k=5)
        with pytest.raises(ValueError, match="rule"):
            self._kernel(*args, rule="typical")
        with pytest.raises(ValueError, match="exponentials"):
            self._kernel(*args[:4], args[4][:, :5])
        with pytest.raises(ValueError, match="block_v"):
            kv.BlockSizes(block_b=1, block_v=0)


class TestVerifyKernelInterpret(TestVerifyKernel):
    INTERPRET = True


def test_reference_transform_mirrors_processors():
    """ref_verify's own transform is processors.log_probs / nucleus_mask, bit for bit."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(2.0 * rng.standard_normal((4, 5, 33)), jnp.float32)
    mirror, original = jax.jit(kv.ref_log_probs), jax.jit(processors.log_probs)
    for scale in (1.0, 40.0):  # 40: some probabilities underflow to 0
        for temperature, top_k, top_p in ((1.0, 0, 1.0), (0.7, 5, 0.9), (0.0, 0, 0.8),
                                          (1.3, 0, 0.3)):
            np.testing.assert_array_equal(mirror(scale * logits, temperature, top_k, top_p),
                                          original(scale * logits, temperature, top_k, top_p))
    probs = jax.nn.softmax(logits)
    np.testing.assert_array_equal(jax.jit(kv.ref_nucleus_mask)(probs, 0.7),
                                  jax.jit(processors.nucleus_mask)(probs, 0.7))


def test_wrapper_kernel_path_matches_reference_path():
    """relf_jax's verify: use_kernel=True (interpreted on CPU) == the reference path."""
    from relf_jax.speculative import verify

    target, draft, tokens, _, _ = _problem(7, 3, jnp.float32)
    key = jax.random.PRNGKey(0)
    settings = {"rule": "nsd", "temperature": 0.8, "top_p": 0.9, "nsd_top_p": 0.7}
    kernel = verify(target, draft, tokens, key, use_kernel=True, **settings)
    reference = verify(target, draft, tokens, key, use_kernel=False, **settings)
    for a, b in zip(jax.tree.leaves(kernel), jax.tree.leaves(reference)):
        np.testing.assert_array_equal(a, b)
