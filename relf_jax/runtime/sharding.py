"""Device mesh, logical axis rules and the sharding helpers every loop uses.

Parameters carry logical axis names as Variable metadata (``logical_axes=("embed", "mlp")``);
one table, `LOGICAL_RULES`, maps logical names to mesh axes ``data``, ``fsdp``, ``tensor``.
A logical dimension whose size the mesh axes do not divide is replicated instead (so a tiny
model runs on any mesh). Activations go through `constrain`.

Multi-host: `init_distributed` is the one place that calls ``jax.distributed.initialize()``.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# logical name -> mesh axis (or tuple of mesh axes, or None for replicated)
LOGICAL_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("vocab", "tensor"),
    ("layers", None),
)

_log = logging.getLogger(__name__)


def init_distributed(mode: str = "auto") -> bool:
    """Initialise JAX's multi-host runtime when launched on several hosts.

    mode "on" always calls ``jax.distributed.initialize()`` (on TPU pods it discovers the
    coordinator itself); "auto" does so only when the environment names a coordinator or a
    multi-worker TPU slice; "off" never. Returns whether it initialised.
    """
    if mode == "off":
        return False
    multi_tpu = "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")
    named = any(k in os.environ for k in ("JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS"))
    if mode == "on" or multi_tpu or named:
        jax.distributed.initialize()
        return True
    return False


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh with Auto axis types (GSPMD propagation).

    One axis may be -1: it takes the devices the others leave.
    """
    devices = list(devices) if devices is not None else jax.devices()
    n = len(devices)
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1:
        raise ValueError("at most one mesh axis may be -1")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if n % known:
            raise ValueError(f"{n} devices cannot be split into mesh axes {sizes}")
        sizes[sizes.index(-1)] = n // known
    if math.prod(sizes) != n:
        raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, have {n}")
    arr = np.asarray(devices).reshape(sizes)
    return Mesh(arr, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def logical_to_spec(logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> PartitionSpec:
    """Map logical axis names to a PartitionSpec on `mesh`.

    A dimension is replicated when its rule is None, when the mesh axes do not divide it, or
    when an earlier dimension of the same array already uses that mesh axis.
    """
    table = dict(rules)
    used: set[str] = set()
    out = []
    for name, size in zip(logical_axes, shape):
        target = table.get(name) if name is not None else None
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        axes = tuple(a for a in axes if a not in used and mesh.shape.get(a, 1) > 1)
        if axes and size % math.prod(mesh.shape[a] for a in axes) == 0:
            used.update(axes)
            out.append(axes[0] if len(axes) == 1 else axes)
        else:
            out.append(None)
    return PartitionSpec(*out)


def state_shardings(abstract_state: Any, mesh: Mesh) -> Any:
    """NamedShardings for an nnx.State (abstract or concrete), from `logical_axes` metadata."""

    def one(v):
        if isinstance(v, nnx.Variable):
            value = v.get_value()
            axes = v.get_metadata().get("logical_axes")
            if axes is None or not hasattr(value, "shape"):
                spec = PartitionSpec()
            else:
                spec = logical_to_spec(axes, value.shape, mesh)
            return v.replace(NamedSharding(mesh, spec))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Shard the leading (batch) dimension over data x fsdp; replicate the rest."""
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1),
                                               (_lcm_batch(mesh),) + (1,) * (ndim - 1), mesh))


def _lcm_batch(mesh: Mesh) -> int:
    return mesh.shape["data"] * mesh.shape["fsdp"]


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """``with_sharding_constraint`` by logical names under the current mesh; no-op without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or math.prod(mesh.shape.values()) == 1:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(logical_axes, x.shape, mesh))
