"""The one kernel-or-reference switch: method folders call the kernels through this module.

Policy, per kernel, read at trace time:
- an explicit ``use_kernel=`` (True / False) wins;
- else ``RELF_JAX_FORCE_REFERENCE=1``, or tracing inside ``with references():``, forces the
  plain-jnp reference everywhere (`relf_jax.export` traces so: an artifact holds no custom call);
- else the kernel runs on the backends of `KERNEL_BACKENDS` (measured), the reference elsewhere.
A kernel asked for on CPU runs in Pallas interpret mode (tests).

- flow step: GPU and TPU (1.13x faster than the reference on an H200 at B=8, L=1024, V=32k);
- small_matmul (``x @ w.T`` for a float32 [out, in] weight and 2-8 rows: a CPU decode or
  verification step; `kernels_cpu.small_matmul`, C++ through the XLA FFI): CPU only, single
  device, and only where the kernel built (no compiler: XLA's dot). Measured: see that module.
- verify: TPU only. On GPU the kernel agrees bitwise with the reference but was measured 4-40x
  slower (H200, V=32k: benchmarks/h200/verify.json). The kernel has no top-k filter, so a
  top_k > 0 always takes the reference unless the kernel is asked for (which then raises).
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import jax
import jax.numpy as jnp

from kernels_cpu import small_matmul as small_matmul_kernel
from kernels_pallas import flow_step as flow_kernel
from kernels_pallas import verify as verify_kernel
from kernels_pallas import verify_ref

FORCE_REFERENCE_ENV = "RELF_JAX_FORCE_REFERENCE"
KERNEL_BACKENDS = {"flow_step": ("gpu", "tpu"), "verify": ("tpu",), "small_matmul": ("cpu",)}
SMALL_MATMUL_ROWS = (2, small_matmul_kernel.MAX_ROWS)  # at 1 row XLA's matrix-vector product is faster
RULES = verify_ref.RULES
validate_verify_inputs = verify_ref.validate_inputs  # (B, K, V) of verify's arguments, or ValueError


_REFERENCES = contextvars.ContextVar("relf_jax_kernels_references", default=False)


@contextlib.contextmanager
def references():
    """Within this block, what is traced takes the references (explicit ``use_kernel=`` aside).
    Like the environment switch, it acts on tracing: a jitted function traced before with the same
    arguments keeps its cached trace, so trace a fresh function here (as `relf_jax.export` does)."""
    token = _REFERENCES.set(True)
    try:
        yield
    finally:
        _REFERENCES.reset(token)


def runs_kernel(name: str, override: bool | None = None) -> bool:
    """Whether kernel `name` (a key of `KERNEL_BACKENDS`) runs: the policy of the module doc."""
    if override is not None:
        return override
    if _REFERENCES.get() or os.environ.get(FORCE_REFERENCE_ENV, "") not in ("", "0"):
        return False
    return jax.default_backend() in KERNEL_BACKENDS[name]


def runs_verify_kernel(override: bool | None, top_k: int) -> bool:
    """`runs_kernel` for verification: the kernel has no top-k, so top_k > 0 takes the reference
    unless the kernel is asked for explicitly."""
    return override if override is not None else (runs_kernel("verify") and not top_k)


def interpret() -> bool:
    """Pallas interpret mode: the only way a kernel runs on CPU."""
    return jax.default_backend() == "cpu"


def flow_step(z, residual_logits, embeddings, t, t_next, *, c, use_singular: bool = True,
              t_eps: float = flow_kernel.DEFAULT_T_EPS, use_kernel: bool | None = None):
    """One Euler flow step, (z_next, x1_hat) [B, L, d] float32: the fused kernel or
    `flow_step.ref_flow_step` (always the reference without a residual). Arguments as there."""
    if residual_logits is not None and runs_kernel("flow_step", use_kernel):
        return flow_kernel.flow_step(z, residual_logits, embeddings, t, t_next, c=c, t_eps=t_eps,
                                     use_singular=use_singular, interpret=interpret())
    return flow_kernel.ref_flow_step(z, residual_logits, embeddings, t, t_next, c=c, t_eps=t_eps,
                                     use_singular=use_singular)


def verify(target_logits, draft_logits, draft_tokens, uniforms, exponentials, *, rule: str, temperature,
           top_k: int, top_p, nsd_top_p, residual_floor, log_probs_fn, use_kernel: bool | None = None):
    """(num_accepted [B], next_token [B], accept [B, K]): the Pallas kernel or `ref_verify`
    (with `log_probs_fn` as its transform; top_p None leaves the filter out there and is 1 for
    the kernel). Arguments as `verify_ref.ref_verify`."""
    settings = {"rule": rule, "temperature": temperature, "top_k": top_k, "nsd_top_p": nsd_top_p,
                "residual_floor": residual_floor}
    if runs_verify_kernel(use_kernel, top_k):
        return verify_kernel.verify(target_logits, draft_logits, draft_tokens, uniforms, exponentials,
                                    interpret=interpret(), top_p=1.0 if top_p is None else top_p, **settings)
    return verify_ref.ref_verify(target_logits, draft_logits, draft_tokens, uniforms, exponentials,
                                 top_p=top_p, log_probs_fn=log_probs_fn, **settings)


def verify_sparse(target_logits, cand_ids, cand_logits, draft_tokens, uniforms, exponentials, **settings):
    """`verify_ref.ref_verify_sparse`: candidates have no kernel (the kernel takes vocabulary-wide
    draft logits), so this is always the reference."""
    return verify_ref.ref_verify_sparse(target_logits, cand_ids, cand_logits, draft_tokens, uniforms, exponentials,
                                        **settings)


def runs_small_matmul(x, w, override: bool | None = None) -> bool:
    """Whether `small_matmul` takes the kernel for these operands (static: shapes, dtypes, backend)."""
    rows = 1
    for n in x.shape[:-1]:
        rows *= n
    fits = (x.dtype == jnp.float32 and w.dtype == jnp.float32 and w.ndim == 2
            and 1 <= rows <= small_matmul_kernel.MAX_ROWS)
    if override is not None:
        return override and fits and small_matmul_kernel.available()
    return (fits and SMALL_MATMUL_ROWS[0] <= rows <= SMALL_MATMUL_ROWS[1] and runs_kernel("small_matmul")
            and jax.device_count() == 1 and small_matmul_kernel.available())


def small_matmul(x, w, *, use_kernel: bool | None = None):
    """``x @ w.T`` (x [..., in], w [out, in]): the CPU kernel where `runs_small_matmul`, else XLA's
    dot (`kernels_cpu.small_matmul.reference`). ``use_kernel=True`` takes the kernel for 1-8 float32
    rows when it built (1 row included), False never."""
    if runs_small_matmul(x, w, use_kernel):
        return small_matmul_kernel.small_matmul(x, w)
    return small_matmul_kernel.reference(x, w)
