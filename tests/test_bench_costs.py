"""`bench spec`'s verification-cost probe on a tiny model: shapes of the report, sane numbers; where
its draft is distilled."""

import math
import os

import numpy as np
import pytest

from relf_jax.checkpoint import LoadedModel
from relf_jax.config import Config
from relf_jax.speculative.cost import forward_costs


def test_forward_costs_reports_both_batches(tiny_model, tiny_model_cfg):
    graphdef, params = tiny_model
    lm = LoadedModel(cfg=Config(), model_cfg=tiny_model_cfg, graphdef=graphdef, params=params, tokenizer=None, step=0)
    out = forward_costs(lm, k=3, batches=(1, 2), context=16, reps=2)
    assert set(out) == {"b1", "b2"}
    for row in out.values():
        assert row["one_token_ms"] > 0 and row["4_tokens_ms"] > 0
        assert abs(row["ratio"] - row["4_tokens_ms"] / row["one_token_ms"]) < 1e-9


def test_round_profile_splits_a_round_into_its_parts():
    from relf_jax.methods import DraftModel, Speculative
    from relf_jax.speculative.cost import expected_speedup, round_profile
    from tests._serving import tiny_lm

    lm = tiny_lm(num_layers=1)
    out = round_profile(lm, Speculative(rule="nsd", k=3, proposer=DraftModel(lm)), draft=lm, batch=2, context=8,
                        reps=1, loops=2)
    assert out["k"] == 3 and out["batch"] == 2
    for name in ("propose_ms", "target_forward_ms", "round_ms", "one_token_ms"):
        assert 0 < out[name] < 1e5, (name, out[name])
    parts = out["propose_ms"] + out["target_forward_ms"] + out["verify_ms"] + out["bookkeeping_ms"]
    assert abs(parts - out["round_ms"]) < 1e-6
    # tau tokens per round over (K drafts + the K + 1-token forward), in one-token forwards
    assert expected_speedup(3.0, propose_ms=1.0, target_forward_ms=1.0, one_token_ms=1.0) == 1.5
    assert expected_speedup(2.0, propose_ms=0.0, target_forward_ms=1.0, one_token_ms=1.0) == 2.0


def test_decode_step_is_the_slope_over_reply_lengths_and_feeds_the_regime():
    from experiments.bench.spec_cost import regime
    from relf_jax.speculative.cost import decode_step_ms, weight_bytes
    from tests._serving import tiny_lm

    lm = tiny_lm(num_layers=1)
    out = decode_step_ms(lm, batch=1, prompt_len=4, steps=(4, 12), reps=1)
    assert out["generate_4_ms"] > 0 and out["generate_12_ms"] > 0
    # two lengths: the line runs through both medians
    assert out["step_ms"] == pytest.approx((out["generate_12_ms"] - out["generate_4_ms"]) / 8)
    assert out["fixed_ms"] + 4 * out["step_ms"] == pytest.approx(out["generate_4_ms"])
    # more lengths: the least-squares line through the medians
    three = decode_step_ms(lm, batch=1, prompt_len=4, steps=(4, 8, 12), reps=1)
    slope, intercept = np.polyfit([4, 8, 12], [three[f"generate_{n}_ms"] for n in (4, 8, 12)], 1)
    assert three["step_ms"] == pytest.approx(slope) and three["fixed_ms"] == pytest.approx(intercept)
    # the regime reads the weights' traffic per step three ways, each over the matrix-vector rate
    costs = {"b1": {"one_token_ms": 0.5, "ratio": 1.2}}
    rep = regime(lm, [{"batch": 1, "tokens_per_s": 1000.0}], costs, {"gb_per_s": 10.0},
                 {**out, "step_ms": 0.8})
    nbytes = weight_bytes(lm)
    assert rep["step_gb_per_s"] == pytest.approx(nbytes / 0.5 / 1e6)
    assert rep["ar_decode_step_gb_per_s"] == pytest.approx(nbytes / 0.8 / 1e6)
    assert rep["ar_decode_step_over_matvec"] == pytest.approx(nbytes / 0.8 / 1e6 / 10.0)
    assert rep["ar_decode_gb_per_s"] == pytest.approx(nbytes * 1000.0 / 1e9)
    assert "ar_decode_step" not in regime(lm, [], costs, {"gb_per_s": 10.0})
    # the speculative loop: rounds counted, the slope per round and the prefill's intercept
    from relf_jax.methods import DraftModel, Speculative
    from relf_jax.speculative.cost import speculative_round_ms

    sp = speculative_round_ms(lm, Speculative(rule="nsd", k=2, proposer=DraftModel(lm)), draft=lm, prompt_len=4,
                              steps=(4, 12), reps=1)
    # a draft that is the target accepts every token: K + 1 = 3 a round, the first from the prefill
    assert sp["rounds"] == {4: 1, 12: 4}
    assert sp["round_ms"] == pytest.approx((sp["generate_12_ms"] - sp["generate_4_ms"]) / 3)
    assert sp["fixed_ms"] + sp["round_ms"] == pytest.approx(sp["generate_4_ms"])


