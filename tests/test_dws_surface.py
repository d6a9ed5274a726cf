"""DWS workload surfaces: executed maps, empirical surfaces, invariants, workload curves and the
surface implied by a block head and a step head (checked against brute-force enumeration)."""

import itertools

import numpy as np
import pytest

from relf_jax.dws.surface import (
    check_surface,
    empirical_surface,
    executed_map,
    surface_from_heads,
    surface_stats,
    workload_curve,
    workload_curve_from_steps,
)


def random_runs(rng, n, max_blocks, block_size):
    return [rng.integers(1, block_size + 1, rng.integers(1, max_blocks + 1)).tolist() for _ in range(n)]


def test_executed_map_hand_examples():
    np.testing.assert_array_equal(
        executed_map([2, 1], 3, 3),
        [[1, 1, 0], [1, 0, 0], [0, 0, 0]],
    )
    np.testing.assert_array_equal(executed_map([4], 1, 4), [[1, 1, 1, 1]])
    np.testing.assert_array_equal(executed_map(np.array([1, 3, 2]), 3, 3), [[1, 0, 0], [1, 1, 1], [1, 1, 0]])
    assert executed_map([1], 2, 2).dtype == np.float64


@pytest.mark.parametrize(
    "steps, match",
    [
        ([], "at least one"),
        ([0], r"1\.\.3"),
        ([2, 4], r"1\.\.3"),
        ([1, 1, 1, 1], "max_blocks"),
        ([1.5], "integers"),
        ([[1]], "1-D"),
    ],
)
def test_executed_map_rejects_bad_runs(steps, match):
    with pytest.raises(ValueError, match=match):
        executed_map(steps, 3, 3)


def test_empirical_surface_invariants_and_sums():
    rng = np.random.default_rng(0)
    max_blocks, block_size = 5, 4
    runs = random_runs(rng, 64, max_blocks, block_size)  # 64 runs: every mean is exact in binary
    S = empirical_surface(runs, max_blocks, block_size)
    assert S.shape == (max_blocks, block_size)
    assert check_surface(S) == []
    assert S[0, 0] == 1.0
    stats = surface_stats(S)
    assert stats["expected_steps"] == np.mean([sum(r) for r in runs])
    assert stats["expected_blocks"] == np.mean([len(r) for r in runs])
    with pytest.raises(ValueError, match="at least one run"):
        empirical_surface([], 2, 2)


def test_surface_stats_on_batches():
    rng = np.random.default_rng(1)
    runs = random_runs(rng, 6, 4, 3)
    maps = np.stack([executed_map(r, 4, 3) for r in runs]).reshape(2, 3, 4, 3)
    stats = surface_stats(maps)
    assert stats["expected_steps"].shape == (2, 3)
    np.testing.assert_array_equal(stats["expected_steps"].reshape(-1), [sum(r) for r in runs])
    np.testing.assert_array_equal(stats["expected_blocks"].reshape(-1), [len(r) for r in runs])
    single = surface_stats(maps[0, 0])
    assert isinstance(single["expected_steps"], float) and single["expected_blocks"] == len(runs[0])


def test_workload_curves():
    rng = np.random.default_rng(2)
    max_blocks, block_size = 4, 5
    runs = random_runs(rng, 32, max_blocks, block_size)
    S = empirical_surface(runs, max_blocks, block_size)
    horizons = [0, 1, 2, 3, block_size, block_size + 3]
    curve = workload_curve(S, horizons)
    stats = surface_stats(S)
    assert curve[0] == 0
    assert curve[1] == pytest.approx(stats["expected_blocks"], rel=1e-12)
    assert curve[4] == pytest.approx(stats["expected_steps"], rel=1e-12)
    assert curve[5] == curve[4]  # a horizon past d counts every step, no more
    assert np.all(np.diff(curve) >= 0)
    # a surface is the mean of executed maps, so its curve is the mean of the realised curves
    realised = np.mean([workload_curve_from_steps(r, horizons) for r in runs], axis=0)
    np.testing.assert_allclose(curve, realised, rtol=1e-12)
    np.testing.assert_array_equal(workload_curve_from_steps([3, 1, 5], [1, 2, 5]), [3, 5, 9])
    # batches: [..., B, d] -> [..., H]
    batch = np.stack([S, executed_map(runs[0], max_blocks, block_size)])
    assert workload_curve(batch, horizons).shape == (2, len(horizons))
    with pytest.raises(ValueError, match="non-negative integers"):
        workload_curve(S, [-1])
    with pytest.raises(ValueError, match="T_b >= 1"):
        workload_curve_from_steps([2, 0], [1])


