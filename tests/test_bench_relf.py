"""The arithmetic of `relf-jax bench relf`: matched-entropy interpolation and target ratios."""

import inspect
import math
import os

import pytest

from experiments.bench.relf_targets import targets
from relf_jax.eval.baselines import ar_ppl_at_entropy


def _ar(entropy, ppl, steps=10):
    return {"variant": "ar", "train_steps": steps, "entropy": entropy, "gen_ppl": ppl, "nfe": None,
            "reflow_rounds": 0, "method": "ar"}


def test_ar_ppl_at_entropy_interpolates_log_ppl_and_reports_the_gap():
    rows = [_ar(3.0, 10.0), _ar(2.0, 10.0), _ar(4.0, 1000.0)]
    # points (2, 10), (3, 10), (4, 1000): halfway between 3 and 4 is the geometric mean
    ppl, gap = ar_ppl_at_entropy(rows, 3.5)
    assert ppl == pytest.approx(100.0) and gap == 0.0
    ppl, gap = ar_ppl_at_entropy(rows, 4.25)
    assert ppl == pytest.approx(1000.0) and gap == pytest.approx(0.25)
    ppl, gap = ar_ppl_at_entropy(rows, 1.5)
    assert ppl == pytest.approx(10.0) and gap == pytest.approx(0.5)


def test_fitted_read_off_recovers_a_smooth_sweep_and_averages_out_entropy_noise():
    from relf_jax.eval.baselines import ar_ppl_at_entropy_fitted

    temps = [0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3]

    def sweep(noise=()):  # entropy 2 + T, log gen PPL 3 T: gen PPL at entropy e is exp(3 (e - 2))
        noise = list(noise) or [0.0] * len(temps)
        return [{"temperature": t, "entropy": 2.0 + t + d, "gen_ppl": math.exp(3.0 * t)} for t, d in zip(temps, noise)]

    ppl, gap, t = ar_ppl_at_entropy_fitted(sweep(), 2.95)
    assert ppl == pytest.approx(math.exp(2.85), rel=1e-3) and gap == 0.0 and t == pytest.approx(0.95, abs=1e-3)
    ppl, gap, t = ar_ppl_at_entropy_fitted(sweep(), 3.5)  # past the hottest row: its end, and the gap
    assert ppl == pytest.approx(math.exp(3.9), rel=1e-3) and gap == pytest.approx(0.2) and t == 1.3
    # two neighbours' entropies swapped by noise: the line through them is far off, the fit is not
    noisy = sweep([0, 0, 0.045, -0.045, 0, 0, 0, 0])
    truth = math.exp(3.0 * 0.86)
    piecewise, _ = ar_ppl_at_entropy(noisy, 2.86)
    fitted, _, _ = ar_ppl_at_entropy_fitted(noisy, 2.86)
    assert abs(math.log(fitted / truth)) < 0.5 * abs(math.log(piecewise / truth))
    assert ar_ppl_at_entropy_fitted(sweep()[:3], 3.0) is None  # too few temperatures for a quadratic


def _relf(steps, nfe, rounds, ppl, entropy=3.0, variant="relf", method=None, **kw):
    return {"variant": variant, "train_steps": steps, "nfe": nfe, "reflow_rounds": rounds, "gen_ppl": ppl,
            "entropy": entropy, "method": method or ("relf stochastic linear" if nfe == 64 else "relf euler"),
            **kw}


