"""`relf-jax bench hf`: relf_jax vs HuggingFace transformers on the same weights, in one run.

Composition only. A target and a distilled draft are trained (or reused) with the `cpu` preset
(`tiny` with --quick), exported with `relf_jax.export.hf.export_hf`, and loaded by transformers,
so both stacks run the very same float32 weights on the same CPU and prompts:

- ``decode``: AR sampling at temperature 1, batch 1 and 8, a fixed number of new tokens (no EOS
  stop on either side): relf_jax's jitted while_loop vs ``model.generate(do_sample=True)``.
  Repeated on a larger model with random weights (``decode_d512``), to show where the ratio goes
  when the network, not the Python around it, dominates.
- ``spec_standard`` / ``spec_nsd``: speculative sampling at batch 1 with the same draft and K=4:
  relf_jax's speculative while_loop (exact rule / NSD) vs transformers' assisted generation
  (``assistant_model=``, constant 4 draft tokens).
- ``train``: one optimizer step on the same [B, L] batch: relf_jax's sharded train step (AdamW,
  clipping) vs a transformers ``LlamaForCausalLM`` forward + backward + ``torch.optim.AdamW``.

Compilation (JAX) and the first call (both) are excluded; each row is the median over the same
number of repetitions. All relf_jax rows run first, then all transformers rows (the HF models are
loaded only then): torch's OpenMP workers spin after a call and slow a JAX call that follows.
Rows: ``{"task", "batch", "ours_tok_s", "hf_tok_s", "ratio"}`` (+ details).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from collections.abc import Sequence

import numpy as np

from experiments.bench.common import ensure_target_and_draft, held_out_prompts
from relf_jax.io import write_json


def _timed(fn, reps: int) -> float:
    """Median seconds per call over `reps` calls, after one warm-up call (compilation)."""
    fn(0)
    times = []
    for r in range(reps):
        t0 = time.perf_counter()
        fn(r + 1)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _prompt_block(tok, prompts: Sequence[str], batch: int, length: int) -> np.ndarray:
    """[batch, length] ids: BOS + the first tokens of each prompt, all rows the same length."""
    rows = []
    for p in prompts:
        ids = [tok.bos_id] + tok.encode(p)
        if len(ids) >= length:
            rows.append(ids[:length])
        if len(rows) == batch:
            return np.asarray(rows, np.int32)
    raise RuntimeError(f"not enough prompts of {length} tokens")


def _ours_ar(lm, prompts: np.ndarray, new: int):
    import jax

    from relf_jax.sampling import autoregressive as ar

    lens = jax.numpy.full((prompts.shape[0],), prompts.shape[1], jax.numpy.int32)
    settings = ar.DecodeSettings(max_new_tokens=new, eos_id=-1, pad_id=lm.tokenizer.pad_id)
    params = ar.TracedSampling.make(1.0)

    def run(r):
        state = ar.generate(lm.graphdef, lm.params, jax.numpy.asarray(prompts), lens, jax.random.key(r), params,
                            settings)
        jax.block_until_ready(state.tokens)
        assert int(np.asarray(state.num_generated).sum()) == prompts.shape[0] * new
    return run


def _ours_spec(lm, draft, prompts: np.ndarray, new: int, rule: str, k: int):
    import jax

    from relf_jax.speculative import generate as spec

    lens = jax.numpy.full((prompts.shape[0],), prompts.shape[1], jax.numpy.int32)
    settings = spec.SpecSettings(k=k, rule=rule, proposer="draft", max_new_tokens=new, eos_id=-1,
                                 pad_id=lm.tokenizer.pad_id)
    sp = spec.SpecParams.make(1.0, 1.0, 0.9)
    taus = []

    def run(r):
        state = spec.generate(lm.graphdef, lm.params, jax.numpy.asarray(prompts), lens, jax.random.key(r), sp,
                              settings, draft_graphdef=draft.graphdef, draft_params=draft.params)
        jax.block_until_ready(state.tokens)
        taus.append(spec.stats(state)["tau"])
    return run, taus


def _hf_generate(model, prompts: np.ndarray, new: int, assistant=None):
    import torch
    from transformers import GenerationConfig

    ids = torch.tensor(prompts, dtype=torch.long)
    gc = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new,
                          min_new_tokens=new, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    if assistant is not None:
        assistant.generation_config.num_assistant_tokens = 4
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        assistant.generation_config.assistant_confidence_threshold = 0.0

    def run(r):
        torch.manual_seed(r)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc,
                                 assistant_model=assistant)
        assert out.shape[1] - ids.shape[1] == new, out.shape
    return run


def _ours_train(lm, batch: np.ndarray):
    import jax

    from relf_jax.runtime import sharding as shd
    from relf_jax.train.loop import init_state, make_train_step, plan_state, put_batch
    from relf_jax.train.objectives import next_token_loss
    from relf_jax.train.optimizers import make_optimizer

    mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    plan = plan_state(lm.model_cfg, make_optimizer(lm.cfg.train), mesh)
    # the same (trained) weights transformers starts from; copied, since the step donates them
    _, opt_state = init_state(plan, lm.model_cfg, jax.random.key(0))
    params = jax.jit(lambda p: jax.tree.map(jax.numpy.copy, p), out_shardings=plan.param_shardings)(lm.params)
    state = {"s": (params, opt_state)}
    b = put_batch({"tokens": batch, "segment_ids": np.ones_like(batch)}, mesh)
    step = make_train_step(plan, next_token_loss, 1, jax.tree.map(lambda x: x.sharding, b))

    def run(r):
        params, opt = state["s"]
        params, opt, m = step(params, opt, b, jax.random.key(r), None)
        jax.block_until_ready(m["loss"])
        state["s"] = (params, opt)
    return run


def _hf_train(model, batch: np.ndarray, train_cfg):
    import torch

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=train_cfg.learning_rate, weight_decay=train_cfg.weight_decay,
                            betas=(train_cfg.b1, train_cfg.b2))
    ids = torch.tensor(batch, dtype=torch.long)

    def run(r):
        out = model(input_ids=ids[:, :-1], labels=ids[:, :-1])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train_cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return run


def _big_model(lm):
    """A freshly initialised d=512, 8-layer model on `lm`'s config and tokenizer: where the network,
    not the Python around it, dominates."""
    from flax import nnx

    from relf_jax.checkpoint import LoadedModel
    from relf_jax.models import build_model

    big_cfg = dataclasses.replace(lm.model_cfg, d_model=512, num_layers=8, num_heads=8, num_kv_heads=4, mlp_dim=1536,
                                  head_dim=0)
    gd, params = nnx.split(build_model(big_cfg, nnx.Rngs(0)))
    return LoadedModel(cfg=lm.cfg, model_cfg=big_cfg, graphdef=gd, params=params, tokenizer=lm.tokenizer, step=0)


def _row(task: str, batch: int, ours_s: float, hf_s: float, tokens: int, **extra) -> dict:
    """One result row (tokens/s of both stacks and their ratio), printed."""
    row = {"task": task, "batch": batch, "ours_tok_s": tokens / ours_s, "hf_tok_s": tokens / hf_s,
           "ratio": hf_s / ours_s, **extra}
    print(f"[bench hf] {task:>14} b={batch}: ours {row['ours_tok_s']:10,.1f} tok/s   transformers "
          f"{row['hf_tok_s']:10,.1f} tok/s   ratio {row['ratio']:6.2f}x", flush=True)
    return row


def bench_hf(out: str, quick: bool = False, workdir: str | None = None, overrides: Sequence[str] = ()) -> dict:
    import jax
    import torch
    from transformers import AutoModelForCausalLM

    from relf_jax.export.hf import export_hf
    from relf_jax.models.causal_lm import count_params

    preset = "tiny" if quick else "cpu"
    workdir = workdir or os.path.join("runs", f"bench_spec_{preset}")  # shares models with `bench spec`
    cfg, lm, draft = ensure_target_and_draft(preset, workdir, overrides)
    new, reps, k = (16, 2, 4) if quick else (64, 5, 4)
    prompts = held_out_prompts(cfg, 64)
    rows = []
    t_start = time.perf_counter()

    def load_hf(model, tmp, name):
        path = export_hf(model, os.path.join(tmp, name))
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    big = _big_model(lm)
    with tempfile.TemporaryDirectory() as tmp:
        # Phase 1, relf_jax only; phase 2, transformers only (models loaded after phase 1): torch's
        # OpenMP workers keep spinning after a call and would steal the two cores from JAX.
        plen, ours_runs, row_meta = 8, [], []
        for name, model in (("decode", lm), ("decode_d512", big)):
            for batch in (1, 8):
                block = _prompt_block(lm.tokenizer, prompts, batch, plen)
                ours_runs.append(_ours_ar(model, block, new))
                row_meta.append((name, batch, batch * new, {"params": count_params(model.params), "new_tokens": new}))
        block1 = _prompt_block(lm.tokenizer, prompts, 1, plen)
        spec_taus = {}
        for rule in ("standard", "nsd"):
            run, spec_taus[rule] = _ours_spec(lm, draft, block1, new, rule, k)
            ours_runs.append(run)
            row_meta.append((f"spec_{rule}", 1, new, {"k": k, "draft_params": count_params(draft.params),
                                                      "hf": "assisted generation (exact speculative sampling), "
                                                            "4 draft tokens"}))
        tc = cfg.train
        rng = np.random.default_rng(0)
        batch = rng.integers(4, lm.model_cfg.vocab_size, size=(tc.batch_size, cfg.data.seq_len + 1)).astype(np.int32)
        ours_runs.append(_ours_train(lm, batch))
        row_meta.append(("train", tc.batch_size, tc.batch_size * cfg.data.seq_len,
                         {"seq_len": cfg.data.seq_len, "repetitions": reps * 2}))
        ours = [_timed(run, reps * 2 if meta[0] == "train" else reps) for run, meta in zip(ours_runs, row_meta)]

        hf_target, hf_draft, hf_big = load_hf(lm, tmp, "target"), load_hf(draft, tmp, "draft"), load_hf(big, tmp, "big")
        hf_runs = []
        for hf_model in (hf_target, hf_big):
            for b in (1, 8):
                hf_runs.append(_hf_generate(hf_model, _prompt_block(lm.tokenizer, prompts, b, plen), new))
        assisted = _hf_generate(hf_target, block1, new, assistant=hf_draft)
        hf_runs += [assisted, assisted]
        hf_train = AutoModelForCausalLM.from_pretrained(os.path.join(tmp, "target"), dtype=torch.float32)
        hf_runs.append(_hf_train(hf_train, batch, tc))
        theirs = [_timed(run, reps * 2 if meta[0] == "train" else reps) for run, meta in zip(hf_runs, row_meta)]
        for (task, batch_size, tokens, extra), o, t in zip(row_meta, ours, theirs):
            if task.startswith("spec_"):
                extra = {**extra, "ours_tau": float(np.mean(spec_taus[task[5:]]))}
            rows.append(_row(task, batch_size, o, t, tokens, **extra))
    import transformers

    report = {"rows": rows, "preset": preset, "params": count_params(lm.params),
              "draft_params": count_params(draft.params), "new_tokens": new, "repetitions": reps,
              "torch_threads": torch.get_num_threads(), "jax_devices": str(jax.devices()),
              "versions": {"jax": jax.__version__, "torch": torch.__version__,
                           "transformers": transformers.__version__},
              "wall_s": time.perf_counter() - t_start}
    write_json(out, report)
    print(json.dumps({r["task"] + f"@b{r['batch']}": round(r["ratio"], 2) for r in rows}, indent=2))
    return report
