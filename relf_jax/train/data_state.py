"""The data iterator's position in a checkpoint, for one process or several.

Every host reads the same global stream of rows and keeps its block of each batch
(`relf_jax.data.pipeline`), so the hosts' positions are equal. A checkpoint still keeps each
host's (``{"per_process": [state_0, state_1, ...]}``, gathered from every process before the
save, since one process writes the JSON item): a restore checks that they agree and then
resumes any number of processes from that one position. Positions that differ (an iterator
whose hosts read their own data) go back to their own hosts, with the same process count only.
A single-process run keeps the plain state.
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
    """This process's iterator state from what `gather` saved (under any process count when
    the saved positions agree)."""
    if not (isinstance(saved, dict) and PER_PROCESS in saved):
        return saved  # one position, the one every host holds
    states = saved[PER_PROCESS]
    if all(s == states[0] for s in states):
        return states[0]
    if len(states) != jax.process_count():
        raise UserError(f"the checkpoint holds the different data positions of {len(states)} processes and this "
                        f"run has {jax.process_count()}; resume with {len(states)}")
    return states[jax.process_index()]
