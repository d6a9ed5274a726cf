"""One fused ReLF flow step (posterior, its mean, Euler update) as a Pallas kernel, with its
plain-jnp reference.

Per position (methods.md section 1), with om = max(1 - t, t_eps):

    s_w     = ( t <z, E_w> - t^2 ||E_w||^2 / 2 ) / om^2        (0 when use_singular=False)
    logit_w = s_w + c tanh(f_w / c)                            (f_w itself when c is None)
    p       = softmax_w(logit)
    x1_hat  = sum_w p_w E_w
    z_next  = z + (t_next - t) (x1_hat - z) / om

all in float32. `ref_flow_step` is the one reference of this step (the samplers' CPU path, through
`kernels_pallas.dispatch`); it composes relf_jax.flow.singular's formulas operation for operation.

Kernel layout (flash-attention style): the B*L positions are flattened into rows; a grid over
tiles of `block_rows` rows; each program loops over the vocabulary in tiles of `block_v` with an
online softmax -- running max m [rows], running sum l [rows] and running weighted sum of
embedding rows acc [rows, d], all rescaled by exp(m_old - m_new) when the max moves -- so the
[B, L, V] posterior is never written to memory. x1_hat = acc / l at the end.

Padding: V is padded to a multiple of `block_v` (E with zero rows, f with zeros) and the padded
tokens' logits are set to -inf *by index* inside the kernel (a -inf f would not do: c tanh(-inf/c)
= -c is finite), so they get probability exactly 0. Rows are padded to a multiple of `block_rows`
with z = 0, f = 0, t = 0 (finite dummies, sliced off). d is padded with zeros to a power of two
>= 16 (Triton needs power-of-two loads and dot dimensions >= 16); zero columns change neither the
inner products, nor the norms, nor the real output columns.

Matmuls run at Precision.HIGHEST (IEEE float32 on GPU, not TF32): near t = 1 the logits reach
~1/t_eps^2 and a reduced-precision pass would scramble them. ||E_w||^2 is computed outside the
kernel with the reference's own expression, so the only rounding differences from the reference
are the summation orders of the two matmuls and of the softmax normaliser.

Memory: each program holds its rows' full f tile [block_rows, V] and all of E [V, d] as blocks and
slices them per vocabulary tile (Triton: pointers, loaded per tile). On TPU the whole E sits in
VMEM (d padded to 128 lanes): fine for small V, but at V = 32k it would need a 2-D grid with the
vocabulary as an "arbitrary" axis and scratch accumulators -- not implemented (untested here).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

DEFAULT_T_EPS = 1e-4
_HIGHEST = lax.Precision.HIGHEST
_MIN_DOT_DIM = 16  # Triton's tl.dot needs every dimension >= 16


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling of the flow-step kernel: `block_rows` flattened (batch, position) rows per program,
    vocabulary tiles of `block_v`. Use powers of two (Triton), >= 16 on GPU (tl.dot); on TPU a
    multiple of 8 rows and of 128 vocabulary entries."""

    block_rows: int = 32  # H200, B=8, L=1024, V=32000, d=32, bf16 f: 32x256 took 2.25 ms
    block_v: int = 256    # (reference 2.54 ms); 32x128 2.55, 16x128 3.60, 64x128 56 ms (spills)

    def __post_init__(self):
        for name in ("block_rows", "block_v"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"BlockSizes.{name} must be a positive int, got {value!r}")


def validate_inputs(z, residual_logits, embeddings, t, t_next, *, c=None,
                    t_eps: float = DEFAULT_T_EPS) -> tuple[int, int, int, int]:
    """Checks shapes, dtypes and settings; returns (B, L, V, d). Raises ValueError.

    z [B, L, d] and residual_logits [B, L, V] floating; embeddings [V, d] floating, V >= 1,
    d >= 1; t and t_next scalars, [B] or [B, L]; c None or > 0; t_eps > 0.
    """
    for name, x, ndim in (("z", z, 3), ("residual_logits", residual_logits, 3),
                          ("embeddings", embeddings, 2)):
        if jnp.ndim(x) != ndim:
            raise ValueError(f"{name} must have {ndim} dimensions, got shape {jnp.shape(x)}")
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            raise ValueError(f"{name} must be floating point, got {jnp.result_type(x)}")
    b, l, d = jnp.shape(z)
    v, d_e = jnp.shape(embeddings)
    if v < 1:
        raise ValueError(f"vocabulary size V must be >= 1, got embeddings {jnp.shape(embeddings)}")
    if d < 1:
        raise ValueError(f"embedding size d must be >= 1, got z {jnp.shape(z)}")
    if d_e != d:
        raise ValueError(f"embeddings must have shape (V, d) with d = {d} from z {jnp.shape(z)}, "
                         f"got {jnp.shape(embeddings)}")
    if jnp.shape(residual_logits) != (b, l, v):
        raise ValueError(f"residual_logits must have shape (B, L, V) = {(b, l, v)}, "
                         f"got {jnp.shape(residual_logits)}")
    for name, x in (("t", t), ("t_next", t_next)):
        if jnp.shape(x) not in ((), (b,), (b, l)):
            raise ValueError(f"{name} must be a scalar, [B] = ({b},) or [B, L] = ({b}, {l}), "
                             f"got shape {jnp.shape(x)}")
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            raise ValueError(f"{name} must be floating point, got {jnp.result_type(x)}")
    if c is not None and not c > 0:
        raise ValueError(f"residual bound c must be positive (or None = unbounded), got {c}")
    if not t_eps > 0:
        raise ValueError(f"t_eps must be positive, got {t_eps}")
    return b, l, v, d


