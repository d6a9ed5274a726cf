"""Shared transformer blocks (Flax NNX): RMSNorm, RoPE, SwiGLU, grouped-query attention.

Every parameter carries logical axis names as ``logical_axes`` metadata (see
`relf_jax.runtime.sharding`). Attention takes an explicit boolean mask, so the same block serves
causal LMs, bidirectional flow models and block-diffusion models; the mask helpers are here.
An optional conditioning vector (e.g. a flow time embedding) modulates the norms (adaLN,
zero-initialised so a fresh conditioned block equals an unconditioned one).

Shapes: B batch, T query length, S key length (cache size), D model width, H query heads,
K key/value heads, Dh head width, F MLP width.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from kernels_pallas import dispatch
from relf_jax.runtime.sharding import KV_CACHE_AXES, constrain

KVCache = tuple[tuple[jax.Array, jax.Array], ...]  # per layer (k, v): [B, K, S, Dh] each

# Up to this many queries, attention is an elementwise product + sum instead of a batched
# matmul: XLA:CPU runs the tiny per-row matmuls of decode steps ~3x slower (measured at B=8).
SMALL_QUERY = 8


def make_param(rngs: nnx.Rngs, init, shape: tuple[int, ...], axes: tuple[str | None, ...],
               dtype=jnp.float32) -> nnx.Param:
    """A parameter initialised by `init`, tagged with its logical axis names."""
    return nnx.Param(init(rngs.params(), shape, dtype), logical_axes=axes)


def _dense_init(fan_in: int):
    return jax.nn.initializers.normal(stddev=fan_in ** -0.5)


# How the dense weights of the transformer blocks (and an untied LM head) are stored:
# "in_out" ([in, out], ``x @ w``: relf_jax's layout) or "out_in" ([out, in], ``x @ w.T``:
# PyTorch's). They compute the same function; XLA:CPU compiles them to different kernels. Measured
# on a 2-core EPYC with a 32 MiB L3 (jax 0.10): a lone 4096 x 8192 float32 product, 1 row 5.3 ms
# "out_in" against 6.7 ms "in_out", 5 rows 1.57x one row against 2.49x; a 210 MB AR model
# (d 1024, 4 layers, alternating runs), the one-token cached step 8.2 ms against 9.2 ms and the
# 5-token one (verifying K = 4 drafts) 18.8 ms against 25.9 ms (`ModelConfig.weight_layout`).
WEIGHT_LAYOUTS = ("in_out", "out_in")

# out_in storage of each dense weight, as a permutation of its in_out axes
_OUT_IN_PERM = {"wq": (1, 2, 0), "wk": (1, 2, 0), "wv": (1, 2, 0), "wo": (2, 0, 1),
                "w_gate": (1, 0), "w_up": (1, 0), "w_down": (1, 0), "lm_head": (1, 0)}


def dense_shape(shape: tuple[int, ...], axes: tuple, name: str, layout: str) -> tuple[tuple[int, ...], tuple]:
    """The stored shape and logical axes of dense weight `name` (given in_out) in `layout`."""
    if layout == "in_out":
        return shape, axes
    perm = _OUT_IN_PERM[name]
    return tuple(shape[i] for i in perm), tuple(axes[i] for i in perm)


def convert_layout(flat: dict, src: str, dst: str) -> dict:
    """A flat ``{"blocks.0.attn.wq": array}`` parameter dict (numpy or jax arrays) with its dense
    weights moved from layout `src` to `dst` (`WEIGHT_LAYOUTS`); other entries unchanged."""
    if src not in WEIGHT_LAYOUTS or dst not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight layouts are {WEIGHT_LAYOUTS}, got {src!r} -> {dst!r}")
    if src == dst:
        return dict(flat)
    out = {}
    for name, value in flat.items():
        perm = _OUT_IN_PERM.get(name.rsplit(".", 1)[-1])
        if perm is not None and dst == "in_out":
            perm = tuple(perm.index(i) for i in range(len(perm)))  # the inverse permutation
        out[name] = value if perm is None else value.transpose(perm)
    return out


def dense(x: jax.Array, w: jax.Array, layout: str) -> jax.Array:
    """``x @ w`` for a [in, out] weight, or ``x @ w.T`` for a [out, in] one (through
    `kernels_pallas.dispatch.small_matmul`: on CPU, 2-8 float32 rows take a kernel whose cost
    follows the weight's bytes rather than the rows)."""
    return x @ w if layout == "in_out" else dispatch.small_matmul(x, w)


class RMSNorm(nnx.Module):
    """y = x / rms(x) * scale, computed in float32."""

    def __init__(self, dim: int, *, eps: float = 1e-6, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.eps = eps
        self.scale = make_param(rngs, jax.nn.initializers.ones, (dim,), ("embed",), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


ROPE_SCALINGS = ("none", "linear", "dynamic", "llama3")


@dataclasses.dataclass(frozen=True)
class Rope:
    """A rotary embedding's frequencies: plain RoPE (theta ** (-2i / Dh)) or one of HuggingFace's
    scalings, defined as transformers computes them (``modeling_rope_utils``):

    - ``linear``: every inverse frequency divided by `factor` (position interpolation);
    - ``llama3`` (Llama 3.1 / 3.2): wavelengths 2 pi / f longer than
      ``original_max_len / low_freq_factor`` divided by `factor`, shorter than
      ``original_max_len / high_freq_factor`` kept, and in between a blend with weight
      ``s = (original_max_len / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)``:
      ``(1 - s) f / factor + s f``;
    - ``dynamic`` (dynamic NTK): for a sequence of L > original_max_len tokens the base becomes
      ``theta * (factor L / original_max_len - (factor - 1)) ** (Dh / (Dh - 2))``; up to
      original_max_len it is plain RoPE. ``original_max_len`` is HF's ``max_position_embeddings``.
      Which L a forward pass uses: see `CausalLM` (``rope_len``) and `apply_rope`.

    None of the three rescales the attention (transformers' ``attention_factor`` is 1 for them).
    """

    theta: float = 10000.0
    scaling: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 0

    @classmethod
    def from_config(cls, cfg) -> "Rope":
        """The rope of a `relf_jax.config.ModelConfig` (its ``rope_*`` fields)."""
        return cls(theta=float(cfg.rope_theta), scaling=cfg.rope_scaling, factor=float(cfg.rope_factor),
                   low_freq_factor=float(cfg.rope_low_freq_factor), high_freq_factor=float(cfg.rope_high_freq_factor),
                   original_max_len=int(cfg.rope_original_max_len))

    @property
    def dynamic(self) -> bool:
        return self.scaling == "dynamic"


def rope_inv_freq(rope: Rope | float, dim: int, seq_len: jax.Array | int | None = None) -> jax.Array:
    """Inverse frequencies (float32) of a `dim`-wide rotary embedding: [dim // 2], or for a
    dynamic rope with `seq_len` (int array of any shape: the sequence length each entry was
    computed for) [*seq_len.shape, dim // 2]. `seq_len` None or <= original_max_len: plain RoPE."""
    if not isinstance(rope, Rope):
        rope = Rope(theta=float(rope))
    if rope.scaling not in ROPE_SCALINGS:
        raise ValueError(f"unknown rope scaling {rope.scaling!r}; choose one of {', '.join(ROPE_SCALINGS)}")
    exponent = jnp.arange(0, dim, 2, dtype=jnp.float32) / jnp.float32(dim)  # 2i / dim
    if rope.dynamic and seq_len is not None:
        if dim <= 2:
            raise ValueError("dynamic rope scaling needs a head width > 2")
        orig = jnp.float32(rope.original_max_len)
        length = jnp.maximum(jnp.asarray(seq_len).astype(jnp.float32), orig)
        base = jnp.float32(rope.theta) * ((jnp.float32(rope.factor) * length / orig) - jnp.float32(rope.factor - 1.0)
                                          ) ** jnp.float32(dim / (dim - 2))
        return 1.0 / (base[..., None] ** exponent)
    inv = 1.0 / (jnp.float32(rope.theta) ** exponent)
    if rope.scaling == "linear":
        inv = inv / jnp.float32(rope.factor)
    elif rope.scaling == "llama3":
        factor, low = jnp.float32(rope.factor), jnp.float32(rope.low_freq_factor)
        high = jnp.float32(rope.high_freq_factor)
        old = jnp.float32(rope.original_max_len)
        wavelen = jnp.float32(2 * math.pi) / inv
        scaled = jnp.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        inv = jnp.where(medium, blended, scaled)
    return inv


def apply_rope(x: jax.Array, positions: jax.Array, rope: Rope | float,
               seq_len: Optional[jax.Array] = None) -> jax.Array:
    """Rotary position embedding (rotate-half). x: [B, T, N, Dh], positions: [B, T] (int).

    `rope`: a `Rope` or a plain theta. `seq_len` (dynamic rope only; [B, T] or [B, 1] int): the
    sequence length whose frequencies each position is rotated with; None: each row's
    ``max(positions) + 1``, as transformers takes it for a forward pass.
    """
    if not isinstance(rope, Rope):
        rope = Rope(theta=float(rope))
    if rope.dynamic:
        if seq_len is None:
            seq_len = jnp.max(positions, axis=1, keepdims=True) + 1
        freq = rope_inv_freq(rope, x.shape[-1], seq_len)  # [B, T or 1, half]
    else:
        freq = rope_inv_freq(rope, x.shape[-1])
    angle = positions[..., None].astype(jnp.float32) * freq  # [B, T, half]
    sin, cos = jnp.sin(angle)[:, :, None, :], jnp.cos(angle)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


# ----------------------------------------------------------------------------- masks

def causal_mask(q_idx: jax.Array, k_idx: jax.Array, q_seg: Optional[jax.Array] = None,
                k_seg: Optional[jax.Array] = None) -> jax.Array:
    """[B, T, S] bool: key j visible to query i iff k_idx[j] <= q_idx[i] (and same segment)."""
    m = k_idx[:, None, :] <= q_idx[:, :, None]
    if q_seg is not None:
        m &= q_seg[:, :, None] == k_seg[:, None, :]
    return m


def bidirectional_mask(k_valid: jax.Array, num_queries: int) -> jax.Array:
    """[B, T, S] bool: every valid key visible to every query. k_valid: [B, S]."""
    return jnp.broadcast_to(k_valid[:, None, :], (k_valid.shape[0], num_queries, k_valid.shape[1]))


def block_causal_mask(q_idx: jax.Array, k_idx: jax.Array, block_size: int) -> jax.Array:
    """[B, T, S] bool: bidirectional inside a block, causal across blocks."""
    return (k_idx[:, None, :] // block_size) <= (q_idx[:, :, None] // block_size)


# ----------------------------------------------------------------------------- blocks

class Attention(nnx.Module):
    """Grouped-query attention with RoPE and an optional fixed-size KV cache.

    `rope` (a `Rope`, e.g. ``Rope.from_config(cfg)``) sets the rotary frequencies; without it,
    plain RoPE with `rope_theta`.
    """

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 rope_theta: float = 10000.0, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32,
                 qkv_bias: bool = False, rope: Optional[Rope] = None, layout: str = "in_out"):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layout = layout
        self.rope = rope if rope is not None else Rope(theta=float(rope_theta))
        self.dtype = dtype
        init = _dense_init(d_model)
        kv_axes = ("embed", "kv_heads", "head_dim")
        self.wq = make_param(rngs, init, *dense_shape((d_model, num_heads, head_dim), ("embed", "heads", "head_dim"),
                                                      "wq", layout), param_dtype)
        self.wk = make_param(rngs, init, *dense_shape((d_model, num_kv_heads, head_dim), kv_axes, "wk", layout),
                             param_dtype)
        self.wv = make_param(rngs, init, *dense_shape((d_model, num_kv_heads, head_dim), kv_axes, "wv", layout),
                             param_dtype)
        self.wo = make_param(rngs, _dense_init(num_heads * head_dim),
                             *dense_shape((num_heads, head_dim, d_model), ("heads", "head_dim", "embed"), "wo", layout),
                             param_dtype)
        self.qkv_bias = qkv_bias
        if qkv_bias:
            zeros = jax.nn.initializers.zeros
            self.bq = make_param(rngs, zeros, (num_heads, head_dim), ("heads", "head_dim"), param_dtype)
            self.bk = make_param(rngs, zeros, (num_kv_heads, head_dim), ("kv_heads", "head_dim"), param_dtype)
            self.bv = make_param(rngs, zeros, (num_kv_heads, head_dim), ("kv_heads", "head_dim"), param_dtype)

    def _project(self, x: jax.Array, weights, biases) -> list[jax.Array]:
        """x [B, T, D] through each [D, H, Dh] weight (``out_in``: stored [H, Dh, D]) -> [B, T, H, Dh]."""
        dt = self.dtype
        if self.layout == "in_out":
            out = [jnp.einsum("btd,dhk->bthk", x, w[...].astype(dt)) for w in weights]
        else:  # [H, Dh, D] as one [H * Dh, D] matrix: a 3-D contraction would make XLA:CPU transpose it
            out = [dense(x, w[...].astype(dt).reshape(-1, w.shape[-1]), "out_in").reshape(*x.shape[:2], *w.shape[:2])
                   for w in weights]
        if self.qkv_bias:
            out = [y + getattr(self, b)[...].astype(dt) for y, b in zip(out, biases)]
        return out

    def keys_values(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The keys (rotated) and values [B, K, S, Dh] this layer computes for inputs x [B, S, D] at
        `positions` [B, S]: what a cache holds, for attending to a sequence the queries do not come from."""
        k, v = self._project(x.astype(self.dtype), (self.wk, self.wv), ("bk", "bv"))
        return jnp.swapaxes(apply_rope(k, positions, self.rope), 1, 2), jnp.swapaxes(v, 1, 2)

    def __call__(self, x: jax.Array, positions: jax.Array, mask: jax.Array,
                 cache: Optional[tuple[jax.Array, jax.Array]] = None,
                 cache_index: Optional[jax.Array] = None, rope_len: Optional[jax.Array] = None):
        """x: [B, T, D]; positions: [B, T]; mask: [B, T, S] (S = T without cache); rope_len: a
        dynamic rope's sequence length per position (`apply_rope`'s seq_len).

        With a cache ([B, K, C, Dh] each), the new keys/values are written at slots
        ``cache_index[b] + arange(T)`` of each row before attending; returns (y, new_cache).
        A mask narrower than the cache (S < C) attends to its first S slots only.
        """
        dt = self.dtype
        x = x.astype(dt)
        q, k, v = self._project(x, (self.wq, self.wk, self.wv), ("bq", "bk", "bv"))
        q = apply_rope(q, positions, self.rope, rope_len)
        k = jnp.swapaxes(apply_rope(k, positions, self.rope, rope_len), 1, 2)  # [B, K, T, Dh]
        v = jnp.swapaxes(v, 1, 2)
        if cache is not None:
            write = jax.vmap(lambda c, u, i: jax.lax.dynamic_update_slice(c, u.astype(c.dtype), (0, i, 0)))
            k_all = constrain(write(cache[0], k, cache_index), KV_CACHE_AXES)
            v_all = constrain(write(cache[1], v, cache_index), KV_CACHE_AXES)
            cache = (k_all, v_all)
        else:
            k_all, v_all = k, v
        if mask.shape[-1] < k_all.shape[2]:  # attend to the first slots only (`CausalLM`'s attend_len)
            k_all, v_all = k_all[:, :, :mask.shape[-1]], v_all[:, :, :mask.shape[-1]]
        b, t, h, dh = q.shape
        g = h // self.num_kv_heads
        qg = jnp.moveaxis(q.reshape(b, t, self.num_kv_heads, g, dh), 1, 3).astype(jnp.float32)  # [B, K, G, T, Dh]
        k_all, v_all = k_all.astype(jnp.float32), v_all.astype(jnp.float32)
        kh, s_len = self.num_kv_heads, k_all.shape[2]
        if t <= SMALL_QUERY:
            q2, k2 = qg.reshape(b * kh, g * t, dh), k_all.reshape(b * kh, s_len, dh)
            if g * t == 1:
                scores = (q2 * k2).sum(-1).reshape(b, kh, g, t, s_len)
            else:
                scores = (q2[:, :, None, :] * k2[:, None, :, :]).sum(-1).reshape(b, kh, g, t, s_len)
        else:
            scores = jnp.einsum("bkgtd,bksd->bkgts", qg, k_all)
        scores = scores * (dh ** -0.5)
        scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1)
        if t <= SMALL_QUERY:
            p2, v2 = probs.reshape(b * kh, g * t, s_len), v_all.reshape(b * kh, s_len, dh)
            if g * t == 1:
                out = (p2.reshape(b * kh, s_len, 1) * v2).sum(-2).reshape(b, kh, g, t, dh)
            else:
                out = (p2[..., None] * v2[:, None, :, :]).sum(-2).reshape(b, kh, g, t, dh)
        else:
            out = jnp.einsum("bkgts,bksd->bkgtd", probs, v_all)
        out = jnp.moveaxis(out, 3, 1).astype(dt).reshape(b, t, h, dh)
        if self.layout == "in_out":
            y = jnp.einsum("bthk,hkd->btd", out, self.wo[...].astype(dt))
        else:
            y = dense(out.reshape(b, t, h * dh), self.wo[...].astype(dt).reshape(self.wo.shape[0], -1), "out_in")
        return y, cache


class SwiGLU(nnx.Module):
    """down(silu(x W_gate) * (x W_up))."""

    def __init__(self, d_model: int, mlp_dim: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32, layout: str = "in_out"):
        self.dtype, self.layout = dtype, layout
        up = dense_shape((d_model, mlp_dim), ("embed", "mlp"), "w_up", layout)
        self.w_gate = make_param(rngs, _dense_init(d_model), *up, param_dtype)
        self.w_up = make_param(rngs, _dense_init(d_model), *up, param_dtype)
        self.w_down = make_param(rngs, _dense_init(mlp_dim), *dense_shape((mlp_dim, d_model), ("mlp", "embed"),
                                                                          "w_down", layout), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        dt, lay = self.dtype, self.layout
        x = x.astype(dt)
        h = jax.nn.silu(dense(x, self.w_gate[...].astype(dt), lay)) * dense(x, self.w_up[...].astype(dt), lay)
        h = constrain(h, ("batch", "length", "mlp"))
        return dense(h, self.w_down[...].astype(dt), lay)


class TransformerBlock(nnx.Module):
    """Pre-norm block: x + attn(norm(x)); x + mlp(norm(x)).

    With ``cond_dim > 0`` the block takes a conditioning vector c [B, cond_dim] (or one per
    position, [B, L, cond_dim]) and modulates both norms, ``norm(x) * (1 + scale(c)) + shift(c)``,
    and scales both residual branches by ``1 + gate(c)`` (adaLN). The modulation starts at zero,
    so a fresh conditioned block computes exactly what an unconditioned one does.
    """

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, head_dim: int, mlp_dim: int, *,
                 rope_theta: float = 10000.0, norm_eps: float = 1e-6, cond_dim: int = 0,
                 rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32, qkv_bias: bool = False,
                 rope: Optional[Rope] = None, layout: str = "in_out"):
        self.attn_norm = RMSNorm(d_model, eps=norm_eps, rngs=rngs, param_dtype=param_dtype)
        self.attn = Attention(d_model, num_heads, num_kv_heads, head_dim, rope_theta=rope_theta,
                              rngs=rngs, dtype=dtype, param_dtype=param_dtype, qkv_bias=qkv_bias, rope=rope,
                              layout=layout)
        self.mlp_norm = RMSNorm(d_model, eps=norm_eps, rngs=rngs, param_dtype=param_dtype)
        self.mlp = SwiGLU(d_model, mlp_dim, rngs=rngs, dtype=dtype, param_dtype=param_dtype, layout=layout)
        self.cond_dim = cond_dim
        if cond_dim:
            self.modulation = make_param(rngs, jax.nn.initializers.zeros, (cond_dim, 6, d_model),
                                         (None, None, "embed"), param_dtype)

    def __call__(self, x: jax.Array, positions: jax.Array, mask: jax.Array, *,
                 cond: Optional[jax.Array] = None, cache=None, cache_index=None, rope_len=None,
                 context: Optional[tuple] = None):
        """`context` (x_ctx [B, S, D], positions [B, S], cond [B, cond_dim] or [B, S, cond_dim] or
        None): a further sequence the queries attend to (keys and values from this block's norm and
        projections, no output for it); `mask` is then [B, T, S + T], the context's S keys first."""
        if context is not None:
            if cache is not None:
                raise ValueError("a block attends to a context or to a cache, not both")
            x_ctx, ctx_pos, ctx_cond = context
            k_ctx, v_ctx = self.attn.keys_values(self._attn_input(x_ctx, ctx_cond)[0], ctx_pos)
            pad = ((0, 0), (0, 0), (0, x.shape[1]), (0, 0))
            cache = (jnp.pad(k_ctx, pad), jnp.pad(v_ctx, pad))
            cache_index = jnp.full((x.shape[0],), x_ctx.shape[1], jnp.int32)
        h, gates = self._attn_input(x, cond)
        a, cache = self.attn(h, positions, mask, cache, cache_index, rope_len)
        if context is not None:
            cache = None
        if self.cond_dim:
            gate1, shift2, scale2, gate2 = gates
            x = x + ((1 + gate1) * a).astype(x.dtype)
            h = self.mlp_norm(x) * (1 + scale2) + shift2
            x = x + ((1 + gate2) * self.mlp(h)).astype(x.dtype)
        else:
            x = x + a.astype(x.dtype)
            x = x + self.mlp(self.mlp_norm(x)).astype(x.dtype)
        return constrain(x, ("batch", "length", "embed")), cache

    def _attn_input(self, x: jax.Array, cond: Optional[jax.Array]):
        """(the attention's input, the rest of the modulation: gate1, shift2, scale2, gate2 or None)."""
        if not self.cond_dim:
            return self.attn_norm(x), None
        if cond is None:
            raise ValueError("this block was built with cond_dim > 0 and needs `cond`")
        c = cond.astype(jnp.float32)
        c = c[:, None, :] if c.ndim == 2 else c  # [B, 1 or L, cond_dim]
        mod = jnp.einsum("blc,cmd->blmd", c, self.modulation[...].astype(jnp.float32))
        shift1, scale1, gate1, shift2, scale2, gate2 = [mod[:, :, i, :] for i in range(6)]
        return self.attn_norm(x) * (1 + scale1) + shift1, (gate1, shift2, scale2, gate2)


def decoder_stack(cfg, *, rngs: nnx.Rngs, dtype, param_dtype) -> nnx.List:
    """``cfg.num_layers`` unconditioned pre-norm blocks of a `ModelConfig`'s shape (causal and
    block-diffusion LMs; the mask passed at call time decides causal or block-causal)."""
    return nnx.List([
        TransformerBlock(cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim, cfg.mlp_dim,
                         rope=Rope.from_config(cfg), norm_eps=cfg.norm_eps, rngs=rngs,
                         dtype=dtype, param_dtype=param_dtype, qkv_bias=cfg.qkv_bias, layout=cfg.weight_layout)
        for _ in range(cfg.num_layers)
    ])
