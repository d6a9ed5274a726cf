"""The serving engines on a device mesh: slots split into groups over the mesh's data axis, each
model's heads, MLP and vocabulary over its tensor axis (and its model dimension over fsdp).

An engine built on a `LoadedModel` placed on a mesh (``lm.on_mesh(mesh)``, `relf-jax serve
mesh.data=M mesh.tensor=N`) compiles its calls under that mesh (`engine_jit`): the per-slot
sampler, vmapped over slots with ``spmd_axis_name`` (`vmap_slots`), runs each slot group on its
own devices, and every call returns its slots in one layout (`constrain_slots`: slots over the
groups, a KV cache's heads over tensor), so a call never meets a layout it was not compiled for.
Without a mesh all three are the plain single-device versions.
"""

from __future__ import annotations

import functools

import jax

from relf_jax.errors import UserError
from relf_jax.runtime.sharding import LOGICAL_RULES, logical_to_spec, slot_axes, slot_groups
from relf_jax.serving.engines.slots import set_slot

# a slot's KV cache as the engines stack it: [slots, 1, kv_heads, span, head_dim]
_SLOT_CACHE_AXES = ("slots", None, "kv_heads", "length", "head_dim")
# the slot axis goes over the slot groups (`slot_axes`: data), the rest as the model has it
_SLOT_RULES = (("slots", "data"),) + LOGICAL_RULES


def check_slot_groups(num_slots: int, mesh) -> int:
    """The number of slot groups of `mesh` (`slot_groups`), which must divide `num_slots`."""
    groups = slot_groups(mesh)
    if num_slots % groups:
        raise UserError(f"{num_slots} slots cannot be split into the mesh's {groups} slot groups "
                        f"(mesh.data = {groups}); use a multiple of {groups} slots")
    return groups


def constrain_slots(slots):
    """`slots` (a stacked slot tree, traced) in the engines' layout: every array's leading (slot)
    axis over the slot groups, the heads of the KV caches (arrays under a field named ``*cache*``,
    [slots, 1, K, C, Dh]) over tensor; a no-op without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return slots

    def one(path, x):
        if getattr(x, "ndim", 0) == 0:
            return x
        cache = x.ndim == 5 and "cache" in jax.tree_util.keystr(path)
        names = _SLOT_CACHE_AXES if cache else ("slots",) + (None,) * (x.ndim - 1)
        return jax.lax.with_sharding_constraint(x, logical_to_spec(names, x.shape, mesh, _SLOT_RULES))

    return jax.tree_util.tree_map_with_path(one, slots)


def vmap_slots(fn, mesh):
    """``jax.vmap(fn)`` over slots; on a mesh with slot groups the vmapped axis is split over
    them (``spmd_axis_name``), so the sharding constraints inside the model keep each group's
    slots on its devices."""
    return jax.vmap(fn, spmd_axis_name=slot_axes(mesh))


def bind_slot_calls(engine, free, *, slots_arg: int) -> None:
    """The jitted calls of an engine whose state is its stacked slots (block diffusion, ReLF), on
    its model's mesh: ``mesh``, ``_jit_step`` (``_step_all(weights, slots)``), ``_jit_insert``,
    ``_jit_prefill`` (``_prefix_data``), ``_jit_prefill_insert`` (``_prefill_into``, whose slots
    are argument `slots_arg`) and ``_jit_free`` (``free(slots, slot)``)."""
    engine.mesh = mesh = engine.lm.mesh
    check_slot_groups(engine.num_slots, mesh)
    engine._jit_step = engine_jit(engine._step_all, mesh, slots_out=0, donate_argnums=(1,))
    engine._jit_insert = engine_jit(set_slot, mesh, slots_out="all", donate_argnums=(0,))
    engine._jit_prefill = engine_jit(engine._prefix_data, mesh)
    engine._jit_prefill_insert = engine_jit(engine._prefill_into, mesh, slots_out="all", donate_argnums=(slots_arg,))
    engine._jit_free = engine_jit(free, mesh, slots_out="all", donate_argnums=(0,))


def engine_jit(fn, mesh, *, slots_out=None, **jit_kw):
    """``jax.jit(fn, **jit_kw)``; on a mesh traced and called under it (`jax.set_mesh`), with the
    output's slots constrained to `constrain_slots`'s layout. slots_out: None (the output holds no
    slots), "all" (the output is the slots) or the index of the output element that is."""
    if mesh is None:
        return jax.jit(fn, **jit_kw)

    @functools.wraps(fn)
    def laid_out(*args, **kw):
        out = fn(*args, **kw)
        if slots_out == "all":
            return constrain_slots(out)
        if slots_out is not None:
            out = list(out)
            out[slots_out] = constrain_slots(out[slots_out])
            return tuple(out)
        return out

    jitted = jax.jit(laid_out, **jit_kw)

    @functools.wraps(fn)
    def call(*args, **kw):
        with jax.set_mesh(mesh):
            return jitted(*args, **kw)

    call._cache_size = jitted._cache_size  # noqa: SLF001 - the tests count compilations
    return call