# ----------------------------------------------------------------------------- reference


def _time(t, ndim: int) -> jax.Array:
    t = jnp.asarray(t, jnp.float32)
    return t.reshape(t.shape + (1,) * (ndim - t.ndim))


def _one_minus_t(t, t_eps: float) -> jax.Array:
    return jnp.maximum(1.0 - jnp.asarray(t, jnp.float32), jnp.float32(t_eps))


def _bounded(f: jax.Array, c: float | None) -> jax.Array:
    return f if c is None else c * jnp.tanh(f / c)


def ref_flow_step(z: jax.Array, residual_logits: jax.Array | None, embeddings: jax.Array, t, t_next, *,
                  c: float | None, t_eps: float = DEFAULT_T_EPS, use_singular: bool = True
                  ) -> tuple[jax.Array, jax.Array]:
    """The one plain-jnp flow step: relf_jax.flow.singular's posterior_logits -> softmax ->
    posterior_mean -> Euler update, operation for operation (kernels import no relf_jax).

    z [B, L, d], residual_logits [B, L, V] (any float dtype, cast to float32) or None (no
    residual), embeddings [V, d], t / t_next scalar, [B] or [B, L].
    Returns (z_next [B, L, d], x1_hat [B, L, d]) float32.
    """
    z = jnp.asarray(z, jnp.float32)
    e = jnp.asarray(embeddings, jnp.float32)
    tt = _time(t, z.ndim)
    if use_singular:
        inner = jnp.einsum("...d,vd->...v", z, e, precision=_HIGHEST)
        sq_norm = jnp.sum(e * e, axis=-1)
        logits = (tt * inner - 0.5 * tt * tt * sq_norm) / _one_minus_t(tt, t_eps) ** 2
    else:
        logits = jnp.zeros(z.shape[:-1] + (e.shape[0],), jnp.float32)
    if residual_logits is not None:
        if c is not None and not c > 0:
            raise ValueError(f"residual bound c must be positive, got {c}")
        logits = logits + _bounded(jnp.asarray(residual_logits, jnp.float32), c)
    probs = jax.nn.softmax(logits, axis=-1)
    x1_hat = jnp.einsum("...v,vd->...d", probs, e, precision=_HIGHEST)
    dt = _time(t_next, z.ndim) - tt
    v = (x1_hat - z) / _one_minus_t(tt, t_eps)
    return z + dt * v, x1_hat


# ----------------------------------------------------------------------------- kernel


def _flow_step_kernel(t_ref, dt_ref, sq_ref, z_ref, f_ref, e_ref, z_next_ref, x1_ref, *,
                      vocab: int, block_v: int, n_tiles: int, c: float | None, t_eps: float,
                      use_singular: bool):
    """One program: `rows` flattened positions. z_ref [rows, d], f_ref [rows, V_pad],
    e_ref [V_pad, d], sq_ref [V_pad] (||E_w||^2), t_ref / dt_ref [rows] (t, t_next - t)."""
    rows = z_ref.shape[0]
    z = z_ref[...].astype(jnp.float32)
    t = t_ref[...]
    om = jnp.maximum(1.0 - t, jnp.float32(t_eps))
    scale = (om * om)[:, None]  # om ** 2, as the reference
    t_col = t[:, None]

    def body(j, carry):
        m, l, acc = carry
        start = pl.multiple_of(j * block_v, block_v)
        cols = pl.ds(start, block_v)
        e = e_ref[cols, :].astype(jnp.float32)                   # [block_v, d]
        logits = _bounded(f_ref[:, cols].astype(jnp.float32), c)  # [rows, block_v]
        if use_singular:
            inner = lax.dot_general(z, e, (((1,), (1,)), ((), ())), precision=_HIGHEST,
                                    preferred_element_type=jnp.float32)
            sq = sq_ref[cols][None, :]
            logits = (t_col * inner - 0.5 * t_col * t_col * sq) / scale + logits
        ids = lax.broadcasted_iota(jnp.int32, (rows, block_v), 1) + start
        logits = jnp.where(ids < vocab, logits, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))
        # Guard: a row whose max is still -inf (cannot happen for real rows, V >= 1) gives 0s.
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(logits - m_safe[:, None])
        l = alpha * l + jnp.sum(p, axis=1)
        acc = alpha[:, None] * acc + jnp.dot(p, e, precision=_HIGHEST,
                                             preferred_element_type=jnp.float32)
        return m_new, l, acc

    init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros(z.shape, jnp.float32))
    _, l, acc = lax.fori_loop(0, n_tiles, body, init)
    x1 = acc / l[:, None]
    v = (x1 - z) / om[:, None]
    z_next_ref[...] = z + dt_ref[...][:, None] * v
    x1_ref[...] = x1


