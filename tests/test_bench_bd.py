"""`relf-jax bench bd`'s report logic on hand-made rows (the bench itself is a long run)."""

import math

import pytest

from experiments.bench.bd import plot, targets


def _ar(steps, pts):
    return [{"method": f"ar T={t}", "variant": "ar", "train_steps": steps, "temperature": t, "gen_ppl": p,
             "entropy": e} for t, (e, p) in zip((0.6, 0.8, 1.0), pts)]


def _bd(steps, t, e, p, rule="max", per_step=1.6):
    return {"method": f"bd T={t:g}", "variant": "bd", "train_steps": steps, "temperature": t, "confidence": rule,
            "gen_ppl": p, "entropy": e, "committed_per_step": per_step, "tokens_per_step": per_step - 0.2}


def test_targets_match_entropy_and_budget():
    rows = (_ar(600, [(3.0, 50.0), (3.2, 100.0), (3.4, 200.0)]) + _ar(1200, [(3.0, 40.0), (3.2, 80.0), (3.4, 160.0)])
            + [_bd(600, 1.0, 3.1, 120.0), _bd(600, 0.8, 2.5, 30.0), _bd(600, 1.0, 3.1, 60.0, rule="sampled"),
               _bd(1200, 1.0, 3.3, 150.0, per_step=1.2)])
    out = targets(rows, (600, 1200))
    head = out["steps600"]["headline"]
    # T=1 sits inside the sweep: AR at 3.1 nats is exp(mean(log 50, log 100)) = 70.7; T=0.8 is outside
    assert head["ar_gen_ppl_interpolated"] == pytest.approx(math.sqrt(50 * 100))
    assert head["ratio"] == pytest.approx(120 / math.sqrt(5000)) and head["entropy_outside_ar_sweep_nats"] == 0
    assert out["steps600"]["rows"]["bd T=0.8"]["entropy_outside_ar_sweep_nats"] == pytest.approx(0.5)
    assert out["steps600"]["ratio_met"] is False and out["steps600"]["tokens_per_step_met"] is True
    assert out["steps1200"]["ratio_met"] is True and out["steps1200"]["tokens_per_step_met"] is False
    # the old rule's row is never the headline; T=1 gen PPL rose from 120 to 150: not falling
    assert "bd T=1 sampled-confidence" not in out["steps600"]["rows"]
    assert out["bd_t1_gen_ppl_falls_with_budget"] is False
    # a lower-threshold row is reported on its own, never as the headline
    low = dict(_bd(600, 1.0, 3.2, 60.0, per_step=3.0), method="bd T=1 thr=0.5", threshold=0.5)
    out = targets(rows + [low], (600, 1200))
    assert out["steps600"]["headline"]["ratio"] == pytest.approx(120 / math.sqrt(5000))
    assert out["steps600"]["lower_thresholds_t1"]["bd T=1 thr=0.5"]["committed_per_step"] == 3.0
    assert "ratio_pooled" not in out["steps600"]["headline"]
    # with pooled entropies (AR's 5.0 + T, the BD row's at T = 0.6's): read off at AR's T = 0.6
    for r in rows:
        r["pooled_entropy"] = 5.0 + r["temperature"] if r["variant"] == "ar" else 5.6
    head = targets(rows, (600,))["steps600"]["headline"]
    assert head["ratio_pooled"] == pytest.approx(120 / 50.0) and head["pooled_outside_ar_sweep_nats"] == 0


def test_plot_writes_a_png(tmp_path):
    rows = _ar(600, [(3.0, 50.0), (3.2, 100.0), (3.4, 200.0)]) + [_bd(600, 1.0, 3.1, 120.0)]
    path = tmp_path / "q.png"
    plot(rows, (600,), str(path))
    assert path.stat().st_size > 1000


def test_a_budget_whose_rows_are_all_in_out_is_not_retrained(monkeypatch):
    """A rerun with more budgets keeps the rows it has: no training, no sampling for them."""
    import experiments.bench.bd as bd

    def refuse(*a, **k):
        raise AssertionError("trained or sampled a budget whose rows were all there")

    monkeypatch.setattr(bd.rj, "train", refuse)
    monkeypatch.setattr(bd, "sample_bd", refuse)
    keys = []
    for t, rule, x in ((0.9, "max", 0.95), (1.0, "max", 0.95), (1.0, "sampled", 0.95), (1.0, "max", 0.7),
                       (1.0, "max", 0.5)):
        name = f"bd T={t:g}" + ("" if rule == "max" else " sampled-confidence") + ("" if x == 0.95 else f" thr={x:g}")
        keys.append({"method": name, "variant": "bd", "train_steps": 600, "temperature": t, "confidence": rule,
                     "threshold": x, "block_size": 8, "gen_ppl": 100.0, "entropy": 3.0, "mean_tokens": 30.0})
    rows = bd.BenchRows("unused.json", "cpu", keys)
    monkeypatch.setattr(bd, "write_json", lambda *a, **k: None)
    bd.bd_rows(rows, "cpu", [], "/nonexistent", 600, "bd", [], 256, quick=False)
    assert [r["method"] for r in rows.rows] == [k["method"] for k in keys]


def test_borrowed_ar_rows_are_marked_and_checked(tmp_path):
    import json

    from experiments.bench.common import borrowed_ar_rows

    path = tmp_path / "bd.json"
    rows = _ar(600, [(3.0, 50.0), (3.2, 100.0), (3.4, 200.0)]) + [_bd(600, 1.0, 3.1, 120.0)]
    path.write_text(json.dumps({"preset": "cpu", "num_samples": 256, "rows": rows}))
    got = borrowed_ar_rows(str(path), "cpu", 256)
    assert len(got) == 3 and all(r["source"] == "bd.json" and r["nfe"] is None for r in got)
    assert borrowed_ar_rows(None, "cpu", 256) == []
    with pytest.raises(ValueError, match="this bench needs"):
        borrowed_ar_rows(str(path), "cpu", 128)
