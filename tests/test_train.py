import dataclasses
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from relf_jax.checkpoint import Checkpointer, CheckpointWarning
from relf_jax.config import make_config
from relf_jax.errors import UserError
from relf_jax.train.loop import TrainingDiverged, load_params, plan_state, train
from relf_jax.train.objectives import next_token_loss, segment_positions
from relf_jax.train.optimizers import make_optimizer
from tests._synthetic_batches import CountingBatches


def _cfg(*overrides):
    return make_config("tiny", ["train.progress=false", "train.steps=40", "train.checkpoint_every=20",
                                "train.eval_every=20", "train.warmup_steps=5", "data.seq_len=32", *overrides])


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_cfg):
    wd = str(tmp_path_factory.mktemp("train"))
    cfg = _cfg()
    res = train(cfg, tiny_model_cfg, next_token_loss, CountingBatches(), eval_data=[next(CountingBatches())],
                workdir=wd, tensorboard=True)
    return cfg, res


def test_loss_decreases_and_artifacts(trained):
    cfg, res = trained
    rows = [line for line in open(os.path.join(res.workdir, "metrics.jsonl"))]
    import json
    losses = [json.loads(r)["loss"] for r in rows if "\"loss\"" in r]
    assert res.step == 40 and losses[-1] < losses[0] - 0.5
    assert res.eval_loss is not None and np.isfinite(res.eval_loss)
    assert os.path.exists(os.path.join(res.workdir, "loss_curve.png"))
    assert os.listdir(os.path.join(res.workdir, "tensorboard"))
    assert Checkpointer(res.workdir).steps() == [20, 40]


def test_resume_continues_from_checkpoint(trained, tiny_model_cfg):
    cfg, res = trained
    more = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=50))
    res2 = train(more, tiny_model_cfg, next_token_loss, CountingBatches(), workdir=res.workdir, tensorboard=False)
    assert res2.resumed_from == 40 and res2.step == 50


def test_segment_positions():
    seg = jnp.asarray([[1, 1, 1, 2, 2, 3]])
    np.testing.assert_array_equal(segment_positions(seg), [[0, 1, 2, 0, 1, 0]])


def test_grad_accumulation_matches_full_batch(tmp_path, tiny_model_cfg):
    outs = []
    for accum in (1, 4):
        cfg = _cfg("train.steps=1", f"train.grad_accum={accum}", "train.async_checkpoint=false")
        res = train(cfg, tiny_model_cfg, next_token_loss, CountingBatches(), workdir=str(tmp_path / f"a{accum}"),
                    tensorboard=False)
        outs.append(jax.tree.leaves(res.params))
    for a, b in zip(*outs):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)


def test_non_finite_loss_stops_and_keeps_last_good(tmp_path, tiny_model_cfg):
    def poisoned_loss(model, batch, key):
        loss, aux = next_token_loss(model, batch, key)
        return loss + jnp.where(batch["poison"][0] > 0, jnp.nan, 0.0), aux

    cfg = _cfg("train.steps=40", "train.checkpoint_every=10")
    with pytest.raises(TrainingDiverged, match="non-finite loss.*step 25.*last good checkpoint is step 20"):
        train(cfg, tiny_model_cfg, poisoned_loss, CountingBatches(nan_at=25), workdir=str(tmp_path), tensorboard=False)
    assert Checkpointer(str(tmp_path)).steps() == [10, 20]
    _, params, meta = load_params(str(tmp_path), tiny_model_cfg, cfg.train)
    assert meta["step"] == 20
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))


def test_corrupt_latest_checkpoint_falls_back(trained, tmp_path, tiny_model_cfg):
    import shutil
    cfg, res = trained
    wd = str(tmp_path / "copy")
    shutil.copytree(res.workdir, wd)
    latest = max(Checkpointer(wd).steps())
    data_dir = os.path.join(wd, "checkpoints", str(latest), "state")
    for root, _, files in os.walk(data_dir):
        for f in files:
            if "ocdbt" in root and f not in ("manifest.ocdbt",):
                p = os.path.join(root, f)
                with open(p, "r+b") as fh:
                    fh.truncate(os.path.getsize(p) // 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, params, meta = load_params(wd, tiny_model_cfg, cfg.train)
    assert meta["step"] < latest
    assert any(issubclass(w.category, CheckpointWarning) and str(latest) in str(w.message) for w in caught)


def test_checkpoint_of_other_family_is_a_user_error(trained, tiny_model_cfg):
    cfg, res = trained
    plan = plan_state(tiny_model_cfg, make_optimizer(cfg.train), _one_device_mesh())
    with pytest.raises(UserError, match="holds a 'ar' model, not 'relf'"):
        Checkpointer(res.workdir).restore_latest(plan.restore_target(), family="relf")


def test_resuming_with_other_model_settings_is_a_user_error(trained, tiny_model_cfg, tmp_path):
    import shutil
    cfg, res = trained
    wd = str(tmp_path / "copy")
    shutil.copytree(res.workdir, wd)
    steps = Checkpointer(wd).steps()
    wider = dataclasses.replace(tiny_model_cfg, mlp_dim=tiny_model_cfg.mlp_dim * 2)
    # not mistaken for a corrupt checkpoint (which would be skipped, and the run restarted over it)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        with pytest.raises(UserError, match=rf"model.mlp_dim={tiny_model_cfg.mlp_dim}, now {wider.mlp_dim}"):
            train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=max(steps) + 2)), wider,
                  next_token_loss, CountingBatches(), workdir=wd, tensorboard=False)
    assert Checkpointer(wd).steps() == steps  # nothing written
    # the compute dtype may change on resume: same parameters
    bf16 = dataclasses.replace(tiny_model_cfg, dtype="bfloat16")
    latest = max(steps)  # other tests may have trained the shared fixture's run on
    out = train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=latest + 1)), bf16,
                next_token_loss, CountingBatches(), workdir=wd, tensorboard=False)
    assert out.step == latest + 1 and out.resumed_from == latest


