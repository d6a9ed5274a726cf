"""What each ReLF network variant of `relf-jax bench relf --parts core` costs on this machine: a
network forward at the sampler's shape and a training step's forward and backward, for random-weight
networks of the preset's shape, timed round-robin in one process and reported over the default's.

The core bench compares variants at equal optimizer steps; this is the other half of a trade-off
(docs/relf.md: the query variant's 1.4-1.6x forward)::

    python -c "from experiments.bench.relf_cost import variant_costs; \\
        variant_costs('benchmarks/relf/query_cost_probe.json', ('relf', 'query', 'query_gqa', 'full_kv'))"
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.bench.relf_variants import CORE_VARIANTS
from relf_jax.config import make_config
from relf_jax.errors import UserError
from relf_jax.io import write_json
from relf_jax.models.flow_lm import FlowLM


def variant_costs(out: str | None, variants: Sequence[str] = ("relf", "query"), preset: str = "cpu",
                  vocab: int = 512, sample_batch: int = 8, train_batch: int | None = None, reps: int = 7,
                  calls: int = 3) -> dict:
    """Median ms of one jitted network forward ([sample_batch, seq_len] noisy embeddings, as a
    sampler step calls it) and one gradient of a loss on the residual logits ([train_batch,
    seq_len], the preset's train.batch_size by default), per variant of `CORE_VARIANTS`, each
    timed `calls` times in a row per round, `reps` rounds with the variants in turn; and each over
    the first variant's. Written to `out` (JSON) when given."""
    unknown = sorted(set(variants) - set(CORE_VARIANTS))
    if unknown:
        raise UserError(f"variants must be among {', '.join(CORE_VARIANTS)}; got {unknown}")
    fns = {}
    for name in variants:
        cfg = make_config(preset, ["model=relf", *CORE_VARIANTS[name]])
        model_cfg = dataclasses.replace(cfg.model, vocab_size=vocab, flow_blind_spot=cfg.flow.blind_spot)
        graphdef, params = nnx.split(FlowLM(model_cfg, rngs=nnx.Rngs(0)))
        table = jnp.asarray(np.random.default_rng(0).standard_normal((vocab, model_cfg.flow_embed_dim)), jnp.float32)

        def net(p, z, sc, t, g=graphdef, e=table):
            return nnx.merge(g, p)(z, sc, t, embeddings=e)

        fns[name] = {"forward": (jax.jit(lambda p, z, sc, t, f=net: f(p, z, sc, t).sum()), sample_batch),
                     "train_step": (jax.jit(jax.grad(lambda p, z, sc, t, f=net: (f(p, z, sc, t) ** 2).mean())),
                                    train_batch or cfg.train.batch_size),
                     "params": params, "dims": (cfg.data.seq_len, model_cfg.flow_embed_dim)}
    rng = np.random.default_rng(1)
    times: dict[str, dict[str, list[float]]] = {n: {"forward": [], "train_step": []} for n in variants}
    for _ in range(reps):
        for name in variants:
            f = fns[name]
            length, d_emb = f["dims"]
            for what in ("forward", "train_step"):
                fn, batch = f[what]
                z, sc = (jnp.asarray(rng.standard_normal((batch, length, d_emb)), jnp.float32) for _ in range(2))
                args = (f["params"], z, sc, jnp.full((batch,), 0.5, jnp.float32))
                jax.block_until_ready(fn(*args))
                t0 = time.perf_counter()
                for _ in range(calls):
                    jax.block_until_ready(fn(*args))
                times[name][what].append(1e3 * (time.perf_counter() - t0) / calls)
    base = variants[0]
    report = {"preset": preset, "vocab": vocab, "sample_batch": sample_batch,
              "train_batch": train_batch or make_config(preset).train.batch_size, "reps": reps, "rows": []}
    for name in variants:
        row = {"variant": name, "overrides": CORE_VARIANTS[name]}
        for what in ("forward", "train_step"):
            row[f"{what}_ms"] = float(np.median(times[name][what]))
            row[f"{what}_over_{base}"] = row[f"{what}_ms"] / float(np.median(times[base][what]))
        report["rows"].append(row)
        print(f"[bench relf cost] {name:>10}: forward {row['forward_ms']:8.2f} ms (x{row[f'forward_over_{base}']:.2f})"
              f"  training step {row['train_step_ms']:8.2f} ms (x{row[f'train_step_over_{base}']:.2f})", flush=True)
    if out:
        write_json(out, report)
    return report