def test_cost_model_rows_name_the_gap_between_measured_and_predicted():
    from experiments.bench.spec_cost import predictions

    rows = [{"method": "ar", "rule": "none", "proposer": "-", "batch": 1, "temperature": 1.0, "k": None,
             "tokens_per_s": 100.0, "tau": 1.0},
            {"method": "nsd@0.9", "rule": "nsd", "proposer": "draft", "batch": 1, "temperature": 1.0, "k": 4,
             "tokens_per_s": 150.0, "tau": 3.0},
            {"method": "nsd@0.9", "rule": "nsd", "proposer": "draft", "batch": 1, "temperature": 1.0, "k": 2,
             "tokens_per_s": 120.0, "tau": 2.0},  # another K: no profile of its round
            {"method": "nsd@0.9", "rule": "nsd", "proposer": "prompt_lookup", "batch": 1, "temperature": 1.0,
             "k": 4, "tokens_per_s": 90.0, "tau": 1.5}]  # proposer not profiled
    prof = {"propose_ms": 2.0, "target_forward_ms": 10.0, "verify_ms": 1.0, "bookkeeping_ms": 0.5,
            "round_ms": 13.5, "one_token_ms": 8.0}
    (p,) = predictions(rows, {"draft_b1": prof}, k=4)
    assert p["measured_speedup"] == 1.5 and p["predicted_speedup"] == 3.0 * 8.0 / 12.0
    assert p["ar_step_ms"] == 10.0 and p["ar_overhead_ms"] == 2.0  # 1 / 100 tokens/s, beyond the 8 ms forward
    assert p["round_measured_ms"] == 20.0 and p["outside_round_ms"] == 6.5  # 3 tokens / 150 tokens/s
    # the measured speedup is tau x AR step / measured round: the named parts add up
    assert abs(p["measured_speedup"] - p["tau"] * p["ar_step_ms"] / p["round_measured_ms"]) < 1e-12
    assert p["measured_over_predicted"] == 1.5 / 2.0
    assert "predicted_speedup_forward_cost" not in p
    # with the report's forward costs: r = 1.5 for 5 tokens at batch 1, c = 2 / 8 for the 4 drafts
    (p,) = predictions(rows, {"draft_b1": prof}, k=4, costs={"b1": {"ratio": 1.5}, "b8": {"ratio": 3.0}})
    assert p["predicted_speedup_forward_cost"] == pytest.approx(3.0 / (0.25 + 1.5))
    assert p["measured_over_predicted_forward_cost"] == pytest.approx(1.5 / (3.0 / 1.75))
    assert "predicted_speedup_with_prefill" not in p  # the row has no reply length
    # with the loops' per-step costs and prefills: AR's 40-token replies cost 10 ms a step + 20 ms of
    # prefill (10.5 ms a token); the row's 31-token replies 31 / 3 - 1 rounds of 25 ms + 30 ms
    rows[1]["mean_tokens"], rows[0]["mean_tokens"] = 31.0, 40.0
    loops = {"ar_b1": {"step_ms": 10.0, "fixed_ms": 20.0}, "draft_b1": {"round_ms": 25.0, "fixed_ms": 30.0}}
    (p,) = predictions(rows, {"draft_b1": prof}, k=4, loops=loops)
    rounds = 31.0 / 3.0 - 1.0
    spec_token_ms = (rounds * 25.0 + 30.0) / 31.0
    assert p["predicted_speedup_with_prefill"] == pytest.approx(10.5 / spec_token_ms)
    assert p["measured_over_predicted_with_prefill"] == pytest.approx(1.5 * spec_token_ms / 10.5)
    assert p["prefill_per_token_ar_ms"] == pytest.approx(20.0 / 40.0)
    assert p["prefill_per_round_ms"] == pytest.approx(30.0 / rounds)
    assert p["loop_overhead_per_round_ms"] == pytest.approx(25.0 - 2.0 - 10.0)


