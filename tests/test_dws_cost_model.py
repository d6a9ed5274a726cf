"""DWS cost models: the surface cost model recovers the parameters that generated synthetic
timings, the scalar baseline recovers its line, and the error metrics on hand examples."""

import json

import numpy as np
import pytest

from relf_jax.dws.cost_model import (
    CostModel,
    ScalarCostModel,
    fit_cost_model,
    fit_scalar_cost,
)
from relf_jax.dws.metrics import cost_errors, kendall_tau, mae, mape
from relf_jax.dws.surface import executed_map, surface_from_heads

B, D, N = 6, 4, 400
BLOCK, STEP = np.arange(B)[:, None], np.arange(D)[None, :]
# The data cannot split intercept from W[0, 0], nor beta from a shift of W[:, 0] (module
# docstring); the smoothness penalty settles that split, so each true W below follows the
# convention of the penalty it is fitted with: first differences take W[:, 0] flat along the
# step axis and W[0, 0] equal to its neighbours; second differences take them linear.
W_FLAT_START = 0.01 * (1 + 0.15 * np.maximum(BLOCK - 1, 0)) + 0.0 * STEP  # grows from block 1 on
W_PLANAR = 0.01 * (1 + 0.15 * BLOCK + 0.05 * STEP)  # step cost linear in context and step


def realised_requests(seed, n=N, max_blocks=B, block_size=D, max_n=None, max_t=None):
    """Prompt lengths in blocks (fractional) and the executed maps of random realised runs."""
    rng = np.random.default_rng(seed)
    runs = [
        rng.integers(1, (max_t or block_size) + 1, rng.integers(1, (max_n or max_blocks) + 1)).tolist()
        for _ in range(n)
    ]
    maps = np.stack([executed_map(r, max_blocks, block_size) for r in runs])
    return rng.uniform(0.5, 8.0, n), maps


def true_model(m, W):
    return CostModel(alpha=0.02, beta=0.02, delta=5e-4, m_mean=float(np.mean(m)), W=W, intercept=0.03)


def timings(model, m, maps, noise, seed):
    return model.predict(m, maps) * (1 + noise * np.random.default_rng(seed).standard_normal(len(m)))


def rel(a, b):
    return np.abs(np.asarray(a) / np.asarray(b) - 1)


@pytest.mark.parametrize("order, W", [(1, W_FLAT_START), (2, W_PLANAR)])
def test_fit_recovers_parameters_from_noisy_timings(order, W):
    # Tolerances: with 0.5 % multiplicative noise on 400 requests, refitting over 40 noise
    # seeds gave relative standard deviations of ~0.2 % (alpha), 1-2 % (beta), ~1.1 % (delta),
    # ~1 % (intercept), worst |error| 0.5 %, 4.8 %, 4 %, 3.1 %; W's mean cell error stayed under
    # 2.4 % and its worst cell error under 7.4 % (the rarest cell, block 5 step 3, runs in ~25
    # requests; column 0 also carries beta's error). The bounds below are ~4-6 of those standard
    # deviations (alpha's is looser, it costs nothing).
    m, maps = realised_requests(0)
    truth = true_model(m, W)
    fit = fit_cost_model(m, maps, timings(truth, m, maps, 0.005, 1), penalty_order=order)
    assert rel(fit.alpha, truth.alpha) < 0.02
    assert rel(fit.beta, truth.beta) < 0.08
    assert rel(fit.delta, truth.delta) < 0.06
    assert rel(fit.intercept, truth.intercept) < 0.06
    assert fit.m_mean == pytest.approx(np.mean(m))
    assert np.all(maps.sum(axis=0) > 0)  # every cell executed, so every W is data-driven
    assert rel(fit.W, W).mean() < 0.05
    assert rel(fit.W, W).max() < 0.15
    assert np.all(fit.W >= 0)
    # and the thing that matters: held-out requests are predicted to ~ the noise level
    m_test, maps_test = realised_requests(7, n=200)
    assert rel(fit.predict(m_test, maps_test), truth.predict(m_test, maps_test)).max() < 0.02


@pytest.mark.parametrize("order, W", [(1, W_FLAT_START), (2, W_PLANAR)])
def test_fit_is_near_exact_without_noise(order, W):
    m, maps = realised_requests(0)
    truth = true_model(m, W)
    fit = fit_cost_model(m, maps, truth.predict(m, maps), smoothness=1e-8, penalty_order=order)
    for name in ("alpha", "beta", "delta", "intercept"):
        assert rel(getattr(fit, name), getattr(truth, name)) < 1e-5, name
    np.testing.assert_allclose(fit.W, W, rtol=1e-5)


