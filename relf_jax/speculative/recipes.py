"""Speculative decoding recipes on loaded models: the draft (distilled from the target, loaded
beside it), the corpus n-gram table, and batch sampling with a `relf_jax.methods.Speculative`
method (`sample`)."""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
from typing import Optional, Sequence

import jax

from relf_jax.checkpoint import LoadedModel
from relf_jax.config import ModelConfig, SampleConfig, set_value, validate_sampling
from relf_jax.data import pipeline, sources
from relf_jax.data import tokenizer as tokenizer_lib
from relf_jax.data.prepare import prepare_data
from relf_jax.errors import UserError
from relf_jax.loading import load_model
from relf_jax.methods import Autoregressive, DraftModel, Method, NgramTable, Speculative, method_from_config
from relf_jax.runtime.sharding import to_host
from relf_jax.sampling.batch import Samples, prompt_ids
from relf_jax.sampling.recipes import ar_batch, decode_batches
from relf_jax.train.loop import TrainResult, train

NGRAM_DOCS = 20_000


def trained_by_relf_jax(lm: LoadedModel) -> bool:
    """True for a model relf_jax trained (its run config names its training data); False for one
    imported from HuggingFace (its tokenizer is the checkpoint's: relf_jax never trains one)."""
    return not isinstance(lm.tokenizer, tokenizer_lib.HFTokenizer)


def corpus_rows(lm: LoadedModel, files: Sequence[str]) -> list[list[int]]:
    """Token rows of the documents in `files` (``.txt`` / ``.jsonl`` files, directories or globs,
    read as the ``text_files`` source reads them), each ``tokens + [eos]``."""
    from relf_jax.data.builders.text_files import read_documents, resolve_files

    tok = lm.tokenizer
    docs = [d for f in files for path in resolve_files(f) for d in read_documents(path)]
    if not docs:
        raise UserError(f"no text in {', '.join(files)}")
    return [tok.encode(d) + [tok.eos_id] for d in docs]


def corpus_ngram_table(lm: LoadedModel, order: int = 3, top_m: int = 16, *, files: Sequence[str] = ()):
    """The corpus n-gram draft (`relf_jax.speculative.ngram_draft`) of `lm`.

    files: text the user names (`corpus_rows`): the table counts it. None / empty: the model's
    training data, (up to 20k) documents of the run's configured source, tokenized with the
    model's tokenizer; saved as ``<model dir>/ngram_draft_o<order>_m<top_m>.npz`` and read back
    from there (a read-only model directory just rebuilds it, a few seconds). That needs a model
    relf_jax trained: for an imported checkpoint (whose training text relf_jax does not have) it
    is a `UserError`. Either way stderr says which corpus the table came from.
    """
    from relf_jax.speculative import ngram_draft

    if files:
        rows = corpus_rows(lm, files)
        print(f"[corpus_ngram] the n-gram table counts {len(rows)} documents of {', '.join(files)}",
              file=sys.stderr, flush=True)
        return ngram_draft.build_ngram_draft(rows, lm.model_cfg.vocab_size, order=order, top_m=top_m)
    if not trained_by_relf_jax(lm):
        raise UserError("proposer corpus_ngram: this model was imported (HuggingFace), and relf_jax does not have "
                        "its training text; name text to count (relf-jax serve --ngram-corpus FILE..., or "
                        "NgramTable(corpus=[...]) in ChatModel.load / generate) or count the traffic served "
                        "(--ngram-corpus online)")
    print(f"[corpus_ngram] the n-gram table counts the model's training corpus (data.source="
          f"{lm.cfg.data.source}, up to {NGRAM_DOCS} documents)", file=sys.stderr, flush=True)
    path = os.path.join(lm.model_dir, f"ngram_draft_o{order}_m{top_m}.npz")
    if os.path.exists(path):
        table = ngram_draft.NgramDraft.load(path)
        if table.vocab_size == lm.model_cfg.vocab_size:
            return table
    tok = lm.tokenizer
    builder = prepare_data(lm.cfg)
    rows = [[tok.bos_id] + tok.encode(t) + [tok.eos_id]
            for t in itertools.islice(sources.iter_texts(builder, "train"), NGRAM_DOCS)]
    table = ngram_draft.build_ngram_draft(rows, lm.model_cfg.vocab_size, order=order, top_m=top_m)
    if jax.process_index() == 0 and os.access(lm.model_dir, os.W_OK):
        table.save(path)
    return table


def spec_batch(lm: LoadedModel, sc: SampleConfig, method: Speculative, draft: Optional[LoadedModel] = None,
               ngram_table=None):
    """``run(prompts, lengths, key) -> (tokens, lengths, state)`` of speculative decoding with
    `method` (a `relf_jax.methods.Speculative`) and `sc`; `draft` (a `DraftModel` proposer) or
    `ngram_table` (an `NgramTable` proposer) resolved (`proposer_inputs`)."""
    from relf_jax.speculative import generate as spec

    settings = spec.SpecSettings.from_method(method, lm.tokenizer, sc.max_new_tokens, top_k=sc.top_k)
    params = spec.SpecParams.make(sc.temperature, sc.top_p, method.nsd_top_p, method.draft_temperature_scale)

    def run(arr, lens, key):
        state = spec.generate(lm.graphdef, lm.params, arr, lens, key, params, settings,
                              draft_graphdef=draft.graphdef if draft else None,
                              draft_params=draft.params if draft else ngram_table)
        return state.tokens, state.lengths, state

    return run


