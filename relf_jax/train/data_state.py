"""The data iterator's position in a checkpoint, for one process or several.

Each host reads its own slice of the data, so each has its own iterator position. A checkpoint
keeps them all (``{"per_process": [state_0, state_1, ...]}``, gathered from every process before
the save, since one process writes the JSON item); a restore hands each process its own. A
single-process run keeps the plain state, as before.
"""

from __future__ import annotations

from typing import Any

import jax

from relf_jax.errors import UserError
from relf_jax.runtime.sharding import process_allgather_json

PER_PROCESS = "per_process"


def gather(state: Any) -> Any:
    """What the checkpoint keeps of this process's iterator `state` (a collective: every process calls it)."""
    if jax.process_count() == 1:
        return state
    return {PER_PROCESS: process_allgather_json(state)}


def own(saved: Any) -> Any:
    """This process's iterator state from what `gather` saved."""
    if not (isinstance(saved, dict) and PER_PROCESS in saved):
        if jax.process_count() > 1:
            raise UserError(f"the checkpoint holds one data position and this run has {jax.process_count()} "
                            "processes, each reading its own slice of the data; resume with 1 process")
        return saved
    states = saved[PER_PROCESS]
    if len(states) != jax.process_count():
        raise UserError(f"the checkpoint holds the data positions of {len(states)} processes and this run has "
                        f"{jax.process_count()}; resume with {len(states)}")
    return states[jax.process_index()]
