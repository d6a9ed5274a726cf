"""`relf-jax bench flowstep`: the fused Pallas flow step vs its jnp reference."""

from __future__ import annotations

from collections.abc import Sequence

from experiments.bench.common import kernel_timing_text, kernel_vs_reference, write_kernel_report


def bench_flowstep(out: str, quick: bool = False, workdir: str | None = None, overrides: Sequence[str] = ()) -> dict:
    """Fused Pallas flow step vs the jnp reference, same inputs, one run: max |diff| and time.

    GPU/TPU: B=8, L=1024, V=32k, d=32 (bf16 residual logits). CPU (interpreted kernel, toy
    shapes with ``--quick``) checks agreement only.
    """
    import jax
    import jax.numpy as jnp

    from kernels_pallas import flow_step as kf

    del workdir, overrides
    backend = jax.default_backend()
    interpret = backend == "cpu"
    b, length, v, d = (2, 16, 300, 32) if quick or interpret else (8, 1024, 32768, 32)
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    emb = jax.random.normal(k1, (v, d))
    z = jax.random.normal(k2, (b, length, d))
    f = (3.0 * jax.random.normal(k3, (b, length, v))).astype(jnp.bfloat16)
    rows = []
    for t in (0.3, 0.9):
        tt, tn = jnp.full((b,), t), jnp.full((b,), t + 0.05)
        ref = jax.jit(lambda *a: kf.ref_flow_step(*a, c=10.0))
        ker = jax.jit(lambda *a: kf.flow_step(*a, c=10.0, interpret=interpret))
        args = (z, f, emb, tt, tn)
        r, k = jax.block_until_ready(ref(*args)), jax.block_until_ready(ker(*args))
        diff = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(r, k))
        row = {"t": t, "batch": b, "length": length, "vocab": v, "dim": d, "max_abs_diff": diff,
               **kernel_vs_reference(ref, ker, args, 3 if interpret else 20)}
        rows.append(row)
        print(f"[bench flowstep] {backend} t={t} B={b} L={length} V={v}: max|diff| {diff:.2e}  "
              f"{kernel_timing_text(row)}", flush=True)
    return write_kernel_report(out, rows, interpret)
