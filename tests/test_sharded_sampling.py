"""Sampling and serving split over a device mesh give the tokens one device gives.

On 8 simulated CPU devices (a fresh process, `tests/_sharded_checks.py`), meshes (data=8),
(fsdp=8), (data=2, tensor=4) and (tensor=8): the AR, speculative, ReLF and block-diffusion
samplers and every serving engine against the same models on one device, greedy and seeded at
T = 1; the parameters and KV caches are checked to be really split. The speculative rule
alternates over the meshes (standard on two, NSD on two, both on one device): each rule is a
program of its own to compile, and they differ only in the accept test on gathered logits.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHES = ("data8", "fsdp8", "data2_tensor4", "tensor8")


def _checks(which: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "tests._sharded_checks", which], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _param(samplers, mesh, name):
    return next(v for k, v in samplers[mesh]["params"].items() if name in k)


@pytest.mark.entry
@pytest.mark.multidevice
def test_every_sampler_gives_the_one_device_tokens_on_a_mesh_that_really_splits_the_model():
    samplers = _checks("samplers")  # one process for all meshes: the models and references are built once
    one = samplers["one"]["tokens"]
    assert set(one) == {"ar_t0", "ar_t1", "standard_t0", "nsd_t0", "relf", "bd_t0", "bd_t1"}
    for mesh in MESHES:
        got = samplers[mesh]["tokens"]
        assert set(got) == set(one) - {"nsd_t0" if "standard_t0" in got else "standard_t0"}
        for name in got:
            assert got[name] == one[name], (mesh, name)
            assert sum(map(len, one[name])) > 0, name  # something was sampled
        assert samplers[mesh]["logit_diff"] <= 1e-5, mesh
        assert samplers[mesh]["recompiles"] == 0, mesh  # the sharded loop is one program per shape
    assert {"standard_t0", "nsd_t0"} <= {name for mesh in MESHES for name in samplers[mesh]["tokens"]}

    # (data=2, tensor=4): query heads 8 -> 2 and KV heads 4 -> 1 per device, the MLP 64 -> 16
    wq, wk = _param(samplers, "data2_tensor4", "['attn']['wq']"), _param(samplers, "data2_tensor4", "['attn']['wk']")
    assert wq["shape"] == [32, 8, 4] and wq["shard_shapes"] == [[32, 2, 4]] and "tensor" in wq["spec"]
    assert wk["shard_shapes"] == [[32, 1, 4]]
    assert _param(samplers, "data2_tensor4", "['mlp']['w_down']")["shard_shapes"] == [[16, 32]]
    # rows over data, KV heads over tensor, the sequence whole: [8, 4, S, 4] -> [4, 1, S, 4]
    cache = samplers["data2_tensor4"]["kv_cache"]
    assert cache["spec"] == "P('data', 'tensor')"
    (shard,) = cache["shard_shapes"]
    assert shard == [4, 1, cache["shape"][2], 4]
    assert samplers["data8"]["kv_cache"]["shard_shapes"][0][:2] == [1, 4]
    assert samplers["data8"]["decode_tokens"]["shard_shapes"][0][0] == 1
    # fsdp=8 splits the model dimension of the weights (and the rows)
    assert _param(samplers, "fsdp8", "['attn']['wq']")["shard_shapes"] == [[4, 8, 4]]
    # tensor=8: the 8 query heads split, the 4 KV heads stay whole (they do not divide 8 ways)
    assert _param(samplers, "tensor8", "['attn']['wq']")["shard_shapes"] == [[32, 1, 4]]
    assert _param(samplers, "tensor8", "['attn']['wk']")["shard_shapes"] == [[32, 4, 4]]


@pytest.mark.entry
@pytest.mark.multidevice
def test_every_serving_engine_gives_the_one_device_tokens_on_a_mesh():
    out = _checks("engines")
    one = out["one"]
    for mesh in MESHES:
        got = out[mesh]
        for name, tokens in got.items():
            if name == "_layout":
                continue
            assert tokens == one[name], (mesh, name)
            assert sum(map(len, tokens.values())) > 0, (mesh, name)
    assert {name for mesh in MESHES for name in out[mesh]} >= {"ar", "standard", "nsd", "bd", "relf"}
    # 8 slots in 2 groups, each slot's KV heads over tensor: [8, 1, 4, S, 4] -> [4, 1, 1, S, 4]
    layout = out["data2_tensor4"]["_layout"]
    assert layout["kv_cache"]["spec"] == "P('data', None, 'tensor')"
    assert [s[:3] for s in layout["kv_cache"]["shard_shapes"]] == [[4, 1, 1]]
    assert out["data8"]["_layout"]["tokens"]["shard_shapes"][0][0] == 1
