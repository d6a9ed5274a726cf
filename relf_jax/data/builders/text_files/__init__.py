"""TFDS builder for the user's own chat files (``.txt`` / ``.jsonl``)."""

from relf_jax.data.builders.text_files.text_files import (
    TextFiles,
    TextFilesConfig,
    text_files_config,
)

__all__ = ["TextFiles", "TextFilesConfig", "text_files_config"]
