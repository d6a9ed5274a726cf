"""Engines and served models from checkpoints: `engine_for` (the engine of a method object,
`relf_jax.methods`, for `ChatModel` and `relf-jax serve`; `load_engine` parses the CLI's generator
and proposer strings into one) and `build_models` (engines + batchers + chat templates behind
one model id, what the HTTP server serves).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Sequence

from relf_jax import methods
from relf_jax.errors import UserError
from relf_jax.serving.batching import Batcher
from relf_jax.serving.chat_template import ChatTemplate
from relf_jax.serving.engine_api import Engine

GENERATORS = methods.GENERATORS


# AR tokens / speculative rounds per engine call when served (`load_engine`, `relf-jax serve`):
# amortises the host work per call (see `relf_jax.serving.engines.slots.check_steps_per_call`). About
# 10 ms of model time per call for the demo's cpu model: 8 AR steps or 2 speculative rounds.
STEPS_PER_CALL = {"ar": 8, "speculative": 2}


# traffic tokens an online corpus n-gram table keeps (`load_engine`'s ngram_corpus "online")
ONLINE_NGRAM_TOKENS = methods.ONLINE_NGRAM_TOKENS


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
    method = methods.parse_method(generator, proposer=proposer, k=k, nsd_top_p=nsd_top_p, nfe=nfe,
                                  threshold=threshold, draft=draft, corpus=ngram_corpus,
                                  online_tokens=ngram_online_tokens)
    return engine_for(workdir, method, slots=slots, top_k=top_k, steps_per_call=steps_per_call,
                      max_context=max_context)


def engine_for(workdir: str, method: methods.Method, *, slots: int = 8, top_k: int = 0,
               steps_per_call: int | None = None, max_context: int | None = None) -> Engine:
    """The serving engine that decodes the checkpoint in `workdir` with `method` (a
    `relf_jax.methods` object); the other settings as in `load_engine`. A `BlockDiffusion`
    threshold left None is 0.95, a `Flow` nfe left None the model's."""
    from relf_jax.loading import load_model
    from relf_jax.serving import engines as E

    family = methods.family_of(method)
    if isinstance(method, methods.BlockDiffusion):
        threshold = 0.95 if method.threshold is None else method.threshold
        return E.BlockDiffusionEngine(load_model(workdir, family), slots, threshold=threshold)
    if isinstance(method, methods.Flow):
        return E.ReLFEngine(load_model(workdir, family), slots, nfe=method.nfe)
    lm = load_model(workdir, family)
    if isinstance(method, methods.Autoregressive):
        return E.AREngine(lm, slots, top_k=top_k, steps_per_call=_or(steps_per_call, "ar"), max_context=max_context)
    draft, table, online, ngram = proposer_inputs(workdir, lm, method)
    return E.SpeculativeEngine(lm, draft, slots, rule=method.rule, k=method.k, proposer=method.proposer_name,
                               nsd_top_p=method.nsd_top_p, ngram=ngram,
                               steps_per_call=_or(steps_per_call, "speculative"), name=f"spec-{method.rule}",
                               max_context=max_context, ngram_table=table, ngram_online=online)


def proposer_inputs(workdir: str, lm, method: methods.Speculative):
    """(draft model, n-gram table, online n-gram table, prompt-lookup n) of `method`'s proposer
    for the target `lm` of `workdir` (None where the proposer takes none)."""
    from relf_jax.data.tokenizer import same_tokenization
    from relf_jax.loading import load_model
    from relf_jax.speculative.recipes import corpus_ngram_table, corpus_rows

    p = method.proposer
    if isinstance(p, methods.PromptLookup):
        return None, None, None, p.ngram
    if isinstance(p, methods.NgramTable):
        files = list(p.files)
        if not p.online:
            return None, corpus_ngram_table(lm, p.order, p.top_m, files=files), None, methods.PromptLookup().ngram
        from relf_jax.speculative.ngram_draft import OnlineNgram

        online = OnlineNgram(lm.model_cfg.vocab_size, max_tokens=p.online_tokens,
                             seed_rows=corpus_rows(lm, files) if files else ())
        print(f"[corpus_ngram] the n-gram table counts the requests served (the newest {p.online_tokens} "
              f"tokens){' and ' + ', '.join(files) if files else ''}", file=sys.stderr, flush=True)
        return None, None, online, methods.PromptLookup().ngram
    if not isinstance(p.path_or_model, (str, type(None))):
        draft, path = p.path_or_model, "the draft model given"
    else:
        path = p.path_or_model or os.path.join(workdir, "draft")
        if p.path_or_model is None and not os.path.exists(path):
            raise UserError(f"generator {method.rule!r} with proposer 'draft' needs a draft model: none at {path}; "
                            "name one with draft= (relf-jax serve --draft PATH) or use proposer 'prompt_lookup' "
                            "or 'corpus_ngram'")
        draft = load_model(path, "ar")
        path = f"the draft in {path}"
    if not same_tokenization(draft.tokenizer, lm.tokenizer):
        raise UserError(f"{path} uses another tokenizer than the target")
    return draft, None, None, methods.PromptLookup().ngram


@dataclasses.dataclass
class ServedEngine:
    """One engine behind a model id: its batcher, template and fixed settings."""

    engine: Engine
    batcher: Batcher
    template: ChatTemplate
    generator: str
    settings: dict  # the engine's fixed settings a request may name (k, nfe)


def build_models(workdir: str | None, generators: list, *, model_name: str | None = None, slots: int = 8,
                 max_queue: int = 256, policy: str = "fcfs", aging: float = 0.05, template: ChatTemplate | None = None,
                 cost_fn=None, mock: bool = False, mock_step_s: float = 0.0, warmup: bool = True,
                 overlap: bool | None = None, **engine_kw) -> dict[str, list[ServedEngine]]:
    """Engines + batchers for `relf-jax serve`: one model id with one engine per generator.

    generators: method objects (`relf_jax.methods`; `engine_kw` then takes `engine_for`'s
    top_k, steps_per_call, max_context) or the CLI's generator names (`load_engine`'s keywords).

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
            if isinstance(gen, str):
                engine = load_engine(workdir, gen, slots=slots, **engine_kw)
            else:  # a method object: the engine's own settings come with it
                engine = engine_for(workdir, gen, slots=slots, **engine_kw)
                gen = methods.generator_name(gen)
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
