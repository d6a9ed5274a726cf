"""The arithmetic of `relf-jax bench rcsd`'s summary (the benchmark itself is a bench command)."""

import pytest

from experiments.bench.rcsd import summary


def test_summary_ratios_spread_and_shift_recovery():
    rows = []
    for seed, (a, b, c) in enumerate([(2.0, 2.2, 2.6), (2.0, 2.0, 2.4), (2.5, 2.5, 3.0)]):
        rows += [{"variant": "a_distilled", "seed": seed, "tau": a, "tokens_per_s": 10.0},
                 {"variant": "b_online_distill", "seed": seed, "tau": b, "tokens_per_s": 11.0},
                 {"variant": "c_rcsd", "seed": seed, "tau": c, "tokens_per_s": 12.0}]
    report = {"rows": rows, "shift_reference": {"full_draft_tau": 3.0},
              "shift": {"a_distilled": [2.0, 2.0, 2.0], "b_online_distill": [2.0, 2.2, 2.4],
                        "c_rcsd": [2.0, 2.5, 2.75]}}
    s = summary(report)
    assert s["a_distilled"]["tau_mean"] == pytest.approx(13 / 6)
    assert s["c_rcsd"]["tau_ratio_to_a"] == pytest.approx((1.3 + 1.2 + 1.2) / 3)
    assert s["b_online_distill"]["tau_ratio_to_a"] == pytest.approx((1.1 + 1.0 + 1.0) / 3)
    assert s["c_minus_b"]["per_seed"] == pytest.approx([0.4, 0.4, 0.5])
    assert s["c_rcsd"]["tau_min"] == 2.4 and s["c_rcsd"]["tau_max"] == 3.0 and s["c_rcsd"]["seeds"] == 3
    # shift: the shifted draft is the last a_distilled value (2.0); the full draft 3.0 -> 1.0 lost
    assert s["shift"]["shifted_draft_tau"] == 2.0
    assert s["shift"]["c_rcsd_recovered_fraction"] == pytest.approx(0.75)
    assert s["shift"]["b_online_distill_recovered_fraction"] == pytest.approx(0.4)
    assert s["shift"]["a_distilled_recovered_fraction"] == pytest.approx(0.0)


def test_summary_reference_and_extra_variant():
    rows = [{"variant": "a_distilled", "seed": 0, "tau": 2.0, "tokens_per_s": 1.0},
            {"variant": "a_distilled", "seed": 1, "tau": 3.0, "tokens_per_s": 1.0},
            {"variant": "c_rcsd_beta1", "seed": 0, "tau": 2.2, "tokens_per_s": 1.0},
            {"variant": "c_rcsd_beta1", "seed": 1, "tau": 2.7, "tokens_per_s": 1.0}]
    s = summary({"rows": rows, "shift": {}, "reference": {"distill_steps": 1200, "tau": 3.75}})
    assert s["c_rcsd_beta1"]["tau_ratio_to_a"] == pytest.approx((1.1 + 0.9) / 2)
    assert s["reference_tau_ratio_to_a"] == pytest.approx(1.5)
    assert "c_minus_b" not in s and "shift" not in s
