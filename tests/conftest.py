"""Shared fixtures. Tests run on the CPU with tiny shapes; `slow` tests are opt-in."""

import dataclasses
import os
import sys

import jax
import pytest

# Tests compare code paths (cache vs recompute, kernel vs reference) to 1e-5; on GPU/TPU the
# default float32 matmul precision is lower (TF32/bf16 passes), so pin it for the suite.
jax.config.update("jax_default_matmul_precision", "highest")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: pass --runslow to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_cfg():
    from relf_jax.config import make_config

    return dataclasses.replace(make_config("tiny").model, vocab_size=61)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_cfg):
    from flax import nnx

    from relf_jax.models import build_model

    return nnx.split(build_model(tiny_model_cfg, nnx.Rngs(0)))
