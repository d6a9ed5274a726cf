"""Samplers and serving engines on 8 simulated devices, split over four meshes, against one device.

Run as ``python -m tests._sharded_checks samplers|engines`` (tests/test_sharded_sampling.py
does, in a fresh process: the device count is fixed when JAX starts). Prints one JSON object:
per mesh the tokens of every sampler / engine, the largest logit difference, and how the
parameters and KV caches are laid out; the test compares them with the one-device run.
"""

import dataclasses
import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402 - after the device count is set
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from relf_jax import api  # noqa: E402
from relf_jax.methods import (  # noqa: E402
    Autoregressive,
    BlockDiffusion,
    DraftModel,
    Flow,
    SamplingParams,
    Speculative,
)
from relf_jax.runtime.sharding import describe_shardings, make_mesh, mesh_scope  # noqa: E402
from relf_jax.sampling import autoregressive as ar  # noqa: E402
from relf_jax.serving import engines as E  # noqa: E402
from relf_jax.serving.engine_api import RequestParams  # noqa: E402
from tests._serving import tiny_lm  # noqa: E402

# (data, fsdp, tensor); the tiny models have 8 query heads, 4 KV heads and an MLP of 64, so
# tensor=8 splits the query heads and the MLP and replicates the KV heads (4 do not split 8 ways)
MESHES = {"data8": (8, 1, 1), "fsdp8": (1, 8, 1), "data2_tensor4": (2, 1, 4), "tensor8": (1, 1, 8)}
# the speculative rule run on each mesh (both on one device): the rules differ only in the accept
# test on logits the loop has already gathered, and each is a program of its own to compile
SPEC_RULES = {"data8": "standard", "fsdp8": "nsd", "data2_tensor4": "standard", "tensor8": "nsd"}
HEADS = {"num_heads": 8, "num_kv_heads": 4, "num_layers": 1}  # one layer: half the compile time
PROMPTS = ["<user> hello there <assistant>", "<user> hi <assistant>", "<user> what is the weather? <assistant>",
           "<user> tell me a story <assistant>"] * 2


def models():
    target = tiny_lm("ar", **HEADS)
    draft = dataclasses.replace(tiny_lm("ar", seed=1, **HEADS), tokenizer=target.tokenizer)
    return {"ar": target, "draft": draft, "bd": tiny_lm("bd", max_seq_len=64, **HEADS),
            "relf": tiny_lm("relf", **{**HEADS, "num_layers": 2})}  # a blind-spot ReLF needs two


def placed(lms, mesh):
    return {k: v if mesh is None else v.on_mesh(mesh) for k, v in lms.items()}


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, batch_size=8, seed=3)


def sampler_tokens(m, rules=("standard", "nsd")) -> dict:
    """Every sampler's tokens through `relf_jax.api.sample` (greedy, and seeded at T = 1); the
    speculative loop with each of `rules` (each rule is a program of its own to compile)."""
    greedy, hot = GREEDY, dataclasses.replace(GREEDY, temperature=1.0)
    draft = DraftModel(m["draft"])
    out = {
        "ar_t0": api.sample(m["ar"], PROMPTS, greedy, Autoregressive()),
        "ar_t1": api.sample(m["ar"], PROMPTS, hot, Autoregressive()),
        **{f"{rule}_t0": api.sample(m["ar"], PROMPTS, greedy, Speculative(rule=rule, k=3, proposer=draft))
           for rule in rules},
        "relf": api.sample(m["relf"], None, dataclasses.replace(hot, n=8), Flow(nfe=4)),
        "bd_t0": api.sample(m["bd"], PROMPTS, dataclasses.replace(greedy, max_new_tokens=16),
                            BlockDiffusion(threshold=0.5)),
        "bd_t1": api.sample(m["bd"], PROMPTS, dataclasses.replace(hot, max_new_tokens=16),
                            BlockDiffusion(threshold=0.5)),
    }
    return {k: v.token_ids for k, v in out.items()}


def logits(lm) -> np.ndarray:
    from flax import nnx

    toks = jnp.asarray(np.random.default_rng(0).integers(3, 250, (8, 16)), jnp.int32)
    with mesh_scope(lm.mesh):
        out = jax.jit(lambda p, t: nnx.merge(lm.graphdef, p)(t)[0])(lm.params, toks)
    return np.asarray(out)


