"""The grain input pipeline: documents -> shuffled -> tokenized -> packed rows -> batches.

``make_iterator`` builds, on every host::

    MapDataset.source(builder.as_data_source(split))
      .shuffle(seed).repeat(num_epochs)     reshuffled every epoch
      .map(bos + encode(text) + eos)
      .to_iter_dataset()
      -> PackedRows(seq_len + 1)            concatenate documents, cut fixed rows
      .batch(batch_size, drop_remainder=True)   the global batch
      .map(rows of this host)               rows [i * B / P, (i + 1) * B / P) on host i of P

Every host reads the same global stream of rows and keeps its block of each global batch, so
the global batch (what the trainer assembles from the hosts' blocks, in process order) and
hence the loss curve do not depend on the number of processes, and every host's iterator is
at the same position. The price: each host tokenizes the whole split, not 1/P of it.

Each batch is ``{"tokens", "segment_ids", "positions"}``, all int32
``[batch_size, seq_len + 1]``: inputs are ``tokens[:, :-1]``, targets ``tokens[:, 1:]``.
``segment_ids`` numbers the document pieces of a row from 1 (0 is padding, which only
the last row of a finite pass has); ``positions`` counts from 0 within each piece. A
loss mask is ``segment_ids[:, 1:] != 0``; restricting attention to equal segment ids
keeps documents apart.

With ``rows="documents"`` each row is one document instead: ``[bos, *ids, eos]`` cut to
``seq_len + 1`` tokens and filled up with the pad id, every position (the pad tail included)
in segment 1, so a whole-sequence generator (ReLF) learns where its text ends.

With ``rows="segments"`` (`SegmentRows`, for whole-sequence families: ReLF, block diffusion)
each row holds several *whole* documents back to back, so the loss is spent on text, not pad.
The contract, for a batch ``{"tokens", "segment_ids", "positions"}`` int32 ``[B, seq_len + 1]``:

- the first ``seq_len`` positions of a row hold documents ``[bos, *ids, eos]``, each whole (a
  document never continues into the next row), numbered 1, 2, ... in ``segment_ids``;
  ``positions`` restart at 0 in each document. A row starts with the oldest document not yet
  emitted and fills its rest from the next ``lookahead`` documents, longest fitting first
  (``data.pack_lookahead``; 1 is stream order, where a document that does not fit starts the
  next row);
- the rest of the row is padding: token ``pad_id``, segment id 0, position 0. The last column
  (index ``seq_len``) is always padding, so a model that reads ``tokens[:, :-1]`` (the
  whole-sequence losses do) sees every text token;
- a document longer than ``seq_len`` is cut into pieces of ``seq_len`` tokens, each filling a
  row of its own (segment 1); the last piece packs like a document;
- over one pass every token of every document appears exactly once (documents in stream order
  with ``lookahead=1``, at most ``lookahead - 1`` places early otherwise).

A model honours the contract by attending only within equal, non-zero segment ids (pad
queries see nothing that matters: their outputs carry no loss) and by taking the loss where
``segment_ids[:, :-1] != 0``; at sampling time one segment per row, of a length drawn from the
training documents' lengths, reproduces the training layout (`relf_jax.flow.lengths`).

The iterator is a grain ``DatasetIterator``: ``get_state()`` is a small JSON-safe dict
and ``set_state`` on a freshly built iterator resumes exactly. Packing is our own
``PackedRows`` rather than ``grain.experimental.ConcatThenSplitIterDataset`` because in
grain 0.2.18 the latter's state does not survive a JSON round trip (its
``(-1, -1)`` sentinel comes back as a list and restores the wrong position), and grain's
checkpoint handler stores states as JSON.
"""

from __future__ import annotations

from typing import Any

import grain
import numpy as np

from relf_jax.data.sources import DataError


def validate_nonempty(builder, split: str):
    """The data source of ``split`` (a TFDS split string such as ``"train[:10%]"`` works).

    Raises ``DataError`` if the split does not exist or is empty.
    """
    try:
        source = builder.as_data_source(split)
    except (ValueError, KeyError) as e:
        splits = sorted(builder.info.splits.keys())
        raise DataError(f"{builder.name} has no split {split!r}; it has {splits}.") from e
    if len(source) == 0:
        raise DataError(f"split {split!r} of {builder.name} is empty.")
    return source


def _documents(builder, split: str) -> grain.MapDataset:
    """All documents of `split`, in stored order (every host reads them all, see the module docstring)."""
    return grain.MapDataset.source(validate_nonempty(builder, split))