def test_targets_ratios():
    rows = [_ar(2.0, 20.0, 10), _ar(4.0, 80.0, 10), _ar(2.0, 40.0, 5), _ar(4.0, 160.0, 5),
            _relf(10, 64, 0, 46.0, renoise="linear"),
            _relf(10, 64, 0, 50.0, renoise="marginal", entropy=3.2, method="relf stochastic marginal"),
            _relf(5, 64, 0, 100.0, renoise="linear"),
            _relf(10, 8, 0, 200.0), _relf(10, 8, 2, 120.0), _relf(10, 16, 2, 48.3),
            _relf(5, 64, 0, 150.0, variant="no_singular"), _relf(10, 64, 0, 46.0, variant="guidance", guidance=1.3),
            _relf(10, 16, 0, 60.0), _relf(10, 64, 0, 40.0, variant="aux_head", method="relf stochastic marginal",
                                          entropy=3.5),
            _relf(10, 16, 0, 30.0, variant="aux_head")]
    t = targets(rows, (10, 5))
    m = t["steps10_relf64_vs_ar_at_matched_entropy"]
    assert m["ar_gen_ppl_interpolated"] == pytest.approx(40.0)  # sqrt(20 * 80)
    assert m["ratio"] == pytest.approx(46.0 / 40.0)
    assert t["steps5_relf64_vs_ar_at_matched_entropy"]["ratio"] == pytest.approx(100.0 / 80.0)
    assert t["reflow2_euler16_over_pre_stochastic64_gen_ppl"]["ratio"] == pytest.approx(48.3 / 46.0)
    assert t["reflow2_euler8_gen_ppl_reduction"]["reduction"] == pytest.approx(0.4)
    assert t["ablations_vs_relf64"]["no_singular"]["gen_ppl_over_baseline"] == pytest.approx(1.5)  # vs 5 steps
    # guidance rows sample with the default (marginal) renoise: against that row, not the linear one
    assert t["ablations_vs_relf64"]["guidance_1.3"]["gen_ppl_over_baseline"] == pytest.approx(46.0 / 50.0)
    assert t["renoise_marginal_over_linear"]["entropy_delta"] == pytest.approx(0.2)
    assert math.isfinite(t["renoise_marginal_over_linear"]["gen_ppl"])
    # extensions: against the plain model's row of the same sampler (marginal renoise at 64 NFE)
    assert t["extensions_vs_relf"]["aux_head_nfe64"]["gen_ppl_over_relf"] == pytest.approx(0.8)
    assert t["extensions_vs_relf"]["aux_head_nfe64"]["entropy_delta"] == pytest.approx(0.3)
    assert t["extensions_vs_relf"]["aux_head_nfe16"]["gen_ppl_over_relf"] == pytest.approx(0.5)
    # and against AR at the same entropy (3.5: between the 10-step AR points, sqrt(20 * 80) * 2^0.5)
    assert t["extensions_vs_relf"]["aux_head_nfe64"]["gen_ppl_over_ar_at_matched_entropy"] == pytest.approx(
        40.0 / (40.0 * 2 ** 0.5))
    assert t["extensions_vs_relf"]["aux_head_nfe64"]["entropy_outside_ar_sweep_nats"] == 0.0


def test_targets_compare_relf_with_the_positional_unigram_reference():
    rows = [_ar(2.0, 20.0, 10), _ar(4.0, 80.0, 10), _ar(2.0, 40.0, 5), _ar(4.0, 160.0, 5),
            _relf(10, 64, 0, 400.0), _relf(10, 8, 0, 600.0), _relf(5, 64, 0, 500.0), _relf(10, 8, 2, 300.0),
            {"variant": "reference", "method": "positional unigram", "train_steps": 0, "nfe": None,
             "reflow_rounds": 0, "gen_ppl": 500.0, "entropy": 3.0}]
    t = targets(rows, (10, 5))["relf_over_positional_unigram_gen_ppl"]
    assert t["positional_unigram"]["gen_ppl"] == 500.0
    assert t["best_relf_ratio"] == pytest.approx(0.8)  # before reflow only: 400 / 500


def test_positional_unigram_samples_follow_each_positions_frequencies(monkeypatch):
    from relf_jax.data import sources
    from relf_jax.eval.baselines import positional_unigram_samples
    from relf_jax.serving.engines import ByteTokenizer

    docs = ["ab"] * 3 + ["cd"]
    monkeypatch.setattr(sources, "iter_texts", lambda builder, split: iter(docs))
    tok = ByteTokenizer()
    s = positional_unigram_samples(None, tok, 2000, 6)
    # rows BOS x y EOS pad pad: each position independent, 'a'/'c' at 3:1, 'b'/'d' at 3:1
    counts = {}
    for text in s.texts:
        counts[text] = counts.get(text, 0) + 1
    assert set(counts) <= {"ab", "ad", "cb", "cd"} and all(s.complete)
    assert counts["ab"] / 2000 == pytest.approx(0.75 * 0.75, abs=0.04)
    assert counts["cb"] / 2000 == pytest.approx(0.25 * 0.75, abs=0.04)


