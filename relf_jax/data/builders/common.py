"""What every text builder shares: the data error and the train/validation holdout.

The floor below both ``relf_jax.data.sources`` (which picks a builder) and the builders
themselves, so neither imports the other's module for these.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from relf_jax.errors import UserError

# Every VALIDATION_EVERY-th document is held out for validation.
VALIDATION_EVERY = 20

T = TypeVar("T")


class DataError(UserError):
    """A data source that is missing, empty or malformed; the message is one line."""


def holdout_split(docs: Sequence[T], every: int = VALIDATION_EVERY) -> tuple[list[T], list[T]]:
    """Deterministic (train, validation): validation is every ``every``-th document.

    At least one document is held out: with fewer than ``every`` documents the last one
    is. A single document goes to both splits, since neither may be empty.
    """
    docs = list(docs)
    if len(docs) <= 1:
        return docs, list(docs)
    held = [i for i in range(len(docs)) if i % every == every - 1] or [len(docs) - 1]
    held_set = set(held)
    train = [d for i, d in enumerate(docs) if i not in held_set]
    return train, [docs[i] for i in held]


class TextSplits:
    """Mixin for the text builders: `holdout_split` documents into train/validation examples."""

    def _text_splits(self, docs: Sequence[str]) -> dict:
        train, validation = holdout_split(docs)
        return {"train": self._generate_examples(train), "validation": self._generate_examples(validation)}

    def _generate_examples(self, docs: Sequence[str]):
        for i, doc in enumerate(docs):
            yield i, {"text": doc}
