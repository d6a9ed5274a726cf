"""JAX's persistent compilation cache, on by default for the `relf-jax` command.

Every `relf-jax` process compiles its programs afresh: a server restart, a second `sample`, a
demo rerun. With the cache on, a program compiled once on this machine (same code, shapes,
flags and jaxlib) is read back from disk instead. `enable()` turns it on unless the process
already has a cache directory (``JAX_COMPILATION_CACHE_DIR`` or ``jax_compilation_cache_dir``:
those win, untouched) or ``RELF_JAX_JIT_CACHE`` is ``0`` / ``off``. Where it goes:
``RELF_JAX_JIT_CACHE`` when that is a path, else ``$XDG_CACHE_HOME/relf_jax/jit``, else
``~/.cache/relf_jax/jit``. It keeps programs that took at least `MIN_COMPILE_S` to compile and
holds at most `MAX_BYTES` (JAX drops the least recently used entries past that).

Colab or any Python process: call ``relf_jax.runtime.jit_cache.enable()`` before the first compile.
A cache that cannot be read or written only costs the compile again (JAX warns and goes on).
"""

from __future__ import annotations

import logging
import os

_log = logging.getLogger(__name__)

ENV = "RELF_JAX_JIT_CACHE"
MIN_COMPILE_S = 0.2
MAX_BYTES = 2 * 1024**3


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "relf_jax", "jit")


def enable(path: str | None = None) -> str | None:
    """Turn the persistent cache on (see the module doc); returns the directory in use, or None
    when it stays off. `path` overrides ``RELF_JAX_JIT_CACHE`` and the default directory."""
    import jax

    current = jax.config.jax_compilation_cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if current:
        return current
    setting = os.environ.get(ENV, "").strip()
    if path is None and setting.lower() in ("0", "off", "false", "no"):
        return None
    path = path or (setting if setting not in ("", "1", "on", "true", "yes") else default_dir())
    try:
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise PermissionError(f"{path} is not writable")
    except OSError as e:
        _log.warning("relf_jax: no persistent compilation cache (%s); set %s=off to silence this", e, ENV)
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_S)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return path
