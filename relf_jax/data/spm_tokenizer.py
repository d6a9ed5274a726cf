"""relf_jax's own tokenizer: a SentencePiece model trained in memory, with fixed special ids so every
model, checkpoint and pipeline agrees on them (pad=0, eos=1, bos=2, unk=3). The chat markers
``<user>`` and ``<assistant>`` are user-defined symbols, so each is always exactly one token."""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import sentencepiece as spm
from etils import epath

from relf_jax.data.tokenizer_common import (
    BOS_ID,
    CHAT_MARKERS,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    is_bad_text,
    reply_ids,
    space_markers,
    text_error,
)


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
    """A SentencePiece model held as its serialized proto bytes (picklable).

    Prompts start with BOS (``add_bos``); EOS is the one end-of-reply id; the model has no chat
    template of its own (the marker template of `relf_jax.serving.chat` is its turn format) and
    no generation defaults. ``pad_id``, ``eos_id``, ``bos_id``, ``unk_id``: the model's special ids
    (`PAD_ID` ...); ``eos_ids``: the one EOS id; ``special_ids``: pad, bos and eos."""

    add_bos = True
    chat_template: str | None = None

    def __init__(self, model_proto: bytes):
        self._proto = bytes(model_proto)
        self._sp = spm.SentencePieceProcessor()
        self._sp.LoadFromSerializedProto(self._proto)
        sp = self._sp
        self.pad_id, self.eos_id, self.bos_id, self.unk_id = sp.pad_id(), sp.eos_id(), sp.bos_id(), sp.unk_id()
        self.eos_ids: tuple[int, ...] = (self.eos_id,)
        self.special_ids = frozenset((self.pad_id, self.bos_id, self.eos_id))  # never shown in a reply

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
    def special_tokens_map(self) -> dict[str, str]:
        """The special tokens' text under HuggingFace's names (what a Jinja chat template sees)."""
        return {"bos_token": self.id_to_piece(self.bos_id), "eos_token": self.id_to_piece(self.eos_id),
                "pad_token": self.id_to_piece(self.pad_id), "unk_token": self.id_to_piece(self.unk_id)}

    @property
    def chat_templates(self) -> dict[str, str]:
        return {}

    @property
    def generation_defaults(self) -> dict:
        return {}

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no bos/eos added."""
        try:
            return self._sp.encode(text)
        except (TypeError, UnicodeError, RuntimeError) as e:
            raise text_error(text) from e

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        try:
            return self._sp.encode(list(texts))
        except (TypeError, UnicodeError, RuntimeError) as e:
            raise next((text_error(t) for t in texts if is_bad_text(t)), text_error(None)) from e

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of ``ids`` (list or 1-D array): stops at the first eos, drops pad and bos."""
        return space_markers(self._sp.decode(reply_ids(ids, (self.eos_id,), (self.pad_id, self.bos_id))))

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
