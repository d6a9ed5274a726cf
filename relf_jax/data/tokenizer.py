"""SentencePiece tokenizer trained in memory, with fixed special ids and chat markers.

Special ids are fixed so every model, checkpoint and pipeline agrees on them:
pad=0, eos=1, bos=2, unk=3. The chat markers ``<user>`` and ``<assistant>`` are
user-defined symbols, so each is always exactly one token.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import sentencepiece as spm
from etils import epath

PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
CHAT_MARKERS = ("<user>", "<assistant>")
_MARKER_RE = re.compile(r"\s*(" + "|".join(re.escape(m) for m in CHAT_MARKERS) + r")\s*")


def _space_markers(text: str) -> str:
    """Chat markers are words of their own: a model that drops the space token before one
    (e.g. ``hi<assistant>``) still decodes to ``hi <assistant>``."""
    if "<" not in text:
        return text
    return re.sub(r"(?<=>)  (?=<)", " ", _MARKER_RE.sub(r" \1 ", text)).strip()


def reply_ids(ids: Sequence[int] | np.ndarray, eos_id: int, pad_id: int, bos_id: int) -> list[int]:
    """The ids to turn into text (both tokenizers): up to the first eos, without pad and bos."""
    out = []
    for i in np.asarray(ids, dtype=np.int64).reshape(-1).tolist():
        if i == eos_id:
            break
        if i != pad_id and i != bos_id:
            out.append(i)
    return out


def turn_stop_ids(tok, *, pad: bool = False) -> tuple[int, ...]:
    """Token ids that end an assistant reply: EOS, plus the ``<user>`` marker that opens the
    next turn when the tokenizer has it as a token of its own (either tokenizer class).

    pad=True adds the pad id (when distinct from EOS): for models trained on document rows
    (BOS, the conversation, EOS, then pad), where pad only ever follows the end of a
    conversation, a pad means the reply is over. Block diffusion uses it; without it, a model
    that writes pad instead of EOS decodes pad blocks up to its block limit."""
    stops = [tok.eos_id]
    try:
        user = tok.piece_to_id("<user>")
    except Exception:  # noqa: BLE001 - a tokenizer without the marker
        user = None
    if user is not None and user >= 0 and user not in (getattr(tok, "unk_id", -1), tok.eos_id, tok.pad_id):
        stops.append(int(user))
    pad_id = getattr(tok, "pad_id", -1)
    if pad and pad_id is not None and pad_id >= 0 and pad_id not in stops:
        stops.append(int(pad_id))
    return tuple(stops)


def _training_lines(texts: Iterable[str | bytes]) -> Iterator[str]:
    """Yields whitespace-normalised, non-empty texts; raises if there are none."""
    seen = False
    for text in texts:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        line = " ".join(text.split())
        if line:
            seen = True
            yield line
    if not seen:
        raise ValueError("train_tokenizer got no non-empty text to train on.")


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    *,
    model_type: str = "bpe",
    user_symbols: Sequence[str] = CHAT_MARKERS,
) -> Tokenizer:
    """Trains a SentencePiece model on ``texts`` in memory (no files written).

    Choices that matter to callers:
    - ``hard_vocab_limit=False``: ``vocab_size`` is an upper bound. A small corpus with
      few distinct pieces yields a smaller vocabulary instead of a trainer crash, so
      read the real size from ``Tokenizer.vocab_size``.
    - ``character_coverage=1.0``: every character seen in training gets a piece, so the
      corpus's own text round-trips without ``<unk>`` (characters never seen map to unk).
    - Pieces never cross whitespace (``split_by_whitespace``), and the default
      ``nmt_nfkc`` normaliser collapses runs of whitespace (newlines included) into one
      space, so ``decode(encode(t)) == t`` holds for text with single spaces.
    """
    if vocab_size <= 4 + len(user_symbols):
        raise ValueError(
            f"vocab_size={vocab_size} leaves no room beyond the 4 special ids and "
            f"{len(user_symbols)} user symbols."
        )
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_training_lines(texts),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            pad_id=PAD_ID,
            eos_id=EOS_ID,
            bos_id=BOS_ID,
            unk_id=UNK_ID,
            user_defined_symbols=list(user_symbols),
            hard_vocab_limit=False,
            character_coverage=1.0,
            split_by_whitespace=True,
            # Whole documents are training sentences; the default 4192 bytes skips long ones.
            max_sentence_length=1 << 16,
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
        )
    except RuntimeError as e:
        # The trainer raises a C++ check failure; turn the common one into one plain line.
        if "Vocabulary size is smaller than required_chars" in str(e):
            counts = str(e).split("required_chars.")[-1].split(".")[0].strip()
            raise ValueError(
                f"vocab_size={vocab_size} is too small for this corpus's characters "
                f"({counts}, vocab_size vs characters + special pieces)."
            ) from e
        raise
    return Tokenizer(model.getvalue())


class Tokenizer:
    """A SentencePiece model held as its serialized proto bytes (picklable)."""

    def __init__(self, model_proto: bytes):
        self._proto = bytes(model_proto)
        self._sp = spm.SentencePieceProcessor()
        self._sp.LoadFromSerializedProto(self._proto)

    # Pickle only the proto bytes so grain worker processes can rebuild the model.
    def __getstate__(self) -> dict:
        return {"model_proto": self._proto}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_proto"])

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size})"

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def pad_id(self) -> int:
        return self._sp.pad_id()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def unk_id(self) -> int:
        return self._sp.unk_id()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no bos/eos added."""
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.encode(list(texts))

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of ``ids`` (list or 1-D array): stops at the first eos, drops pad and bos."""
        return _space_markers(self._sp.decode(reply_ids(ids, self.eos_id, self.pad_id, self.bos_id)))

    def id_to_piece(self, token_id: int) -> str:
        return self._sp.id_to_piece(int(token_id))

    def piece_to_id(self, piece: str) -> int:
        return self._sp.piece_to_id(piece)

    def to_bytes(self) -> bytes:
        return self._proto

    def save(self, path: str | os.PathLike) -> None:
        """Writes the ``.model`` file (the serialized proto) that any SentencePiece reads."""
        epath.Path(path).write_bytes(self._proto)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        return cls(epath.Path(path).read_bytes())


# ----------------------------------------------------------------------------- imported tokenizers

_HF_MAGIC = b'{"relf_hf_tokenizer"'


class HFTokenizer:
    """A HuggingFace ``tokenizer.json`` (via the ``tokenizers`` library) with explicit special ids.

    Used for checkpoints imported from HuggingFace. Same interface as `Tokenizer`; special ids
    come from the checkpoint (a model without a pad token pads with its eos id). Serialized by
    `to_bytes` as one JSON document, which `tokenizer_from_bytes` recognises.
    """

    def __init__(self, tokenizer_json: str, *, bos_id: int, eos_id: int, pad_id: int, unk_id: int = -1):
        from tokenizers import Tokenizer as _Backend

        self._json = tokenizer_json
        self._tk = _Backend.from_str(tokenizer_json)
        self.bos_id, self.eos_id, self.pad_id, self.unk_id = int(bos_id), int(eos_id), int(pad_id), int(unk_id)

    def __getstate__(self) -> dict:
        return {"bytes": self.to_bytes()}

    def __setstate__(self, state: dict) -> None:
        other = HFTokenizer.from_bytes(state["bytes"])
        self.__dict__.update(other.__dict__)

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size})"

    @property
    def vocab_size(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self):
        """The `tokenizers.Tokenizer` underneath."""
        return self._tk

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no bos/eos added."""
        return self._tk.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tk.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of ``ids``: stops at the first eos, drops pad and bos."""
        return self._tk.decode(reply_ids(ids, self.eos_id, self.pad_id, self.bos_id), skip_special_tokens=False)

    def id_to_piece(self, token_id: int) -> str:
        return self._tk.id_to_token(int(token_id))

    def piece_to_id(self, piece: str) -> int:
        i = self._tk.token_to_id(piece)
        return self.unk_id if i is None else i

    def to_bytes(self) -> bytes:
        import json

        head = {"relf_hf_tokenizer": 1, "bos_id": self.bos_id, "eos_id": self.eos_id, "pad_id": self.pad_id,
                "unk_id": self.unk_id, "tokenizer_json": self._json}
        return json.dumps(head).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes) -> HFTokenizer:
        import json

        head = json.loads(data.decode("utf-8"))
        return cls(head["tokenizer_json"], bos_id=head["bos_id"], eos_id=head["eos_id"], pad_id=head["pad_id"],
                   unk_id=head.get("unk_id", -1))


def tokenizer_from_bytes(data: bytes) -> Tokenizer | HFTokenizer:
    """The tokenizer serialized by either class's ``to_bytes`` (as stored in checkpoints)."""
    if data.startswith(_HF_MAGIC):
        return HFTokenizer.from_bytes(data)
    return Tokenizer(data)
