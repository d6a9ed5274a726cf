"""``chatterbot``: the English dialogs of ``chatterbot-corpus`` as ``{"text": str}``.

Each YAML file under ``chatterbot_corpus/data/english/`` holds ``conversations``: lists of
alternating utterances. A conversation becomes one document
``<user> a <assistant> b <user> c ...`` (the first utterance is the user's).

Normalisation of every utterance: lower case; curly quotes become straight ones; every
character that is neither a word character, whitespace nor an apostrophe
(``. , ! ? : ; " ( ) -`` ...) becomes its own space-separated token; whitespace runs
become single spaces. Apostrophes stay inside words (``don't``).

Validation is every 20th conversation in file order (files sorted by name). Entries that
are not lists are skipped (release 1.3.3 has one: a bare string in ``trivia.yml``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import re

import tensorflow_datasets as tfds

from relf_jax.data.builders.common import DataError, TextSplits

_PUNCT = re.compile(r"([^\w\s'])")
_STRAIGHT_QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"'})


def _corpus_version() -> str:
    try:
        return importlib.metadata.version("chatterbot-corpus")
    except importlib.metadata.PackageNotFoundError:
        return "missing"


def normalize_utterance(text) -> str:
    """Lower case, punctuation split off as separate tokens, single spaces."""
    text = str(text).lower().translate(_STRAIGHT_QUOTES)
    return " ".join(_PUNCT.sub(r" \1 ", text).split())


def render_conversation(utterances) -> str:
    """``[a, b, c, ...]`` as ``<user> a <assistant> b <user> c ...``."""
    parts = []
    for i, utterance in enumerate(utterances):
        parts.append("<user>" if i % 2 == 0 else "<assistant>")
        parts.append(normalize_utterance(utterance))
    return " ".join(p for p in parts if p)


def read_conversations() -> list[str]:
    """Every English conversation of the installed corpus, rendered, in file order."""
    import yaml  # PyYAML: the corpus is YAML (a dependency of flax and orbax too).

    try:
        root = importlib.resources.files("chatterbot_corpus") / "data" / "english"
    except ModuleNotFoundError:
        raise DataError("the chatterbot source needs `pip install chatterbot-corpus`.") from None
    files = sorted((f for f in root.iterdir() if f.name.endswith(".yml")), key=lambda f: f.name)
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser when PyYAML has it: ~10x faster
    docs = []
    for file in files:
        data = yaml.load(file.read_text(encoding="utf-8"), Loader=loader) or {}  # noqa: S506 - a safe loader
        for conversation in data.get("conversations") or []:
            if isinstance(conversation, list) and conversation:
                docs.append(render_conversation(conversation))
    if not docs:
        raise DataError(f"chatterbot: no conversations found under {root}")
    return docs


def first_user_turns(n: int, seed: int) -> list[str]:
    """Up to ``n`` prompts ``<user> ... <assistant>``: the first user turn of conversations
    taken in a ``seed``-shuffled order (conversations with no assistant reply are skipped)."""
    import numpy as np

    convs = read_conversations()
    order = np.random.default_rng(seed).permutation(len(convs))
    prompts = []
    for i in order:
        words = convs[i].split()
        if "<assistant>" in words:
            prompts.append(" ".join(words[: words.index("<assistant>") + 1]))
        if len(prompts) >= n:
            break
    return prompts

class Chatterbot(TextSplits, tfds.core.GeneratorBasedBuilder):
    """English chatterbot-corpus dialogs; the config name carries the corpus version."""

    VERSION = tfds.core.Version("1.0.0")
    # A new corpus release gets its own cache folder.
    BUILDER_CONFIGS = [
        tfds.core.BuilderConfig(name="english_" + _corpus_version().replace(".", "_"))
    ]

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict({"text": tfds.features.Text()}),
            homepage="https://github.com/gunthercox/chatterbot-corpus",
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # The corpus ships inside the pip package.
        return self._text_splits(read_conversations())
