"""An append-only store of RCSD training examples on disk: one ``.npz`` shard per append.

A shard is written to a temporary name in the same directory, flushed and fsync'ed, then
renamed into place (atomic on POSIX), so a process killed mid-write leaves at worst a stray
temporary file, never a half shard under a shard name. Reading still verifies every shard
(it opens as a zip, has the expected arrays with a common leading size, and its checksum
matches) and skips one that does not, with a warning: a file torn by something else (a full
disk, a partial copy) costs its own examples, not the store.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import warnings
import zipfile

import numpy as np

from relf_jax.speculative.trace import EXAMPLE_KEYS

SHARD_RE = re.compile(r"^shard-(\d{8})\.npz$")


class ReplayWarning(UserWarning):
    """A shard of the replay store was unreadable and skipped."""


def _checksum(arrays: dict[str, np.ndarray]) -> np.ndarray:
    h = hashlib.sha256()
    for key in sorted(arrays):
        a = np.ascontiguousarray(arrays[key])
        h.update(key.encode())
        h.update(str(a.dtype).encode())
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    return np.frombuffer(h.digest(), np.uint8)


class ReplayStore:
    """Shards ``<path>/shard-00000000.npz``, ``shard-00000001.npz``, ... in append order."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        os.makedirs(self.path, exist_ok=True)

    def shard_ids(self) -> list[int]:
        """Ids of the shards present (readable or not), ascending."""
        ids = [int(m.group(1)) for name in os.listdir(self.path) if (m := SHARD_RE.match(name))]
        return sorted(ids)

    def _file(self, shard_id: int) -> str:
        return os.path.join(self.path, f"shard-{shard_id:08d}.npz")

    def append(self, examples: dict[str, np.ndarray]) -> int:
        """Write `examples` (arrays sharing a leading size N >= 1) as a new shard; returns its id."""
        missing = [k for k in EXAMPLE_KEYS if k not in examples]
        if missing:
            raise ValueError(f"examples lack {missing}")
        sizes = {np.asarray(v).shape[0] for v in examples.values()}
        if len(sizes) != 1 or 0 in sizes:
            raise ValueError(f"example arrays need one common, non-zero leading size, got {sorted(sizes)}")
        arrays = {k: np.asarray(v) for k, v in examples.items()}
        buf = io.BytesIO()
        np.savez(buf, **arrays, __checksum__=_checksum(arrays))
        shard_id = (self.shard_ids() or [-1])[-1] + 1
        tmp = os.path.join(self.path, f".tmp-{os.getpid()}-{shard_id:08d}.npz")
        with open(tmp, "wb") as f:
            f.write(buf.getvalue())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._file(shard_id))
        return shard_id

    def read(self, shard_id: int) -> dict[str, np.ndarray] | None:
        """The arrays of one shard, or None (with a `ReplayWarning`) if it is torn or corrupt."""
        path = self._file(shard_id)
        try:
            with np.load(path, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
            stored = arrays.pop("__checksum__")
            if not np.array_equal(stored, _checksum(arrays)):
                raise ValueError("checksum mismatch")
            if any(k not in arrays for k in EXAMPLE_KEYS) or len({a.shape[0] for a in arrays.values()}) != 1:
                raise ValueError("missing arrays or unequal sizes")
            return arrays
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
            warnings.warn(f"skipping unreadable replay shard {path}: {e}", ReplayWarning, stacklevel=2)
            return None

    def read_all(self, shard_ids=None) -> dict[str, np.ndarray] | None:
        """The readable shards among `shard_ids` (default: all) concatenated, or None if none."""
        parts = [a for i in (self.shard_ids() if shard_ids is None else shard_ids) if (a := self.read(i)) is not None]
        if not parts:
            return None
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def __len__(self) -> int:
        return len(self.shard_ids())