def _backend_options(interpret: bool, block_sizes: BlockSizes):
    """The one backend-specific place: compiler params for the grid over row tiles (and the
    block-size constraints of the compiled backends)."""
    if interpret:
        return None
    backend = jax.default_backend()
    if backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu
        return pltpu.CompilerParams(dimension_semantics=("parallel",))
    if backend in ("gpu", "cuda", "rocm"):
        from jax.experimental.pallas import triton as pltriton
        for name in ("block_rows", "block_v"):
            value = getattr(block_sizes, name)
            if value < _MIN_DOT_DIM or value & (value - 1):
                raise ValueError(f"on GPU BlockSizes.{name} must be a power of two >= "
                                 f"{_MIN_DOT_DIM} (Triton loads and dots), got {value}")
        return pltriton.CompilerParams(num_warps=4, num_stages=1)
    raise ValueError(f"no compiled Pallas flow-step kernel for backend {backend!r}: "
                     "use ref_flow_step, or interpret=True")


def _padded_dim(d: int) -> int:
    return max(_MIN_DOT_DIM, 1 << (d - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("c", "t_eps", "use_singular", "block_sizes",
                                             "interpret"))
def flow_step(z: jax.Array, residual_logits: jax.Array, embeddings: jax.Array, t, t_next, *,
              c: float | None, t_eps: float = DEFAULT_T_EPS, use_singular: bool = True,
              block_sizes: BlockSizes = BlockSizes(), interpret: bool = False
              ) -> tuple[jax.Array, jax.Array]:
    """The Pallas kernel; same arguments and results as `ref_flow_step`.

    c, t_eps, use_singular, block_sizes, interpret are static; t and t_next are traced.
    z and residual_logits stay in their dtype in memory and are cast to float32 per tile.
    Returns (z_next [B, L, d], x1_hat [B, L, d]) float32.
    """
    b, l, v, d = validate_inputs(z, residual_logits, embeddings, t, t_next, c=c, t_eps=t_eps)
    br, bv = block_sizes.block_rows, block_sizes.block_v
    n = b * l
    n_pad, v_pad, d_pad = pl.cdiv(n, br) * br, pl.cdiv(v, bv) * bv, _padded_dim(d)

    def per_row(x):  # scalar / [B] / [B, L] -> [N_pad] float32
        x = jnp.asarray(x, jnp.float32)
        x = jnp.broadcast_to(x.reshape(x.shape + (1,) * (2 - x.ndim)), (b, l)).reshape(n)
        return jnp.pad(x, (0, n_pad - n))

    t_rows = per_row(t)
    dt_rows = per_row(jnp.asarray(t_next, jnp.float32) - jnp.asarray(t, jnp.float32))
    e32 = jnp.asarray(embeddings, jnp.float32)
    sq = jnp.pad(jnp.sum(e32 * e32, axis=-1), (0, v_pad - v))  # the reference's expression
    e_in = jnp.pad(embeddings, ((0, v_pad - v), (0, d_pad - d)))
    z_in = jnp.pad(z.reshape(n, d), ((0, n_pad - n), (0, d_pad - d)))
    f_in = jnp.pad(residual_logits.reshape(n, v), ((0, n_pad - n), (0, v_pad - v)))

    rows_1d = pl.BlockSpec((br,), lambda i: (i,))
    rows_2d = lambda width: pl.BlockSpec((br, width), lambda i: (i, 0))
    out_shape = jax.ShapeDtypeStruct((n_pad, d_pad), jnp.float32)
    z_next, x1_hat = pl.pallas_call(
        functools.partial(_flow_step_kernel, vocab=v, block_v=bv, n_tiles=v_pad // bv, c=c,
                          t_eps=float(t_eps), use_singular=use_singular),
        out_shape=(out_shape, out_shape),
        grid=(n_pad // br,),
        in_specs=[rows_1d, rows_1d, pl.BlockSpec((v_pad,), lambda i: (0,)),
                  rows_2d(d_pad), rows_2d(v_pad), pl.BlockSpec((v_pad, d_pad), lambda i: (0, 0))],
        out_specs=(rows_2d(d_pad), rows_2d(d_pad)),
        compiler_params=_backend_options(interpret, block_sizes),
        interpret=interpret,
        name="relf_flow_step",
    )(t_rows, dt_rows, sq, z_in, f_in, e_in)
    return (z_next[:n, :d].reshape(b, l, d), x1_hat[:n, :d].reshape(b, l, d))