def test_split_off_convention_only_changes_parameters_not_predictions():
    # W_PLANAR under first differences: the intercept / beta / W[:, 0] split follows the
    # penalty's convention, not the truth, yet predictions stay exact (the split is unobservable).
    m, maps = realised_requests(0)
    truth = true_model(m, W_PLANAR)
    fit = fit_cost_model(m, maps, truth.predict(m, maps), smoothness=1e-8, penalty_order=1)
    np.testing.assert_allclose(fit.W[:, 1:], W_PLANAR[:, 1:], rtol=1e-5)
    assert rel(fit.alpha, truth.alpha) < 1e-5 and rel(fit.delta, truth.delta) < 1e-5
    # the identifiable combinations
    assert fit.beta + fit.W[1, 0] == pytest.approx(truth.beta + W_PLANAR[1, 0], rel=1e-5)
    first_cell = truth.intercept + truth.beta + W_PLANAR[0, 0]
    assert fit.intercept + fit.beta + fit.W[0, 0] == pytest.approx(first_cell, rel=1e-5)
    # soft surfaces also have S[0, 0] = 1 and first column P(N >= b + 1): still exact
    rng = np.random.default_rng(5)
    soft = surface_from_heads(rng.uniform(0, 1, (50, B - 1)), rng.dirichlet(np.ones(D), (50, B)))
    m_soft = rng.uniform(0.5, 8.0, 50)
    np.testing.assert_allclose(fit.predict(m_soft, soft), truth.predict(m_soft, soft), rtol=1e-6)


def test_cells_never_executed_get_finite_nonnegative_costs():
    # no run has more than 4 blocks or more than 3 steps: blocks 4-5 and step 3 are never seen
    m, maps = realised_requests(2, n=200, max_n=4, max_t=3)
    unseen = maps.sum(axis=0) == 0
    assert unseen[4:].all() and unseen[:, 3].all() and not unseen[:4, :3].any()
    truth = true_model(m, W_FLAT_START)
    costs = timings(truth, m, maps, 0.005, 3)
    for smoothness in (1e-2, 0.0):
        for order in (1, 2):
            fit = fit_cost_model(m, maps, costs, smoothness=smoothness, penalty_order=order)
            assert np.all(np.isfinite(fit.W)) and np.all(fit.W >= 0)
            assert np.all(np.isfinite(fit.predict(m, maps)))
            assert rel(fit.predict(m, maps), truth.predict(m, maps)).max() < 0.02
    # with first differences the unseen cells minimise their squared differences, so they are a
    # discrete harmonic fill-in of the seen ones and stay within the seen range (max principle)
    fit = fit_cost_model(m, maps, costs, penalty_order=1)
    seen = fit.W[~unseen]
    assert seen.min() * (1 - 1e-6) <= fit.W[unseen].min() and fit.W[unseen].max() <= seen.max() * (1 + 1e-6)


def test_nonnegativity_binds_when_true_step_costs_are_zero():
    # free late steps: noise pushes the unconstrained W below zero, the bounded solve clamps it
    m, maps = realised_requests(0)
    W = W_FLAT_START.copy()
    W[:, 2:] = 0.0
    truth = true_model(m, W)
    fit = fit_cost_model(m, maps, timings(truth, m, maps, 0.005, 1), smoothness=1e-4)
    assert np.all(fit.W >= 0) and np.any(fit.W == 0.0)  # exact zeros only come from the bound
    assert np.abs(fit.W[:, 2:]).max() < 1e-3  # a tenth of a step's cost
    assert rel(fit.predict(m, maps), truth.predict(m, maps)).max() < 0.01


