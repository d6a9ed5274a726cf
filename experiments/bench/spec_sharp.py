"""NSD with a sharpened draft: speed against quality as the draft's temperature scale falls.

`Speculative.draft_temperature_scale` s < 1 makes the draft sample at T x s. The standard rule
stays exact (the verifier is given the distribution the draft sampled) but accepts less; NSD
accepts every draft inside the target's nucleus, so a sharper draft lands there more often and
tau rises, while its replies follow the draft's sharpened choices and lose entropy. Whether that
is a gain depends on where the replies land against the target's own quality curve.

`draft_scale_curve` measures, for each scale:

- quality, on `QUALITY_PROMPTS` held-out prompts at batch 8 (as `spec_quality`): NSD@0.9 at T = 1
  with the scale, against an AR temperature sweep reaching down to T = 0.5 (the sharpened rows'
  entropy lies below T = 0.8's); each row's gen PPL over AR's at its entropy, interpolated and
  fitted (`relf_jax.eval.baselines`), and over the standard rule's own ratio at T = 1. Twice: at
  the per-reply mean entropy (the project's entropy column) and at the pooled entropy
  (`relf_jax.eval.metrics.pooled_unigram_entropy`), which does not follow reply length and so
  places a row on the sweep far more precisely (docs/speculative.md);
- speed, at batch 1 on 16 prompts, round-robin (`spec.interleaved_timing`): NSD with the scale
  over the standard rule at T = 1 (issue 40's ratio), and over the standard rule at the
  temperature whose AR pooled entropy matches the NSD row's (the fitted sweep's temperature, to
  0.05): the exact rule made as sharp, so the speed each buys at the same entropy.
"""

from __future__ import annotations

from experiments.bench.spec import interleaved_timing
from experiments.bench.spec_quality import quality_row
from relf_jax.eval.baselines import ar_ppl_at_entropy, ar_ppl_at_entropy_fitted
from relf_jax.methods import Autoregressive, Speculative, parse_proposer

SCALES = (1.0, 0.8, 0.65, 0.5)
CURVE_TEMPERATURES = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1)


def _quality_rows(lm, cfg, draft, judge, prompts, k: int, max_new: int, scales) -> list[dict]:
    rows = []

    def run(name, method, temperature, scale=None):
        label = name if scale is None else f"{name} s={scale:g}"
        row = quality_row(lm, cfg, judge, prompts, label, method, temperature, max_new)[0]
        rows.append({**row, "name": name, "draft_temperature_scale": scale})

    for temperature in CURVE_TEMPERATURES:
        run("ar", Autoregressive(), temperature)
    run("standard", Speculative(rule="standard", k=k, proposer=parse_proposer("draft", draft=draft)), 1.0)
    for scale in scales:
        run("nsd0.9", Speculative(rule="nsd", k=k, nsd_top_p=0.9, draft_temperature_scale=scale,
                                  proposer=parse_proposer("draft", draft=draft)), 1.0, scale)
    return rows


def score_against_sweep(rows: list[dict]) -> list[dict]:
    """Each speculative row of `rows` (`_quality_rows`) with its gen PPL over the AR sweep's at its
    entropy, interpolated (``over_ar``, ``entropy_outside_sweep``) and fitted (``over_ar_fitted``),
    the same at its pooled entropy (``over_ar_pooled``, ``pooled_outside_sweep``,
    ``over_ar_pooled_fitted``, ``matched_temperature``: the sweep's temperature at that pooled
    entropy), and each over the standard rule's (``over_standard``, ``over_standard_fitted``,
    ``over_standard_pooled``, ``over_standard_pooled_fitted``)."""
    ar = [r for r in rows if r["name"] == "ar"]
    spec_rows = [r for r in rows if r["name"] != "ar"]
    for r in spec_rows:
        ref, gap = ar_ppl_at_entropy(ar, r["entropy"])
        r["over_ar"], r["entropy_outside_sweep"] = r["gen_ppl"] / ref, gap
        ref, gap = ar_ppl_at_entropy(ar, r["pooled_entropy"], key="pooled_entropy")
        r["over_ar_pooled"], r["pooled_outside_sweep"] = r["gen_ppl"] / ref, gap
        fit = ar_ppl_at_entropy_fitted(ar, r["entropy"])
        if fit is not None:
            r["over_ar_fitted"] = r["gen_ppl"] / fit[0]
        fit = ar_ppl_at_entropy_fitted(ar, r["pooled_entropy"], key="pooled_entropy")
        if fit is not None:
            r["over_ar_pooled_fitted"], r["matched_temperature"] = r["gen_ppl"] / fit[0], fit[2]
    std = next(r for r in spec_rows if r["name"] == "standard")
    for r in spec_rows:
        for read in ("", "_fitted", "_pooled", "_pooled_fitted"):
            if f"over_ar{read}" in r and f"over_ar{read}" in std:
                r[f"over_standard{read}"] = r[f"over_ar{read}"] / std[f"over_ar{read}"]
    return rows


