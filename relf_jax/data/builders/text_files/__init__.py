"""TFDS builder for the user's own chat files (``.txt`` / ``.jsonl``)."""

from relf_jax.data.builders.text_files.text_files import (
    TextFiles,
    TextFilesConfig,
    read_documents,
    resolve_files,
    text_files_config,
)

__all__ = ["TextFiles", "TextFilesConfig", "read_documents", "resolve_files", "text_files_config"]
