"""`relf-jax bench relf-toy`: the toy's data, its exact posterior, and a small end-to-end run."""

import dataclasses
import json
import os

import numpy as np
import pytest

from experiments.bench.relf_toy import (
    BOS,
    EOS,
    FIRST_WORD,
    PAD,
    ToyBatches,
    ToySizes,
    bench_relf_toy,
    candidate_rows,
    distinct_share,
    sample_entropy,
    valid_share,
)
from relf_jax.flow.exact import exact_residual


def test_candidate_rows_batches_and_valid_share():
    sz = ToySizes(words=3, repeats=2, length=6, vocab=8)
    rows = candidate_rows(sz)
    np.testing.assert_array_equal(rows[1], [BOS, FIRST_WORD + 1, FIRST_WORD + 1, EOS, PAD, PAD, PAD])
    it = ToyBatches(rows, batch=5, seed=1)
    first = next(it)["tokens"]
    state = it.get_state()
    second = next(it)["tokens"]
    it.set_state(state)
    np.testing.assert_array_equal(next(it)["tokens"], second)  # resumable, a function of i only
    assert first.shape == (5, 7) and all((r == rows).all(1).any() for r in first)
    mixed = rows[:2, :6].copy()
    mixed[1, 2] = FIRST_WORD  # a row that changes its word halfway is not data
    assert valid_share(rows[:, :6], rows) == 1.0 and valid_share(mixed, rows) == 0.5


def test_bench_relf_toy_runs_and_the_exact_posterior_samples_valid_rows(tmp_path):
    sz = ToySizes(preset="tiny", steps=4, batch=8, words=6, repeats=4, length=8, vocab=16, samples=32, nfe=8,
                  probe_times=(0.5,))
    out = tmp_path / "toy.json"
    # the paper's parametrisation and the default (the no_singular variant trains like the former)
    bench_relf_toy(str(out), workdir=str(tmp_path / "runs"), sizes=sz, variants=("exact", "singular", "default"))
    report = json.loads(out.read_text())
    assert report["complete"] and report["sizes"]["words"] == 6
    rows = {(r["variant"], r["sampler"]): r for r in report["rows"]}
    assert set(rows) == {(v, s) for v in ("exact", "singular", "default") for s in ("euler", "stochastic")}
    for r in report["rows"]:
        assert 0 < r["distinct_share"] <= 1 and 0 <= r["sample_entropy"] <= np.log(32) + 1e-9
    # the exact posterior draws the six rows about uniformly: many distinct rows, near-data entropy
    assert rows["exact", "stochastic"]["distinct_share"] == 1.0 and rows["exact", "stochastic"]["distinct_rows"] == 6
    assert rows["exact", "stochastic"]["distinct_valid_rows"] == 6
    assert rows["exact", "stochastic"]["sample_entropy"] > 0.8 * np.log(6)
    # the samplers with the exact posterior return data rows: the reference every model is read against
    assert rows["exact", "euler"]["valid_share"] >= 0.9 and rows["exact", "stochastic"]["valid_share"] >= 0.9
    assert rows["exact", "euler"]["word_ce"]["0.5"] < 0.1
    # four steps teach nothing: the trained rows are far from the exact posterior
    assert rows["singular", "euler"]["word_ce"]["0.5"] > 0.3
    assert all(0.0 <= r["valid_share"] <= 1.0 for r in report["rows"])
    # the default row trains with the default recipe's clean start (4 steps: round(0.4 * 4) = 2 near 1),
    # which the paper's rows do not: the saved data state says how many batches it drew
    for variant, clean in (("default", {"clean_start": 4}), ("singular", {})):
        (ckpt,) = (tmp_path / "runs").glob(f"{variant}_*/checkpoints/4/data/metadata")
        state = json.loads(ckpt.read_text())["iterator"]
        assert {k: state[k] for k in clean} == clean and ("clean_start" in state) == bool(clean)
    with pytest.raises(ValueError, match="unknown variants"):
        bench_relf_toy(str(out), sizes=sz, variants=("exact", "nope"))
    # other settings in the same workdir train a model of their own, never resume another toy's
    bench_relf_toy(str(out), workdir=str(tmp_path / "runs"), sizes=dataclasses.replace(sz, seed=1),
                   variants=("singular",))
    assert len([d for d in os.listdir(tmp_path / "runs") if d.startswith("singular_")]) == 2


def test_a_collapsed_sampler_reads_valid_but_not_distinct():
    """A denoiser whose data is one row returns that row every time: valid share 1, distinct
    share 1 / min(n, rows) (~0), sample entropy 0: what valid share alone would have hidden."""
    import jax
    import jax.numpy as jnp

    from relf_jax.flow.embeddings import gaussian_embeddings
    from relf_jax.flow.samplers import FlowSamplerSettings, sample

    sz = ToySizes(words=6, repeats=4, length=8, vocab=16)
    rows = candidate_rows(sz)
    table = jnp.asarray(gaussian_embeddings(sz.vocab, 8, seed=0, norm=3.0))
    collapsed = exact_residual(rows[2:3], table)  # the exact denoiser of a one-row data set
    samples = np.asarray(sample(jax.random.key(0), collapsed, table,
                                FlowSamplerSettings(nfe=8, sampler="stochastic", c=1e4), batch=64, length=8)[0])
    assert valid_share(samples, rows) == 1.0
    assert distinct_share(samples) == 1 / 64 and distinct_share(samples, 6) == 1 / 6
    assert sample_entropy(samples) == 0.0
    assert distinct_share(rows[:, :8]) == 1.0 and sample_entropy(rows[:, :8]) == pytest.approx(np.log(6))
