"""Tokenizers: relf_jax's SentencePiece model, and HuggingFace ``tokenizer.json`` for imports.

`Tokenizer`: trained in memory, with fixed special ids so every model, checkpoint and
pipeline agrees on them: pad=0, eos=1, bos=2, unk=3. The chat markers ``<user>`` and
``<assistant>`` are user-defined symbols, so each is always exactly one token.

`HFTokenizer`: an imported checkpoint's tokenizer with what its folder says about it: the
special tokens, whether prompts get a BOS, every EOS id, the chat template(s) and the
generation defaults (see `relf_jax.export.hf_import.tokenizer_from_hf`).

Both classes offer the same surface to the samplers and the server: ``encode`` (no BOS/EOS
added), ``decode`` (stops at the first id of ``eos_ids``, never shows special-token text),
``bos_id`` / ``eos_id`` / ``pad_id`` / ``unk_id``, ``eos_ids``, ``add_bos``, ``special_ids``,
``special_tokens_map``, ``chat_template``, ``generation_defaults``; `encode_prompt` builds a
completion prompt from them.
"""

from __future__ import annotations

from relf_jax.data.hf_tokenizer import GENERATION_KEYS, HF_MAGIC, HFTokenizer
from relf_jax.data.spm_tokenizer import Tokenizer, train_tokenizer
from relf_jax.data.tokenizer_common import (
    BOS_ID,
    CHAT_MARKERS,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    reply_ids,
    text_error,
)

__all__ = [
    "BOS_ID", "CHAT_MARKERS", "EOS_ID", "GENERATION_KEYS", "PAD_ID", "UNK_ID", "HFTokenizer", "Tokenizer",
    "encode_prompt", "eos_ids_of", "reply_ids", "same_tokenization", "text_error", "tokenizer_from_bytes",
    "train_tokenizer", "turn_stop_ids",
]


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


def tokenizer_from_bytes(data: bytes) -> Tokenizer | HFTokenizer:
    """The tokenizer serialized by either class's ``to_bytes`` (as stored in checkpoints)."""
    if data.startswith(HF_MAGIC):
        return HFTokenizer.from_bytes(data)
    return Tokenizer(data)


def same_tokenization(a, b) -> bool:
    """Whether two tokenizers map text to the same ids (a draft and its target must): the same
    vocabulary and rules. Chat templates and generation defaults may differ."""
    def key(tok):
        if isinstance(tok, HFTokenizer):  # the backend's own serialization: file formatting aside
            return "hf", tok.backend.to_str()
        if isinstance(tok, Tokenizer):
            return "spm", tok.to_bytes()
        return type(tok).__name__, tok.to_bytes() if hasattr(tok, "to_bytes") else id(tok)

    return key(a) == key(b)
