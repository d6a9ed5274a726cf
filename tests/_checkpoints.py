"""Test helper: the checkpoint steps a (possibly still running) training run has committed."""

import os
import re


def committed_steps(workdir: str, family: str = "ar") -> list[int]:
    """Sorted steps under ``<workdir>/<family>/checkpoints`` whose commit has finished (Orbax
    writes ``_CHECKPOINT_METADATA`` last); read straight from disk, cheap enough to poll."""
    d = os.path.join(workdir, family, "checkpoints")
    if not os.path.isdir(d):
        return []
    return sorted(int(n) for n in os.listdir(d) if re.fullmatch(r"\d+", n)
                  and os.path.exists(os.path.join(d, n, "_CHECKPOINT_METADATA")))
