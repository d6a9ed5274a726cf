"""Tokenizers: relf_jax's SentencePiece model, and HuggingFace ``tokenizer.json`` for imports.

`Tokenizer`: trained in memory, with fixed special ids so every model, checkpoint and
pipeline agrees on them: pad=0, eos=1, bos=2, unk=3. The chat markers ``<user>`` and
``<assistant>`` are user-defined symbols, so each is always exactly one token.

`HFTokenizer`: an imported checkpoint's tokenizer with what its folder says about it: the
special tokens, whether prompts get a BOS, every EOS id, the chat template(s) and the
generation defaults (see `relf_jax.export.hf.tokenizer_from_hf`).

Both classes offer the same surface to the samplers and the server: ``encode`` (no BOS/EOS
added), ``decode`` (stops at the first id of ``eos_ids``, never shows special-token text),
``bos_id`` / ``eos_id`` / ``pad_id`` / ``unk_id``, ``eos_ids``, ``add_bos``, ``special_ids``,
``special_tokens_map``, ``chat_template``, ``generation_defaults``; `encode_prompt` builds a
completion prompt from them.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import sentencepiece as spm
from etils import epath

from relf_jax.errors import UserError

PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
CHAT_MARKERS = ("<user>", "<assistant>")
_MARKER_RE = re.compile(r"\s*(" + "|".join(re.escape(m) for m in CHAT_MARKERS) + r")\s*")


def _space_markers(text: str) -> str:
    """Chat markers are words of their own: a model that drops the space token before one
    (e.g. ``hi<assistant>``) still decodes to ``hi <assistant>``."""
    if "<" not in text:
        return text
    return re.sub(r"(?<=>)  (?=<)", " ", _MARKER_RE.sub(r" \1 ", text)).strip()


def reply_ids(ids: Sequence[int] | np.ndarray, stop_ids: Iterable[int], drop_ids: Iterable[int]) -> list[int]:
    """The ids to turn into text (both tokenizers): up to the first of `stop_ids` (the EOS ids),
    without any of `drop_ids` (pad, bos, other special tokens)."""
    stop, drop = set(stop_ids), set(drop_ids)
    out = []
    for i in np.asarray(ids, dtype=np.int64).reshape(-1).tolist():
        if i in stop:
            break
        if i not in drop:
            out.append(i)
    return out


def encode_prompt(tok, text: str) -> list[int]:
    """A completion prompt's ids: BOS (when the tokenizer's prompts start with one, ``add_bos``)
    + the text's tokens; the same ids as HuggingFace's ``tokenizer(text).input_ids``. A prompt
    that would be empty (no text, no BOS) is the bos id alone: every sampler needs one token."""
    ids = tok.encode(text) if text else []
    if getattr(tok, "add_bos", True) or not ids:
        ids = [tok.bos_id] + ids
    return ids


def eos_ids_of(tok) -> tuple[int, ...]:
    """Every id that ends a reply (`eos_ids`, or the one `eos_id` of a tokenizer without it)."""
    return tuple(getattr(tok, "eos_ids", None) or (tok.eos_id,))


def turn_stop_ids(tok, *, pad: bool = False) -> tuple[int, ...]:
    """Token ids that end an assistant reply: every EOS id (``eos_ids``), plus, for a tokenizer
    without a chat template of its own, the ``<user>`` marker that opens the next turn when the
    tokenizer has it as a token of its own (either tokenizer class).

    pad=True adds the pad id (when distinct from EOS): for models trained on document rows
    (BOS, the conversation, EOS, then pad), where pad only ever follows the end of a
    conversation, a pad means the reply is over. Block diffusion uses it; without it, a model
    that writes pad instead of EOS decodes pad blocks up to its block limit."""
    stops = list(eos_ids_of(tok))
    user = None
    if getattr(tok, "chat_template", None) is None:  # the marker turn format
        try:
            user = tok.piece_to_id("<user>")
        except Exception:  # noqa: BLE001 - a tokenizer without the marker
            user = None
    if user is not None and user >= 0 and user not in (getattr(tok, "unk_id", -1), *stops, tok.pad_id):
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
    """A SentencePiece model held as its serialized proto bytes (picklable).

    Prompts start with BOS (``add_bos``); EOS is the one end-of-reply id; the model has no chat
    template of its own (the marker template of `relf_jax.serving.chat` is its turn format) and
    no generation defaults."""

    add_bos = True
    chat_template: str | None = None

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

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return (self.eos_id,)

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids never shown in a reply: pad, bos, eos."""
        return frozenset((self.pad_id, self.bos_id, self.eos_id))

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
            raise next((text_error(t) for t in texts if _bad_text(t)), text_error(None)) from e

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of ``ids`` (list or 1-D array): stops at the first eos, drops pad and bos."""
        return _space_markers(self._sp.decode(reply_ids(ids, (self.eos_id,), (self.pad_id, self.bos_id))))

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


def _bad_text(text) -> bool:
    if not isinstance(text, str):
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def text_error(text) -> UserError:
    """The `UserError` for text no tokenizer can take: not a string, or a lone surrogate
    (``"a\ud800b"``, which JSON allows as ``"\\ud800"`` but is not Unicode text)."""
    if not isinstance(text, str):
        return UserError(f"text to tokenize must be a string, got {type(text).__name__}")
    for i, ch in enumerate(text):
        if 0xD800 <= ord(ch) <= 0xDFFF:
            return UserError(f"the text holds a lone surrogate \\u{ord(ch):04x} at character {i}: not valid "
                             "Unicode (surrogates must come in pairs)")
    return UserError("the text could not be tokenized (not valid Unicode)")


# ----------------------------------------------------------------------------- imported tokenizers

_HF_MAGIC = b'{"relf_hf_tokenizer"'
_HF_FORMAT = 2  # 1: special ids only; 2: + eos_ids, add_bos, special tokens, chat templates, defaults
GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class HFTokenizer:
    """A HuggingFace ``tokenizer.json`` (via the ``tokenizers`` library) with what the checkpoint
    folder says about it (see `relf_jax.export.hf.tokenizer_from_hf`).

    - ``bos_id`` is always an id (for code that needs one, e.g. an empty prompt); ``add_bos``
      says whether prompts start with it (False for models without a BOS, such as Qwen2).
    - ``eos_id`` is the tokenizer's EOS; ``eos_ids`` every id that ends a reply (``eos_id``
      first, then the ``eos_token_id`` lists of generation_config.json and config.json).
    - ``special_tokens_map``: the special tokens' text under HF's names (bos_token, eos_token,
      pad_token, unk_token; only those the model defines), as a chat template sees them.
    - ``special_ids``: the added tokens marked special, the EOS ids, bos, pad and unk: never
      shown by `decode`.
    - ``chat_templates``: name -> Jinja source (``"default"`` is ``chat_template``; e.g.
      ``"tool_use"``); ``generation_defaults``: sampling settings from generation_config.json.

    A model without a pad token pads with its eos id. Serialized by `to_bytes` as one JSON
    document, which `tokenizer_from_bytes` recognises; bytes of the first format (special ids
    only) still load.
    """

    def __init__(self, tokenizer_json: str, *, bos_id: int, eos_id: int, pad_id: int, unk_id: int = -1,
                 eos_ids: Sequence[int] = (), add_bos: bool = True, special_tokens: dict[str, str] | None = None,
                 chat_templates: dict[str, str] | None = None, generation_defaults: dict | None = None):
        from tokenizers import Tokenizer as _Backend

        self._json = tokenizer_json
        self._tk = _Backend.from_str(tokenizer_json)
        self.bos_id, self.eos_id, self.pad_id, self.unk_id = int(bos_id), int(eos_id), int(pad_id), int(unk_id)
        self.eos_ids = tuple(dict.fromkeys([self.eos_id, *(int(i) for i in eos_ids)]))
        self.add_bos = bool(add_bos)
        self.special_tokens_map = {k: str(v) for k, v in (special_tokens or {}).items() if v is not None}
        self.chat_templates = {str(k): str(v) for k, v in (chat_templates or {}).items()}
        self.generation_defaults = {k: v for k, v in (generation_defaults or {}).items() if k in GENERATION_KEYS}
        marked = {int(i) for i, t in self._tk.get_added_tokens_decoder().items() if t.special}
        self.special_ids = frozenset(marked | set(self.eos_ids) | {self.bos_id, self.pad_id}
                                     | ({self.unk_id} if self.unk_id >= 0 else set()))

    @property
    def chat_template(self) -> str | None:
        """The model's (default) Jinja chat template, or None."""
        return self.chat_templates.get("default")

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
        """Token ids of ``text``; no bos/eos added. Added and special tokens written in the text
        (``<|im_start|>``) are matched as their single ids."""
        try:
            return self._tk.encode(text, add_special_tokens=False).ids
        except (TypeError, UnicodeError) as e:
            raise text_error(text) from e

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        try:
            return [e.ids for e in self._tk.encode_batch(list(texts), add_special_tokens=False)]
        except (TypeError, UnicodeError) as e:
            raise next((text_error(t) for t in texts if _bad_text(t)), text_error(None)) from e

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of ``ids``: stops at the first of ``eos_ids``, skips every special token."""
        return self._tk.decode(reply_ids(ids, self.eos_ids, self.special_ids), skip_special_tokens=True)

    def id_to_piece(self, token_id: int) -> str:
        return self._tk.id_to_token(int(token_id))

    def piece_to_id(self, piece: str) -> int:
        i = self._tk.token_to_id(piece)
        return self.unk_id if i is None else i

    def to_bytes(self) -> bytes:
        import json

        head = {"relf_hf_tokenizer": _HF_FORMAT, "bos_id": self.bos_id, "eos_id": self.eos_id,
                "pad_id": self.pad_id, "unk_id": self.unk_id, "eos_ids": list(self.eos_ids),
                "add_bos": self.add_bos, "special_tokens": self.special_tokens_map,
                "chat_templates": self.chat_templates, "generation_defaults": self.generation_defaults,
                "tokenizer_json": self._json}
        return json.dumps(head).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes) -> HFTokenizer:
        """Read `to_bytes` output. Format 1 (before chat templates were kept) has one EOS, no
        template, no defaults; its import used the EOS as BOS for a model without one, so
        ``bos_id == eos_id`` there means no BOS."""
        import json

        head = json.loads(data.decode("utf-8"))
        version = head["relf_hf_tokenizer"]
        if version > _HF_FORMAT:
            raise UserError(f"this tokenizer was written by a newer relf_jax (format {version}); upgrade relf_jax")
        ids = {"bos_id": head["bos_id"], "eos_id": head["eos_id"], "pad_id": head["pad_id"],
               "unk_id": head.get("unk_id", -1)}
        if version >= 2:
            return cls(head["tokenizer_json"], **ids, eos_ids=head.get("eos_ids", ()),
                       add_bos=head.get("add_bos", True), special_tokens=head.get("special_tokens"),
                       chat_templates=head.get("chat_templates"),
                       generation_defaults=head.get("generation_defaults"))
        tok = cls(head["tokenizer_json"], **ids, add_bos=ids["bos_id"] != ids["eos_id"])
        names = {"bos_token": tok.bos_id if tok.add_bos else -1, "eos_token": tok.eos_id,
                 "pad_token": tok.pad_id, "unk_token": tok.unk_id}
        tok.special_tokens_map = {k: tok.id_to_piece(i) for k, i in names.items()
                                  if i >= 0 and tok.id_to_piece(i) is not None}
        return tok


def tokenizer_from_bytes(data: bytes) -> Tokenizer | HFTokenizer:
    """The tokenizer serialized by either class's ``to_bytes`` (as stored in checkpoints)."""
    if data.startswith(_HF_MAGIC):
        return HFTokenizer.from_bytes(data)
    return Tokenizer(data)


def same_tokenization(a, b) -> bool:
    """Whether two tokenizers map text to the same ids (a draft and its target must): the same
    vocabulary and rules. Chat templates and generation defaults may differ."""
    def key(tok):
        if isinstance(tok, HFTokenizer):  # the backend's own serialization: file formatting aside
            return "hf", tok.backend.to_str()
        if isinstance(tok, Tokenizer):
            return "spm", tok._proto
        return type(tok).__name__, tok.to_bytes() if hasattr(tok, "to_bytes") else id(tok)

    return key(a) == key(b)
