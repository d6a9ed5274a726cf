"""What `relf-jax info` prints: devices, the default mesh, library versions."""

from __future__ import annotations

import importlib.metadata
import platform

import jax

from relf_jax.runtime.sharding import make_mesh, slot_groups

PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "tensorflow-datasets",
            "sentencepiece", "numpy")


def last_level_cache() -> tuple[int, int] | None:
    """(level, bytes) of this CPU's last-level cache as Linux's sysfs names it, or None where it
    does not (another OS, a container hiding it). Whether a model's weights fit in it decides
    whether its decode step reads them from memory (the regime speculative decoding is for)."""
    import glob

    best = None
    for d in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(f"{d}/level") as f:
                level = int(f.read())
            with open(f"{d}/size") as f:
                size = f.read().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        nbytes = int(size[:-1]) * units[size[-1]] if size[-1:] in units else int(size)
        if best is None or level > best[0]:
            best = (level, nbytes)
    return best


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