def test_another_preset_s_forward_cost_is_measured_on_its_shape():
    from experiments.bench.spec_cost import preset_forward_cost
    from relf_jax.config import make_config

    out = preset_forward_cost("tiny", 2, vocab=64)
    assert out["preset"] == "tiny" and set(out) >= {"b1", "b8", "weight_bytes"}
    m = make_config("tiny").model
    d, dh, f = m.d_model, m.resolved_head_dim, m.mlp_dim
    attn = d * dh * (2 * m.num_heads + 2 * m.num_kv_heads)  # wq, wo; wk, wv
    per_layer = attn + 3 * d * f + 2 * d  # + SwiGLU, two norms
    assert out["weight_bytes"] == 4 * (64 * d + m.num_layers * per_layer + d)  # + tied embedding, final norm
    assert out["b1"]["ratio"] > 0 and out["b8"]["3_tokens_ms"] > 0


def test_a_longer_distillation_gets_a_draft_folder_of_its_own(tmp_path, monkeypatch):
    """The default draft (half the target's steps) lives in <workdir>/draft; --draft-steps N in
    <workdir>/draft_steps<N>, so the two are measured side by side and neither overwrites the other."""
    import relf_jax as rj
    import relf_jax.loading
    import relf_jax.speculative.recipes as recipes
    from experiments.bench.common import ensure_target_and_draft
    from relf_jax.errors import UserError

    calls = []
    monkeypatch.setattr(rj, "train", lambda cfg: None)
    monkeypatch.setattr(relf_jax.loading, "load_model", lambda path, family: path)
    monkeypatch.setattr(recipes, "train_draft", lambda target, overrides, workdir: calls.append((overrides, workdir)))
    wd = str(tmp_path)
    for steps in (None, 300, 1200):  # the cpu preset trains 600 steps: 300 is the default draft
        _, _, draft = ensure_target_and_draft("cpu", wd, ["model.d_model=64"], ["model.num_layers=1"],
                                              distill_steps=steps)
        assert draft == calls[-1][1]
    assert calls == [(["model.num_layers=1", "train.steps=300"], os.path.join(wd, "draft")),
                     (["model.num_layers=1", "train.steps=300"], os.path.join(wd, "draft")),
                     (["model.num_layers=1", "train.steps=1200"], os.path.join(wd, "draft_steps1200"))]
    with pytest.raises(UserError, match="distillation steps must be >= 1"):
        ensure_target_and_draft("cpu", wd, distill_steps=0)


