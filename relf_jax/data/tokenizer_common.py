"""What both tokenizer classes share: the special ids of relf_jax's own tokenizer, the chat
markers, the ids a reply shows, and the error for text no tokenizer can take."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import numpy as np

from relf_jax.errors import UserError

PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
CHAT_MARKERS = ("<user>", "<assistant>")
_MARKER_RE = re.compile(r"\s*(" + "|".join(re.escape(m) for m in CHAT_MARKERS) + r")\s*")


def space_markers(text: str) -> str:
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


def is_bad_text(text) -> bool:
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
