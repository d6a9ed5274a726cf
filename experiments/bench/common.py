"""What several benches share: finding a row, the target + draft pair of the
speculative benches, held-out prompts, reply quality under the exact judge, and the text tokens a
training step sees."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence

import numpy as np

from relf_jax.config import make_config
from relf_jax.errors import UserError

# the repository root: the working directory of the subprocesses benches start (`python -m experiments...`)
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def find_row(rows, **kw):
    """The first row whose values equal every keyword's, else None."""
    for r in rows:
        if all(r.get(k) == v for k, v in kw.items()):
            return r
    return None


def borrowed_ar_rows(path: str | None, preset: str, n: int) -> list[dict]:
    """The AR sweep rows of the bench report at `path` (`bench relf` or `bench bd`; same preset and
    sample count), each marked with the ``source`` file it was measured for; [] without a path."""
    import json

    if not path:
        return []
    with open(path) as f:
        rep = json.load(f)
    if rep.get("preset") != preset or rep.get("num_samples") != n:
        raise ValueError(f"{path}: preset {rep.get('preset')!r} / {rep.get('num_samples')} samples, "
                         f"this bench needs {preset!r} / {n}")
    return [{"source": os.path.basename(path), "nfe": None, **r} for r in rep["rows"] if r.get("variant") == "ar"]


def draft_steps(cfg) -> int:
    """The distillation steps of the demo's draft: half the target's."""
    return max(1, cfg.train.steps // 2)


def ensure_target_and_draft(preset: str, workdir: str, overrides: Sequence[str] = (),
                            draft_overrides: Sequence[str] = (), distill_steps: int | None = None):
    """(config, target, draft): trained in `workdir` (or resumed / reused), the draft distilled
    for `draft_steps` as the demo does, in ``<workdir>/draft`` (`draft_overrides`: its ``model.*``
    shape, if not the default half-size one; `distill_steps`: another distillation length, its
    draft kept apart in ``<workdir>/draft_steps<N>``)."""
    import relf_jax as rj
    from relf_jax.loading import load_model
    from relf_jax.speculative.recipes import train_draft
    cfg = make_config(preset, list(overrides), workdir=workdir)
    rj.train(cfg)
    lm = load_model(workdir, "ar")
    if distill_steps is not None and distill_steps < 1:
        raise UserError(f"the draft's distillation steps must be >= 1, got {distill_steps}")
    steps = distill_steps or draft_steps(cfg)
    draft_dir = os.path.join(workdir, "draft" if steps == draft_steps(cfg) else f"draft_steps{steps}")
    train_draft(workdir, [*draft_overrides, f"train.steps={steps}"], workdir=draft_dir)
    draft = load_model(draft_dir, "ar")
    return cfg, lm, draft


def held_out_prompts(cfg, n: int, seed: int = 12345) -> list[str]:
    """First user turns (ending with ``<assistant>``) of fresh grammar conversations."""
    from relf_jax.eval.evaluate import exact_judge
    judge = exact_judge(cfg)
    return [info["prompt"] for info in judge.grammar.sample_with_info(n, seed)]


def reply_quality(judge, prompts: Sequence[str], texts: Sequence[str], complete: Sequence[bool] | None = None) -> dict:
    """Gen PPL of the replies given their prompts under the exact judge (reply words; a reply not
    `complete` is scored as a prefix: it may end where the next turn begins), mean unigram entropy
    of the replies' words and the entropy of all of them pooled (`pooled_unigram_entropy`), their
    mean length in words and their number."""
    from relf_jax.eval.metrics import mean_unigram_entropy, pooled_unigram_entropy

    texts = list(texts)
    complete = [False] * len(texts) if complete is None else list(complete)
    logp, n = judge.score_replies(list(prompts), texts, complete)
    words = [judge.tokenize(t) for t in texts]
    return {"gen_ppl": float(math.exp(-logp.sum() / max(n.sum(), 1))),
            "entropy": mean_unigram_entropy(words), "pooled_entropy": pooled_unigram_entropy(words),
            "reply_words": float(np.mean([len(t.split()) for t in texts])), "replies": len(texts)}


def text_tokens_per_step(cfg, builder, tok, rows: str, align: int = 1, batches: int = 50) -> float:
    """Mean text tokens (non-pad, in a segment) in the loss of one training batch of `cfg` under a
    row layout, over `batches` batches: what "the same budget" spends on text (AR's packed rows:
    all of batch x seq_len)."""
    from relf_jax.data import pipeline

    it = pipeline.make_iterator(builder, "train", tok, seq_len=cfg.data.seq_len, batch_size=cfg.train.batch_size,
                                seed=cfg.train.seed, rows=rows, align=align, lookahead=cfg.data.pack_lookahead)
    total = 0
    for _ in range(batches):
        x = next(it)
        t, s = x["tokens"][:, :-1], x["segment_ids"][:, :-1]
        total += int(((t != tok.pad_id) & (s != 0)).sum())
    return total / batches


def median_seconds(fn, reps: int) -> float:
    """Median wall seconds of `reps` calls of `fn()`, each waited for (`jax.block_until_ready`)."""
    import jax

    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples))


def kernel_vs_reference(ref, ker, args, reps: int) -> dict:
    """Median ms of the reference and of the kernel on `args`, and the kernel's speedup."""
    times = {name: median_seconds(lambda fn=fn: fn(*args), reps) for name, fn in (("reference", ref), ("kernel", ker))}
    return {"reference_ms": times["reference"] * 1e3, "kernel_ms": times["kernel"] * 1e3,
            "speedup_kernel_over_reference": times["reference"] / times["kernel"]}


def kernel_timing_text(row: dict) -> str:
    """A `kernel_vs_reference` row's times, for the log line."""
    return (f"ref {row['reference_ms']:.3f} ms  kernel {row['kernel_ms']:.3f} ms  "
            f"x{row['speedup_kernel_over_reference']:.2f}")


def write_kernel_report(out: str, rows: list[dict], interpret: bool) -> dict:
    """A kernel bench's report (backend, whether the kernel was interpreted, device, rows), written to `out`."""
    import jax

    from relf_jax.io import write_json

    report = {"backend": jax.default_backend(), "interpret": interpret, "device": str(jax.devices()[0]), "rows": rows}
    write_json(out, report)
    return report
