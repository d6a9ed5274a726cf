"""A run's data and tokenizer, from its config: the source prepared (cached under the workdir),
the tokenizer loaded or trained on it, and how training rows are cut."""

from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Optional

import jax

from relf_jax.config import Config
from relf_jax.data import sources
from relf_jax.data.tokenizer import Tokenizer, train_tokenizer
from relf_jax.errors import UserError
from relf_jax.runtime.sharding import primary_first

TOKENIZER_TRAIN_DOCS = 20_000


def data_dir(cfg: Config) -> str:
    return os.path.join(os.path.abspath(cfg.workdir), "data")


def prepare_data(cfg: Config, root: Optional[str] = None):
    """Prepare the configured source (cached under ``<root or workdir>/data``); return the TFDS builder."""
    if root is not None:
        cfg = dataclasses.replace(cfg, workdir=root)
    # several hosts: process 0 prepares first (two writers of one directory collide)
    return primary_first(lambda: _prepare(cfg), "relf_jax.prepare_data")


def _prepare(cfg: Config):
    d = cfg.data
    if d.source == "synthetic_chat":
        topics = tuple(int(t) for t in d.topics.split(",") if t.strip()) or None
        return sources.prepare("synthetic_chat", data_dir(cfg), num_train=d.num_train,
                               num_validation=d.num_validation, seed=d.data_seed, topics=topics)
    if d.source == "text_files":
        if not d.path:
            raise UserError("data.source=text_files needs data.path=<file, directory or glob>")
        return sources.prepare("text_files", data_dir(cfg), path=d.path)
    return sources.prepare(d.source, data_dir(cfg))


def prepare_tokenizer(cfg: Config, builder) -> Tokenizer:
    """Load ``<workdir>/tokenizer.model`` or train it on the training split and save it there."""
    path = os.path.join(os.path.abspath(cfg.workdir), "tokenizer.model")
    if os.path.exists(path):
        return Tokenizer.load(path)
    texts = itertools.islice(sources.iter_texts(builder, "train"), TOKENIZER_TRAIN_DOCS)
    tok = train_tokenizer(texts, cfg.data.vocab_size, model_type=cfg.data.tokenizer_type)
    if jax.process_index() == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tok.save(path)
    return tok


def row_mode(cfg: Config) -> str:
    """How training rows are cut (``data.rows``): "auto" is "segments" (several whole
    conversations per row, segment-aware attention, no pad in the loss, row tails filled from the
    next ``data.pack_lookahead`` conversations: 0.99x AR's text tokens per step on the cpu preset,
    0.95x for block diffusion's block-aligned conversations) for ReLF and block diffusion (there each
    conversation is filled up with pad to whole blocks, so blocks align with positions), else
    "packed"."""
    if cfg.data.rows != "auto":
        return cfg.data.rows
    return "segments" if cfg.model.family in ("relf", "bd") else "packed"

