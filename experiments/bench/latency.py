"""`relf-jax bench latency`: one reply's latency, AR with a KV cache vs ReLF at 16 NFE."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence

import numpy as np

from experiments.bench.common import find_row
from relf_jax.config import make_config
from relf_jax.io import write_json


def bench_latency(out: str, quick: bool = False, workdir: str | None = None, overrides: Sequence[str] = ()) -> dict:
    """Latency of one reply: AR with a KV cache (one forward per token) vs ReLF at 16 NFE
    (all positions in parallel), same preset and width, batch 1 and 64, in one run.

    Latency does not depend on the weights, so both models are freshly initialised: no data
    stack is needed (it runs on a bare accelerator machine). `--quick`: tiny preset, 64 tokens.
    """
    import jax
    from flax import nnx

    from relf_jax.flow.samplers import FlowSamplerSettings
    from relf_jax.flow.samplers import sample as flow_sample
    from relf_jax.models import build_model
    from relf_jax.sampling import autoregressive as ar

    del workdir
    preset = "tiny" if quick else "small"
    cfg = make_config(preset, list(overrides))
    length = 64 if quick else 1024
    vocab = 512 if quick else cfg.data.vocab_size
    rows, reps = [], 3
    for family in ("ar", "relf"):
        mcfg = dataclasses.replace(cfg.model, family=family, vocab_size=vocab, max_seq_len=max(length + 8, 128))
        graphdef, params = nnx.split(build_model(mcfg, nnx.Rngs(0)))
        for batch in (1, 64):
            if family == "ar":
                settings = ar.DecodeSettings(max_new_tokens=length, eos_id=-1)
                prompts, lens = ar.pad_prompts([[2]] * batch, bucket=8)
                sp = ar.TracedSampling.make(1.0)

                def run(key, _p=prompts, _l=lens, _s=settings, _sp=sp):
                    return ar.generate(graphdef, params, _p, _l, key, _sp, _s).tokens
                nfe = length
            else:
                table = jax.random.normal(jax.random.key(1), (vocab, mcfg.flow_embed_dim))
                fs = FlowSamplerSettings(nfe=16, sampler="euler")

                @jax.jit
                def relf(params, key, table, _b=batch):
                    return flow_sample(key, lambda z, t, sc: nnx.merge(graphdef, params)(z, sc, t), table, fs,
                                       batch=_b, length=length)[0]

                def run(key, _t=table):
                    return relf(params, key, _t)
                nfe = 16
            jax.block_until_ready(run(jax.random.key(0)))
            times = []
            for i in range(reps):
                t0 = time.perf_counter()
                jax.block_until_ready(run(jax.random.key(i + 1)))
                times.append(time.perf_counter() - t0)
            row = {"method": "ar (kv cache)" if family == "ar" else "relf euler", "nfe": nfe, "batch": batch,
                   "tokens": length, "latency_s": float(np.median(times))}
            rows.append(row)
            print(f"[bench latency] {jax.default_backend()} {preset} {row['method']:>14} B={batch:>2}: "
                  f"{row['latency_s'] * 1e3:9.1f} ms for {length} tokens", flush=True)
    ratio = {str(b): find_row(rows, method="ar (kv cache)", batch=b)["latency_s"]
             / find_row(rows, method="relf euler", batch=b)["latency_s"] for b in (1, 64)}
    report = {"backend": jax.default_backend(), "device": str(jax.devices()[0]), "preset": preset, "rows": rows,
              "latency_ratio_ar_over_relf16": ratio}
    write_json(out, report)
    print(json.dumps(ratio))
    return report