def speed_against_standard(lm, cfg, draft, prompts, k: int, max_new: int, scored: list[dict], reps: int) -> dict:
    """Round-robin batch-1 rows: the standard rule at T = 1, NSD at each scale, and the standard rule
    at each scale's matched temperature (to 0.05); the two ratios per scale."""
    rows = [("standard_T1", 1, "standard", "draft", None, 1.0, 1.0)]
    ratios, matched = {}, {}
    for r in scored:
        if r["name"] != "nsd0.9":
            continue
        s = r["draft_temperature_scale"]
        t = round(round(r.get("matched_temperature", 1.0) / 0.05) * 0.05, 2)
        matched[s] = t
        rows.append((f"nsd0.9_s{s:g}", 1, "nsd", "draft", 0.9, s, 1.0))
        if f"standard_T{t:g}" not in [row[0] for row in rows]:
            rows.append((f"standard_T{t:g}", 1, "standard", "draft", None, 1.0, t))
        ratios[f"nsd0.9_s{s:g}_over_standard_T1"] = (f"nsd0.9_s{s:g}", "standard_T1")
        ratios[f"nsd0.9_s{s:g}_over_standard_matched"] = (f"nsd0.9_s{s:g}", f"standard_T{t:g}")
    out = interleaved_timing(lm, prompts, cfg, draft, None, k, max_new, reps, rows=tuple(rows), ratios=ratios)
    out["matched_temperature"] = {f"{s:g}": t for s, t in matched.items()}
    return out


def draft_scale_curve(out: str, workdir: str = "runs/bench_spec_cpu-wide", scales=SCALES, reps: int = 5,
                      quality_prompts: int | None = None) -> dict:
    """Trains or reuses cpu-wide's target and draft in `workdir` (as `bench spec --preset cpu-wide`),
    measures the curve (module docstring) and writes it to `out`."""
    from experiments.bench.common import ensure_target_and_draft, held_out_prompts
    from experiments.bench.spec import SMALL_DRAFT, WIDE_DRAFT_STEPS
    from experiments.bench.spec_quality import QUALITY_PROMPTS
    from relf_jax.eval.evaluate import exact_judge
    from relf_jax.io import write_json

    cfg, lm, draft = ensure_target_and_draft("cpu-wide", workdir, (), SMALL_DRAFT, distill_steps=WIDE_DRAFT_STEPS)
    judge = exact_judge(cfg)
    k, max_new = 4, 64
    scored = score_against_sweep(_quality_rows(
        lm, cfg, draft, judge, held_out_prompts(cfg, quality_prompts or QUALITY_PROMPTS, seed=54321), k, max_new,
        scales))
    speed = speed_against_standard(lm, cfg, draft, held_out_prompts(cfg, 16), k, max_new, scored, reps)
    report = {"preset": "cpu-wide", "k": k, "max_new_tokens": max_new, "draft_distill_steps": draft.step,
              "quality": scored, "speed": speed}
    write_json(out, report)
    for r in scored:
        if r["name"] == "nsd0.9":
            s = r["draft_temperature_scale"]
            print(f"[bench spec sharp] s={s:g}: entropy {r['entropy']:.3f} (pooled {r['pooled_entropy']:.3f}), gen PPL "
                  f"over the standard rule's at matched entropy {r['over_standard']:.3f} (fitted "
                  f"{r.get('over_standard_fitted', float('nan')):.3f}), at matched pooled entropy "
                  f"{r['over_standard_pooled']:.3f} (fitted {r.get('over_standard_pooled_fitted', float('nan')):.3f})"
                  f"; tokens/s over standard at T = 1 x{speed['ratios'][f'nsd0.9_s{s:g}_over_standard_T1']:.2f}, "
                  f"at T = {speed['matched_temperature'][f'{s:g}']:g} "
                  f"x{speed['ratios'][f'nsd0.9_s{s:g}_over_standard_matched']:.2f}", flush=True)
    return report