def test_targets_compare_clean_prompts_with_renoised_ones():
    rows = [_ar(2.0, 20.0, 10), _ar(4.0, 80.0, 10), _ar(2.0, 40.0, 5), _ar(4.0, 160.0, 5),
            _relf(10, 64, 0, 46.0), _relf(5, 64, 0, 100.0)]
    prompted = [{"variant": "relf", "prompt_mode": "renoise", "nfe": 64, "gen_ppl": 4000.0, "entropy": 3.0},
                {"variant": "relf", "prompt_mode": "renoise", "nfe": 16, "gen_ppl": 5000.0, "entropy": 3.0},
                {"variant": "prompt_training", "prompt_mode": "renoise", "nfe": 64, "gen_ppl": 9.0, "entropy": 1.0},
                {"variant": "prompt_training", "prompt_mode": "clean", "nfe": 64, "gen_ppl": 1000.0, "entropy": 2.5}]
    t = targets(rows, (10, 5), prompted)
    assert t["prompted_reply_gen_ppl_clean_over_renoise_nfe64"]["ratio"] == pytest.approx(0.25)
    assert t["prompted_reply_gen_ppl_clean_over_renoise_nfe64"]["entropy_delta"] == pytest.approx(-0.5)
    assert "prompted_reply_gen_ppl_clean_over_renoise_nfe16" not in t  # no clean 16-NFE row
    assert "prompted_reply_gen_ppl_clean_over_renoise_nfe64" not in targets(rows, (10, 5))


def test_ar_replies_are_cut_at_the_end_of_their_turn():
    from experiments.bench.relf_rows import cut_turns
    from relf_jax.sampling.batch import Samples
    from relf_jax.serving.engines import ByteTokenizer

    tok = ByteTokenizer()
    user = tok.MARKERS["<user>"]
    bodies = [tok.encode("hi there") + [user] + tok.encode("more"), tok.encode("no end"), tok.encode("done")]
    s = Samples(texts=[tok.decode(b) for b in bodies], token_ids=bodies, complete=[False, False, True],
                seconds=1.0, tokens=30)
    cut = cut_turns(s, tok)
    assert cut.texts == ["hi there", "no end", "done"] and cut.complete == [True, False, True]
    assert cut_turns(s) is s  # ReLF prompted samples come cut already


def test_reflow_targets_for_an_extension_use_its_own_rows_and_the_nearest_entropy():
    rows = [_ar(2.0, 20.0, 10), _ar(4.0, 80.0, 10), _ar(2.0, 40.0, 5), _ar(4.0, 160.0, 5),
            _relf(10, 64, 0, 46.0), _relf(5, 64, 0, 100.0), _relf(10, 8, 0, 200.0), _relf(10, 8, 2, 120.0),
            _relf(10, 16, 2, 48.3),
            # the plain model (an extension row): two 64-NFE rows before reflow, the 16-NFE row after reflow is
            # compared with the one nearest its entropy (3.3: the marginal row at 3.2, not 2.0)
            _relf(10, 64, 0, 300.0, variant="plain", entropy=2.0, method="relf stochastic linear"),
            _relf(10, 64, 0, 400.0, variant="plain", entropy=3.2, method="relf stochastic marginal"),
            _relf(10, 8, 0, 500.0, variant="plain", entropy=3.0),
            _relf(10, 64, 1, 380.0, variant="plain", entropy=3.1, method="relf stochastic marginal"),
            _relf(10, 8, 1, 418.0, variant="plain", entropy=3.0),
            _relf(10, 64, 2, 350.0, variant="plain", entropy=3.1, method="relf stochastic marginal"),
            _relf(10, 8, 2, 350.0, variant="plain", entropy=3.1),
            _relf(10, 16, 2, 360.0, variant="plain", entropy=3.3)]
    t = targets(rows, (10, 5))
    assert t["reflow2_euler8_gen_ppl_reduction"]["reduction"] == pytest.approx(0.4)  # the default model's
    assert t["plain_reflow2_euler8_gen_ppl_reduction"]["reduction"] == pytest.approx(0.3)
    assert t["plain_reflow2_euler8_gen_ppl_reduction"]["entropy_delta"] == pytest.approx(0.1)
    e16 = t["plain_reflow2_euler16_over_pre_stochastic64_gen_ppl"]
    assert e16["ratio"] == pytest.approx(0.9) and e16["entropy_delta"] == pytest.approx(0.1)
    gaps = t["plain_euler8_over_stochastic64_gen_ppl_by_reflow_round"]
    assert gaps["0"]["ratio"] == pytest.approx(500.0 / 400.0)  # the marginal row (3.2) is nearer 3.0
    assert gaps["1"]["ratio"] == pytest.approx(1.1) and gaps["2"]["ratio"] == pytest.approx(1.0)
    # the matched-entropy target takes the 64-NFE row nearest the AR sweep (both inside it here)
    assert t["steps10_relf64_vs_ar_at_matched_entropy"]["relf_gen_ppl"] == 46.0
    # no rows after reflow for a variant: no targets for it
    assert "aux_head_reflow2_euler8_gen_ppl_reduction" not in t


