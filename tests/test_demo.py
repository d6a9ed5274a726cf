"""The main job at tiny size: `relf-jax demo --quick` end to end, then again from its cache."""

import json
import os

import pytest

from experiments.launch import main


def _saved(wd):
    """Checkpoint step folders, tokenizers and saved arrays under `wd`, with their modification times."""
    out = {}
    for root, dirs, files in os.walk(wd):
        names = dirs if os.path.basename(root) == "checkpoints" else [
            f for f in files if f.endswith((".npz", ".npy", ".model"))]
        out.update({os.path.join(root, n): os.stat(os.path.join(root, n)).st_mtime_ns for n in names})
    return out


@pytest.mark.entry
def test_demo_quick_writes_report_and_reuses_its_cache(tmp_path, capsys):
    wd = str(tmp_path / "demo")
    assert main(["demo", "--quick", "--workdir", wd]) == 0
    out = capsys.readouterr().out
    report = json.load(open(os.path.join(wd, "report.json")))
    methods = [r["method"] for r in report["rows"]]
    assert methods[0] == "data" and any(m.startswith("ar ") for m in methods)
    assert any(m.startswith("spec standard") for m in methods) and any(m.startswith("spec nsd") for m in methods)
    assert "spec nsd p=0.9 k=4 rcsd draft" in methods
    assert "spec nsd p=0.9 k=4 corpus n-gram" in methods
    assert os.path.exists(os.path.join(wd, "ar", "ngram_draft_o3_m16.npz"))
    assert json.load(open(os.path.join(wd, "rcsd", "progress.json")))["trained"] == 2
    assert {"relf stochastic", "relf euler", "relf euler reflow2", "positional unigram (reference)"} <= set(methods)
    assert any(m.startswith("block diffusion d=8") for m in methods)
    assert [r["nfe"] for r in report["rows"] if r["method"].startswith("relf")] == [64, 16, 16]
    uni = next(r for r in report["rows"] if r["method"] == "positional unigram (reference)")
    versus = report["over_positional_unigram"]
    assert set(versus) == {m for m in methods if m.startswith(("relf", "block diffusion"))}
    assert versus["relf euler"] == pytest.approx(
        next(r["gen_ppl"] for r in report["rows"] if r["method"] == "relf euler") / uni["gen_ppl"])
    assert "over the positional-unigram reference" in out
    reflow = json.load(open(os.path.join(wd, "reflow.json")))
    assert [r["round"] for r in reflow] == [1, 2]
    for row in report["rows"]:
        assert set(row) >= {"method", "nfe", "gen_ppl", "entropy", "tokens_per_s"}
        assert row["gen_ppl"] > 1 and row["entropy"] > 0 and row["pooled_entropy"] > 0
    # the exact judge rates held-out data better than an undertrained tiny model's samples
    data = report["rows"][0]
    assert all(r["gen_ppl"] > data["gen_ppl"] for r in report["rows"][1:])
    assert set(report["decode_tokens_per_s"]) == {"1", "8"}
    # the speculative rows' regime, measured: weight bytes, cache, what K + 1 tokens cost against one
    regime = report["speculative_regime"]
    assert regime["k"] == 4 and regime["weight_bytes"] > 0 and regime["verify_over_one_token"] > 0
    assert regime["ceiling_speedup"] == pytest.approx(5 / regime["verify_over_one_token"])
    assert "speculative rows' regime" in out and "bench spec --preset cpu-wide" in out
    assert "Speculative rows: the target's" in open(os.path.join(wd, "report.md")).read()
    for name in ("report.md", "quality.png", os.path.join("ar", "loss_curve.png"), "tokenizer.model"):
        assert os.path.exists(os.path.join(wd, name)), name
    assert "gen_ppl" in out and "data" in out
    # second run: data, tokenizer, models, draft and reflow rounds come from the workdir; nothing is retrained
    trained = _saved(wd)
    assert any("checkpoints" in path for path in trained)
    assert main(["demo", "--quick", "--workdir", wd]) == 0
    again = json.load(open(os.path.join(wd, "report.json")))
    assert again["train"]["resumed_from"] == again["train"]["steps"]
    assert json.load(open(os.path.join(wd, "reflow.json"))) == reflow
    assert _saved(wd) == trained  # no checkpoint, tokenizer, table or n-gram draft written again
    assert reflow[0]["settings"]["pair_weight"] == 1.0
    # the same rounds asked for with another lambda: refused, not silently reused
    assert main(["reflow", "--workdir", wd, "--data-weight", "0.5"]) == 2
    assert "data_weight=0.5" in capsys.readouterr().err
