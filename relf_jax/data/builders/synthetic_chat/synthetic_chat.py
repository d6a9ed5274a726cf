"""TFDS builder: conversations sampled from the SyntheticChat grammar.

Each record is ``{"text": <one conversation>}`` (``<user> ... <assistant> ...``).
Splits ``train`` and ``validation`` are sampled with different seeds, so the
validation conversations are held out (drawn independently from the same
grammar). Works without TensorFlow::

    builder = build("/tmp/tfds", num_train=20_000, num_validation=1_000)
    ds = builder.as_data_source("train")   # ds[i]["text"] -> bytes

Settings live in a ``SyntheticChatConfig`` whose name is derived from its values
(``n{train}_v{validation}_s{seed}_t{topics|all}``), so different settings are
cached in different folders ``data_dir/synthetic_chat/<name>/1.0.0``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

import tensorflow_datasets as tfds

from relf_jax.data.synthetic_chat import GrammarConfig, SyntheticChat

# Conversations are sampled in blocks, each with its own derived seed, so that
# memory stays bounded for large splits.
_BLOCK = 50_000
_SPLIT_OFFSET = {"train": 1, "validation": 2}


def _config_name(num_train: int, num_validation: int, seed: int, topics) -> str:
    t = "all" if topics is None else "-".join(str(int(x)) for x in topics)
    return f"n{num_train}_v{num_validation}_s{seed}_t{t}"


@dataclasses.dataclass(eq=False)
class SyntheticChatConfig(tfds.core.BuilderConfig):
    """Builder settings. ``seed`` is the grammar seed (``GrammarConfig.seed``)
    and also derives the two split sampling seeds; ``topics`` restricts the
    latent topic (indices into ``SyntheticChat.topics``), ``None`` = all."""

    num_train: int = 100_000
    num_validation: int = 2_000
    seed: int = 0
    topics: tuple[int, ...] | None = None

    @classmethod
    def from_values(cls, num_train: int, num_validation: int, seed: int = 0,
                    topics: Sequence[int] | None = None) -> SyntheticChatConfig:
        topics = None if topics is None else tuple(sorted({int(t) for t in topics}))
        return cls(
            name=_config_name(num_train, num_validation, seed, topics),
            description=(f"{num_train} train / {num_validation} validation conversations, "
                         f"grammar seed {seed}, topics {topics if topics is not None else 'all'}"),
            num_train=int(num_train), num_validation=int(num_validation),
            seed=int(seed), topics=topics,
        )


_DEFAULT = SyntheticChatConfig.from_values(100_000, 2_000, 0, None)


class SyntheticChatBuilder(tfds.core.GeneratorBasedBuilder):
    """Conversations from the SyntheticChat probabilistic grammar (exact likelihoods)."""

    name = "synthetic_chat"
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {"1.0.0": "Initial release."}
    BUILDER_CONFIGS: ClassVar[list[SyntheticChatConfig]] = [_DEFAULT]
    DEFAULT_BUILDER_CONFIG_NAME = _DEFAULT.name

    @classmethod
    def make_config(cls, num_train: int, num_validation: int, seed: int = 0,
                    topics: Sequence[int] | None = None) -> SyntheticChatConfig:
        """The config for these values (the registered object if it is the default)."""
        cfg = SyntheticChatConfig.from_values(num_train, num_validation, seed, topics)
        return _DEFAULT if cfg.name == _DEFAULT.name else cfg

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            description=__doc__,
            features=tfds.features.FeaturesDict({"text": tfds.features.Text()}),
        )

    def _split_generators(self, dl_manager):
        cfg = self.builder_config
        return {
            "train": self._generate_examples("train", cfg.num_train),
            "validation": self._generate_examples("validation", cfg.num_validation),
        }

    def _generate_examples(self, split: str, n: int):
        cfg = self.builder_config
        grammar = SyntheticChat(GrammarConfig(seed=cfg.seed))
        for start in range(0, n, _BLOCK):
            m = min(_BLOCK, n - start)
            sample_seed = (cfg.seed * 1_000_003 + _SPLIT_OFFSET[split]) * 100_003 + start // _BLOCK
            for i, text in enumerate(grammar.sample(m, seed=sample_seed, topics=cfg.topics)):
                yield start + i, {"text": text}


def build(data_dir: str, num_train: int, num_validation: int, seed: int = 0,
          topics: Sequence[int] | None = None) -> tfds.core.DatasetBuilder:
    """Prepare (once; later calls reuse the cache) and return the builder.

    The data is written as ``array_record``; read it with
    ``build(...).as_data_source("train")`` (records ``{"text": bytes}``).
    """
    config = SyntheticChatBuilder.make_config(num_train, num_validation, seed, topics)
    builder = SyntheticChatBuilder(data_dir=data_dir, config=config, file_format="array_record")
    builder.download_and_prepare(file_format="array_record")
    return builder