def test_matched_entropy_target_takes_the_64_nfe_row_inside_the_ar_sweep():
    rows = [_ar(2.0, 20.0, 10), _ar(4.0, 80.0, 10),
            _relf(10, 64, 0, 30.0, entropy=1.0, renoise="linear"),  # mode-seeking: 1 nat below the sweep
            _relf(10, 64, 0, 60.0, entropy=3.0, renoise="marginal", method="relf stochastic marginal")]
    m = targets(rows, (10,))["steps10_relf64_vs_ar_at_matched_entropy"]
    assert m["relf_gen_ppl"] == 60.0 and m["entropy_outside_ar_sweep_nats"] == 0.0
    assert m["ratio"] == pytest.approx(60.0 / 40.0)


def test_reflow_is_compared_with_its_no_pairs_control_and_a_reflow_only_run_has_no_ar_targets():
    rows = [_relf(10, 64, 0, 400.0, variant="plain", method="relf stochastic marginal"),
            _relf(10, 8, 0, 500.0, variant="plain"), _relf(10, 16, 0, 450.0, variant="plain"),
            _relf(10, 8, 2, 350.0, variant="plain", entropy=3.2),
            _relf(10, 16, 2, 360.0, variant="plain"),
            # data-only rounds of the same length: the 8-NFE row gains more without the pairs
            _relf(10, 8, 2, 400.0, variant="plain_nopairs", entropy=3.0),
            _relf(10, 16, 2, 300.0, variant="plain_nopairs")]
    t = targets(rows, (10,))  # no AR rows (--parts reflow): no matched-entropy target, no error
    assert not any(k.startswith("steps10_relf64_vs_ar") for k in t)
    c = t["plain_reflow2_vs_nopairs_control"]
    assert c["euler8"]["nopairs2_reduction"] == pytest.approx(0.2)
    assert c["euler8"]["reflow2_over_nopairs2"] == pytest.approx(350.0 / 400.0)
    assert c["euler8"]["entropy_delta_reflow2_minus_nopairs2"] == pytest.approx(0.2)
    assert c["euler16"]["reflow2_over_nopairs2"] == pytest.approx(1.2)
    assert t["plain_reflow2_euler8_gen_ppl_reduction"]["reduction"] == pytest.approx(0.3)
    assert "reflow2_vs_nopairs_control" not in t  # the default model has no rows here


def test_core_part_runs_alone():
    import pytest

    from experiments.bench.relf import bench_relf
    from experiments.bench.relf_core import CORE_VARIANTS
    from relf_jax.errors import UserError

    with pytest.raises(UserError, match="core alone"):
        bench_relf("unused.json", parts=["core", "models"])
    # the default (`relf-jax bench relf` without --parts) is the three parts that run together
    from experiments.bench.relf_variants import DEFAULT_PARTS

    assert inspect.signature(bench_relf).parameters["parts"].default == DEFAULT_PARTS == ("models", "reflow",
                                                                                           "latency")
    assert CORE_VARIANTS["relf"] == [] and CORE_VARIANTS["plain"] == ["flow.blind_spot=false",
                                                                      "model.flow_embed_head=false"]
    assert CORE_VARIANTS["free_head"] == ["model.flow_embed_head=false"]  # the default before 12-07


def _core_rows():
    ar = [{"variant": "ar", "train_steps": s, "method": f"ar T={t}", "temperature": t, "entropy": e,
           "gen_ppl": p * f, "nfe": None}
          for s, f in ((600, 1.0), (1200, 0.5)) for t, e, p in ((0.8, 3.0, 100.0), (1.0, 3.4, 400.0))]
    relf = [{"variant": "relf", "train_steps": s, "method": "relf stochastic", "nfe": 64, "entropy": 3.2,
             "gen_ppl": p} for s, p in ((600, 400.0), (1200, 300.0))]
    uni = {"variant": "reference", "train_steps": 0, "method": "positional unigram", "nfe": None,
           "entropy": 3.1, "gen_ppl": 500.0}
    return [uni, *ar, *relf]


