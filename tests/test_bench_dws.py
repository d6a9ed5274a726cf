"""`relf-jax bench dws` end to end at toy sizes: the JSON the issue asks for, and the plots."""

import dataclasses
import json
import os

import pytest


@pytest.mark.slow
def test_bench_dws_toy_sizes(tmp_path):
    from experiments.bench.dws import QUICK, bench_dws

    sizes = dataclasses.replace(QUICK, bd_steps=10, n_train=48, n_probe=16, n_test=24, coarse_steps=5,
                                fine_steps=5, predictor_batch=16, loads=(0.5, 0.9), seeds=5, sim_jobs=100)
    out = str(tmp_path / "dws.json")
    bench_dws(out, quick=True, workdir=str(tmp_path / "wd"), sizes=sizes, overrides=["train.progress=false"])
    r = json.load(open(out))
    assert set(r["error"]) == {"dws", "dws_continue", "dws_median", "length", "steps", "prompt_len", "oracle",
                               "length_oracle", "steps_oracle"}
    # the ceilings are the realised scalars' errors over the realised surface's
    for name in ("length", "steps"):
        assert r["error_ratio_ceiling"][f"vs_{name}"] == pytest.approx(
            r["error"][f"{name}_oracle"]["mae"] / r["error"]["oracle"]["mae"])
    assert all(q["output_len"] >= 0 for q in r["requests"])
    assert set(r["error_ratio_vs_length_by_predictor"]) == {"dws", "dws_continue", "dws_median"}
    assert os.path.isdir(r["predictor_dir"]) and r["predictor_dir"].endswith("surface_length")
    for e in r["error"].values():
        assert set(e) == {"mae", "mape", "kendall_tau"}
    for key in ("error_ratio_vs_length", "error_ratio_vs_steps", "latency_ratio_fcfs_over_sjf_dws",
                "predictor_ms_per_prompt"):
        assert r[key] > 0
    assert set(r["latency"]) >= {"fcfs", "sjf_dws", "sjf_length", "sjf_steps", "sjf_oracle"}
    assert set(r["latency"]["fcfs"]) == {"0.5", "0.9"}
    assert set(r["latency"]["fcfs"]["0.9"]) == {"mean", "p50", "p90", "p99"}
    assert set(r["transfer"]) >= {"before_refit", "after_refit"}
    for path in r["plots"].values():
        assert os.path.getsize(path) > 0
