"""The continual RCSD loop on a tiny trained target: learning, resuming, no lost traces."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import relf_jax as rj
from relf_jax.checkpoint import latest_meta
from relf_jax.config import make_config
from relf_jax.data.tokenizer import encode_prompt
from relf_jax.eval.evaluate import exact_judge
from relf_jax.loading import load_model
from relf_jax.speculative.continual import ContinualDraftTrainer, ContinualSettings, ReplayBatches
from relf_jax.speculative.rcsd import RCSDLossSettings, rcsd_inputs, rcsd_terms
from relf_jax.speculative.recipes import train_draft


@pytest.fixture(scope="module")
def target_and_draft(tmp_path_factory):
    wd = str(tmp_path_factory.mktemp("rcsd_target"))
    cfg = make_config("tiny", ["train.steps=60", "train.progress=false"], workdir=wd)
    rj.train(cfg)
    # a deliberately weak starting draft: a few distillation steps only
    train_draft(wd, ["train.steps=5", "train.progress=false"])
    return load_model(wd, "ar"), load_model(os.path.join(wd, "draft"), "ar")


def _prompts(lm, n, seed):
    judge = exact_judge(lm.cfg)
    return [encode_prompt(lm.tokenizer, info["prompt"])
            for info in judge.grammar.sample_with_info(n, seed)]


SETTINGS = ContinualSettings(steps_per_cycle=30, batch_size=8, serve_batch=8, learning_rate=1e-2, k=3,
                             max_new_tokens=24, prompt_len=32, trace_top_k=32,
                             loss=RCSDLossSettings(pref_weight=1.0, beta=0.5))


def test_continual_rcsd_fits_the_target_on_its_own_traffic(target_and_draft, tmp_path):
    target, draft = target_and_draft
    prompts = _prompts(target, 16, seed=1)
    trainer = ContinualDraftTrainer(target, draft, str(tmp_path / "run"), SETTINGS)
    records = trainer.run([prompts] * 3)
    assert [r["cycle"] for r in records] == [1, 2, 3] and all(r["tau"] >= 1.0 for r in records)
    assert len(trainer.store) == 3
    batch = {k: jnp.asarray(v) for k, v in
             next(ReplayBatches(trainer.store, 64, recent_shards=[], recent_fraction=0.0, seed=5)).items()}

    @jax.jit  # one program (op by op, the two forwards compiled each of their ops)
    def terms(params):
        tokens, positions, seg = rcsd_inputs(batch)
        logits, _ = nnx.merge(draft.graphdef, params)(tokens, positions, segment_ids=seg)
        ref, _ = nnx.merge(draft.graphdef, draft.params)(tokens, positions, segment_ids=seg)
        return rcsd_terms(logits, ref, batch, SETTINGS.loss)

    before, after = terms(draft.params), terms(trainer.params)
    assert float(before["pairs"]) > 0  # the traffic produced preference pairs
    assert float(after["distill"]) < float(before["distill"]) - 0.03  # closer to the target on its traffic
    assert float(after["margin"]) > 0  # emitted tokens gained on rejected ones against the reference


def test_continual_run_resumes_without_losing_traces(target_and_draft, tmp_path):
    target, draft = target_and_draft
    wd = str(tmp_path / "run")
    batches = [_prompts(target, 8, seed=s) for s in (2, 3, 4)]
    settings = dataclasses.replace(SETTINGS, steps_per_cycle=4)
    first = ContinualDraftTrainer(target, draft, wd, settings)
    first.run(batches, cycles=1)

    # killed after serving cycle 2, before its training finished
    second = ContinualDraftTrainer(target, draft, wd, settings)

    def killed(*a, **k):
        raise KeyboardInterrupt

    second.train = killed
    with pytest.raises(KeyboardInterrupt):
        second.run(batches)
    progress = json.load(open(os.path.join(wd, "progress.json")))
    assert (progress["served"], progress["trained"]) == (2, 1) and len(second.store) == 2

    third = ContinualDraftTrainer(target, draft, wd, settings)  # resumes: trains cycle 2 on what it served
    records = third.run(batches)
    assert [r["cycle"] for r in records] == [2, 3]
    assert len(third.store) == 3  # cycle 2 was not served twice, nothing was lost
    assert latest_meta(os.path.join(wd, "draft"))["step"] == 3 * settings.steps_per_cycle


def test_rcsd_command_line(target_and_draft, tmp_path, capsys):
    from experiments.launch import main

    target, _ = target_and_draft
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("<user> hello there <assistant>\n\n<user> what should i cook <assistant>\n")
    wd = str(tmp_path / "rcsd")
    args = ["rcsd", "--target", target.cfg.workdir, "--workdir", wd, "--cycles", "2", "--prompts-per-cycle", "4",
            "--steps-per-cycle", "2", "--prompts", str(prompts)]
    assert main(args) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [r["cycle"] for r in lines] == [1, 2] and all(r["tau"] >= 1 for r in lines)
    assert main(args) == 0  # finished: nothing to redo
    assert main(["rcsd", "--target", target.cfg.workdir, "--cycles", "0"]) == 2
    assert main(["rcsd", "--target", target.cfg.workdir, "--prompts", str(tmp_path / "missing.txt")]) == 2