def test_core_targets_over_budgets():
    from experiments.bench.relf_core import core_targets

    t = core_targets(_core_rows(), {"ar": 2048.0, "relf": 1647.0}, (600, 1200))
    m = t["steps600_relf_stochastic64_vs_ar_at_matched_entropy"]
    assert m["ar_gen_ppl_interpolated"] == pytest.approx(200.0)  # halfway in log PPL: sqrt(100 * 400)
    assert m["ratio"] == pytest.approx(2.0) and m["target"].startswith("<= 1.5")
    assert t["steps1200_relf_stochastic64_vs_ar_at_matched_entropy"]["ratio"] == pytest.approx(3.0)
    assert t["steps600_over_positional_unigram_gen_ppl"]["relf stochastic 64"] == pytest.approx(0.8)
    assert t["by_budget"]["relf_stochastic64"]["1200"]["ratio_vs_ar"] == pytest.approx(3.0)
    assert t["gen_ppl_falls_with_budget"] == {"relf_stochastic64": True}
    assert m["ratio_fitted"] is None  # two temperatures: too few for the fit
    rows = _core_rows() + [{"variant": "ar", "train_steps": 600, "method": f"ar T={t}", "temperature": t,
                            "entropy": 3.0 + 2 * (t - 0.8), "gen_ppl": 100.0 * 4 ** ((t - 0.8) / 0.2), "nfe": None}
                           for t in (0.9, 1.1)]
    m = core_targets(rows, {}, (600,))["steps600_relf_stochastic64_vs_ar_at_matched_entropy"]
    assert m["ar_gen_ppl_fitted"] == pytest.approx(200.0, rel=1e-3)
    assert m["ratio_fitted"] == pytest.approx(2.0, rel=1e-3)
    assert m["ar_temperature_fitted"] == pytest.approx(0.9, abs=1e-3)
    assert "ratio_pooled" not in m  # rows without a pooled entropy
    # the pooled read-off: the ReLF row's pooled entropy sits at T = 0.8's (its per-sample one at 0.9's)
    for r in rows:
        r["pooled_entropy"] = 4.0 if r["variant"] == "relf" else 4.0 + (r.get("temperature", 0.8) - 0.8)
    m = core_targets(rows, {}, (600,))["steps600_relf_stochastic64_vs_ar_at_matched_entropy"]
    assert m["ratio"] == pytest.approx(2.0) and m["ratio_pooled"] == pytest.approx(4.0)
    assert m["ratio_pooled_fitted"] == pytest.approx(4.0, rel=1e-3)
    assert m["ar_temperature_pooled_fitted"] == pytest.approx(0.8, abs=1e-3)
    rows = _core_rows()
    rows[-1]["gen_ppl"] = 450.0
    assert core_targets(rows, {}, (600, 1200))["gen_ppl_falls_with_budget"] == {"relf_stochastic64": False}
    assert "by_budget" not in core_targets(rows, {}, (600,))


def test_budget_plot_writes_a_png(tmp_path):
    from experiments.bench.relf_core import budget_plot

    path = tmp_path / "b.png"
    bd = [{"label": "block diffusion", "train_steps": s, "gen_ppl": p} for s, p in ((600, 420.0), (1200, 380.0))]
    budget_plot(_core_rows(), (600, 1200), str(path), bd)
    assert path.stat().st_size > 1000


def test_core_options_are_checked():
    from experiments.bench.relf_core import bench_relf_core
    from experiments.commands.bench import bench_options
    from experiments.launch import build_parser
    from relf_jax.errors import UserError

    with pytest.raises(UserError, match="variants must be among"):
        bench_relf_core("unused.json", variants=["nope"])
    from experiments.bench.relf import bench_relf

    for parts, variants in ((["reflow"], ["query"]), (["models", "reflow"], ["relf"]), (["reflow"], [])):
        with pytest.raises(UserError, match="--variants applies"):  # checked before anything is prepared
            bench_relf("unused.json", parts=parts, variants=variants)
    parse = build_parser().parse_args
    opts = bench_options(parse(["bench", "relf", "--out", "x.json", "--parts", "core", "--budgets", "600,1200",
                                 "--variants", "relf", "--ar-rows", "a.json"]))
    assert opts == {"parts": ["core"], "budgets": [600, 1200], "variants": ["relf"], "ar_rows": "a.json"}
    opts = bench_options(parse(["bench", "relf", "--out", "x.json", "--parts", "reflow", "--variants", "relf"]))
    assert opts == {"parts": ["reflow"], "variants": ["relf"]}
    for argv in (["bench", "relf", "--out", "x.json", "--budgets", "600"],  # not the core part
                 ["bench", "spec", "--out", "x.json", "--variants", "relf"],
                 ["bench", "relf", "--out", "x.json", "--parts", "models,reflow", "--variants", "relf"],
                 ["bench", "relf", "--out", "x.json", "--parts", "core", "--ablation"]):
        with pytest.raises(UserError):
            bench_options(parse(argv))