def test_interleaved_timing_takes_each_ratio_within_a_round(monkeypatch):
    """Rows timed round-robin with the order rotated each round; a host that slows down round by
    round scales both sides of a ratio alike, so the reported medians are the rows' true ratios."""
    import types

    import relf_jax.speculative.recipes as recipes
    from experiments.bench.spec import INTERLEAVED, interleaved_timing
    from relf_jax.methods import Autoregressive, DraftModel

    speed = {"ar_b1": 100.0, "standard_draft_b1": 170.0, "nsd0.9_draft_b1": 210.0, "nsd0.9_ngram_b1": 250.0,
             "nsd0.9_sharp_draft_b1": 230.0, "standard_draft_T0.7_b1": 180.0, "ar_b8": 400.0,
             "standard_draft_b8": 360.0}
    calls = []

    def fake_sample(lm, prompts, sample_cfg, method, ngram_table):
        b = sample_cfg.batch_size
        if isinstance(method, Autoregressive):
            name = f"ar_b{b}"
        elif method.rule == "standard":
            t = sample_cfg.temperature
            name = "standard_draft" + ("" if t == 1.0 else f"_T{t:g}") + f"_b{b}"
        elif method.draft_temperature_scale != 1.0:
            name = f"nsd0.9_sharp_draft_b{b}"
        else:
            name = f"nsd0.9_{'draft' if isinstance(method.proposer, DraftModel) else 'ngram'}_b{b}"
        slow = 1.0 + len(calls) // len(INTERLEAVED)  # the host slows down every round
        calls.append(name)
        return types.SimpleNamespace(tokens_per_s=speed[name] / slow, tau=1.0 if name.startswith("ar") else 2.0,
                                     tokens=40)

    monkeypatch.setattr(recipes, "sample", fake_sample)
    cfg = Config()
    # the decoding loops, timed once a round: AR 10 ms a step, the draft's round 15 ms, the table's
    # 12 ms, 40 ms of prefill each
    loops = {"ar_b1": {"step_ms": 10.0, "fixed_ms": 40.0}, "draft_b1": {"round_ms": 15.0, "fixed_ms": 40.0},
             "corpus_ngram_b1": {"round_ms": 12.0, "fixed_ms": 40.0}}
    out = interleaved_timing(None, ["p"], cfg, None, None, k=4, max_new=8, reps=3, loops=lambda: loops)
    n = len(INTERLEAVED)
    assert len(calls) == 3 * n and sorted(calls[:n]) == sorted(speed)
    assert [calls[r * n] for r in range(3)] == [INTERLEAVED[r][0] for r in range(3)]  # rotated each round
    assert out["ratios"]["standard_over_ar_b1"] == pytest.approx(1.7)
    assert out["ratios"]["nsd0.9_over_standard_b1"] == pytest.approx(210 / 170)
    assert out["ratios"]["nsd0.9_sharp_over_standard_b1"] == pytest.approx(230 / 170)
    assert out["ratios"]["nsd0.9_sharp_over_standard_T0.7_b1"] == pytest.approx(230 / 180)
    assert out["ratios"]["standard_over_ar_b8"] == pytest.approx(0.9)
    assert len(out["tokens_per_s"]["ar_b1"]) == 3 and out["tokens_per_s"]["ar_b1"][2] < out["tokens_per_s"]["ar_b1"][0]
    # predicted per token from the loops: AR 10 + 40 / 40 = 11 ms; 40-token replies at tau 2 take
    # 19 rounds: (19 x 15 + 40) / 40 = 8.125 ms with the draft, (19 x 12 + 40) / 40 = 6.7 with the table
    cm = out["cost_model"]
    assert set(cm) == {name for name in out["ratios"] if name.endswith("_b1")}  # b1 only
    assert "standard_over_ar_b8" not in cm
    assert cm["standard_over_ar_b1"]["predicted"] == pytest.approx(11 / 8.125)
    assert cm["standard_over_ar_b1"]["measured_over_predicted"] == pytest.approx(1.7 / (11 / 8.125))
    assert cm["nsd0.9_ngram_over_ar_b1"]["predicted"] == pytest.approx(11 / 6.7)
    assert cm["nsd0.9_over_standard_b1"]["predicted"] == pytest.approx(1.0)
    assert len(out["loops"]) == 3 and out["mean_tokens"]["ar_b1"] == 40


