"""Device mesh, logical axis rules and the sharding helpers every loop uses.

Parameters carry logical axis names as Variable metadata (``logical_axes=("embed", "mlp")``);
one table, `LOGICAL_RULES`, maps logical names to mesh axes ``data``, ``fsdp``, ``tensor``.
A logical dimension whose size the mesh axes do not divide is replicated instead (so a tiny
model runs on any mesh). Activations go through `constrain`.

Multi-host: `init_distributed` is the one place that calls ``jax.distributed.initialize()``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from typing import Any, Callable, Sequence, TypeVar

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from relf_jax.errors import UserError

MESH_AXES = ("data", "fsdp", "tensor")
T = TypeVar("T")

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
# a KV cache [batch, kv_heads, slots, head_dim]: rows over data x fsdp, heads over tensor, the
# sequence unsharded (a decode step writes one slot of every row)
KV_CACHE_AXES = ("batch", "kv_heads", "length", "head_dim")

_log = logging.getLogger(__name__)


# The environment `init_distributed` reads (set by `relf-jax launch-local`, or by hand on hosts
# that JAX does not detect as a cluster): the coordinator's host:port, the number of processes
# and this process's id.
COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"

_initialised = False


def init_distributed(mode: str = "auto") -> bool:
    """Initialise JAX's multi-host runtime when launched on several hosts; idempotent.

    mode "on" always calls ``jax.distributed.initialize()`` (on TPU pods and SLURM it discovers
    the coordinator, process count and id itself); "auto" does so only when the environment names
    a coordinator or a multi-worker TPU slice; "off" never. Where JAX detects no cluster (several
    processes on one machine, hosts without SLURM) the environment names all three:
    ``JAX_COORDINATOR_ADDRESS=host:port``, ``JAX_NUM_PROCESSES=N``, ``JAX_PROCESS_ID=i``. On CPU
    the processes' collectives need ``JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo`` (JAX reads it).
    Returns whether the runtime is initialised.
    """
    global _initialised
    if _initialised or mode == "off":
        return _initialised
    multi_tpu = "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")
    named = any(k in os.environ for k in (COORDINATOR_ENV, "COORDINATOR_ADDRESS"))
    if mode == "on" or multi_tpu or named:
        jax.distributed.initialize(**cluster_from_env())
        _initialised = True
    return _initialised


def cluster_from_env() -> dict:
    """initialize()'s coordinator, process count and id from the environment (what is unset is
    left for JAX to detect); a clear error for a malformed value."""
    kw: dict[str, Any] = {}
    if os.environ.get(COORDINATOR_ENV):
        kw["coordinator_address"] = os.environ[COORDINATOR_ENV]
    for name, key in ((NUM_PROCESSES_ENV, "num_processes"), (PROCESS_ID_ENV, "process_id")):
        raw = os.environ.get(name, "")
        if raw:
            try:
                kw[key] = int(raw)
            except ValueError:
                raise UserError(f"{name}={raw!r} is not an integer") from None
    if "process_id" in kw and "num_processes" in kw and not 0 <= kw["process_id"] < kw["num_processes"]:
        raise UserError(f"{PROCESS_ID_ENV}={kw['process_id']} not in [0, {NUM_PROCESSES_ENV}={kw['num_processes']})")
    return kw


def primary_first(fn: Callable[[], T], name: str) -> T:
    """``fn()`` on process 0 first, then (after a barrier named `name`) on the others.

    For work that writes files a later step reads, e.g. preparing a dataset: on shared storage
    the other processes then find it done; on per-host disks each builds its own copy. One
    process: just ``fn()``.
    """
    if jax.process_count() == 1:
        return fn()
    from jax.experimental import multihost_utils

    if jax.process_index() == 0:
        out = fn()
        multihost_utils.sync_global_devices(name)
        return out
    multihost_utils.sync_global_devices(name)
    return fn()


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


def model_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, *, local: bool = False) -> Mesh | None:
    """The mesh a model samples or serves on (``mesh.data`` x ``mesh.fsdp`` x ``mesh.tensor``,
    `make_mesh`) over all processes' devices, or over this process's own (`local`: a server
    answers on its own host); None where that is one device (the single-device path). A shape
    the devices cannot take is a `UserError`."""
    devices = jax.local_devices() if local else jax.devices()
    if len(devices) == 1 and {data, fsdp, tensor} <= {-1, 1}:
        return None
    try:
        return make_mesh(data, fsdp, tensor, devices=devices)
    except ValueError as e:
        raise UserError(f"mesh.data={data} mesh.fsdp={fsdp} mesh.tensor={tensor}: {e}") from None


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


def shard_params(params: Any, mesh: Mesh) -> Any:
    """`params` (an nnx.State) placed on `mesh` by their `logical_axes` (`state_shardings`): the
    layout the trainer uses, for sampling and serving a model split over devices."""
    return put_on(params, state_shardings(params, mesh), mesh)


def put_on(tree: Any, shardings: Any, mesh: Mesh) -> Any:
    """``jax.device_put(tree, shardings)``; on a mesh that spans other processes' devices the
    arrays go through this host's memory first (every process holds the same values and places
    its own shards: there is no cross-host device-to-device copy to do it)."""
    if any(d.process_index != jax.process_index() for d in mesh.devices.flat):
        tree = jax.device_get(tree)
    return jax.device_put(tree, shardings)


def mesh_scope(mesh: Mesh | None):
    """``jax.set_mesh(mesh)``, or a no-op context without a mesh: the samplers and engines trace
    their programs inside it, so `constrain` shards activations and KV caches on it."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def slot_axes(mesh: Mesh | None) -> tuple[str, ...] | None:
    """The mesh axes the serving engines split their slots over: ``data`` when it has more than
    one device, else None (the engines' ``vmap(..., spmd_axis_name=...)``). Not ``fsdp``: it
    splits the weights' model dimension, which the activations inside a slot use too."""
    return ("data",) if mesh is not None and mesh.shape.get("data", 1) > 1 else None