def test_core_run_reuses_rows_and_keeps_a_borrowed_sweeps_extra_temperatures(tmp_path, monkeypatch):
    """Every AR row of a budget found in --out or a borrowed report: nothing trained, each
    temperature once, the borrowed sweep's T = 1.2 kept."""
    import experiments.bench.relf_core as core

    monkeypatch.setattr(core.rj, "train", lambda *a, **k: pytest.fail("trained a budget whose rows were all there"))
    run = object.__new__(core.CoreRun)
    run.out, run.preset, run.n, run.rows = str(tmp_path / "core.json"), "cpu", 4, []

    def ar(t, source=None):
        return {"method": f"ar T={t:g}", "variant": "ar", "train_steps": 600, "nfe": None, "temperature": t,
                "gen_ppl": 100.0 * t, "entropy": 3.0 + t / 10, **({"source": source} if source else {})}

    # the same borrowed rows twice (read back from --out and borrowed again), one extra temperature
    run.old = [ar(0.8, "bd.json"), ar(1.0, "bd.json"), ar(1.2, "bd.json"), ar(0.8, "bd.json"), ar(1.2, "bd.json")]
    run.ar_rows(600, (0.8, 1.0), 2048.0)
    assert [r["temperature"] for r in run.rows] == [0.8, 1.0, 1.2]


@pytest.mark.parametrize("variants, studied", [(["relf"], ["steps4"]), (["plain"], ["steps4_plain"]),
                                                (None, ["steps4_plain", "steps4"])])
def test_reflow_part_runs_the_studies_of_the_named_models_only(tmp_path, monkeypatch, variants, studied):
    """`--parts reflow --variants relf` trains and reflows the default model alone (no plain model)."""
    import types

    import experiments.bench.relf as br

    shared = tmp_path / "shared"
    (shared / "data").mkdir(parents=True)
    (shared / "tokenizer.model").write_text("tok")
    cfg = types.SimpleNamespace(workdir=str(shared), train=types.SimpleNamespace(steps=4, batch_size=2),
                                data=types.SimpleNamespace(seq_len=8))
    trained, reflowed = [], []
    monkeypatch.setattr(br, "make_config", lambda preset, overrides, workdir: cfg)
    for name in ("prepare_data", "prepare_tokenizer", "exact_judge"):
        monkeypatch.setattr(br, name, lambda *a, **k: types.SimpleNamespace(name="fake"))
    monkeypatch.setattr(br.rj, "train", lambda c: trained.append(c))
    monkeypatch.setattr(br, "load_model", lambda path, family: path)
    monkeypatch.setattr(br, "relf_rows", lambda *a, **k: None)
    monkeypatch.setattr(br, "targets", lambda *a, **k: {})
    monkeypatch.setattr(br, "reflow", lambda wd, **k: reflowed.append(os.path.basename(wd)) or {})
    report = br.bench_relf(str(tmp_path / "out.json"), workdir=str(tmp_path / "root"), parts=["reflow"],
                           variants=variants)
    assert sorted(report["straightness"]) == sorted({"steps4": "relf", "steps4_plain": "plain"}[s] for s in studied)
    # each study: the reflow rounds and the no-pairs control rounds
    assert reflowed == [s for s in studied for _ in range(2)]
    assert len(trained) == 1 + ("steps4_plain" in studied)


def test_variant_costs_time_each_network_against_the_first(tmp_path):
    import json

    from experiments.bench.relf_cost import variant_costs
    from relf_jax.errors import UserError

    out = tmp_path / "cost.json"
    rep = variant_costs(str(out), ("relf", "plain"), preset="tiny", vocab=32, sample_batch=2, train_batch=2, reps=1,
                        calls=1)
    assert [r["variant"] for r in rep["rows"]] == ["relf", "plain"] and json.loads(out.read_text()) == rep
    first, plain = rep["rows"]
    assert first["forward_over_relf"] == 1.0 and first["train_step_over_relf"] == 1.0
    assert plain["forward_ms"] > 0 and plain["train_step_over_relf"] == plain["train_step_ms"] / first["train_step_ms"]
    with pytest.raises(UserError, match="variants must be among"):
        variant_costs(None, ("relf", "nope"))


