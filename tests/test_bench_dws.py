"""`bench dws` after the measurements (experiments.bench.dws_report), on small fake costs, surfaces
and lengths: every number is checked against one computed here by hand. The end-to-end run
(model, timed decodes, predictors) is `relf-jax bench dws --quick`."""

import numpy as np
import pytest

from experiments.bench.dws_report import (
    PREDICTORS,
    SCALAR_ORACLES,
    cost_error_table,
    error_ratios,
    latency_ratios,
    price_requests,
    write_plots,
)
from relf_jax.dws.cost_model import CostModel
from relf_jax.dws.surface import executed_map

NB, D = 4, 3
MODEL = CostModel(alpha=0.5, beta=2.0, delta=0.1, m_mean=2.0, W=np.arange(1, NB * D + 1).reshape(NB, D) / 10,
                  intercept=1.0)


def _requests(n, seed):
    """Prompt lengths in blocks and executed 0/1 maps of n fake runs."""
    rng = np.random.default_rng(seed)
    m = rng.uniform(0.5, 4.0, n)
    steps = [rng.integers(1, D + 1, size=rng.integers(1, NB + 1)) for _ in range(n)]
    return m, np.stack([executed_map(s, NB, D) for s in steps]), steps


def _by_hand(m, maps):
    """The cost model's price, written out: intercept + alpha m + beta N + sum((W + delta (m - m_mean)) S)."""
    blocks = maps[:, :, 0].sum(1)
    cells = np.array([(s * (MODEL.W + MODEL.delta * (mi - MODEL.m_mean))).sum() for mi, s in zip(m, maps)])
    return MODEL.intercept + MODEL.alpha * m + MODEL.beta * blocks + cells


def _scalars(m_probe, m_test, steps_probe, steps_test):
    lengths = lambda ss: np.array([3.0 * len(s) for s in ss])
    totals = lambda ss: np.array([float(s.sum()) for s in ss])
    return {"length": (lengths(steps_probe), lengths(steps_test)), "steps": (totals(steps_probe), totals(steps_test)),
            "prompt_len": (m_probe, m_test), "length_oracle": (np.full(len(m_probe), 5.0), lengths(steps_test)),
            "steps_oracle": (totals(steps_probe), totals(steps_test))}


def test_price_requests_perfect_surface_and_lines_by_hand():
    m_probe, maps_probe, steps_probe = _requests(30, 0)
    m_test, maps_test, steps_test = _requests(20, 1)
    x_probe = np.array([float(s.sum()) for s in steps_probe])
    probe_cost = 0.3 + 0.7 * x_probe  # exactly a line in total steps
    scalars = _scalars(m_probe, m_test, steps_probe, steps_test)
    cost = price_requests(MODEL, m_test, maps_test, maps_test, maps_test, scalars, probe_cost)

    assert set(cost) == set(PREDICTORS + SCALAR_ORACLES)
    test_cost = _by_hand(m_test, maps_test)
    for name in ("dws", "dws_continue", "oracle", "dws_median"):  # the realised surface: the model's exact price
        np.testing.assert_allclose(cost[name], test_cost, rtol=1e-12)
    # a scalar fitted on probe costs that are a line in it recovers the line
    np.testing.assert_allclose(cost["steps"], 0.3 + 0.7 * scalars["steps"][1], rtol=1e-9)
    np.testing.assert_allclose(cost["steps_oracle"], cost["steps"])
    # every probe the same realised length: no slope, the probes' mean cost
    np.testing.assert_allclose(cost["length_oracle"], np.full(20, probe_cost.mean()))

    errors = cost_error_table(cost, test_cost)
    assert list(errors) == list(PREDICTORS + SCALAR_ORACLES)
    assert errors["dws"]["mae"] == pytest.approx(0.0, abs=1e-12)
    assert errors["oracle"]["mape"] == pytest.approx(0.0, abs=1e-12)
    assert errors["oracle"]["kendall_tau"] == pytest.approx(1.0)
    assert errors["length"]["mae"] == pytest.approx(np.mean(np.abs(cost["length"] - test_cost)))


def test_error_table_and_ratios_against_hand_numbers():
    test_cost = np.array([1.0, 2.0, 4.0, 8.0])
    offsets = {"dws": 0.5, "dws_continue": 1.0, "dws_median": 0.25, "length": 2.0, "steps": 1.5,
               "prompt_len": 3.0, "oracle": 0.1, "length_oracle": 0.4, "steps_oracle": 0.3}
    # over and under by the offset in turn: each MAE is its offset
    cost = {k: test_cost + v * np.array([1.0, -1.0, 1.0, -1.0]) for k, v in offsets.items()}
    errors = cost_error_table(cost, test_cost)
    for k, v in offsets.items():
        assert errors[k]["mae"] == pytest.approx(v)
    assert errors["dws"]["mape"] == pytest.approx(np.mean(0.5 / test_cost))

    r = error_ratios(errors)
    assert r["error_ratio_vs_length"] == pytest.approx(2.0 / 0.5)
    assert r["error_ratio_vs_steps"] == pytest.approx(1.5 / 0.5)
    assert r["error_ratio_vs_prompt_len"] == pytest.approx(3.0 / 0.5)
    # the ceiling: realised scalar's MAE over the realised surface's
    assert r["error_ratio_ceiling"] == pytest.approx({"vs_length": 0.4 / 0.1, "vs_steps": 0.3 / 0.1})
    assert r["error_ratio_vs_length_by_predictor"] == pytest.approx({"dws": 4.0, "dws_continue": 2.0,
                                                                     "dws_median": 8.0})
    assert r["error_ratio_vs_steps_by_predictor"] == pytest.approx({"dws": 3.0, "dws_continue": 1.5,
                                                                    "dws_median": 6.0})
    assert r["error_ratio_vs_length_by_predictor"]["dws"] == r["error_ratio_vs_length"]


def _latency(loads):
    means = {"fcfs": 4.0, "sjf_dws": 2.0, "sjf_length": 3.0, "sjf_steps": 2.5, "sjf_oracle": 1.5}
    return {p: {str(x): {"mean": v * x} for x in loads} for p, v in means.items()}


def test_latency_ratios_at_load():
    r = latency_ratios(_latency((0.5, 0.9)))
    assert r == pytest.approx({"latency_ratio_fcfs_over_sjf_dws": 2.0, "latency_ratio_sjf_length_over_sjf_dws": 1.5,
                               "latency_ratio_sjf_steps_over_sjf_dws": 1.25})


def test_write_plots(tmp_path):
    m, maps, _ = _requests(12, 2)
    s_pred = np.clip(maps + 0.1, 0, 1)
    loads = (0.5, 0.9)
    paths = write_plots(str(tmp_path / "dws"), s_pred, maps, [f"prompt {i}" for i in range(12)], _latency(loads),
                        loads)
    assert paths == {"surfaces": str(tmp_path / "dws_surfaces.png"),
                     "latency_vs_load": str(tmp_path / "dws_latency.png")}
    for p in paths.values():
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