def test_a_model_field_added_later_reads_as_it_was_then():
    """A checkpoint saved before `flow_embed_head` existed holds a ReLF network without that head:
    it loads as one, resuming it under the new default is refused, and the field does not concern
    an AR checkpoint at all."""
    from relf_jax.checkpoint import model_settings_changed
    from relf_jax.config import ModelConfig, saved_model_config

    relf_now = dataclasses.asdict(ModelConfig(family="relf"))
    assert relf_now["flow_embed_head"]  # the default
    old_relf = {k: v for k, v in relf_now.items() if k != "flow_embed_head"}
    assert not saved_model_config(old_relf).flow_embed_head
    assert model_settings_changed(old_relf, relf_now) == [("flow_embed_head", False, True)]
    assert model_settings_changed(old_relf, {**relf_now, "flow_embed_head": False}) == []
    ar_now = dataclasses.asdict(ModelConfig(family="ar"))
    assert model_settings_changed({k: v for k, v in ar_now.items() if k != "flow_embed_head"}, ar_now) == []
    assert model_settings_changed({**ar_now, "flow_embed_head": False}, ar_now) == []
    assert model_settings_changed({**ar_now, "mlp_dim": 1}, ar_now) == [("mlp_dim", 1, ar_now["mlp_dim"])]
    # so is the bag input (the default since 12-07, eighth session): an older checkpoint has none
    assert relf_now["flow_bag_input"]
    assert not saved_model_config({k: v for k, v in relf_now.items() if k != "flow_bag_input"}).flow_bag_input
    # a field this version does not know (a patched model's) is a clear error, not a TypeError
    from relf_jax.config import ConfigError

    with pytest.raises(ConfigError, match="flow_final_norm"):
        saved_model_config({**relf_now, "flow_final_norm": False})


def _one_device_mesh():
    from relf_jax.runtime.sharding import make_mesh
    return make_mesh(1, 1, 1, devices=jax.devices()[:1])


MULTIDEVICE_SCRIPT = r"""
import os
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
import dataclasses, json, sys
import jax, numpy as np
sys.path.insert(0, sys.argv[1])
from relf_jax.config import make_config
from relf_jax.runtime.sharding import make_mesh
from relf_jax.train.loop import train
from relf_jax.train.objectives import next_token_loss
from tests._synthetic_batches import CountingBatches
assert jax.device_count() == 8, jax.devices()
cfg = make_config("tiny", ["train.progress=false", "train.steps=3", "train.log_every=1", "data.seq_len=32",
                           "model.num_kv_heads=2", "train.async_checkpoint=false"])
mcfg = dataclasses.replace(cfg.model, vocab_size=64)
out = {}
for name, mesh in [("one", make_mesh(1, 1, 1, devices=jax.devices()[:1])), ("eight", make_mesh(2, 2, 2))]:
    res = train(cfg, mcfg, next_token_loss, CountingBatches(vocab=64), workdir=os.path.join(sys.argv[2], name),
                mesh=mesh, tensorboard=False)
    shardings = {str(x.sharding.spec) for x in jax.tree.leaves(res.params)}
    losses = [json.loads(l)["loss"] for l in open(os.path.join(sys.argv[2], name, "metrics.jsonl")) if '"loss"' in l]
    out[name] = {"losses": losses, "final": res.loss, "specs": sorted(shardings),
                 "params": [np.asarray(x).tolist() for x in jax.tree.leaves(res.params)[:2]]}
print("RESULT" + json.dumps(out))
"""