def test_the_ar_sweep_goes_on_up_until_it_passes_the_relf_rows_entropy(monkeypatch):
    from experiments.bench.relf_core import CoreRun

    run = object.__new__(CoreRun)
    run.rows = [{"variant": "ar", "train_steps": 1200, "temperature": t, "gen_ppl": 100 * t, "entropy": e}
                for t, e in ((1.0, 3.20), (1.1, 3.25))]
    run.old = [{"variant": "ar", "train_steps": 1200, "temperature": 1.2, "method": "ar T=1.2", "nfe": None}]
    entropy_at = {1.2: 3.30, 1.3: 3.33, 1.4: 3.38, 1.5: 3.45}
    trained, measured = [], []
    monkeypatch.setattr(run, "have", lambda key: next((r for r in run.old if r["temperature"] == key["temperature"]),
                                                      None))
    monkeypatch.setattr(run, "ar_model", lambda steps: trained.append(steps) or "model")

    def ar_row(key, lm, tokens):
        measured.append((key["temperature"], lm))
        run.rows.append({**key, "gen_ppl": 1.0, "entropy": entropy_at[key["temperature"]]})

    monkeypatch.setattr(run, "ar_row", ar_row)
    run.extend_ar_sweep(1200, {"entropy": 3.36}, tokens=2048.0)
    # 1.2 was measured before (no model needed for it); 1.3 trains the model once; 1.4 passes 3.36
    assert [t for t, _ in measured] == [1.2, 1.3, 1.4] and trained == [1200]
    assert measured[0][1] is None and measured[2][1] == "model"
    run.extend_ar_sweep(1200, {"entropy": 3.36}, tokens=2048.0)  # already past it: nothing more
    assert len(measured) == 3
    run.extend_ar_sweep(1200, {"entropy": 9.0}, tokens=2048.0, top=1.5)  # stops at the top temperature
    assert [t for t, _ in measured] == [1.2, 1.3, 1.4, 1.5]


def test_the_ar_sweep_extension_reads_the_pooled_entropy_where_the_rows_carry_it(monkeypatch):
    """The per-sample column of the ReLF row lies above every AR row, its pooled entropy inside
    the sweep: nothing is added. Past the pooled sweep, AR rows are added until one passes it."""
    from experiments.bench.relf_core import CoreRun

    run = object.__new__(CoreRun)
    run.rows = [{"variant": "ar", "train_steps": 600, "temperature": t, "gen_ppl": 100 * t, "entropy": 3.2,
                 "pooled_entropy": p} for t, p in ((1.0, 5.40), (1.1, 5.50))]
    measured = []
    monkeypatch.setattr(run, "have", lambda key: None)
    monkeypatch.setattr(run, "ar_model", lambda steps: "model")

    def ar_row(key, lm, tokens):
        measured.append(key["temperature"])
        run.rows.append({**key, "gen_ppl": 1.0, "entropy": 3.2, "pooled_entropy": 5.5 + key["temperature"] - 1.1})

    monkeypatch.setattr(run, "ar_row", ar_row)
    run.extend_ar_sweep(600, {"entropy": 3.5, "pooled_entropy": 5.45}, tokens=2048.0)
    assert measured == []
    run.extend_ar_sweep(600, {"entropy": 3.1, "pooled_entropy": 5.65}, tokens=2048.0)
    assert measured == pytest.approx([1.2, 1.3])