def _host(process_index: int | None, process_count: int | None, batch_size: int) -> tuple[int, int]:
    """(process index, count), JAX's where None; the global `batch_size` must split evenly."""
    if process_index is None or process_count is None:
        import jax

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} not in [0, {process_count}).")
    if batch_size % process_count:
        raise ValueError(f"batch_size={batch_size} (the global batch) is not divisible by the {process_count} "
                         "processes")
    return process_index, process_count


class _HostRows(grain.transforms.Map):
    """A global batch -> this host's block of its rows."""

    def __init__(self, start: int, count: int):
        self.start, self.count = start, count

    def map(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {k: v[self.start:self.start + self.count] for k, v in batch.items()}


class _Tokenize(grain.transforms.Map):
    """``{"text"}`` -> ``{"tokens": int32 [bos, *ids, eos]}``; picklable for grain workers."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def map(self, element: dict[str, Any]) -> np.ndarray:
        text = element["text"]
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        tok = self._tokenizer
        return np.asarray([tok.bos_id, *tok.encode(text), tok.eos_id], dtype=np.int32)


class PackedRows(grain.IterDataset):
    """Concatenate-then-split packing of 1-D int32 token arrays into rows of ``row_len``.

    No token is dropped or repeated; only the final row of a finite parent is padded
    (with zeros, segment id 0).
    """

    def __init__(self, parent: grain.IterDataset, row_len: int):
        super().__init__(parent)
        if row_len < 1:
            raise ValueError(f"row_len must be positive, got {row_len}.")
        self._row_len = row_len

    def __iter__(self) -> _RowsIterator:
        return _RowsIterator(self._parent.__iter__(), self._row_len, self._row_len, 0, whole=False)

    def __str__(self) -> str:
        return f"PackedRows(row_len={self._row_len})"


class _DocumentRow(grain.transforms.Map):
    """1-D token array -> one row of ``row_len``: cut, then filled up with the pad id."""

    def __init__(self, row_len: int, pad_id: int):
        self._row_len, self._pad_id = row_len, pad_id

    def map(self, doc: np.ndarray) -> dict[str, np.ndarray]:
        n = self._row_len
        tokens = np.full(n, self._pad_id, np.int32)
        tokens[: min(n, len(doc))] = doc[:n]
        return {"tokens": tokens, "segment_ids": np.ones(n, np.int32), "positions": np.arange(n, dtype=np.int32)}


class _RowsIterator(grain.DatasetIterator):
    """Packs the parent's 1-D token arrays into rows of ``text_len`` tokens (+ pad up to
    ``row_len``), each document piece its own segment with positions from 0.

    whole=False (`PackedRows`): the concatenation is cut wherever a row ends. whole=True
    (`SegmentRows`): documents stay whole; a row starts with the oldest document not yet
    emitted (one longer than a row is cut into full-row pieces, each filling a row), and its
    rest is filled from the next ``lookahead`` documents of the stream, each time with the
    longest one that still fits (ties: the earliest), until none fits. ``lookahead=1`` is
    stream order: a document that does not fit starts the next row.

    The window holds the documents pulled from the parent and not yet passed, oldest first;
    the oldest is never emitted yet (emitted ones are dropped from the front), later ones may
    be. State: the parent's state just before the window's first document, how many of that
    document's tokens are already emitted (a long document's pieces), and which later window
    documents are already emitted (indices into the window): small, JSON-safe, exact.
    """

    def __init__(self, parent: grain.DatasetIterator, text_len: int, row_len: int, pad_id: int,
                 whole: bool = True, lookahead: int = 1):
        super().__init__(parent)
        if lookahead < 1:
            raise ValueError(f"lookahead must be at least 1, got {lookahead}.")
        self._text_len, self._row_len, self._pad_id, self._whole = text_len, row_len, pad_id, whole
        self._lookahead = lookahead if whole else 1
        self._docs: list[np.ndarray] = []  # the window, oldest first
        self._states: list[Any] = []  # the parent's state just before each window document
        self._taken: list[bool] = []  # emitted already (never the first)
        self._offset = 0  # tokens of the window's first document already emitted
        self._exhausted = False

    def _fill(self) -> None:
        """Top the window up to ``lookahead`` documents (fewer at the parent's end; empty
        documents are skipped)."""
        while len(self._docs) < self._lookahead and not self._exhausted:
            state = self._parent.get_state()
            try:
                doc = next(self._parent)
            except StopIteration:
                self._exhausted = True
                break
            if len(doc) == 0:
                continue
            self._docs.append(doc)
            self._states.append(state)
            self._taken.append(False)

    def _drop_front(self) -> None:
        """The first document is emitted: drop it, and every emitted one behind it."""
        self._offset = 0
        while True:
            self._docs.pop(0), self._states.pop(0), self._taken.pop(0)
            if not self._taken or not self._taken[0]:
                return

    def __next__(self) -> dict[str, np.ndarray]:
        cap = self._text_len
        tokens = np.full(self._row_len, self._pad_id, np.int32)
        segment_ids = np.zeros(self._row_len, np.int32)
        positions = np.zeros(self._row_len, np.int32)
        filled = segment = 0

        def put(doc: np.ndarray) -> None:
            nonlocal filled, segment
            segment += 1
            end = filled + len(doc)
            tokens[filled:end], segment_ids[filled:end] = doc, segment
            positions[filled:end] = np.arange(len(doc), dtype=np.int32)
            filled = end

        while filled < cap:
            self._fill()
            if not self._docs:
                break
            if filled == 0 or not self._whole:  # the oldest document, or (packed) the stream's next tokens
                doc, rest = self._docs[0], len(self._docs[0]) - self._offset
                if self._whole and rest > cap:  # alone in a row, a full row's piece
                    put(doc[self._offset:self._offset + cap])
                    self._offset += cap
                    break
                take = min(rest, cap - filled)
                put(doc[self._offset:self._offset + take])
                self._offset += take
                if self._offset >= len(doc):
                    self._drop_front()
                continue
            space, best = cap - filled, -1
            for k, (doc, taken) in enumerate(zip(self._docs, self._taken)):
                if not taken and len(doc) <= space and (best < 0 or len(doc) > len(self._docs[best])):
                    best = k
            if best < 0:
                break  # nothing in the window fits: the rest is pad
            put(self._docs[best])
            if best == 0:
                self._drop_front()
            else:
                self._taken[best] = True
        if filled == 0:
            raise StopIteration
        return {"tokens": tokens, "segment_ids": segment_ids, "positions": positions}

    def get_state(self) -> dict[str, Any]:
        if not self._docs:
            return {"parent": self._parent.get_state(), "offset": 0, "taken": []}
        return {"parent": self._states[0], "offset": self._offset,
                "taken": [k for k, t in enumerate(self._taken) if t]}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["parent"])
        self._docs, self._states, self._taken, self._exhausted = [], [], [], False
        self._offset = int(state["offset"])
        self._fill()  # the window now holds what the state names: get_state gives it back as it came
        for k in state.get("taken", []):  # states saved before the window have none
            if k < len(self._taken):
                self._taken[k] = True


class SegmentRows(grain.IterDataset):
    """Whole documents packed into rows for whole-sequence models (module doc: the contract).

    Rows are ``text_len + 1`` long: documents fill the first ``text_len`` positions (segment
    ids 1, 2, ...), the rest is ``pad_id`` with segment id 0. No token is dropped or repeated.
    ``lookahead`` > 1 fills a row's tail from the next ``lookahead`` documents (the longest that
    fits), not only the next one: less pad, documents emitted slightly out of stream order.
    """

    def __init__(self, parent: grain.IterDataset, text_len: int, pad_id: int, lookahead: int = 1):
        super().__init__(parent)
        if text_len < 1:
            raise ValueError(f"text_len must be positive, got {text_len}.")
        if lookahead < 1:
            raise ValueError(f"lookahead must be at least 1, got {lookahead}.")
        self._text_len, self._pad_id, self._lookahead = text_len, pad_id, lookahead

    def __iter__(self) -> _RowsIterator:
        return _RowsIterator(self._parent.__iter__(), self._text_len, self._text_len + 1, self._pad_id,
                             lookahead=self._lookahead)

    def __str__(self) -> str:
        return f"SegmentRows(text_len={self._text_len}, lookahead={self._lookahead})"


def segment_positions(segment_ids):
    """Positions [B, L] int32 counting from 0 within each run of equal segment ids (jnp or np
    input; jnp output). Pad runs (id 0) count too; nothing reads them."""
    import jax
    import jax.numpy as jnp

    seg = jnp.asarray(segment_ids, jnp.int32)
    idx = jnp.broadcast_to(jnp.arange(seg.shape[-1], dtype=jnp.int32), seg.shape)
    start = jnp.concatenate([jnp.ones_like(seg[..., :1], bool), seg[..., 1:] != seg[..., :-1]], axis=-1)
    return idx - jax.lax.cummax(jnp.where(start, idx, 0), axis=seg.ndim - 1)


ROW_MODES = ("packed", "documents", "segments")


class _PadToMultiple(grain.transforms.Map):
    """A tokenized document filled up with ``pad_id`` to a multiple of ``align`` tokens (block
    diffusion: every document then starts on a block boundary of its row and its last block
    ends in pad, as at decoding time, where a block is committed whole and pad stops a reply)."""

    def __init__(self, align: int, pad_id: int):
        self._align, self._pad_id = align, pad_id

    def map(self, doc: np.ndarray) -> np.ndarray:
        fill = -len(doc) % self._align
        return np.concatenate([doc, np.full(fill, self._pad_id, np.int32)]) if fill else doc


def _rows(docs: grain.MapDataset, tokenizer, seq_len: int, rows: str = "packed",
          align: int = 1, lookahead: int = 1) -> grain.IterDataset:
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}.")
    if align > 1:
        if rows != "segments" or seq_len % align:
            raise ValueError(f"align={align} needs rows='segments' and seq_len a multiple of it")
        docs = docs.map(_Tokenize(tokenizer)).map(_PadToMultiple(align, tokenizer.pad_id)).to_iter_dataset()
        return SegmentRows(docs, seq_len, tokenizer.pad_id, lookahead)
    if rows == "packed":
        return PackedRows(docs.map(_Tokenize(tokenizer)).to_iter_dataset(), seq_len + 1)
    if rows == "documents":
        return docs.map(_Tokenize(tokenizer)).map(_DocumentRow(seq_len + 1, tokenizer.pad_id)).to_iter_dataset()
    if rows == "segments":
        return SegmentRows(docs.map(_Tokenize(tokenizer)).to_iter_dataset(), seq_len, tokenizer.pad_id, lookahead)
    raise ValueError(f"rows must be one of {ROW_MODES}, got {rows!r}.")


def make_iterator(
    builder,
    split: str,
    tokenizer,
    *,
    seq_len: int,
    batch_size: int,
    seed: int,
    shuffle: bool = True,
    num_epochs: int | None = None,
    process_index: int | None = None,
    process_count: int | None = None,
    rows: str = "packed",
    align: int = 1,
    lookahead: int = 1,
) -> grain.DatasetIterator:
    """This host's rows of each global batch (``rows``: "packed", "documents" or "segments"),
    int32 ``[batch_size / process_count, seq_len + 1]`` each. ``align`` > 1 (segments only)
    fills each document up with pad ids to a multiple of ``align`` tokens first (block
    diffusion's blocks); ``lookahead`` (segments only) is how many upcoming documents a row's
    tail may be filled from (`SegmentRows`).

    Deterministic given ``seed``; ``num_epochs=None`` repeats forever (reshuffling every
    epoch). ``batch_size`` is the global batch; ``process_index`` / ``process_count`` default
    to JAX's, and host i keeps rows ``[i * B / P, (i + 1) * B / P)`` of every global batch (the
    module docstring), so the batches do not depend on the number of processes.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}.")
    index, count = _host(process_index, process_count, batch_size)
    docs = _documents(builder, split)
    if shuffle:
        docs = docs.shuffle(seed)
    docs = docs.repeat(num_epochs)
    ds = _rows(docs, tokenizer, seq_len, rows, align, lookahead).batch(batch_size, drop_remainder=True)
    if count > 1:
        ds = ds.map(_HostRows(index * batch_size // count, batch_size // count))
    return iter(ds)


def eval_batches(
    builder,
    split: str,
    tokenizer,
    *,
    seq_len: int,
    batch_size: int,
    max_batches: int,
    process_index: int | None = None,
    process_count: int | None = None,
    rows: str = "packed",
    align: int = 1,
    lookahead: int = 1,
) -> list[dict[str, np.ndarray]]:
    """Up to ``max_batches`` global batches from one pass over ``split`` in stored order, this
    host's rows of each (as `make_iterator`: ``[batch_size / process_count, seq_len + 1]``;
    ``process_count=1``: the whole batch on every host).

    Deterministic. Every global batch has the full ``batch_size`` rows: the last one is padded
    with all-zero rows (segment id 0, so masked out by ``segment_ids != 0``).
    """
    index, count = _host(process_index, process_count, batch_size)
    per = batch_size // count
    batches = []
    for batch in _rows(_documents(builder, split), tokenizer, seq_len, rows, align, lookahead).batch(batch_size):
        missing = batch_size - len(batch["tokens"])
        if missing:
            batch = {k: np.pad(v, ((0, missing), (0, 0))) for k, v in batch.items()}
        batches.append({k: v[index * per:(index + 1) * per] for k, v in batch.items()})
        if len(batches) >= max_batches:
            break
    return batches