def recompiles(m) -> int:
    """Compilations of the AR loop for another seed and temperature on a mesh it already ran on:
    the loop is one program whatever the knobs (0 expected)."""
    before = ar.generate_jit._cache_size()
    api.sample(m["ar"], PROMPTS, SamplingParams(temperature=0.7, max_new_tokens=10, batch_size=8, seed=11))
    return ar.generate_jit._cache_size() - before


def layouts(m) -> dict:
    """The parameters' and an AR decode state's KV cache's partition specs and shard shapes (the
    decode of `sampler_tokens`' greedy AR batch, as `relf_jax.sampling.recipes` runs it: no new
    program to compile)."""
    from relf_jax.sampling.batch import prompt_ids
    from relf_jax.sampling.recipes import ar_batch

    lm = m["ar"]
    params = {r["path"]: r for r in describe_shardings(lm.params)}
    ids = prompt_ids(lm.tokenizer, PROMPTS, 0)
    bucket = min(ar.prompt_bucket(max(map(len, ids))), lm.model_cfg.max_seq_len - GREEDY.max_new_tokens)
    arr, lens = ar.pad_prompts(ids, lm.tokenizer.pad_id, bucket)
    with mesh_scope(lm.mesh):
        _, _, state = ar_batch(lm, GREEDY.sample_config(lm.cfg.sample))(arr, lens, jax.random.key(0))
    return {"params": params, "kv_cache": describe_shardings(state.cache)[0],
            "decode_tokens": describe_shardings(state.tokens)[0]}


def samplers() -> dict:
    lms = models()
    out = {"one": {"tokens": sampler_tokens(lms)}}
    ref = logits(lms["ar"])
    for name, shape in MESHES.items():
        m = placed(lms, make_mesh(*shape))
        out[name] = {"tokens": sampler_tokens(m, (SPEC_RULES[name],)),
                     "logit_diff": float(np.abs(logits(m["ar"]) - ref).max()), "recompiles": recompiles(m),
                     **layouts(m)}
    return out


JOBS = [(1, "<user> weather? <assistant>", RequestParams(12, 1.0, seed=9), 0),
        (0, "<user> hi <assistant>", RequestParams(12, 0.0, seed=2), 1),
        (3, "<user> hello there <assistant>", RequestParams(12, 0.7, seed=5), 0)]


def engine_tokens(m, slots: int, rules: tuple, compact: bool = False) -> dict:
    """Each engine's tokens for `JOBS` (sampled and greedy requests, one joining a step late).
    compact: the AR and speculative engines step only the occupied slots (`subset_slots`: more
    programs to compile, so on one mesh only)."""
    from tests._serving import run_engine
    from tests.test_engines import TOK

    jobs = [(slot, [2] + TOK.encode(text), p, at) for slot, text, p, at in JOBS]
    engines = {"ar": (E.AREngine(m["ar"], slots, steps_per_call=2), 5),
               **{rule: (E.SpeculativeEngine(m["ar"], slots, method=Speculative(rule=rule, k=3,
                                                                                 proposer=DraftModel(m["draft"]))), 4)
                  for rule in rules},
               "bd": (E.BlockDiffusionEngine(m["bd"], slots, method=BlockDiffusion(threshold=0.5)), 3),
               "relf": (E.ReLFEngine(m["relf"], slots, method=Flow(nfe=3)), 1)}
    for eng, _ in engines.values():
        eng.compact = compact
    out = {k: {str(s): t for s, t in run_engine(eng, jobs, steps).items()} for k, (eng, steps) in engines.items()}
    state = engines["ar"][0].init_state()
    out["_layout"] = {"kv_cache": describe_shardings(state.slots.state.cache)[0],
                      "tokens": describe_shardings(state.slots.state.tokens)[0]}
    return out


def engines() -> dict:
    lms = models()
    out = {"one": engine_tokens(lms, 8, ("standard", "nsd"))}  # subset stepping gives these tokens too
    for name, shape in MESHES.items():
        # (data=2, tensor=4) also steps subsets of the slots, in multiples of its 2 slot groups
        out[name] = engine_tokens(placed(lms, make_mesh(*shape)), 8, (SPEC_RULES[name],),
                                  compact=name == "data2_tensor4")
    return out


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.devices()
    print(json.dumps({"samplers": samplers, "engines": engines}[sys.argv[1]]()))