def test_entropy_probe_reads_each_model_five_ways(monkeypatch, tmp_path):
    """`relf_core.entropy_probe` with the models and samplers faked: AR's samples are short at low
    T, ReLF's long and repetitive; every row carries the five read-offs (topic purity too) and the file is written."""
    import json
    import types

    import numpy as np

    import experiments.bench.relf_core as core
    from relf_jax.config import Config

    def samples(texts):
        return types.SimpleNamespace(texts=texts, complete=[True] * len(texts))

    judge = types.SimpleNamespace(tokenize=str.split, score=lambda texts, complete: (
        np.array([-float(len(t.split())) for t in texts]), np.array([float(len(t.split())) for t in texts])))
    monkeypatch.setattr(core, "load_model", lambda path, family: types.SimpleNamespace(
        cfg=types.SimpleNamespace(sample=Config().sample, data=types.SimpleNamespace(seq_len=64))))
    monkeypatch.setattr(core, "exact_judge", lambda cfg: judge)
    # AR's words: eight weather words, then food words (topic purity 1 at T = 0.8, 8 / 12 at 1.2)
    words = ["rain", "snow", "wind", "storm", "cloud", "sun", "fog", "thunder", "pasta", "bread", "rice", "soup"]
    monkeypatch.setattr(core, "sample", lambda lm, n, sample_cfg: samples(
        [" ".join(words[:int(10 * sample_cfg.temperature)])] * n))
    monkeypatch.setattr(core, "sample_relf", lambda lm, n, nfe, sampler, grid: samples(
        ["rain pasta rain pasta rain pasta rain pasta rain pasta rain pasta"] * n))
    out = tmp_path / "probe.json"
    rows = core.entropy_probe(str(out), "ar", "relf", temperatures=(0.8, 1.2), n=4, prefix_lengths=(8,))
    assert [r["name"] for r in rows] == ["ar T=0.8", "ar T=1.2", "relf euler 64 late"]
    ar08, ar12, relf = rows
    assert ar08["entropy"] == pytest.approx(math.log(8)) and ar12["entropy"] == pytest.approx(math.log(12))
    assert ar08["entropy_first8"] == ar12["entropy_first8"] == pytest.approx(math.log(8))
    assert relf["pooled_entropy"] == pytest.approx(math.log(2)) and relf["share_first8"] == 1.0
    assert relf["gen_ppl"] == pytest.approx(math.e) and relf["mean_words"] == 12
    assert (ar08["topic_purity"], ar12["topic_purity"], relf["topic_purity"]) == pytest.approx((1.0, 8 / 12, 0.5))
    assert json.loads(out.read_text())["rows"] == rows


def test_the_bag_of_tokens_topic_reader_reads_the_neighbours_only():
    """Two topics (words {0, 1} and {2, 3}), orthogonal embeddings: near t = 1 each position's
    posterior names the topic of the *other* positions' words (leave-one-out), at t = 0 it is the
    uniform prior, masked positions count for nothing; and against the product rule by hand."""
    import numpy as np

    from experiments.bench.relf_core import bag_of_tokens_topic_posterior

    table = 3.0 * np.eye(4)
    log_unigrams = np.log(np.array([[0.5, 0.5, 1e-9, 1e-9], [1e-9, 1e-9, 0.5, 0.5]]))
    tokens = np.array([0, 2, 3])
    post = bag_of_tokens_topic_posterior(table[tokens], 0.999, table, log_unigrams, np.ones(3, bool))
    # position 0 sees words 2 and 3 (topic 1); positions 1 and 2 see one word of each topic
    assert post[0, 1] > 0.999 and np.allclose(post[1:], 0.5, atol=1e-6)
    # masked out, word 3 tells nothing: position 0 reads word 2 alone, position 2 word 0 against word 2
    post = bag_of_tokens_topic_posterior(table[tokens], 0.999, table, log_unigrams, np.array([True, True, False]))
    assert post[0, 1] > 0.999 and post[1, 0] > 0.999 and np.allclose(post[2], 0.5, atol=1e-6)
    np.testing.assert_allclose(bag_of_tokens_topic_posterior(np.zeros((3, 4)), 0.0, table, log_unigrams,
                                                             np.ones(3, bool)), 0.5)
    # a noisy case against the formula: p(k | Z_-0) ∝ prod_{j=1,2} sum_w p(w | k) N(z_j; t e_w, (1-t)^2)
    rng, t = np.random.default_rng(0), 0.4
    z = t * table[tokens] + (1 - t) * rng.standard_normal((3, 4))
    dens = np.exp(-((z[:, None] - t * table[None]) ** 2).sum(-1) / (2 * (1 - t) ** 2))  # [3, V]
    like = dens @ np.exp(log_unigrams).T  # [3, K]
    want = like[1] * like[2] / (like[1] * like[2]).sum()
    np.testing.assert_allclose(bag_of_tokens_topic_posterior(z, t, table, log_unigrams, np.ones(3, bool))[0], want,
                               rtol=1e-6)
