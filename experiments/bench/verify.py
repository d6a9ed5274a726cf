"""`relf-jax bench verify`: the Pallas verification kernel vs its jnp reference."""

from __future__ import annotations

from collections.abc import Sequence

from experiments.bench.common import kernel_timing_text, kernel_vs_reference, write_kernel_report


def bench_verify(out: str, quick: bool = False, workdir: str | None = None, overrides: Sequence[str] = ()) -> dict:
    """Pallas verification kernel vs the jnp reference: agreement and time, in one run.

    On a GPU/TPU the kernel is compiled (V = 32k, K = 4 and 8, B = 1, 8, 64); on a CPU it can
    only be interpreted, so ``--quick`` there checks agreement at toy shapes and its times say
    nothing about speed.
    """
    import jax
    import jax.numpy as jnp

    from kernels_pallas import verify as kv
    from relf_jax.sampling import processors

    del workdir, overrides
    backend = jax.default_backend()
    interpret = backend == "cpu"
    shapes = [(b, k, 512 if quick else 32768) for k in (4, 8) for b in ((1, 8) if quick else (1, 8, 64))]
    reps = 3 if quick else 20
    rows = []
    for b, k, v in shapes:
        rng = jax.random.key(b * 100 + k)
        k1, k2, k3, k4, k5 = jax.random.split(rng, 5)
        target = (2.0 * jax.random.normal(k1, (b, k + 1, v))).astype(jnp.bfloat16)
        draft = target[:, :k] + (0.5 * jax.random.normal(k2, (b, k, v))).astype(jnp.bfloat16)
        tokens = jax.random.categorical(k3, draft.astype(jnp.float32), axis=-1).astype(jnp.int32)
        u = jax.random.uniform(k4, (b, k))
        e = jax.random.exponential(k5, (b, v))
        for rule in ("standard", "nsd"):
            settings = dict(rule=rule, temperature=1.0, top_p=0.95, nsd_top_p=0.9)
            ref = jax.jit(lambda *a, s=settings: kv.ref_verify(*a, log_probs_fn=processors.log_probs, **s))
            ker = jax.jit(lambda *a, s=settings: kv.verify(*a, interpret=interpret, **s))
            args = (target, draft, tokens, u, e)
            r_out, k_out = jax.block_until_ready(ref(*args)), jax.block_until_ready(ker(*args))
            agree = all(bool(jnp.array_equal(x, y)) for x, y in zip(r_out, k_out))
            row = {"batch": b, "k": k, "vocab": v, "rule": rule, "agree": agree,
                   **kernel_vs_reference(ref, ker, args, reps)}
            rows.append(row)
            print(f"[bench verify] {backend} B={b:>2} K={k} V={v} {rule:>8}: agree={agree} "
                  f"{kernel_timing_text(row)}", flush=True)
    return write_kernel_report(out, rows, interpret)