def test_check_surface_flags_each_corruption():
    S = empirical_surface([[3, 2, 1], [2, 2], [1]], 3, 3)
    assert check_surface(S) == []

    too_big = S.copy()
    too_big[0, 0] = 1.2
    assert any("outside [0, 1]" in p for p in check_surface(too_big))

    rising_row = S.copy()
    rising_row[1, 2] = rising_row[1, 1] + 0.1
    problems = check_surface(rising_row)
    assert any("step axis" in p for p in problems)
    assert any("first cell of its row" in p for p in problems)

    rising_column = S.copy()
    rising_column[2, 0] = rising_column[1, 0] + 0.1
    assert any("first column" in p for p in check_surface(rising_column))

    negative = S.copy()
    negative[2, 2] = -0.5
    assert any("outside [0, 1]" in p for p in check_surface(negative))

    assert check_surface(np.full((2, 2), np.nan)) == ["surface has non-finite values"]
    # within atol is fine
    nudged = S.copy()
    nudged[0, 0] += 1e-9
    assert check_surface(nudged) == []
    with pytest.raises(ValueError, match="B_max, d"):
        check_surface(np.ones(3))


def test_counterexample_is_a_valid_surface_not_monotone_along_blocks():
    S = executed_map([1, 5], 2, 5)
    assert S[0, 1] == 0 and S[1, 1] == 1  # later block, more steps: columns s > 0 can rise
    assert check_surface(S) == []


def test_check_surface_on_batches():
    good = np.stack([executed_map([1, 2], 3, 2), executed_map([2], 3, 2)])
    assert check_surface(good) == []
    bad = good.copy()
    bad[1, 0, 1] = 1.5
    assert check_surface(bad) != []


def random_heads(rng, batch, max_blocks, block_size):
    p_continue = rng.uniform(0, 1, batch + (max_blocks - 1,))
    step_probs = rng.dirichlet(np.ones(block_size), batch + (max_blocks,))
    return p_continue, step_probs


def test_surface_from_heads_is_valid():
    rng = np.random.default_rng(3)
    p_continue, step_probs = random_heads(rng, (4, 3), 6, 5)
    S = surface_from_heads(p_continue, step_probs)
    assert S.shape == (4, 3, 6, 5)
    assert check_surface(S) == []
    for S_one in S.reshape(-1, 6, 5):
        assert check_surface(S_one) == []
    np.testing.assert_allclose(S[..., 0, 0], 1.0, rtol=1e-12)
    # float32 heads (a softmax output) are accepted
    S32 = surface_from_heads(p_continue.astype(np.float32), step_probs.astype(np.float32))
    np.testing.assert_allclose(S32, S, atol=1e-6)
    # one block: no continuation probabilities at all
    one = surface_from_heads(np.zeros((0,)), np.array([[0.5, 0.25, 0.25]]))
    np.testing.assert_allclose(one, [[1.0, 0.5, 0.25]])


def brute_force_surface(p_continue, step_probs):
    """E[executed map] by enumerating every (N, T_1..T_N) with its probability."""
    max_blocks, block_size = step_probs.shape
    surface = np.zeros((max_blocks, block_size))
    expected_steps = expected_blocks = 0.0
    for n in range(1, max_blocks + 1):
        p_n = np.prod(p_continue[: n - 1]) * (1 - p_continue[n - 1] if n < max_blocks else 1.0)
        for steps in itertools.product(range(1, block_size + 1), repeat=n):
            p = p_n * np.prod([step_probs[b, t - 1] for b, t in enumerate(steps)])
            surface += p * executed_map(steps, max_blocks, block_size)
            expected_steps += p * sum(steps)
            expected_blocks += p * n
    return surface, expected_steps, expected_blocks


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_surface_from_heads_matches_enumeration(seed):
    rng = np.random.default_rng(seed)
    p_continue, step_probs = random_heads(rng, (), 3, 3)
    S = surface_from_heads(p_continue, step_probs)
    brute, expected_steps, expected_blocks = brute_force_surface(p_continue, step_probs)
    np.testing.assert_allclose(S, brute, rtol=1e-12, atol=1e-14)
    stats = surface_stats(S)
    assert stats["expected_steps"] == pytest.approx(expected_steps, rel=1e-12)
    assert stats["expected_blocks"] == pytest.approx(expected_blocks, rel=1e-12)
    curve = workload_curve(S, [1, 3])
    np.testing.assert_allclose(curve, [expected_blocks, expected_steps], rtol=1e-12)


def test_surface_from_heads_rejects_bad_heads():
    rng = np.random.default_rng(4)
    p_continue, step_probs = random_heads(rng, (2,), 3, 4)
    with pytest.raises(ValueError, match="B_max - 1"):
        surface_from_heads(p_continue[:, :1], step_probs)
    with pytest.raises(ValueError, match="B_max - 1"):
        surface_from_heads(p_continue[:1], step_probs)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        surface_from_heads(p_continue + 1.5, step_probs)
    with pytest.raises(ValueError, match="sum to 1"):
        surface_from_heads(p_continue, step_probs * 2)
    with pytest.raises(ValueError, match="non-negative"):
        bad = step_probs.copy()
        bad[0, 0, :2] = [-0.5, bad[0, 0, 0] + bad[0, 0, 1] + 0.5]
        surface_from_heads(p_continue, bad)
    with pytest.raises(ValueError, match="finite"):
        surface_from_heads(np.full_like(p_continue, np.nan), step_probs)
