"""The launcher: every bad input is a one-line error with exit status 2, not a traceback."""

import json
import os
import subprocess
import sys

import pytest

from experiments.launch import main, parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def cb_run(tmp_path_factory):
    """A tiny AR model trained through the CLI on the chatterbot corpus."""
    wd = str(tmp_path_factory.mktemp("cb"))
    rc = main(["train", "--preset", "tiny", "--workdir", wd, "data.source=chatterbot", "train.steps=10",
               "train.progress=false"])
    assert rc == 0
    return wd


def _one_line_error(rc, err, *words):
    assert rc == 2
    lines = [line for line in err.strip().splitlines() if line.startswith("relf-jax: error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_overrides_may_follow_the_options(capsys):
    a = parse_args(["bench", "dws", "--out", "x.json", "train.steps=9", "--workdir", "w", "model.d_model=64"])
    assert a.which == "dws" and a.out == "x.json" and a.workdir == "w"
    assert a.overrides == ["train.steps=9", "model.d_model=64"]
    a = parse_args(["bench", "dws", "train.steps=9", "--out", "x.json", "data.seq_len=32"])
    assert a.overrides == ["train.steps=9", "data.seq_len=32"]
    with pytest.raises(SystemExit) as e:
        parse_args(["bench", "dws", "--out", "x.json", "--nope"])
    assert e.value.code == 2
    capsys.readouterr()
    # serve and info take the mesh keys only (the model's own settings come with its checkpoint)
    assert parse_args(["serve", "--mock", "mesh.tensor=2"]).overrides == ["mesh.tensor=2"]
    for argv in (["serve", "--mock", "train.steps=9"], ["info", "mesh.distributed=on"]):
        rc, _, err = _run(capsys, *argv)
        _one_line_error(rc, err, "takes only mesh.data, mesh.fsdp and mesh.tensor overrides", argv[-1])
    rc, _, err = _run(capsys, "serve", "--mock", "mesh.tensor=3")
    _one_line_error(rc, err, "mesh.tensor=3", "1 devices cannot be split")


def test_bench_serve_parts_are_checked(capsys, tmp_path):
    out = str(tmp_path / "x.json")
    rc, _, err = _run(capsys, "bench", "spec", "--out", out, "--parts", "engines")
    _one_line_error(rc, err, "--parts applies to bench serve and bench relf only")
    rc, _, err = _run(capsys, "bench", "relf", "--out", out, "--parts", "reflow,speed", "--workdir", str(tmp_path))
    _one_line_error(rc, err, "models, reflow, latency", "speed")
    rc, _, err = _run(capsys, "bench", "serve", "--out", out, "--parts", "engines,gpu", "--workdir", str(tmp_path))
    _one_line_error(rc, err, "engines, batcher, dws", "gpu")
    rc, _, err = _run(capsys, "bench", "relf", "--out", out, "--preset", "cpu-wide")
    _one_line_error(rc, err, "--preset applies to bench spec only")
    rc, _, err = _run(capsys, "bench", "spec", "--out", out, "--preset", "cpu-wide", "--quick")
    _one_line_error(rc, err, "--preset and --quick are exclusive")
    rc, _, err = _run(capsys, "bench", "relf", "--out", out, "--draft-steps", "1200")
    _one_line_error(rc, err, "--draft-steps applies to bench spec only")
    rc, _, err = _run(capsys, "bench", "spec", "--out", out, "--draft-steps", "0")
    _one_line_error(rc, err, "--draft-steps must be >= 1", "0")
    from experiments.commands.bench import bench_options
    assert bench_options(parse_args(["bench", "spec", "--out", out, "--preset", "cpu-wide", "--draft-steps",
                                     "1200"])) == {"preset": "cpu-wide", "draft_steps": 1200}
    assert parse_args(["serve", "--mock", "--steps-per-call", "3"]).steps_per_call == 3


@pytest.mark.parametrize("argv, words", [
    (["train", "--preset", "huge"], ["unknown preset 'huge'", "tiny"]),
    (["train", "--preset", "tiny", "train.stepz=1"], ["train.stepz", "train.steps"]),
    (["train", "--preset", "tiny", "train.steps=many"], ["train.steps", "int"]),
    (["train", "--preset", "tiny", "sample.temperature=-1"], ["temperature must be >= 0"]),
    (["train", "--preset", "tiny", "sample.top_p=1.5"], ["top_p must be in (0, 1]"]),
    (["train", "--preset", "tiny", "sample.top_k=-3"], ["top_k must be >= 0"]),
    (["reflow", "--pair-weight", "0", "--data-weight", "0"], ["--pair-weight", "not both 0"]),
    (["reflow", "--name", "relf"], ["--name", "'relf'"]),
])
def test_bad_config(capsys, tmp_path, argv, words):
    rc, _, err = _run(capsys, *argv, "--workdir", str(tmp_path))
    _one_line_error(rc, err, *words)


def test_missing_and_empty_data_files(capsys, tmp_path):
    rc, _, err = _run(capsys, "train", "--preset", "tiny", "--workdir", str(tmp_path / "a"),
                      "data.source=text_files", f"data.path={tmp_path / 'nope.jsonl'}")
    _one_line_error(rc, err, "nope.jsonl")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n")
    rc, _, err = _run(capsys, "train", "--preset", "tiny", "--workdir", str(tmp_path / "b"),
                      "data.source=text_files", f"data.path={empty}")
    _one_line_error(rc, err, "empty.txt")
    rc, _, err = _run(capsys, "train", "--preset", "tiny", "--workdir", str(tmp_path / "c"),
                      "data.source=text_files")
    _one_line_error(rc, err, "data.path")
    rc, _, err = _run(capsys, "train", "--preset", "tiny", "--workdir", str(tmp_path / "d"), "data.source=nosuch")
    _one_line_error(rc, err, "nosuch")


def test_sampling_errors(capsys, cb_run):
    rc, _, err = _run(capsys, "sample", "--workdir", cb_run, "sample.temperature=-0.5")
    _one_line_error(rc, err, "temperature")
    rc, _, err = _run(capsys, "sample", "--workdir", cb_run, "sample.top_p=0")
    _one_line_error(rc, err, "top_p")
    rc, _, err = _run(capsys, "sample", "--workdir", cb_run, "sample.top_k=-1")
    _one_line_error(rc, err, "top_k")
    rc, _, err = _run(capsys, "sample", "--workdir", cb_run, "--prompt", "hello " * 200)
    _one_line_error(rc, err, "exceeds the model context")
    rc, _, err = _run(capsys, "sample", "--workdir", cb_run, "train.steps=3")
    _one_line_error(rc, err, "sample.*")
    rc, _, err = _run(capsys, "sample", "--workdir", str(os.path.join(cb_run, "nothing-here")))
    _one_line_error(rc, err, "no checkpoint")


def test_sample_and_stream(capsys, cb_run):
    rc, out, err = _run(capsys, "sample", "--workdir", cb_run, "--prompt", "<user> hello <assistant>",
                        "sample.max_new_tokens=8", "sample.num_samples=1")
    assert rc == 0 and out.strip() and "tokens/s" in err
    rc, out, _ = _run(capsys, "sample", "--workdir", cb_run, "--stream", "--prompt", "<user> hi <assistant>",
                      "sample.max_new_tokens=8", "sample.temperature=0")
    assert rc == 0 and out.strip()


def test_corpus_ngram_proposer_from_the_command_line_and_the_engine(capsys, cb_run):
    """`speculative.proposer=corpus_ngram` counts the run's training data once, saves the table
    next to the model, and the serving engine reads the same table."""
    import glob

    from relf_jax.methods import NgramTable, Speculative
    from relf_jax.serving.loading import engine_for

    rc, out, err = _run(capsys, "sample", "--workdir", cb_run, "--prompt", "<user> hello <assistant>",
                        "sample.max_new_tokens=8", "sample.num_samples=2", "speculative.rule=standard",
                        "speculative.proposer=corpus_ngram", "speculative.corpus_order=2")
    assert rc == 0 and out.strip() and "per target forward" in err, err
    assert "counts the model's training corpus (data.source=chatterbot" in err  # says where the table is from
    assert [os.path.basename(p) for p in glob.glob(os.path.join(cb_run, "**", "ngram_draft_*.npz"),
                                                   recursive=True)] == ["ngram_draft_o2_m16.npz"]
    eng = engine_for(cb_run, Speculative(rule="nsd", proposer=NgramTable()), slots=1)
    assert eng.ngram_table.order == 3 and eng.ngram_table.vocab_size == eng.lm.model_cfg.vocab_size
    rc, _, err = _run(capsys, "sample", "--workdir", cb_run, "speculative.rule=nsd", "speculative.corpus_order=1")
    _one_line_error(rc, err, "corpus_order")


def test_checkpoint_of_another_family(capsys, cb_run, tmp_path):
    """A workdir whose checkpoint holds a different model family is refused by name."""
    from relf_jax.checkpoint import Checkpointer
    ckpt = Checkpointer(str(tmp_path / "other" / "ar"), async_save=False)
    ckpt.save(1, {"x": __import__("numpy").zeros(2)}, meta={"family": "relf", "config": {}, "model": {}})
    ckpt.close()
    rc, _, err = _run(capsys, "sample", "--workdir", str(tmp_path / "other"))
    _one_line_error(rc, err, "'relf'", "not 'ar'")


@pytest.mark.entry
def test_console_script_entry_point(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "experiments.launch", "info"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0
    info = json.loads(proc.stdout)
    assert info["backend"] == "cpu" and info["default_mesh"]["data"] >= 1
    proc = subprocess.run([sys.executable, "-m", "experiments.launch", "train", "--preset", "nope"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown preset" in proc.stderr and "Traceback" not in proc.stderr


def test_eval_with_a_model_judge_and_exact_judge_error(capsys, cb_run, tmp_path):
    out = tmp_path / "eval.json"
    rc, stdout, _ = _run(capsys, "eval", "--workdir", cb_run, "--judge", cb_run, "--out", str(out),
                         "sample.num_samples=2", "sample.batch_size=2", "sample.max_new_tokens=8")
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["judge"] == "model" and result["gen_ppl"] > 1 and result["entropy"] >= 0
    assert result["validation_loss"] > 0 and result["step"] == 10
    rc, _, err = _run(capsys, "eval", "--workdir", cb_run, "sample.num_samples=2")
    _one_line_error(rc, err, "exact judge needs data.source=synthetic_chat")


def test_export_and_import_hf_commands(capsys, cb_run, tmp_path):
    """export (all three formats) -> import-hf -> sample, and a bad import path is one line."""
    pytest.importorskip("transformers")
    hf_dir, st_file, art = str(tmp_path / "hf"), str(tmp_path / "m.safetensors"), str(tmp_path / "art")
    for fmt, out in (("hf", hf_dir), ("safetensors", st_file), ("jax-export", art)):
        rc, out_json, err = _run(capsys, "export", "--workdir", cb_run, "--format", fmt, "--out", out,
                                 "--prompt-len", "8", "--max-len", "32")
        assert rc == 0, err
        assert json.loads(out_json)["format"] == fmt
    assert os.path.exists(os.path.join(hf_dir, "model.safetensors")) and os.path.exists(st_file)
    assert os.path.exists(os.path.join(art, "decode.jax_export"))
    rc, out, err = _run(capsys, "import-hf", hf_dir, "--out", str(tmp_path / "imported"))
    assert rc == 0, err
    rc, out, err = _run(capsys, "sample", "--workdir", str(tmp_path / "imported"), "--prompt",
                        "<user> hello <assistant>", "sample.max_new_tokens=8", "sample.temperature=0")
    assert rc == 0 and out.strip() and "tokens/s" in err
    rc, _, err = _run(capsys, "import-hf", str(tmp_path / "no_such_dir"), "--out", str(tmp_path / "x"))
    _one_line_error(rc, err, "not a local directory")