def test_quality_section_scores_each_rule_against_the_ar_curve_at_its_entropy(monkeypatch):
    """AR rows at four temperatures make the curve; a row on it reads 1.0, a row 10 % above it
    1.1, and NSD's ratio over the standard rule is the quotient of the two."""
    import types

    import experiments.bench.spec_quality as sq
    import relf_jax.speculative.recipes as recipes
    from relf_jax.methods import Autoregressive, DraftModel

    # AR: entropy 2 + T, log gen PPL linear in entropy; the standard rule on the curve, NSD above it
    def fake_sample(lm, prompts, sample_cfg, method, ngram_table):
        t = sample_cfg.temperature
        assert sample_cfg.batch_size == 8 and len(prompts) == 3
        if isinstance(method, Autoregressive):
            e, scale = 2.0 + t, 1.0
        elif method.rule == "standard":
            e, scale = 2.0 + t + 0.05, 1.0
        elif method.draft_temperature_scale != 1.0:  # sharper: at T = 0.7's entropy, 5 % above the curve
            e, scale = 2.75, 1.05
        else:
            e, scale = (3.05, 1.1) if isinstance(method.proposer, DraftModel) else (2.85, 1.3)
        return types.SimpleNamespace(texts=[f"{e} {scale}"] * 3, complete=[True] * 3, tau=2.0)

    def fake_quality(judge, prompts, texts, complete):
        e, scale = map(float, texts[0].split())
        return {"gen_ppl": scale * math.exp(2 * e), "entropy": e, "pooled_entropy": e + 2.0, "reply_words": 10.0,
                "replies": 3}

    def fake_scores(prompts, texts, complete):  # 10 words a reply at the row's gen PPL
        e, scale = map(float, texts[0].split())
        return np.full(len(texts), -10.0 * (math.log(scale) + 2 * e)), np.full(len(texts), 10.0)

    monkeypatch.setattr(recipes, "sample", fake_sample)
    monkeypatch.setattr(sq, "reply_quality", fake_quality)
    judge = types.SimpleNamespace(score_replies=fake_scores)
    out = sq.quality_section(None, Config(), None, None, judge, ["a", "b", "c"], k=4, max_new=8)
    names = [r["name"] for r in out["rows"]]
    assert names == ["ar"] * len(sq.QUALITY_TEMPERATURES) + [r[0] for r in sq.QUALITY_ROWS]
    by = {r["name"]: r for r in out["rows"]}
    assert by["standard_draft"]["over_ar_at_entropy"] == pytest.approx(1.0)  # the T = 1 row, the first
    assert by["nsd0.9_draft"]["over_ar_at_entropy"] == pytest.approx(1.1)
    assert by["nsd0.9_ngram"]["entropy_outside_sweep"] == 0.0
    assert by["nsd0.9_sharp_draft"]["entropy_outside_sweep"] == 0.0  # the sweep reaches T = 0.6
    assert out["ratios"] == pytest.approx({"nsd0.9_draft_over_standard_at_entropy": 1.1,
                                          "nsd0.9_ngram_over_standard_at_entropy": 1.3,
                                          "nsd0.9_sharp_draft_over_standard_at_entropy": 1.05,
                                          "standard_draft_T0.7_over_standard_at_entropy": 1.0})
    assert out["ratios_pooled"] == pytest.approx({k.replace("_at_entropy", "_at_pooled"): v
                                                  for k, v in out["ratios"].items()})
    assert out["bootstrap"]["nsd0.9_sharp_draft_over_standard_T0.7"]["ratio"] == pytest.approx(1.05)
    # raw gen-PPL ratios: NSD 1.1x the standard rule, every resample alike (all replies equal)
    boot = out["bootstrap"]["nsd0.9_draft_over_standard"]
    assert boot["ratio"] == pytest.approx(1.1) and boot["ci95"] == pytest.approx([1.1, 1.1])
    assert out["bootstrap"]["standard_over_ar_T1"]["ratio"] == pytest.approx(math.exp(2 * (3.05 - 3.0)))


def test_bootstrap_interval_brackets_the_ratio_and_pairs_the_prompts():
    """Replies whose difficulty varies by prompt: a row 10 % worse on every prompt reads 1.1 with
    a tight interval, because each resample takes both rows' replies to the same prompts."""
    from experiments.bench.spec_quality import bootstrap

    rng = np.random.default_rng(3)
    words = rng.integers(5, 40, 200).astype(float)
    nll = words * rng.uniform(2.0, 8.0, 200)  # per-prompt difficulty
    base = (-nll, words)
    worse = (-(nll + words * math.log(1.1)), words)
    noisy = (-(nll + words * rng.normal(0.0, 0.5, 200)), words)
    out = bootstrap({("ar", 1.0): base, ("standard_draft", 1.0): noisy, ("nsd0.9_draft", 1.0): worse})
    lo, hi = out["nsd0.9_draft_over_ar_T1"]["ci95"]
    assert out["nsd0.9_draft_over_ar_T1"]["ratio"] == pytest.approx(1.1) and lo == pytest.approx(1.1)
    assert hi == pytest.approx(1.1)
    r = out["standard_over_ar_T1"]
    assert r["ci95"][0] < r["ratio"] < r["ci95"][1] and r["ci95"][1] - r["ci95"][0] > 0.01


