"""``text_files``: the user's own chat files as a TFDS dataset of ``{"text": str}``.

Accepted paths: one ``.txt`` or ``.jsonl`` file, a directory (every ``.txt`` / ``.jsonl``
below it, recursively) or a glob pattern (matches with other suffixes are skipped).

Documents:
- ``.txt``: documents are separated by blank lines; the lines of one paragraph are
  joined with single spaces. A file without any blank line is read as one document per
  line (the usual shape of a chat log).
- ``.jsonl``: one JSON object per line, either ``{"text": "..."}`` or
  ``{"messages": [{"role": "user" | "assistant", "content": "..."}, ...]}``, which is
  rendered as ``<user> ... <assistant> ...``.
Whitespace runs become single spaces (the tokenizer's normalisation) and empty documents
are dropped. Validation is every 20th document (at least one; see
``relf_jax.data.builders.common.holdout_split``).

The config name is ``<name>_<hash>``: the name of the file or of the files' common folder,
and a hash of every file's path and content, so an edited file gets a fresh cache folder
instead of stale examples.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import re

import tensorflow_datasets as tfds

from relf_jax.data.builders.common import DataError, TextSplits

SUFFIXES = (".txt", ".jsonl")
ROLES = ("user", "assistant")


@dataclasses.dataclass
class TextFilesConfig(tfds.core.BuilderConfig):
    """``files``: absolute paths of the files, in reading order."""

    files: tuple[str, ...] = ()


def _supported(path: str) -> bool:
    return path.endswith(SUFFIXES) and os.path.isfile(path)


def resolve_files(path: str | os.PathLike) -> list[str]:
    """Absolute, sorted ``.txt`` / ``.jsonl`` files named by a file, directory or glob."""
    path = os.path.expanduser(os.fspath(path))
    if os.path.isfile(path):
        if not path.endswith(SUFFIXES):
            raise DataError(f"text_files reads .txt or .jsonl files, got {path}")
        files = [path]
    elif os.path.isdir(path):
        files = [
            os.path.join(root, name)
            for root, _, names in os.walk(path)
            for name in names
            if _supported(os.path.join(root, name))
        ]
    elif glob.has_magic(path):
        files = [p for p in glob.glob(path, recursive=True) if _supported(p)]
        if not files:
            raise DataError(f"text_files: no .txt or .jsonl file matches {path}")
    else:
        raise DataError(f"text_files: no such file or directory: {path}")
    if not files:
        raise DataError(f"text_files: no .txt or .jsonl files under {path}")
    return sorted(os.path.abspath(p) for p in files)


def text_files_config(path: str | os.PathLike) -> TextFilesConfig:
    """The config for ``path``; its name changes whenever a file's name or content does."""
    files = resolve_files(path)
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.encode("utf-8") + b"\0")
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        digest.update(b"\0")
    # Named after the files (not the spelling of ``path``): a directory and a glob of the
    # same files share one cache folder.
    stem = os.path.basename(os.path.commonpath(files))
    stem = re.sub(r"[^A-Za-z0-9]+", "_", stem).strip("_")[:40] or "files"
    return TextFilesConfig(
        name=f"{stem}_{digest.hexdigest()[:16]}",
        description=f"text_files from {os.fspath(path)} ({len(files)} files)",
        files=tuple(files),
    )


def _clean(text: str) -> str:
    return " ".join(text.split())


def render_messages(messages, where: str) -> str:
    """``[{"role", "content"}, ...]`` as ``<user> ... <assistant> ...``."""
    if not isinstance(messages, list):
        raise DataError(f"{where}: 'messages' must be a list of {{role, content}} objects")
    parts = []
    for m in messages:
        role = m.get("role") if isinstance(m, dict) else None
        content = m.get("content") if isinstance(m, dict) else None
        if role not in ROLES or not isinstance(content, str):
            raise DataError(
                f"{where}: each message needs role 'user' or 'assistant' and a string "
                f"content, got {json.dumps(m)[:80]}"
            )
        parts.append(f"<{role}> {_clean(content)}")
    return " ".join(parts)


def read_documents(file: str) -> list[str]:
    """The non-empty, whitespace-normalised documents of one ``.txt`` or ``.jsonl`` file."""
    with open(file, encoding="utf-8") as f:
        text = f.read()
    if file.endswith(".txt"):
        if re.search(r"\n[ \t\r\f\v]*\n", text.strip()):
            docs = re.split(r"\n[ \t\r\f\v]*\n", text)
        else:
            docs = text.splitlines()
        return [d for d in map(_clean, docs) if d]
    docs = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{file}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: invalid JSON ({e.msg})") from None
        if isinstance(record, dict) and isinstance(record.get("text"), str):
            doc = _clean(record["text"])
        elif isinstance(record, dict) and "messages" in record:
            doc = render_messages(record["messages"], where)
        else:
            raise DataError(f'{where}: expected {{"text": ...}} or {{"messages": [...]}}')
        if doc:
            docs.append(doc)
    return docs


class TextFiles(TextSplits, tfds.core.GeneratorBasedBuilder):
    """The user's ``.txt`` / ``.jsonl`` files; build the config with ``text_files_config``."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict({"text": tfds.features.Text()}),
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # Local files only.
        files = self.builder_config.files if self.builder_config else ()
        if not files:
            raise DataError("text_files needs a config from text_files_config(path).")
        docs = [doc for file in files for doc in read_documents(file)]
        if not docs:
            raise DataError(f"text_files: no documents in {', '.join(files)}")
        return self._text_splits(docs)
