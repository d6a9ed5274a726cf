"""XLA compiler options chosen per compiled program and backend.

Options go to one ``jax.jit`` (``compiler_options=``), never to the process-wide ``XLA_FLAGS``:
what speeds up one program can slow another. Measured on a 2-core Xeon (AVX-512), jax 0.10.2:

- training steps on CPU: letting XLA:CPU hand its dot and elementwise fusions to the YNNPACK
  library speeds up the `cpu` preset's train steps 1.2-1.3x (AR 16 x 128 tokens with AdamW:
  214 -> 168 ms; `relf-jax train` tokens/s: AR 1.32x, block diffusion 1.19x, ReLF 1.21x).
  The same option for the whole process slows batch-8 decoding 1.36x (51 -> 69 ms per 64
  tokens), so decode programs keep XLA's defaults.

The options are checked once per process by compiling a tiny program with them; a jaxlib
that does not know them gets XLA's defaults (and a warning) instead of a failing train step.
Set ``RELF_JAX_XLA_CPU_DEFAULTS=1`` to compile everything with XLA's defaults.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_log = logging.getLogger(__name__)

# xla_cpu_experimental_ynn_fusion_type is a repeated enum; as a compile option it takes the enum
# names, comma-separated
CPU_TRAIN_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_ELTWISE"}


def _platform(mesh_or_devices: Any) -> str:
    devices = getattr(mesh_or_devices, "devices", mesh_or_devices)
    first = next(iter(getattr(devices, "flat", devices)))
    return first.platform


@functools.cache
def accepted_on_cpu(items: tuple[tuple[str, str], ...]) -> bool:
    """Whether this jaxlib's XLA:CPU compiles a tiny program with these (name, value) options (checked
    once per process); a refusal is logged as a warning."""
    try:
        # on one local device, under a one-device mesh: the caller may be inside a mesh context
        # (whose devices the probe's array would not match) that spans other hosts
        device = jax.local_devices(backend="cpu")[0]
        with jax.set_mesh(jax.sharding.Mesh(np.asarray([device]), ("probe",))):
            x = jax.device_put(np.ones((8, 8), np.float32), device)
            jax.jit(lambda a: jnp.tanh(a @ a), compiler_options=dict(items)).lower(x).compile()
        return True
    except Exception as e:  # noqa: BLE001 - any refusal means: keep XLA's defaults
        _log.warning("XLA:CPU refused the train-step compiler options %s (%s); using XLA's defaults",
                     dict(items), str(e).splitlines()[0][:200])
        return False


def train_options(mesh_or_devices: Any) -> dict[str, str]:
    """Compiler options for a training step on these devices (a `Mesh` or a device list): the CPU
    options above on CPU, an empty dict elsewhere or when ``RELF_JAX_XLA_CPU_DEFAULTS`` is set."""
    if os.environ.get("RELF_JAX_XLA_CPU_DEFAULTS", "") not in ("", "0"):
        return {}
    if _platform(mesh_or_devices) != "cpu" or not accepted_on_cpu(tuple(CPU_TRAIN_OPTIONS.items())):
        return {}
    return dict(CPU_TRAIN_OPTIONS)
