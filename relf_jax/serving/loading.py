"""Engines and served models from checkpoints: `load_engine` (one engine per generator, the
engine of `ChatModel` and `relf-jax serve`) and `build_models` (engines + batchers + chat
templates behind one model id, what the HTTP server serves).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Sequence

from relf_jax.errors import UserError
from relf_jax.serving.batching import Batcher
from relf_jax.serving.chat_template import ChatTemplate
from relf_jax.serving.engine_api import Engine

GENERATORS = ("ar", "standard", "nsd", "greedy", "bd", "relf")


# AR tokens / speculative rounds per engine call when served (`load_engine`, `relf-jax serve`):
# amortises the host work per call (see `relf_jax.serving.engines.slots.check_steps_per_call`). About
# 10 ms of model time per call for the demo's cpu model: 8 AR steps or 2 speculative rounds.
STEPS_PER_CALL = {"ar": 8, "speculative": 2}


# traffic tokens an online corpus n-gram table keeps (`load_engine`'s ngram_corpus "online")
ONLINE_NGRAM_TOKENS = 32768


def _or(steps_per_call: int | None, kind: str) -> int:
    return STEPS_PER_CALL[kind] if steps_per_call is None else steps_per_call


def load_engine(workdir: str, generator: str = "ar", *, slots: int = 8, k: int = 4, proposer: str = "draft",
                draft: str | None = None, nsd_top_p: float = 0.9, nfe: int | None = None,
                threshold: float = 0.95, top_k: int = 0, steps_per_call: int | None = None,
                max_context: int | None = None, ngram_corpus: str | Sequence[str] | None = None,
                ngram_online_tokens: int = ONLINE_NGRAM_TOKENS) -> Engine:
    """An engine over the checkpoint in `workdir` (the ``<workdir>/<family>`` layout of `relf-jax train`),
    or over a HuggingFace Llama / Qwen2 folder, loaded in place (AR and speculative generators;
    a draft may be an HF folder too).

    generator: "ar"; "standard" / "nsd" / "greedy" (speculative, with `proposer` "draft" (the
    model in `draft`, default ``<workdir>/draft``), "prompt_lookup" or "corpus_ngram" (next-token
    statistics, `k` drafts per round) of `ngram_corpus`: text files, directories or globs
    (`relf_jax.speculative.recipes.corpus_ngram_table`), and/or ``"online"``: the prompts and replies served,
    counted as requests finish (`relf_jax.speculative.ngram_draft.OnlineNgram`, keeping the
    newest `ngram_online_tokens` tokens; the named files, if any, always count). None: the
    training data of a model relf_jax trained; an imported model needs a corpus (`UserError`).
    "bd" (block diffusion, `threshold`); "relf" (`nfe` steps). `steps_per_call`: AR tokens or
    speculative rounds per engine call (`relf_jax.serving.engines.slots.check_steps_per_call`;
    None: `STEPS_PER_CALL`). `max_context` (AR and speculative; the others ignore it, as AR
    ignores `nfe`): prompt + reply tokens a slot holds, below the model's context (None: the
    model's). A slot's KV cache holds at most this many tokens (the engines size it to what the
    occupied slots need, `relf_jax.serving.engines.slots.Spans`); longer requests are refused
    (HTTP 400).
    """
    from relf_jax.data.tokenizer import same_tokenization
    from relf_jax.loading import load_model
    from relf_jax.serving import engines as E
    from relf_jax.speculative.recipes import corpus_ngram_table, corpus_rows

    if generator not in GENERATORS:
        raise UserError(f"unknown generator {generator!r}; choose one of: {', '.join(GENERATORS)}")
    if generator == "bd":
        return E.BlockDiffusionEngine(load_model(workdir, "bd"), slots, threshold=threshold)
    if generator == "relf":
        return E.ReLFEngine(load_model(workdir, "relf"), slots, nfe=nfe)
    lm = load_model(workdir, "ar")
    if generator == "ar":
        return E.AREngine(lm, slots, top_k=top_k, steps_per_call=_or(steps_per_call, "ar"), max_context=max_context)
    dm = table = online = None
    corpus = [ngram_corpus] if isinstance(ngram_corpus, str) else list(ngram_corpus or [])
    if corpus and proposer != "corpus_ngram":
        raise UserError(f"an n-gram corpus (--ngram-corpus) is for proposer corpus_ngram, not {proposer!r}")
    if proposer == "corpus_ngram":
        files = [c for c in corpus if c != "online"]
        if "online" in corpus:
            from relf_jax.speculative.ngram_draft import OnlineNgram

            online = OnlineNgram(lm.model_cfg.vocab_size, max_tokens=ngram_online_tokens,
                                 seed_rows=corpus_rows(lm, files) if files else ())
            print(f"[corpus_ngram] the n-gram table counts the requests served (the newest {ngram_online_tokens} "
                  f"tokens){' and ' + ', '.join(files) if files else ''}", file=sys.stderr, flush=True)
        else:
            table = corpus_ngram_table(lm, files=files)
    if proposer == "draft":
        path = draft or os.path.join(workdir, "draft")
        if draft is None and not os.path.exists(path):
            raise UserError(f"generator {generator!r} with proposer 'draft' needs a draft model: none at {path}; "
                            "name one with draft= (relf-jax serve --draft PATH) or use proposer 'prompt_lookup' "
                            "or 'corpus_ngram'")
        dm = load_model(path, "ar")
        if not same_tokenization(dm.tokenizer, lm.tokenizer):
            raise UserError(f"the draft in {path} uses another tokenizer than the target")
    return E.SpeculativeEngine(lm, dm, slots, rule=generator, k=k, proposer=proposer, nsd_top_p=nsd_top_p,
                               steps_per_call=_or(steps_per_call, "speculative"),
                               name=f"spec-{generator}", max_context=max_context, ngram_table=table,
                               ngram_online=online)


@dataclasses.dataclass
class ServedEngine:
    """One engine behind a model id: its batcher, template and fixed settings."""

    engine: Engine
    batcher: Batcher
    template: ChatTemplate
    generator: str
    settings: dict  # the engine's fixed settings a request may name (k, nfe)


def build_models(workdir: str | None, generators: list[str], *, model_name: str | None = None, slots: int = 8,
                 max_queue: int = 256, policy: str = "fcfs", aging: float = 0.05, template: ChatTemplate | None = None,
                 cost_fn=None, mock: bool = False, mock_step_s: float = 0.0, warmup: bool = True,
                 overlap: bool | None = None, **engine_kw) -> dict[str, list[ServedEngine]]:
    """Engines + batchers for `relf-jax serve`: one model id with one engine per generator.

    policy: "fcfs", "sjf" (shortest predicted DWS cost first, with `aging` cost-seconds per
    second waited; needs `cost_fn`, e.g. `relf_jax.dws.predictor.WorkloadCost`) or "priority"
    (the request's ``priority`` field, aging in levels per second). ``mock=True`` serves the
    model-free `MockEngine` (no checkpoint needed). `workdir` may be a HuggingFace folder (read in
    place, `relf_jax.loading.load_model`). template: None serves the checkpoint's own chat
    template (`ChatTemplate.for_tokenizer`; the markers for a model without one). overlap:
    `Batcher`'s (the next engine step starts before the host work on the last one; None: the
    engine's default, on for the AR and speculative engines).
    """
    from relf_jax.serving.engines import MockEngine
    from relf_jax.serving.scheduler import make_policy

    if policy == "sjf":
        if cost_fn is None:
            raise UserError("policy sjf ranks by predicted DWS cost: give a DWS predictor (--dws-predictor) "
                            "and its cost model (--dws-cost-model)")
        pol = make_policy("sjf:dws_cost", aging=aging)
    elif policy == "priority":
        pol = make_policy("priority", aging=aging)
    elif policy == "fcfs":
        pol = make_policy("fcfs")
    else:
        raise UserError(f"unknown policy {policy!r}; choose fcfs, sjf or priority")
    name = model_name or ("mock" if mock else os.path.basename(os.path.normpath(workdir or "model")))
    served = []
    for gen in generators or ["ar"]:
        if mock:
            engine = MockEngine(slots, step_s=mock_step_s)
            gen = "mock"
        else:
            if not workdir:
                raise UserError("serve needs --model (a HuggingFace folder or a run directory), --workdir or --mock")
            engine = load_engine(workdir, gen, slots=slots, **engine_kw)
        if warmup:  # compile every program the engine can run while serving (`Engine.warmup`)
            t0 = time.perf_counter()
            print(f"[serve] compiling the {gen} engine (a first start on CPU can take a minute; with "
                  "`relf_jax.runtime.jit_cache` on, as in `relf-jax serve`, later starts read it back)",
                  file=sys.stderr, flush=True)
            engine.warmup()
            print(f"[serve] {gen} engine compiled in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        settings = {}
        if getattr(engine, "k", None) is not None and gen in ("standard", "nsd", "greedy"):
            settings["k"] = engine.k
        if gen == "relf":
            settings["nfe"] = engine.flow_settings.nfe
        batcher = Batcher(engine, pol, max_queue=max_queue, cost_fn=cost_fn, overlap=overlap).start()
        served.append(ServedEngine(engine=engine, batcher=batcher,
                                   template=template or ChatTemplate.for_tokenizer(engine.tokenizer),
                                   generator=gen, settings=settings))
    return {name: served}