def test_fit_without_intercept_and_with_uniform_weights():
    m, maps = realised_requests(0)
    truth = dataclass_replace(true_model(m, W_FLAT_START), intercept=0.0)
    costs = truth.predict(m, maps)
    for weights in ("relative", "uniform", np.linspace(1, 2, N)):
        fit = fit_cost_model(m, maps, costs, smoothness=1e-8, weights=weights, fit_intercept=False)
        assert fit.intercept == 0.0
        assert rel(fit.alpha, truth.alpha) < 1e-5 and rel(fit.beta, truth.beta) < 1e-5
    # the unit of cost does not matter: milliseconds give the same fit scaled by 1000
    fit_s = fit_cost_model(m, maps, timings(truth, m, maps, 0.005, 4))
    fit_ms = fit_cost_model(m, maps, 1000 * timings(truth, m, maps, 0.005, 4))
    np.testing.assert_allclose(fit_ms.W, 1000 * fit_s.W, rtol=1e-6, atol=1e-9)
    assert fit_ms.beta == pytest.approx(1000 * fit_s.beta, rel=1e-6)


def dataclass_replace(model, **changes):
    return CostModel.from_dict({**model.to_dict(), **changes})


def test_cost_model_round_trips_through_json_and_predicts_batches():
    m, maps = realised_requests(0, n=20)
    model = true_model(m, W_PLANAR)
    again = CostModel.from_dict(json.loads(json.dumps(model.to_dict())))
    np.testing.assert_array_equal(again.predict(m, maps), model.predict(m, maps))
    assert again.W.shape == (B, D) and again.intercept == model.intercept
    # hand check of one request: K = W + delta (m - m_mean) summed over executed cells
    S = executed_map([2, 1], B, D)
    K = model.W + model.delta * (3.0 - model.m_mean)
    expected = model.intercept + model.alpha * 3.0 + model.beta * 2 + K[0, 0] + K[0, 1] + K[1, 0]
    assert model.predict(np.array([3.0]), S[None])[0] == pytest.approx(expected, rel=1e-12)
    assert model.predict(3.0, S) == pytest.approx(expected, rel=1e-12)  # one request, no batch axis
    np.testing.assert_allclose(model.step_costs(3.0), K)
    assert model.predict(m.reshape(4, 5), maps.reshape(4, 5, B, D)).shape == (4, 5)
    with pytest.raises(ValueError, match="surfaces must be"):
        model.predict(m, maps[:, :, :2])
    with pytest.raises(ValueError, match="prompt_blocks"):
        model.predict(m[:3], maps)
    with pytest.raises(ValueError):  # frozen, and W read-only
        model.W[0, 0] = 1.0


