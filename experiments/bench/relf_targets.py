"""`relf-jax bench relf`'s targets: the issue's targets restated as ratios of measured rows."""

from __future__ import annotations

from collections.abc import Sequence

from experiments.bench.common import find_row
from experiments.bench.relf_variants import ABLATIONS, EXTENSIONS, GUIDANCE, REFLOW_EXTENSIONS
from relf_jax.eval.baselines import ar_ppl_at_entropy


def ratio(a, b):
    """a / b, None when either is None."""
    return None if a is None or b is None else a / b


def reflow_targets(rows: Sequence[dict], variant: str, steps: int, prefix: str) -> dict:
    """The reflow targets of one model (`variant` at `steps`), keys starting with `prefix`:
    16-NFE Euler after two rounds over the pre-reflow 64-NFE row nearest its entropy, the 8-NFE
    Euler gen PPL reduction from two rounds, and per round the few-step gap (8-NFE Euler over
    64-NFE stochastic gen PPL: what straightening should close)."""
    def euler(nfe, rounds):
        return find_row(rows, variant=variant, train_steps=steps, nfe=nfe, reflow_rounds=rounds, method="relf euler")

    def nearest64(rounds, entropy):  # of the 64-NFE rows (one per renoise rule), the nearest in entropy
        s64 = [r for r in rows if r["variant"] == variant and r["train_steps"] == steps and r["nfe"] == 64
               and r["reflow_rounds"] == rounds]
        return min(s64, key=lambda r: abs(r["entropy"] - entropy), default=None)

    e16, e8_pre, e8_post = euler(16, 2), euler(8, 0), euler(8, 2)
    near = None if e16 is None else nearest64(0, e16["entropy"])
    if near is None or e8_pre is None or e8_post is None:
        return {}
    out = {f"{prefix}reflow2_euler16_over_pre_stochastic64_gen_ppl": {
        "ratio": ratio(e16["gen_ppl"], near["gen_ppl"]), "entropy_delta": e16["entropy"] - near["entropy"],
        "target": "<= 1.10"},
        f"{prefix}reflow2_euler8_gen_ppl_reduction": {
        "reduction": None if ratio(e8_post["gen_ppl"], e8_pre["gen_ppl"]) is None
        else 1.0 - e8_post["gen_ppl"] / e8_pre["gen_ppl"], "before": e8_pre["gen_ppl"],
        "after": e8_post["gen_ppl"], "entropy_delta": e8_post["entropy"] - e8_pre["entropy"], "target": ">= 0.20"}}
    gaps = {}
    for rounds in (0, 1, 2):
        e8 = euler(8, rounds)
        s = None if e8 is None else nearest64(rounds, e8["entropy"])
        if s is not None:
            gaps[str(rounds)] = {"ratio": ratio(e8["gen_ppl"], s["gen_ppl"]),
                                 "entropy_delta": e8["entropy"] - s["entropy"]}
    out[f"{prefix}euler8_over_stochastic64_gen_ppl_by_reflow_round"] = gaps
    # the no-pairs control (`NO_PAIRS`): as many rounds of data-only training; reflow's own share
    # of the gain is how far its rows beat the control's
    control = {}
    for nfe in (8, 16):
        pre, post = euler(nfe, 0), euler(nfe, 2)
        ctrl = find_row(rows, variant=f"{variant}_nopairs", train_steps=steps, nfe=nfe, reflow_rounds=2,
                     method="relf euler")
        if pre is not None and post is not None and ctrl is not None and ctrl["gen_ppl"] and pre["gen_ppl"]:
            control[f"euler{nfe}"] = {"before": pre["gen_ppl"], "reflow2": post["gen_ppl"], "nopairs2": ctrl["gen_ppl"],
                                      "nopairs2_reduction": 1.0 - ctrl["gen_ppl"] / pre["gen_ppl"],
                                      "reflow2_over_nopairs2": ratio(post["gen_ppl"], ctrl["gen_ppl"]),
                                      "entropy_delta_reflow2_minus_nopairs2": post["entropy"] - ctrl["entropy"]}
    if control:
        out[f"{prefix}reflow2_vs_nopairs_control"] = control
    return out