def load_draft(lm: LoadedModel, path_or_model=None) -> LoadedModel:
    """The draft model for speculative decoding of `lm`: a loaded model, the run folder
    `path_or_model`, or ``<lm's workdir>/draft``; a draft with another tokenizer is refused."""
    if isinstance(path_or_model, (str, type(None))):
        path = path_or_model or os.path.join(lm.cfg.workdir, "draft")
        draft, what = load_model(path, "ar"), f"the draft in {path}"
    else:
        draft, what = path_or_model, "the draft model given"
    if not tokenizer_lib.same_tokenization(draft.tokenizer, lm.tokenizer):
        raise UserError(f"{what} uses another tokenizer than the target")
    if lm.mesh is not None and draft.mesh is not lm.mesh:  # the draft runs on the target's devices
        draft = draft.on_mesh(lm.mesh)
    return draft


def proposer_inputs(lm: LoadedModel, method: Speculative, ngram_table=None):
    """(draft model, n-gram table) of `method`'s proposer for batch sampling: a `DraftModel`'s
    loaded model (or the one `load_draft` reads from its path), an `NgramTable`'s `ngram_table`
    (default: `corpus_ngram_table` of its files, or of the training data); None where the
    proposer takes none."""
    p = method.proposer
    if isinstance(p, DraftModel):
        return load_draft(lm, p.path_or_model), None
    if isinstance(p, NgramTable):
        if ngram_table is not None:
            return None, ngram_table
        if p.online:
            raise UserError("NgramTable(corpus=('online',)) counts the traffic served: use it with ChatModel "
                            "or relf-jax serve; batch sampling takes files (or no corpus: the training data)")
        return None, corpus_ngram_table(lm, p.order, p.top_m, files=p.files)
    return None, None


def sample(lm: LoadedModel, prompts: Optional[Sequence[str]] = None, n: Optional[int] = None,
           sample_cfg: Optional[SampleConfig] = None, warmup: bool = True, *, method: Optional[Method] = None,
           ngram_table=None) -> Samples:
    """Sample replies, `batch_size` prompts at a time, autoregressively or speculatively.

    prompts: texts to continue (default: `n` empty prompts, i.e. unconditional conversations).
    method: `Autoregressive()` or `Speculative(...)` (`relf_jax.methods`; its proposer's draft
    model, prompt lookup or corpus n-gram table, `proposer_inputs`; `ngram_table`: a table built
    already); None: the model's ``speculative`` settings (`relf_jax.methods.method_from_config`).
    With `warmup`, the batch shape is compiled before the clock starts.
    """
    sc = sample_cfg or lm.cfg.sample
    validate_sampling(sc.temperature, sc.top_k, sc.top_p)
    ids = prompt_ids(lm.tokenizer, prompts, n or sc.num_samples)
    method = method if method is not None else method_from_config(lm.cfg)
    if isinstance(method, Autoregressive):
        return decode_batches(lm, ids, sc, ar_batch(lm, sc), warmup=warmup)
    if not isinstance(method, Speculative):
        raise UserError(f"speculative.recipes.sample decodes Autoregressive() or Speculative(...), got {method!r}")
    draft, table = proposer_inputs(lm, method, ngram_table)
    return decode_batches(lm, ids, sc, spec_batch(lm, sc, method, draft, table), extra=method.k + 1,
                          warmup=warmup,
                          count_forwards=lambda state, rows: int(to_host(state.target_forwards)[:rows].sum()))


def draft_defaults(target: ModelConfig) -> list[str]:
    """A draft about 4-8x cheaper than `target`: half the width, half the layers."""
    heads = max(1, target.num_heads // 2)
    kv = max(1, min(target.num_kv_heads, heads))
    while heads % kv:
        kv -= 1
    return [f"model.d_model={max(16, target.d_model // 2)}", f"model.num_layers={max(1, target.num_layers // 2)}",
            f"model.num_heads={heads}", f"model.num_kv_heads={kv}", f"model.mlp_dim={max(32, target.mlp_dim // 2)}",
            "model.head_dim=0"]


def train_draft(target_dir: str, overrides: Sequence[str] = (), workdir: Optional[str] = None,
                *, mesh=None) -> TrainResult:
    """Distil a small AR draft from the target in `target_dir` (same tokenizer and data).

    The draft's shape defaults to `draft_defaults(target)`; `overrides` (``model.*``, ``train.*``)
    change it. It is saved in `workdir` (default ``<target_dir>/draft``).
    """
    from relf_jax.speculative.distill import make_distill_loss

    target = load_model(target_dir, "ar")
    workdir = workdir or os.path.join(target_dir, "draft")
    cfg = dataclasses.replace(target.cfg, workdir=workdir)
    for item in [*draft_defaults(target.model_cfg), *overrides]:
        if "=" not in item:
            raise UserError(f"override {item!r} is not of the form key=value")
        key, value = item.split("=", 1)
        cfg = set_value(cfg, key, value)
    cfg = cfg.validate()
    model_cfg = dataclasses.replace(cfg.model, vocab_size=target.tokenizer.vocab_size,
                                    max_seq_len=target.model_cfg.max_seq_len)
    cfg = dataclasses.replace(cfg, model=model_cfg)
    # the draft's own data settings: e.g. data.topics=0,1 distils it on part of the corpus
    builder = prepare_data(cfg, root=target_dir)
    d, t = cfg.data, cfg.train
    data = pipeline.make_iterator(builder, "train", target.tokenizer, seq_len=d.seq_len, batch_size=t.batch_size,
                                  seed=t.seed + 1)
    evals = pipeline.eval_batches(builder, "validation", target.tokenizer, seq_len=d.seq_len,
                                  batch_size=t.batch_size, max_batches=t.eval_batches)
    return train(cfg, model_cfg, make_distill_loss(target.graphdef), data, eval_data=evals, workdir=workdir,
                 mesh=mesh, tokenizer_bytes=target.tokenizer.to_bytes(), frozen=target.params,
                 extra_meta={"role": "draft", "target": os.path.abspath(target_dir)})
