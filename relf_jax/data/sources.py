"""Named text sources, each prepared once as a TFDS dataset of ``{"text": str}`` examples.

``prepare(source, data_dir, **options)`` returns a prepared ``tfds.core.DatasetBuilder``
with splits ``train`` and ``validation``; ``builder.as_data_source(split)`` then feeds the
grain pipeline (``relf_jax.data.pipeline``). Preparing writes ArrayRecord files under
``data_dir/<builder>/<config>/<version>/`` and works without TensorFlow; a second call with
the same settings finds those files and reuses them.

Sources:
- ``synthetic_chat``: the built-in grammar corpus (options ``num_train``,
  ``num_validation``, ``seed``, ``topics``).
- ``chatterbot``: the English dialogs of the ``chatterbot-corpus`` package.
- ``text_files``: the user's own ``.txt`` / ``.jsonl`` files (option ``path``: a file, a
  directory or a glob); see ``builders/text_files``.
- ``tfds:<name>``: any TFDS catalog dataset with a ``text`` feature, e.g.
  ``tfds:lm1b`` or ``tfds:wikipedia/20230601.en``. Downloading and generating a catalog
  dataset needs network access and, for most of them, TensorFlow on the user's machine;
  failures are reported as ``DataError``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from relf_jax.data.builders.common import VALIDATION_EVERY, DataError, holdout_split

__all__ = ["SOURCES", "VALIDATION_EVERY", "DataError", "holdout_split", "iter_texts", "prepare"]

SOURCES = ("synthetic_chat", "chatterbot", "text_files", "tfds:<name>")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _no_options(source: str, options: dict[str, Any]) -> None:
    if options:
        raise DataError(f"source {source!r} takes no options, got {sorted(options)}.")


def _prepare_tfds_catalog(name: str, data_dir: str, options: dict[str, Any]):
    import tensorflow_datasets as tfds

    _no_options(f"tfds:{name}", options)
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except tfds.core.registered.DatasetNotFoundError:
        raise DataError(
            f"TFDS has no dataset {name!r} (see https://www.tensorflow.org/datasets/catalog)."
        ) from None
    features = builder.info.features
    if "text" not in features:
        raise DataError(f"TFDS dataset {name!r} has no 'text' feature (it has {sorted(features)}).")
    try:
        builder.download_and_prepare(file_format="array_record")
    except Exception as e:  # network, TensorFlow or Beam missing, bad config, ...
        raise DataError(
            f"could not prepare TFDS dataset {name!r} (it needs network access and may "
            f"need TensorFlow): {type(e).__name__}: {_first_line(e)}"
        ) from e
    return builder


def prepare(source: str, data_dir: str, **options):
    """Prepares ``source`` under ``data_dir`` (once) and returns its TFDS builder."""
    if source == "synthetic_chat":
        from relf_jax.data.builders.synthetic_chat import build

        return build(data_dir, **options)
    if source == "chatterbot":
        from relf_jax.data.builders.chatterbot import Chatterbot

        _no_options(source, options)
        builder = Chatterbot(data_dir=data_dir)
    elif source == "text_files":
        from relf_jax.data.builders.text_files import TextFiles, text_files_config

        path = options.pop("path", None)
        if path is None:
            raise DataError("source 'text_files' needs the option path=<file, directory or glob>.")
        _no_options(source, options)
        builder = TextFiles(data_dir=data_dir, config=text_files_config(path))
    elif source.startswith("tfds:") and len(source) > len("tfds:"):
        return _prepare_tfds_catalog(source[len("tfds:") :], data_dir, options)
    else:
        raise DataError(f"unknown data source {source!r}; valid sources: {', '.join(SOURCES)}.")
    builder.download_and_prepare(file_format="array_record")
    return builder


def iter_texts(builder, split: str) -> Iterator[str]:
    """The ``text`` of every example of ``split``, in stored order (for tokenizer training)."""
    source = builder.as_data_source(split)
    for i in range(len(source)):
        text = source[i]["text"]
        yield text.decode("utf-8") if isinstance(text, bytes) else str(text)