@pytest.mark.multidevice
def test_sharded_step_on_8_devices_matches_1_device(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", MULTIDEVICE_SCRIPT, root, str(tmp_path)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    one, eight = out["one"], out["eight"]
    assert len(one["losses"]) >= 2
    np.testing.assert_allclose(eight["losses"], one["losses"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(eight["final"], one["final"], rtol=1e-5, atol=1e-5)
    # the 8-device parameters really are sharded over the mesh
    assert any("fsdp" in s or "tensor" in s for s in eight["specs"]), eight["specs"]


def test_step_cache_reuses_the_compiled_step_only_when_the_optimizer_matches(tmp_path, tiny_model_cfg):
    """Continual learning trains the same model in short resumed calls: with a `step_cache` the
    second call reuses the first call's compiled step when the learning rate does not depend on
    train.steps, and the result equals an uninterrupted run bitwise."""
    flat = ["train.warmup_steps=0", "train.min_lr_ratio=1.0", "train.checkpoint_every=2"]
    cache = {}
    for steps in (2, 4):
        res = train(_cfg(*flat, f"train.steps={steps}"), tiny_model_cfg, next_token_loss, CountingBatches(),
                    workdir=str(tmp_path / "cached"), tensorboard=False, step_cache=cache)
    assert res.resumed_from == 2 and res.step == 4 and len(cache) == 1
    (compiled,) = cache.values()
    assert compiled._cache_size() == 1  # one compilation served both calls
    whole = train(_cfg(*flat, "train.steps=4"), tiny_model_cfg, next_token_loss, CountingBatches(),
                  workdir=str(tmp_path / "whole"), tensorboard=False)
    for a, b in zip(jax.tree.leaves(res.params), jax.tree.leaves(whole.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # a warmup or a decaying schedule depends on train.steps: then a new total needs a new step
    from relf_jax.train.loop import optimizer_signature

    def sig(*over):
        return optimizer_signature(_cfg(*over).train)

    assert sig(*flat, "train.steps=2") == sig(*flat, "train.steps=4")
    assert sig("train.warmup_steps=0", "train.steps=2") != sig("train.warmup_steps=0", "train.steps=4")
    assert sig("train.min_lr_ratio=1.0", "train.steps=2") != sig("train.min_lr_ratio=1.0", "train.steps=4")


def test_cpu_train_options_reach_xla_and_keep_the_step_s_result(tmp_path, tiny_model_cfg, monkeypatch):
    """The train step's CPU compiler options (relf_jax.runtime.compile_options) are accepted by this jaxlib,
    change the compiled program (YNNPACK fusions), and give the step XLA's default result."""
    from relf_jax.runtime import compile_options as co

    opts = co.train_options(jax.devices())
    assert opts == co.CPU_TRAIN_OPTIONS
    x = jnp.ones((64, 64), jnp.float32)
    with_opts = jax.jit(lambda a: jnp.tanh(a @ a), compiler_options=opts).lower(x).compile().as_text()
    plain = jax.jit(lambda a: jnp.tanh(a @ a)).lower(x).compile().as_text()
    assert "ynn" in with_opts and with_opts != plain
    # an option this jaxlib does not know: defaults and a warning, not a failing step
    assert not co.accepted_on_cpu((("xla_cpu_no_such_option", "1"),))

    outs = []
    for defaults in ("0", "1"):
        monkeypatch.setenv("RELF_JAX_XLA_CPU_DEFAULTS", defaults)
        assert bool(co.train_options(jax.devices())) == (defaults == "0")
        cfg = _cfg("train.steps=2", "train.async_checkpoint=false")
        res = train(cfg, tiny_model_cfg, next_token_loss, CountingBatches(), workdir=str(tmp_path / defaults),
                    tensorboard=False)
        outs.append(jax.tree.leaves(res.params))
    for a, b in zip(*outs):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)


def test_grad_accum_sums_tokens_and_averages_other_metrics(tiny_model_cfg):
    """A step's metrics over micro-batches: "tokens" adds up, a per-batch metric (a constant 0.5,
    the batch's mean token id) is averaged, not multiplied by grad_accum."""
    from relf_jax.runtime import sharding as shd
    from relf_jax.train.loop import init_state, make_train_step, put_batch

    def loss_with_metrics(model, batch, key):
        loss, aux = next_token_loss(model, batch, key)
        return loss, {**aux, "half": jnp.float32(0.5), "mean_id": batch["tokens"].mean().astype(jnp.float32)}

    mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    plan = plan_state(tiny_model_cfg, make_optimizer(_cfg().train), mesh)
    batch = put_batch(next(CountingBatches()), mesh)
    got = {}
    for accum in (1, 4):
        params, opt = init_state(plan, tiny_model_cfg, jax.random.key(0))
        step = make_train_step(plan, loss_with_metrics, accum, jax.tree.map(lambda x: x.sharding, batch))
        got[accum] = jax.device_get(step(params, opt, batch, jax.random.key(0), None)[2])
    assert float(got[4]["half"]) == pytest.approx(0.5)
    assert float(got[4]["mean_id"]) == pytest.approx(float(got[1]["mean_id"]), rel=1e-5)
    assert float(got[4]["tokens"]) == pytest.approx(float(got[1]["tokens"]))
