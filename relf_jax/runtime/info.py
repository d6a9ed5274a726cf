"""What `relf-jax info` prints: devices, the default mesh, library versions."""

from __future__ import annotations

import importlib.metadata
import platform

import jax

from relf_jax.runtime.sharding import make_mesh, slot_groups

PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "tensorflow-datasets",
            "sentencepiece", "numpy")


def describe(serving_mesh=None) -> dict:
    """Devices, the training mesh `relf-jax train` makes by default, the mesh `relf-jax serve`
    would serve on (`serving_mesh`: its mesh, None for one device) and versions."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    mesh = make_mesh()
    return {
        "backend": jax.default_backend(),
        "process": f"{jax.process_index()} of {jax.process_count()}",
        "devices": [str(d) for d in jax.devices()],
        "local_device_count": jax.local_device_count(),
        "default_mesh": dict(mesh.shape),
        "serving_mesh": "one device" if serving_mesh is None else dict(serving_mesh.shape),
        "serving_slot_groups": slot_groups(serving_mesh),
        "python": platform.python_version(),
        "versions": versions,
    }
