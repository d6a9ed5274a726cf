"""Shared fixtures. Tests run on the CPU with tiny shapes; every test runs in the default command."""

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile

import jax
import pytest

# Tests compare code paths (cache vs recompute, kernel vs reference) to 1e-5; on GPU/TPU the
# default float32 matmul precision is lower (TF32/bf16 passes), so pin it for the suite.
jax.config.update("jax_default_matmul_precision", "highest")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_configure(config):
    """One persistent JAX compilation cache per test run, shared by the xdist workers and the
    CLI subprocesses they start: the many tests that compile the same tiny programs compile
    them once. The directory is made fresh for the run (so timings are those of a cold start)
    and removed at its end."""
    if not hasattr(config, "workerinput") and "RELF_JAX_TEST_JIT_CACHE" not in os.environ:
        config._relf_jit_cache = tempfile.mkdtemp(prefix="relf_jax_test_jit_")
        os.environ["RELF_JAX_TEST_JIT_CACHE"] = config._relf_jit_cache
    # The tests' programs are tiny, so compiling them takes most of the suite's time. Four XLA:CPU
    # flags cut compile time; the tests' checks hold with and without them (measured on this suite):
    # - LLVM at optimisation level 0 (XLA's default is 3): 1.3-1.5x faster compiles of the
    #   engine and training tests;
    # - the older loop emitters for fusions instead of the MLIR fusion emitters, and
    # - no XNNPACK rewrite of dots: together 1.5-1.9x on the engine and speculative tests;
    # - LLVM code generation in one piece (`xla_cpu_parallel_codegen_split_count=1`): XLA splits a
    #   program's LLVM module to compile the parts on a thread pool, and with two xdist workers on
    #   two cores those threads only compete: 0.80-0.95x the engine tests' wall time (4 runs each).
    # The per-program options of relf_jax.runtime.compile_options still apply. The flags go into
    # XLA_FLAGS, so they reach the CLI subprocesses too.
    # RELF_JAX_TEST_LLVM_OPT=N picks another LLVM level; RELF_JAX_TEST_XLA_DEFAULTS=1 drops all four.
    # XLA aborts the process on a flag it does not know, so each flag is first tried in a
    # subprocess (once per run, by the controller; the workers inherit the result): a jaxlib
    # that has dropped one runs the suite without it.
    if os.environ.get("RELF_JAX_TEST_XLA_DEFAULTS", "") in ("", "0") and not hasattr(config, "workerinput"):
        level = os.environ.get("RELF_JAX_TEST_LLVM_OPT", "0")
        flags = os.environ.get("XLA_FLAGS", "")
        wanted = [f"--{name}={value}" for name, value in (
            ("xla_backend_optimization_level", level), ("xla_cpu_use_fusion_emitters", "false"),
            ("xla_cpu_use_xnnpack", "false"),
            ("xla_cpu_parallel_codegen_split_count", "1")) if name not in flags]
        if wanted and not _xla_accepts(flags, wanted):
            wanted = [f for f in wanted if _xla_accepts(flags, [f])]
        os.environ["XLA_FLAGS"] = " ".join([flags, *wanted]).strip()
    cache = os.environ.get("RELF_JAX_TEST_JIT_CACHE")
    if cache:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = cache
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.3"
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.3)


def _xla_accepts(flags: str, extra: list[str]) -> bool:
    """True when a fresh process compiles and runs a tiny program with these XLA flags."""
    env = {**os.environ, "XLA_FLAGS": " ".join([flags, *extra]).strip(), "JAX_PLATFORMS": "cpu"}
    code = "import jax; jax.block_until_ready(jax.jit(lambda x: x * 2 + 1)(1.0))"
    try:
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def pytest_collection_modifyitems(session, config, items):
    """Files with end-to-end (`entry`) tests first: the xdist workers take tests in collection
    order, so a one-to-two-minute test collected late keeps one worker busy after the other has
    run out of work; started first, the short tests fill in around it. Whole files move, so their
    module fixtures are still built once; otherwise collection order is kept."""
    first = {item.path for item in items if item.get_closest_marker("entry") is not None}
    items.sort(key=lambda item: item.path not in first)


def pytest_unconfigure(config):
    cache = getattr(config, "_relf_jit_cache", None)
    if cache:
        shutil.rmtree(cache, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model_cfg():
    from relf_jax.config import make_config

    return dataclasses.replace(make_config("tiny").model, vocab_size=61)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_cfg):
    from flax import nnx

    from relf_jax.models import build_model

    return nnx.split(build_model(tiny_model_cfg, nnx.Rngs(0)))