def test_cpu_wide_draft_defaults_to_its_longer_distillation(monkeypatch):
    import experiments.bench.spec as spec

    seen = {}

    def stop(preset, workdir, overrides, draft_overrides, distill_steps):
        seen[preset] = distill_steps
        raise KeyboardInterrupt  # nothing after the models is needed here

    monkeypatch.setattr(spec, "ensure_target_and_draft", stop)
    for preset, steps in (("cpu-wide", None), ("cpu", None), ("cpu-wide", 300)):
        with pytest.raises(KeyboardInterrupt):
            spec.bench_spec("unused.json", preset=preset, draft_steps=steps, workdir="unused")
        assert seen[preset] == (steps or (spec.WIDE_DRAFT_STEPS if preset == "cpu-wide" else None))


def test_draft_scale_curve_scores_each_scale_and_times_it_against_the_matched_standard_rule(monkeypatch):
    """`spec_sharp`: AR rows make the curve (entropy 2 + T, log gen PPL = 2 x entropy); a sharpened
    NSD row 10 % above the curve at T = 0.6's entropy reads 1.1 over the standard rule (on the
    curve), its matched temperature is 0.6, and the speed rows time it against the standard rule at
    T = 1 and at T = 0.6."""
    import types

    import experiments.bench.spec_sharp as ss
    import relf_jax.speculative.recipes as recipes
    from relf_jax.methods import Autoregressive

    def row(name, t, e, scale=None, factor=1.0):
        return {"name": name, "temperature": t, "draft_temperature_scale": scale, "entropy": e,
                "pooled_entropy": 2 * e, "gen_ppl": factor * math.exp(2 * e), "tau": 1.0}

    rows = [row("ar", t, 2 + t) for t in ss.CURVE_TEMPERATURES]
    rows += [row("standard", 1.0, 3.0), row("nsd0.9", 1.0, 3.0, 1.0, 0.95), row("nsd0.9", 1.0, 2.6, 0.5, 1.1)]
    scored = ss.score_against_sweep(rows)
    plain, sharp = scored[-2], scored[-1]
    assert scored[-3]["over_standard"] == pytest.approx(1.0)
    assert plain["over_standard"] == pytest.approx(0.95)
    assert plain["matched_temperature"] == pytest.approx(1.0, abs=1e-3)
    assert sharp["over_standard"] == pytest.approx(1.1)
    assert sharp["over_standard_fitted"] == pytest.approx(1.1, rel=1e-3)
    assert sharp["over_standard_pooled"] == pytest.approx(1.1)
    assert sharp["over_standard_pooled_fitted"] == pytest.approx(1.1, rel=1e-3)
    assert sharp["matched_temperature"] == pytest.approx(0.6, abs=1e-3) and sharp["entropy_outside_sweep"] == 0.0

    speed = {("standard", 1.0, 1.0): 100.0, ("standard", 0.6, 1.0): 110.0, ("nsd", 1.0, 1.0): 115.0,
             ("nsd", 1.0, 0.5): 140.0}
    calls = []

    def fake_sample(lm, prompts, sample_cfg, method, ngram_table):
        assert not isinstance(method, Autoregressive) and sample_cfg.batch_size == 1
        key = (method.rule, sample_cfg.temperature, method.draft_temperature_scale)
        calls.append(key)
        return types.SimpleNamespace(tokens_per_s=speed[key], tau=2.0, tokens=40)

    monkeypatch.setattr(recipes, "sample", fake_sample)
    out = ss.speed_against_standard(None, Config(), None, ["p"], 4, 8, scored, reps=2)
    assert sorted(set(calls)) == sorted(speed)  # the standard rule at T = 1 once, though s = 1 matches it
    assert out["matched_temperature"] == {"1": 1.0, "0.5": 0.6}
    assert out["ratios"] == pytest.approx({"nsd0.9_s1_over_standard_T1": 1.15, "nsd0.9_s1_over_standard_matched": 1.15,
                                           "nsd0.9_s0.5_over_standard_T1": 1.4,
                                           "nsd0.9_s0.5_over_standard_matched": 140 / 110})
