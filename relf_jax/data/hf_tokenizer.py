"""An imported checkpoint's tokenizer: a HuggingFace ``tokenizer.json`` (via the ``tokenizers``
library) with what its folder says about it: the special tokens, whether prompts get a BOS,
every EOS id, the chat template(s) and the generation defaults (see
`relf_jax.export.hf_import.tokenizer_from_hf`)."""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from relf_jax.data.tokenizer_common import is_bad_text, reply_ids, text_error
from relf_jax.errors import UserError

HF_MAGIC = b'{"relf_hf_tokenizer"'
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
            raise next((text_error(t) for t in texts if is_bad_text(t)), text_error(None)) from e

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of ``ids``: stops at the first of ``eos_ids``, skips every special token."""
        return self._tk.decode(reply_ids(ids, self.eos_ids, self.special_ids), skip_special_tokens=True)

    def id_to_piece(self, token_id: int) -> str:
        return self._tk.id_to_token(int(token_id))

    def piece_to_id(self, piece: str) -> int:
        i = self._tk.token_to_id(piece)
        return self.unk_id if i is None else i

    def to_bytes(self) -> bytes:
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
