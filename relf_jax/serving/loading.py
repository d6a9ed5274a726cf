"""Engines and served models from checkpoints: `engine_for` (the engine of a method object,
`relf_jax.methods`, for `ChatModel` and `relf-jax serve`) and `build_models` (engines + batchers
+ chat templates behind one model id, what the HTTP server serves). Strings (the CLI's
``--generator`` and ``--proposer``) become method objects at the edge, `relf_jax.methods.parse_method`.
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

# AR tokens / speculative rounds per engine call when served (`engine_for`, `relf-jax serve`):
# amortises the host work per call (see `relf_jax.serving.engines.slots.check_steps_per_call`). About
# 10 ms of model time per call for the demo's cpu model: 8 AR steps or 2 speculative rounds.
STEPS_PER_CALL = {"ar": 8, "speculative": 2}


def _or(steps_per_call: int | None, kind: str) -> int:
    return STEPS_PER_CALL[kind] if steps_per_call is None else steps_per_call


def engine_for(workdir: str, method: methods.Method, *, slots: int = 8, top_k: int = 0,
               steps_per_call: int | None = None, max_context: int | None = None,
               prefix_cache_mb: float = 0.0, mesh=None) -> Engine:
    """The serving engine that decodes the checkpoint in `workdir` (the ``<workdir>/<family>``
    layout of `relf-jax train`, or a HuggingFace Llama / Qwen2 folder, loaded in place: AR and
    speculative methods; a draft may be an HF folder too) with `method`, a `relf_jax.methods`
    object (the CLI's strings become one with `relf_jax.methods.parse_method`):

    `Autoregressive()`; `Speculative(...)` with proposer `DraftModel` (a run folder or a loaded
    model; None: ``<workdir>/draft``), `PromptLookup` or `NgramTable` (next-token statistics of
    its corpus: text files, directories or globs, `relf_jax.speculative.recipes.corpus_ngram_table`,
    and/or ``"online"``: the prompts and replies served, counted as requests finish,
    `relf_jax.speculative.ngram_draft.OnlineNgram`, keeping the newest `online_tokens`; the named
    files, if any, always count; no corpus: the training data of a model relf_jax trained, an
    imported model needs one, `UserError`); `BlockDiffusion(...)` (a threshold left None: 0.95);
    `Flow(...)` (an nfe left None: the model's).

    `steps_per_call`: AR tokens or speculative rounds per engine call
    (`relf_jax.serving.engines.slots.check_steps_per_call`; None: `STEPS_PER_CALL`). `max_context`
    (AR and speculative; the others ignore it): prompt + reply tokens a slot holds, below the
    model's context (None: the model's). A slot's KV cache holds at most this many tokens (the
    engines size it to what the occupied slots need, `relf_jax.serving.engines.slots.Spans`);
    longer requests are refused (HTTP 400).

    `prefix_cache_mb` (AR and speculative): MiB of device memory for the prefix cache, which keeps
    finished requests' keys/values so a prompt that starts like an earlier one (the next turn of a
    conversation) prefills only the rest (`relf_jax.serving.prefix_cache`); 0: none. The
    block-diffusion and ReLF engines denoise every request's tokens from scratch and have no KV
    cache to reuse: they say so on stderr and run without it.

    `mesh` (`relf_jax.runtime.sharding.model_mesh`): the model (and a draft) placed on it,
    `LoadedModel.on_mesh`: the slots split into groups over its data (and fsdp) axes, each
    model over its tensor axis (`relf_jax.serving.engines.on_mesh`); None: one device.
    """
    from relf_jax.loading import load_model
    from relf_jax.serving import engines as E

    family = methods.family_of(method)
    if isinstance(method, (methods.BlockDiffusion, methods.Flow)):
        if prefix_cache_mb:
            print(f"[serve] the {methods.generator_name(method)} engine does not use the prefix cache (it has no "
                  "KV cache of the prompt to reuse)", file=sys.stderr, flush=True)
        cls = E.BlockDiffusionEngine if isinstance(method, methods.BlockDiffusion) else E.ReLFEngine
        return cls(_placed(load_model(workdir, family), mesh), slots, method=method)
    lm = _placed(load_model(workdir, family), mesh)
    if isinstance(method, methods.Autoregressive):
        engine = E.AREngine(lm, slots, top_k=top_k, steps_per_call=_or(steps_per_call, "ar"), max_context=max_context)
    else:
        draft, table, online = proposer_inputs(workdir, lm, method)
        engine = E.SpeculativeEngine(lm, slots, method=method, draft=draft, ngram_table=table, ngram_online=online,
                                     steps_per_call=_or(steps_per_call, "speculative"), max_context=max_context)
    engine.enable_prefix_cache(prefix_cache_mb)
    return engine


def _placed(lm, mesh):
    return lm if mesh is None else lm.on_mesh(mesh)


def proposer_inputs(workdir: str, lm, method: methods.Speculative):
    """(draft model, n-gram table, online n-gram table) of `method`'s proposer for the target
    `lm` of `workdir` (None where the proposer takes none)."""
    from relf_jax.speculative.recipes import corpus_ngram_table, corpus_rows, load_draft

    p = method.proposer
    if isinstance(p, methods.PromptLookup):
        return None, None, None
    if isinstance(p, methods.NgramTable):
        files = list(p.files)
        if not p.online:
            return None, corpus_ngram_table(lm, p.order, p.top_m, files=files), None
        from relf_jax.speculative.ngram_draft import OnlineNgram

        online = OnlineNgram(lm.model_cfg.vocab_size, max_tokens=p.online_tokens,
                             seed_rows=corpus_rows(lm, files) if files else ())
        print(f"[corpus_ngram] the n-gram table counts the requests served (the newest {p.online_tokens} "
              f"tokens){' and ' + ', '.join(files) if files else ''}", file=sys.stderr, flush=True)
        return None, None, online
    draft = p.path_or_model
    if draft is None:  # beside the target served (an imported HF folder's own workdir may differ)
        draft = os.path.join(workdir, "draft")
        if not os.path.exists(draft):
            raise UserError(f"{method.rule!r} speculative decoding with a DraftModel proposer needs a draft model: "
                            f"none at {draft}; name one with DraftModel(path) (relf-jax serve --draft PATH) or "
                            "use PromptLookup() or NgramTable() (--proposer prompt_lookup or corpus_ngram)")
    return load_draft(lm, draft), None, None


@dataclasses.dataclass
class ServedEngine:
    """One engine behind a model id: its batcher, template, method and fixed settings."""

    engine: Engine
    batcher: Batcher
    template: ChatTemplate
    method: methods.Method | None  # None: the model-free `MockEngine`
    settings: dict  # the engine's fixed settings a request may name (k, nfe)

    @property
    def generator(self) -> str:
        """The method's wire name: what a request's ``generator`` field and the metric labels say
        (`relf_jax.methods.generator_name`; "mock" for the mock engine)."""
        return "mock" if self.method is None else methods.generator_name(self.method)


def build_models(workdir: str | None, generators: Sequence[methods.Method], *, model_name: str | None = None,
                 slots: int = 8, max_queue: int = 256, policy: str = "fcfs", aging: float = 0.05,
                 template: ChatTemplate | None = None, cost_fn=None, mock: bool = False, mock_step_s: float = 0.0,
                 warmup: bool = True, overlap: bool | None = None, **engine_kw) -> dict[str, list[ServedEngine]]:
    """Engines + batchers for `relf-jax serve`: one model id with one engine per method.

    generators: `relf_jax.methods` objects (empty: `Autoregressive()`; the first is the default;
    the CLI parses its ``--generator`` names with `relf_jax.methods.parse_method`); `engine_kw`:
    `engine_for`'s top_k, steps_per_call, max_context, prefix_cache_mb, mesh.

    policy: "fcfs", "sjf" (shortest predicted DWS cost first, with `aging` cost-seconds per
    second waited; needs `cost_fn`, e.g. `relf_jax.dws.predictor.WorkloadCost`) or "priority"
    (the request's ``priority`` field, aging in levels per second). ``mock=True`` serves the
    model-free `MockEngine` (no checkpoint needed) once per method. `workdir` may be a
    HuggingFace folder (read in place, `relf_jax.loading.load_model`). template: None serves the
    checkpoint's own chat template (`ChatTemplate.for_tokenizer`; the markers for a model without
    one). overlap: `Batcher`'s (the next engine step starts before the host work on the last one;
    None: the engine's default, on for the AR and speculative engines).
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
    for method in generators or [methods.Autoregressive()]:
        if isinstance(method, str):
            raise UserError(f"build_models takes method objects, not the name {method!r}: parse it with "
                            "relf_jax.methods.parse_method")
        methods.family_of(method)  # a method object, or a ConfigError
        if mock:
            engine, method = MockEngine(slots, step_s=mock_step_s), None
        else:
            if not workdir:
                raise UserError("serve needs --model (a HuggingFace folder or a run directory), --workdir or --mock")
            engine = engine_for(workdir, method, slots=slots, **engine_kw)
        label = "mock" if method is None else methods.generator_name(method)
        if warmup:  # compile every program the engine can run while serving (`Engine.warmup`)
            t0 = time.perf_counter()
            print(f"[serve] compiling the {label} engine (a first start on CPU can take a minute; with "
                  "`relf_jax.runtime.jit_cache` on, as in `relf-jax serve`, later starts read it back)",
                  file=sys.stderr, flush=True)
            engine.warmup()
            print(f"[serve] {label} engine compiled in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        settings = {}
        if isinstance(method, methods.Speculative):
            settings["k"] = engine.k
        if isinstance(method, methods.Flow):
            settings["nfe"] = engine.flow_settings.nfe
        batcher = Batcher(engine, pol, max_queue=max_queue, cost_fn=cost_fn, overlap=overlap).start()
        served.append(ServedEngine(engine=engine, batcher=batcher,
                                   template=template or ChatTemplate.for_tokenizer(engine.tokenizer),
                                   method=method, settings=settings))
    return {name: served}
