"""``x @ w.T`` for a float32 [out, in] weight and a few rows of x, as an XLA:CPU FFI kernel.

Why: a decode step or a speculative verification pass multiplies 1-8 rows by megabytes of weights.
XLA:CPU's dot (every backend flag tried: Eigen, XNNPACK, oneDNN) costs about twice as much for
5 rows as for 1 although both read the weight once; `small_matmul.cc` streams each weight row once
and multiplies it into all rows while it sits in registers. Measured on 113 MB of [out, in]
weights: a 2-core AMD EPYC (AVX2, 32 MiB L3), 5 rows 4.8 ms against XLA's 8.2-9.5 (1 row 3.7); a
2-core Intel Xeon (AVX-512, 300 MiB L3), 5 rows 4.4 against 4.8, but 8 rows 7.3 against 6.6 (XLA
ahead there). At 1 row XLA's matrix-vector product is the faster one (~15 % on the EPYC), so
`dispatch.small_matmul` takes this kernel for 2-8 rows (a range chosen on the EPYC).

The C++ source is compiled on first use with the host's C++ compiler into a cache folder
(``$RELF_JAX_KERNEL_CACHE``, else ``~/.cache/relf_jax/kernels``), keyed by the source, the flags,
the compiler, the JAX version and the CPU's feature flags, and registered once as the FFI target
``relf_small_matmul``. Where there is no compiler or the build fails, `available()` is False (the
reason is logged once) and callers take the XLA dot. Every output element is summed in the same
order whatever the number of rows, so row i of a 5-row product equals the 1-row product of that
row bitwise (the kernel's own 1-row path, not XLA's).

Imports only JAX (a leaf, like `kernels_pallas`).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("small_matmul.cc")
TARGET = "relf_small_matmul"
CACHE_ENV = "RELF_JAX_KERNEL_CACHE"
CXX_ENV = "CXX"
MAX_ROWS = 8  # the kernel's limit (small_matmul.cc: kMaxRows)
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-w")

_lock = threading.Lock()
_state: dict = {}  # "ok": bool, "why": str: whether the kernel built (and is registered)
_registered: list = []  # the library registered as TARGET: once a process, kept alive


def cache_dir() -> Path:
    """Where the compiled kernel is kept."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "relf_jax" / "kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    """$CXX if set (only it), else the first of c++, g++, clang++ on the PATH."""
    if os.environ.get(CXX_ENV):
        return shutil.which(os.environ[CXX_ENV])
    return shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _build(cxx: str) -> Path:
    """The compiled shared library (built into the cache unless already there)."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(encoding="utf-8"), " ".join(FLAGS), version,
                                    jax.__version__, platform.machine(), _cpu_flags()]).encode()).hexdigest()[:16]
    out = cache_dir() / f"small_matmul-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp],
                              capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"{cxx} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, out)  # atomic: concurrent builders (test workers) each install a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def available() -> bool:
    """Whether the kernel is built and registered (builds it on the first call)."""
    with _lock:
        if "ok" not in _state:
            try:
                cxx = _compiler()
                if cxx is None:
                    raise RuntimeError(f"no C++ compiler found (${CXX_ENV}={os.environ.get(CXX_ENV, '')!r})")
                path = _build(cxx)
                if not _registered:  # XLA refuses a second handler under the same name
                    lib = ctypes.cdll.LoadLibrary(str(path))
                    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.RelfSmallMatmul), platform="cpu")
                    _registered.append(lib)
                _state.update(ok=True, why="")
            except Exception as e:  # noqa: BLE001 - any failure means: take the XLA dot
                _state.update(ok=False, why=f"{type(e).__name__}: {e}")
                log.warning("relf_jax CPU small-matmul kernel unavailable, using XLA's dot: %s", _state["why"])
        return _state["ok"]


def unavailable_reason() -> str:
    """Why `available()` is False ("" when it is True or was not asked yet)."""
    return _state.get("why", "")


def _call(x2: jax.Array, w: jax.Array) -> jax.Array:
    out = jax.ShapeDtypeStruct((x2.shape[0], w.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x2, w)


@jax.custom_vjp
def _matmul(x2: jax.Array, w: jax.Array) -> jax.Array:
    return _call(x2, w)


def _fwd(x2, w):
    return _call(x2, w), (x2, w)


def _bwd(res, g):
    x2, w = res
    return g @ w, g.T @ x2


_matmul.defvjp(_fwd, _bwd)


def reference(x: jax.Array, w: jax.Array) -> jax.Array:
    """What the kernel computes, as XLA's dot: ``x @ w.T`` over the last axis of x."""
    return jnp.einsum("...i,oi->...o", x, w)


def small_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w.T`` by the kernel: x [..., in] float32 with at most `MAX_ROWS` rows in its leading
    axes, w [out, in] float32. Differentiable (the backward pass is XLA's dot). Raises ValueError
    for other shapes or dtypes and RuntimeError when the kernel is not `available()`."""
    if x.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise ValueError(f"small_matmul takes float32, got x {x.dtype} and w {w.dtype}")
    if w.ndim != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"small_matmul takes x [..., in] and w [out, in], got {x.shape} and {w.shape}")
    rows = 1
    for n in x.shape[:-1]:
        rows *= n
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"small_matmul takes 1..{MAX_ROWS} rows, got {rows} (x {x.shape})")
    if not available():
        raise RuntimeError(f"the small-matmul kernel is unavailable: {unavailable_reason()}")
    return _matmul(x.reshape(rows, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[0])
