import pytest

from relf_jax.config import PRESETS, Config, ConfigError, make_config


def test_presets_build_and_validate():
    for name in PRESETS:
        cfg = make_config(name)
        assert cfg.preset == name
    assert make_config("small").model.d_model == 768
    assert make_config("large").model.num_layers == 36


def test_overrides_are_typed():
    cfg = make_config("tiny", ["train.steps=7", "sample.temperature=0.5", "train.progress=false",
                               "model.dtype=bfloat16", "model=ar"])
    assert cfg.train.steps == 7 and isinstance(cfg.train.steps, int)
    assert cfg.sample.temperature == 0.5
    assert cfg.train.progress is False
    assert cfg.model.dtype == "bfloat16" and cfg.model.family == "ar"


@pytest.mark.parametrize("override, words", [
    (["train.stepz=3"], ["train.stepz", "train.steps"]),
    (["bogus=1"], ["bogus", "model"]),
    (["train.steps=abc"], ["train.steps", "int"]),
    (["model.dtype=float64"], ["model.dtype", "bfloat16"]),
    (["train.progress=maybe"], ["train.progress", "bool"]),
    (["train=3"], ["train", "group"]),
    (["noequals"], ["key=value"]),
])
def test_bad_overrides_name_the_key(override, words):
    with pytest.raises(ConfigError) as e:
        make_config("tiny", override)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown preset 'huge'.*tiny"):
        make_config("huge")


@pytest.mark.parametrize("override, pattern", [
    ("sample.temperature=-0.1", "temperature must be >= 0"),
    ("sample.top_p=0", "top_p must be in"),
    ("sample.top_p=1.5", "top_p must be in"),
    ("sample.top_k=-1", "top_k must be >= 0"),
    ("data.seq_len=4096", "exceeds model.max_seq_len"),
    ("model.num_kv_heads=3", "multiple of"),
    ("flow.window=0", "flow.window"),
    ("speculative.draft_temperature_scale=0", "draft_temperature_scale must be > 0"),
])
def test_invalid_values(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        make_config("tiny", [override])


def test_round_trip_dict():
    cfg = make_config("tiny", ["train.steps=9"])
    assert Config.from_dict(cfg.to_dict()) == cfg
