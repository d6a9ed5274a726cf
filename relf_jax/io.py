"""File writing shared by every layer: the one atomic JSON writer."""

from __future__ import annotations

import json
import os
from typing import Any


def write_json(path: str, obj: Any, *, indent: int | None = 2) -> None:
    """Write `obj` as JSON to `path` atomically (a temporary file, then a rename): an interrupted
    write leaves the previous file whole, never a torn one. Parent folders are created."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=indent)
    os.replace(tmp, path)