def targets(rows: Sequence[dict], budgets: Sequence[int], prompted: Sequence[dict] = ()) -> dict:
    """The issue's targets as measured ratios (lower gen PPL is better), and the prompted replies'
    gen PPL of clean-prompt training over the renoised prompt (not an issue target)."""
    out = {}
    for nfe in (64, 16):
        clean = find_row(prompted, variant="prompt_training", prompt_mode="clean", nfe=nfe)
        renoised = find_row(prompted, variant="relf", prompt_mode="renoise", nfe=nfe)
        if clean and renoised:
            out[f"prompted_reply_gen_ppl_clean_over_renoise_nfe{nfe}"] = {
                "ratio": ratio(clean["gen_ppl"], renoised["gen_ppl"]),
                "entropy_delta": clean["entropy"] - renoised["entropy"]}
    for steps in budgets:
        ar_rows = [r for r in rows if r["variant"] == "ar" and r["train_steps"] == steps and r["gen_ppl"]]
        # of the 64-NFE rows (one per renoise rule), the one nearest the AR sweep's entropies
        pre = [r for r in rows if r["variant"] == "relf" and r["train_steps"] == steps and r["nfe"] == 64
               and r["reflow_rounds"] == 0]
        if not ar_rows or not pre:  # a run without the "models" part
            continue
        r64 = min(pre, key=lambda r: ar_ppl_at_entropy(ar_rows, r["entropy"])[1])
        ppl, gap = ar_ppl_at_entropy(ar_rows, r64["entropy"])
        out[f"steps{steps}_relf64_vs_ar_at_matched_entropy"] = {
            "relf_gen_ppl": r64["gen_ppl"], "relf_entropy": r64["entropy"], "ar_gen_ppl_interpolated": ppl,
            "entropy_outside_ar_sweep_nats": gap, "ratio": ratio(r64["gen_ppl"], ppl), "target": "<= 1.15"}
    uni = find_row(rows, variant="reference", method="positional unigram")
    if uni is not None:
        pre = [r for r in rows if r["variant"] == "relf" and r["reflow_rounds"] == 0]
        out["relf_over_positional_unigram_gen_ppl"] = {
            "positional_unigram": {"gen_ppl": uni["gen_ppl"], "entropy": uni["entropy"]},
            "best_relf_ratio": min((ratio(r["gen_ppl"], uni["gen_ppl"]) for r in pre if r["gen_ppl"]), default=None)}
    full = budgets[0]

    def sampled_alike(steps):  # ablation and guidance rows use the default (marginal) renoise
        return (find_row(rows, variant="relf", train_steps=steps, nfe=64, reflow_rounds=0,
                      method="relf stochastic marginal")
                or find_row(rows, variant="relf", train_steps=steps, nfe=64, reflow_rounds=0))

    pre64 = sampled_alike(full)
    for variant, prefix in (("relf", ""), *((v, f"{v}_") for v in REFLOW_EXTENSIONS)):
        out.update(reflow_targets(rows, variant, full, prefix))
    abl = {}
    for name in ABLATIONS:
        r = next((x for x in rows if x["variant"] == name), None)
        if r is not None:
            base = sampled_alike(r["train_steps"])
            abl[name] = {"gen_ppl_over_baseline": ratio(r["gen_ppl"], base["gen_ppl"]),
                         "entropy_delta": r["entropy"] - base["entropy"], "train_steps": r["train_steps"]}
    for g in GUIDANCE[1:]:
        r = find_row(rows, variant="guidance", train_steps=full, guidance=g)
        if r is not None:
            abl[f"guidance_{g:g}"] = {"gen_ppl_over_baseline": ratio(r["gen_ppl"], pre64["gen_ppl"]),
                                      "entropy_delta": r["entropy"] - pre64["entropy"]}
    if abl:
        out["ablations_vs_relf64"] = abl
    ext = {}
    for name in EXTENSIONS:
        for nfe, method in ((64, "relf stochastic marginal"), (16, "relf euler")):
            r = find_row(rows, variant=name, nfe=nfe, method=method)
            base = find_row(rows, variant="relf", train_steps=full, nfe=nfe, reflow_rounds=0, method=method)
            ar_full = [x for x in rows if x["variant"] == "ar" and x["train_steps"] == full]
            if r is not None and base is not None and ar_full:
                ar_ppl, gap = ar_ppl_at_entropy(ar_full, r["entropy"])
                ext[f"{name}_nfe{nfe}"] = {"gen_ppl_over_relf": ratio(r["gen_ppl"], base["gen_ppl"]),
                                           "entropy_delta": r["entropy"] - base["entropy"],
                                           "gen_ppl_over_ar_at_matched_entropy": ratio(r["gen_ppl"], ar_ppl),
                                           "entropy_outside_ar_sweep_nats": gap}
    if ext:
        out["extensions_vs_relf"] = ext
    marg = find_row(rows, variant="relf", train_steps=full, nfe=64, reflow_rounds=0, renoise="marginal")
    lin = find_row(rows, variant="relf", train_steps=full, nfe=64, reflow_rounds=0, renoise="linear")
    if marg and lin:
        out["renoise_marginal_over_linear"] = {"gen_ppl": ratio(marg["gen_ppl"], lin["gen_ppl"]),
                                               "entropy_delta": marg["entropy"] - lin["entropy"]}
    return out