def slot_groups(mesh: Mesh | None) -> int:
    """How many groups of slots (`slot_axes`) a mesh runs side by side (1 without a mesh)."""
    return 1 if mesh is None else math.prod(mesh.shape[a] for a in slot_axes(mesh) or ())


def to_host(tree: Any) -> Any:
    """`tree`'s arrays as NumPy arrays on this host: ``jax.device_get``, except that an array
    spanning other processes' devices (a multi-host mesh) is first gathered from all of them
    (``process_allgather``, a collective: every process must call it)."""

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return jax.device_get(x)

    return jax.tree.map(one, tree)


def put_global(batch: dict, mesh: Mesh) -> dict:
    """A batch that every process holds whole (NumPy) -> global arrays on `mesh`, rows over
    data x fsdp: each device takes its rows of that one batch, so the result does not depend on
    the number of processes (unlike the trainer's `put_batch`, where each host adds its own rows)."""
    out = {}
    for k, v in batch.items():
        v = np.asarray(v)
        out[k] = jax.make_array_from_callback(v.shape, batch_sharding(mesh, v.ndim), lambda idx, v=v: v[idx])
    return out


def describe_shardings(tree: Any) -> list[dict]:
    """Per array of `tree`: its PartitionSpec (as text), global shape and the shapes of its
    shards on this process's devices (what tests read to see that a layout really splits)."""
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not isinstance(x, jax.Array):
            continue
        spec = getattr(x.sharding, "spec", None)
        out.append({"path": jax.tree_util.keystr(path), "shape": tuple(x.shape), "spec": str(spec),
                    "shard_shapes": sorted({tuple(s.data.shape) for s in x.addressable_shards})})
    return out


def process_allgather_json(obj: Any) -> list:
    """Every process's `obj` (JSON-serialisable), in process order, on every process; one process:
    ``[obj]``. For small host-local state such as a data iterator's position."""
    if jax.process_count() == 1:
        return [obj]
    from jax.experimental import multihost_utils

    raw = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([raw.size], np.int32))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:raw.size] = raw
    rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    return [json.loads(bytes(row[:n]).decode()) for row, n in zip(rows, sizes)]
