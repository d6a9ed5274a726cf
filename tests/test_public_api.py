"""The public API, used as a Colab user would: ``import relf_jax as rj`` and nothing else."""

import os
import re

import pytest

import relf_jax as rj

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GREEDY = rj.SamplingParams(temperature=0.0, max_new_tokens=12, seed=0)
PROMPTS = ["<user> how is the weather <assistant>", "<user> tell me about music <assistant>"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny AR model trained through `rj.train` (a few steps: the API, not the quality, is tested)."""
    wd = str(tmp_path_factory.mktemp("api"))
    cfg = rj.make_config("tiny", ["train.steps=6", "train.progress=false", "data.num_train=400"], workdir=wd)
    result = rj.train(cfg)
    assert result.step == 6
    return wd


@pytest.fixture(scope="module")
def model(run_dir):
    return rj.load(run_dir)


def test_the_api_names_and_version():
    assert set(rj.__all__) >= {"make_config", "train", "load", "generate", "stream", "evaluate", "SamplingParams",
                               "Autoregressive", "Speculative", "DraftModel", "PromptLookup", "NgramTable", "Flow",
                               "BlockDiffusion", "ChatModel", "__version__"}
    for name in rj.__all__:
        assert getattr(rj, name) is not None
    assert re.fullmatch(r"\d+\.\d+\.\d+", rj.__version__)
    with open(os.path.join(ROOT, "setup.py")) as f:
        assert "version=VERSION" in f.read()  # setup.py reads relf_jax.__version__, defined once
    import relf_jax.train.loop  # noqa: F401 - importing the train package's modules keeps rj.train the function

    assert callable(rj.train)


def test_load_reads_the_family_and_generates(run_dir, model):
    assert model.model_cfg.family == "ar" and model.step == 6
    texts = rj.generate(model, PROMPTS, GREEDY)
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)
    assert rj.generate(run_dir, PROMPTS, GREEDY) == texts  # a path loads the model
    assert rj.generate(model, PROMPTS[0], rj.SamplingParams(temperature=0.0, max_new_tokens=12, n=2)) == [texts[0]] * 2
    assert len(rj.generate(model, None, rj.SamplingParams(max_new_tokens=8, n=3))) == 3  # unconditional
    hot = rj.SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12, seed=3)
    assert rj.generate(model, PROMPTS, hot) == rj.generate(model, PROMPTS, hot)  # the seed fixes the samples


def test_speculative_methods_agree_with_greedy_decoding(model):
    greedy = rj.generate(model, PROMPTS, GREEDY)
    for proposer in (rj.PromptLookup(ngram=2), rj.NgramTable(), rj.DraftModel(model)):
        method = rj.Speculative(rule="standard", k=3, proposer=proposer)
        assert rj.generate(model, PROMPTS, GREEDY, method=method) == greedy, proposer


def test_stream_yields_the_reply_piece_by_piece(model):
    pieces = list(rj.stream(model, PROMPTS[0], GREEDY))
    assert all(isinstance(p, str) and p for p in pieces)
    assert "".join(pieces) == rj.generate(model, PROMPTS[0], GREEDY)[0]
    text = "".join(pieces)
    if len(text) > 2:
        stop = text[1:3]
        assert "".join(rj.stream(model, PROMPTS[0], rj.SamplingParams(temperature=0.0, max_new_tokens=12,
                                                                       stop=[stop]))) == text[:text.find(stop)]
    from relf_jax.errors import UserError

    with pytest.raises(UserError, match="autoregressively"):
        list(rj.stream(model, PROMPTS[0], GREEDY, method=rj.Flow(nfe=4)))


def test_evaluate_reports_quality_and_the_validation_loss(model):
    report = rj.evaluate(model, params=rj.SamplingParams(max_new_tokens=8), num_samples=4)
    assert report["num_samples"] == 4 and report["judge"] == "exact" and report["step"] == 6
    for key in ("gen_ppl", "entropy", "distinct_2", "tau", "validation_loss"):
        assert key in report
    assert report["tau"] == 1.0 and report["validation_loss"] > 0


def test_chat_model_chats_and_streams(run_dir):
    # warmup=False: the test compiles the programs its requests use, not every prompt bucket and
    # slot count (the README quickstart's ChatModel warms up)
    with rj.ChatModel.load(run_dir, method=rj.Autoregressive(), warmup=False) as bot:
        messages = [{"role": "user", "content": "how is the weather"}]
        reply = bot.chat(messages, temperature=0.0, max_tokens=8)
        assert isinstance(reply, str)
        pieces = list(bot.stream(messages, temperature=0.0, max_tokens=8))
        assert all(isinstance(p, str) for p in pieces) and "".join(pieces) == reply
        assert bot.chat(messages, rj.SamplingParams(temperature=0.0, max_new_tokens=8)) == reply
    method = rj.Speculative(rule="nsd", k=2, proposer=rj.DraftModel(rj.load(run_dir)))  # a loaded model drafts
    with rj.ChatModel.load(run_dir, method=method, warmup=False) as bot:
        assert isinstance(bot.chat(messages, temperature=0.0, max_tokens=8), str)


def test_method_objects_check_their_values():
    from relf_jax.config import ConfigError
    from relf_jax.methods import parse_method

    bad = [lambda: rj.Speculative(rule="fast"), lambda: rj.Speculative(k=0),
           lambda: rj.Speculative(proposer="draft"), lambda: rj.Speculative(nsd_top_p=0.0),
           lambda: rj.Speculative(draft_temperature_scale=0.0), lambda: rj.Speculative(draft_temperature_scale="0.5"),
           lambda: rj.PromptLookup(ngram=0), lambda: rj.NgramTable(order=1), lambda: rj.Flow(nfe=0),
           lambda: rj.Flow(sampler="heun"), lambda: rj.Flow(grid="log"), lambda: rj.BlockDiffusion(threshold=1.5),
           lambda: rj.SamplingParams(temperature=-1.0), lambda: rj.SamplingParams(top_p=0.0),
           lambda: rj.SamplingParams(max_new_tokens=0), lambda: rj.SamplingParams(n=0),
           lambda: parse_method("fast"), lambda: parse_method("nsd", proposer="oracle"),
           lambda: parse_method("nsd", proposer="draft", corpus=["x.txt"])]
    for make in bad:
        with pytest.raises(ConfigError):
            make()
    assert parse_method("nsd", proposer="prompt_lookup", k=2) == rj.Speculative(rule="nsd", k=2,
                                                                                proposer=rj.PromptLookup())
    assert parse_method("ar") == rj.Autoregressive()
    assert parse_method("nsd", draft_temperature_scale=0.5).draft_temperature_scale == 0.5
    assert parse_method("relf", nfe=8) == rj.Flow(nfe=8)
    assert parse_method("relf", grid="late") == rj.Flow(grid="late")
    assert parse_method("standard", proposer="corpus_ngram", corpus="online").proposer == rj.NgramTable(("online",))


def test_a_method_for_another_family_is_refused(model):
    from relf_jax.errors import UserError

    with pytest.raises(UserError, match="'relf' model"):
        rj.generate(model, PROMPTS, GREEDY, method=rj.Flow(nfe=4))
    with pytest.raises(UserError, match="'bd' model"):
        rj.generate(model, PROMPTS, GREEDY, method=rj.BlockDiffusion())


def test_readme_quickstart_runs(tmp_path, monkeypatch):
    """README.md's Python quickstart, run as written on the tiny preset (fewer steps) in a fresh folder."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    code = next((b for b in blocks if "import relf_jax as rj" in b), None)
    if code is None:
        pytest.skip("README.md has no Python quickstart")
    code = re.sub(r"train\.steps=\d+", "train.steps=6\", \"data.num_train=400", code)  # the fixture's run
    monkeypatch.chdir(tmp_path)
    namespace = {}
    try:
        exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - the README's own example
    finally:
        for value in namespace.values():
            if isinstance(value, rj.ChatModel):
                value.close()