def test_fit_rejects_bad_inputs():
    m, maps = realised_requests(0, n=10)
    costs = np.linspace(0.1, 0.2, 10)
    cases = [
        ((m[:9], maps, costs), "surfaces must be"),
        ((m, maps, costs[:9]), "one value per request"),
        ((m[:1], maps[:1], costs[:1]), "at least 2"),
        ((m, maps[:, :, :, None], costs), "surfaces must be"),
        ((m, maps, np.where(np.arange(10) == 3, np.nan, costs)), "finite"),
        ((m, maps, np.where(np.arange(10) == 3, 0.0, costs)), "positive"),
        ((m, maps, -costs), "positive"),
        ((np.where(np.arange(10) == 0, np.inf, m), maps, costs), "finite"),
        ((m, np.zeros_like(maps), costs), "all zero"),
        ((m, np.where(maps > 0, np.nan, 0.0), costs), "finite"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            fit_cost_model(*args)
    with pytest.raises(ValueError, match="weights"):
        fit_cost_model(m, maps, costs, weights="squared")
    with pytest.raises(ValueError, match="weights"):
        fit_cost_model(m, maps, costs, weights=np.zeros(10))
    with pytest.raises(ValueError, match="smoothness"):
        fit_cost_model(m, maps, costs, smoothness=-1.0)
    with pytest.raises(ValueError, match="penalty_order"):
        fit_cost_model(m, maps, costs, penalty_order=3)


def test_tiny_grids_fit():
    # B_max = 1 or d = 1: no differences along that axis, still a well-posed fit
    rng = np.random.default_rng(6)
    for max_blocks, block_size in ((1, 3), (3, 1), (1, 1), (2, 2)):
        m, maps = realised_requests(1, n=30, max_blocks=max_blocks, block_size=block_size)
        costs = 0.01 + 0.02 * m + 0.01 * maps.sum(axis=(1, 2)) * (1 + 0.001 * rng.standard_normal(30))
        for order in (1, 2):
            fit = fit_cost_model(m, maps, costs, penalty_order=order)
            assert fit.W.shape == (max_blocks, block_size)
            assert rel(fit.predict(m, maps), costs).max() < 0.01


def test_scalar_cost_model():
    rng = np.random.default_rng(7)
    x = rng.uniform(10, 500, 300)
    exact = 0.05 + 0.002 * x
    for weights in ("relative", "uniform"):
        fit = fit_scalar_cost(x, exact, weights=weights)
        assert fit.a == pytest.approx(0.05, rel=1e-9) and fit.b == pytest.approx(0.002, rel=1e-9)
    noisy = fit_scalar_cost(x, exact * (1 + 0.01 * rng.standard_normal(300)))
    assert noisy.a == pytest.approx(0.05, rel=0.1) and noisy.b == pytest.approx(0.002, rel=0.02)
    np.testing.assert_allclose(noisy.predict(x), noisy.a + noisy.b * x)
    assert ScalarCostModel.from_dict(json.loads(json.dumps(noisy.to_dict()))) == noisy
    with pytest.raises(ValueError, match="at least 2"):
        fit_scalar_cost([1.0], [1.0])
    with pytest.raises(ValueError, match="one value per request"):
        fit_scalar_cost([1.0, 2.0, 3.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="positive"):
        fit_scalar_cost([1.0, 2.0], [1.0, 0.0])
    with pytest.raises(ValueError, match="constant"):
        fit_scalar_cost([2.0, 2.0, 2.0], [1.0, 2.0, 3.0])


def test_metrics_on_hand_examples():
    true = np.array([1.0, 2.0, 4.0, 8.0])
    pred = np.array([2.0, 2.0, 3.0, 10.0])
    assert mae(pred, true) == pytest.approx((1 + 0 + 1 + 2) / 4)
    assert mape(pred, true) == pytest.approx((1.0 + 0.0 + 0.25 + 0.25) / 4)
    assert kendall_tau(true, true) == 1.0
    assert kendall_tau(true, true[::-1]) == -1.0
    # one discordant pair of six: tau = (5 - 1) / 6
    assert kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    # ties: tau-b = (C - D) / sqrt((n0 - n1)(n0 - n2)) with x = [1, 1, 2], y = [1, 2, 3]: (2 - 0) / sqrt(2 * 3)
    assert kendall_tau([1, 1, 2], [1, 2, 3]) == pytest.approx(2 / np.sqrt(6))
    assert np.isnan(kendall_tau([1, 1, 1], [1, 2, 3]))
    errors = cost_errors(pred, true)
    assert set(errors) == {"mae", "mape", "kendall_tau"}
    assert all(type(v) is float for v in errors.values())
    assert errors["kendall_tau"] == pytest.approx(kendall_tau(pred, true))
    with pytest.raises(ValueError, match="same number"):
        mae([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="positive"):
        mape([1.0], [0.0])
    with pytest.raises(ValueError, match="at least 2"):
        kendall_tau([1.0], [1.0])


def test_sample_costs_mean_matches_predict_and_maps_are_exact():
    """Cost samples of a surface: a realised 0/1 map gives its own cost in every draw; a mixed
    surface's sample mean is `predict`'s expected cost (4 standard errors), and its draws are
    the costs of the runs the surface allows."""
    m, maps = realised_requests(1, n=6)
    model = true_model(m, W_PLANAR)
    draws = model.sample_costs(m, maps, n=64)
    np.testing.assert_allclose(draws, np.repeat(model.predict(m, maps)[:, None], 64, axis=1), rtol=1e-12)
    # a request that takes one block of 1 step or two blocks of 4 steps, half and half
    runs = [[1], [4, 4]]
    S = 0.5 * (executed_map(runs[0], B, D) + executed_map(runs[1], B, D))
    x = model.sample_costs(np.array([2.0]), S[None], n=20_000, seed=3)[0]
    each = model.predict(np.array([2.0, 2.0]), np.stack([executed_map(r, B, D) for r in runs]))
    assert x.mean() == pytest.approx(model.predict(2.0, S), abs=4 * x.std() / np.sqrt(x.size))
    # blocks are drawn independently: 2 blocks with T_1 = 1 can appear too, but every draw is a
    # run the surface allows (1 or 2 blocks, T_b in {1, 4})
    allowed = {float(v) for v in each} | {float(model.predict(2.0, executed_map(r, B, D)))
                                          for r in ([4], [1, 4])}
    assert set(np.round(np.unique(x), 12)) <= {round(v, 12) for v in allowed}
    with pytest.raises(ValueError, match="surfaces"):
        model.sample_costs(m, maps[:, :, :2])
