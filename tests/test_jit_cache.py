"""relf_jax.runtime.jit_cache: the persistent compilation cache the CLI turns on (in subprocesses, so
the test workers' own cache settings stay as conftest made them)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import json, os, sys
import jax
from relf_jax.runtime import jit_cache
out = {}
os.environ["RELF_JAX_JIT_CACHE"] = "off"
out["off"] = jit_cache.enable()
out["off_config"] = jax.config.jax_compilation_cache_dir
blocker = os.path.join(sys.argv[1], "a_file")
open(blocker, "w").close()
os.environ["RELF_JAX_JIT_CACHE"] = os.path.join(blocker, "jit")  # under a file: cannot be made
out["unusable"] = jit_cache.enable()
os.environ["RELF_JAX_JIT_CACHE"] = os.path.join(sys.argv[1], "jit")
out["on"] = jit_cache.enable()
out["on_config"] = [jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs,
                    jax.config.jax_compilation_cache_max_size]
out["again"] = jit_cache.enable(os.path.join(sys.argv[1], "other"))  # a cache is set: it stays
print(json.dumps(out))
"""


def _run(tmp_path, env_extra):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "RELF_JAX_JIT_CACHE")}
    env.update(env_extra, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1]), res.stderr


def test_enable_off_unusable_on_and_an_existing_cache_wins(tmp_path):
    from relf_jax.runtime import jit_cache

    out, err = _run(tmp_path, {})
    assert out["off"] is None and out["off_config"] is None
    assert out["unusable"] is None and "no persistent compilation cache" in err
    path = str(tmp_path / "jit")
    assert out["on"] == path and os.path.isdir(path)
    assert out["on_config"] == [path, jit_cache.MIN_COMPILE_S, jit_cache.MAX_BYTES]
    assert out["again"] == path
    # a cache directory the process already has (JAX's own variable) is used as it is
    theirs = str(tmp_path / "theirs")
    out, _ = _run(tmp_path, {"JAX_COMPILATION_CACHE_DIR": theirs})
    assert out["off"] == theirs  # RELF_JAX_JIT_CACHE=off does not switch off JAX's own setting...
    assert out["on"] == theirs and out["on_config"][0] == theirs  # ...and relf_jax does not replace it
    assert out["again"] == theirs


def test_default_directory_follows_xdg(monkeypatch, tmp_path):
    from relf_jax.runtime import jit_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert jit_cache.default_dir() == os.path.join(str(tmp_path), "relf_jax", "jit")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert jit_cache.default_dir() == os.path.join(os.path.expanduser("~"), ".cache", "relf_jax", "jit")
