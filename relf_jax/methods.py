"""How to generate, as typed objects: the method (`Autoregressive`, `Speculative` with a proposer,
`Flow`, `BlockDiffusion`) and the sampling parameters (`SamplingParams`).

The library takes these objects; strings (the CLI's ``--generator nsd --proposer
prompt_lookup``, the server's flags) are parsed into them once, at the edge, by `parse_method`::

    import relf_jax as rj
    params = rj.SamplingParams(temperature=0.8, max_new_tokens=64)
    method = rj.Speculative(rule="nsd", k=4, proposer=rj.PromptLookup(ngram=3))

Every object is a frozen dataclass and checks its values when built (`ConfigError`).
A field left None takes the model's own setting (its run config: ``sample.*``, ``flow.*``).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from typing import Any, Optional, Union

from relf_jax.config import PROPOSERS, ConfigError, SampleConfig, validate_sampling

RULES = ("standard", "nsd", "greedy")
FLOW_SAMPLERS = ("euler", "stochastic")
FLOW_GRIDS = ("uniform", "cosine", "late")
PROMPT_MODES = ("clean", "renoise")
RENOISE = ("linear", "marginal")
CONFIDENCE = ("max", "sampled")
# the CLI's generator names and the proposer names they pair with
GENERATORS = ("ar", "standard", "nsd", "greedy", "bd", "relf")
# traffic tokens an online n-gram table keeps (`NgramTable(corpus=("online",))`)
ONLINE_NGRAM_TOKENS = 32768


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def _one_of(what: str, value: Any, choices: Sequence[Any]) -> None:
    _check(value in choices, f"{what}={value!r} is not valid; choose one of: {', '.join(map(str, choices))}")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """What to sample: temperature, nucleus, length, seed. None: the model's ``sample.*`` setting.

    n: samples per prompt (no prompts: `n` unconditional samples). stop: strings that end a reply
    (the text is cut before the first one). batch_size: prompts decoded at once.
    """

    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    max_new_tokens: Optional[int] = None
    seed: Optional[int] = None
    n: int = 1
    stop: tuple[str, ...] = ()
    batch_size: Optional[int] = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        validate_sampling(1.0 if self.temperature is None else self.temperature,
                          0 if self.top_k is None else self.top_k, 1.0 if self.top_p is None else self.top_p)
        _check(self.max_new_tokens is None or self.max_new_tokens > 0,
               f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        _check(self.n >= 1, f"n must be >= 1, got {self.n}")
        _check(self.batch_size is None or self.batch_size > 0, f"batch_size must be > 0, got {self.batch_size}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings")

    def sample_config(self, base: SampleConfig) -> SampleConfig:
        """`base` (a model's ``sample`` settings) with the fields set here."""
        fields = ("temperature", "top_k", "top_p", "max_new_tokens", "seed", "batch_size")
        return dataclasses.replace(base, **{f: getattr(self, f) for f in fields if getattr(self, f) is not None})


@dataclasses.dataclass(frozen=True)
class Autoregressive:
    """One token per forward pass of the model (the default method)."""


@dataclasses.dataclass(frozen=True)
class DraftModel:
    """Drafts from a small AR model: a run folder (None: ``<target workdir>/draft``) or a loaded model."""

    path_or_model: Any = None

    def __post_init__(self):
        _check(self.path_or_model is None or isinstance(self.path_or_model, str)
               or hasattr(self.path_or_model, "params"),
               f"DraftModel takes a run folder or a loaded model, got {type(self.path_or_model).__name__}")


@dataclasses.dataclass(frozen=True)
class PromptLookup:
    """Drafts copied from the prompt: the tokens that followed the last match of its final n-gram
    (`ngram`: the longest n-gram matched)."""

    ngram: int = 3

    def __post_init__(self):
        _check(self.ngram >= 1, f"PromptLookup.ngram must be >= 1, got {self.ngram}")


@dataclasses.dataclass(frozen=True)
class NgramTable:
    """Drafts from next-token statistics of a corpus (`relf_jax.speculative.ngram_draft`).

    corpus: text files, directories or globs to count, and/or ``"online"`` (the traffic served,
    keeping the newest `online_tokens`); empty: the model's training data (a model relf_jax
    trained). order: contexts of up to order - 1 tokens; top_m: next tokens kept per context.
    """

    corpus: tuple[str, ...] = ()
    order: int = 3
    top_m: int = 16
    online_tokens: int = ONLINE_NGRAM_TOKENS

    def __post_init__(self):
        corpus = (self.corpus,) if isinstance(self.corpus, str) else tuple(self.corpus or ())
        object.__setattr__(self, "corpus", corpus)
        _check(all(isinstance(c, str) and c for c in corpus), "NgramTable.corpus must be paths or 'online'")
        _check(self.order >= 2, f"NgramTable.order must be >= 2, got {self.order}")
        _check(self.top_m >= 1, f"NgramTable.top_m must be >= 1, got {self.top_m}")
        _check(self.online_tokens >= 1, f"NgramTable.online_tokens must be >= 1, got {self.online_tokens}")

    @property
    def online(self) -> bool:
        return "online" in self.corpus

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(c for c in self.corpus if c != "online")


Proposer = Union[DraftModel, PromptLookup, NgramTable]


@dataclasses.dataclass(frozen=True)
class Speculative:
    """Speculative decoding: `k` drafted tokens per round from `proposer`, verified by the model.

    rule: "standard" (exact: samples the model's distribution), "nsd" (accepts a draft inside the
    target's nucleus of mass `nsd_top_p`; not exact) or "greedy" (accepts drafts equal to the
    target's argmax).

    draft_temperature_scale: the proposer samples at the temperature times this (default 1). The
    verifier is given the distribution the draft sampled, so the standard rule stays exact at any
    scale; under NSD a scale below 1 keeps the drafts inside the target's nucleus more often
    (longer accepted prefixes) and sharpens the output (docs/speculative.md).
    """

    rule: str = "standard"
    k: int = 4
    proposer: Proposer = DraftModel()
    nsd_top_p: float = 0.9
    draft_temperature_scale: float = 1.0

    def __post_init__(self):
        _one_of("Speculative.rule", self.rule, RULES)
        _check(isinstance(self.k, int) and self.k >= 1, f"Speculative.k must be an int >= 1, got {self.k!r}")
        _check(isinstance(self.proposer, (DraftModel, PromptLookup, NgramTable)),
               "Speculative.proposer must be DraftModel(...), PromptLookup(...) or NgramTable(...), "
               f"got {self.proposer!r}")
        _check(0 < self.nsd_top_p <= 1, f"Speculative.nsd_top_p must be in (0, 1], got {self.nsd_top_p}")
        scale = self.draft_temperature_scale
        _check(isinstance(scale, numbers.Real) and not isinstance(scale, bool) and scale > 0,
               f"Speculative.draft_temperature_scale must be a number > 0, got {scale!r}")

    @property
    def proposer_name(self) -> str:
        """The proposer's CLI name ("draft", "prompt_lookup", "corpus_ngram")."""
        return proposer_name(self.proposer)


@dataclasses.dataclass(frozen=True)
class Flow:
    """ReLF: whole sequences in `nfe` network calls, all positions in parallel (a "relf" model).
    None: the model's ``flow.*`` setting; length: the row length (None: ``data.seq_len``)."""

    nfe: Optional[int] = None
    sampler: Optional[str] = None
    guidance: Optional[float] = None
    renoise: Optional[str] = None
    prompt_mode: Optional[str] = None
    length: Optional[int] = None
    grid: Optional[str] = None  # the time grid (`relf_jax.flow.samplers.time_grid`)

    def __post_init__(self):
        _check(self.nfe is None or self.nfe >= 1, f"Flow.nfe must be >= 1, got {self.nfe}")
        if self.sampler is not None:
            _one_of("Flow.sampler", self.sampler, FLOW_SAMPLERS)
        if self.grid is not None:
            _one_of("Flow.grid", self.grid, FLOW_GRIDS)
        if self.renoise is not None:
            _one_of("Flow.renoise", self.renoise, RENOISE)
        if self.prompt_mode is not None:
            _one_of("Flow.prompt_mode", self.prompt_mode, PROMPT_MODES)
        _check(self.length is None or self.length >= 2, f"Flow.length must be >= 2, got {self.length}")


@dataclasses.dataclass(frozen=True)
class BlockDiffusion:
    """Block diffusion (a "bd" model): each block denoised in parallel, committing the masked
    positions whose confidence exceeds `threshold` (None: the model's ``sample.threshold``)."""

    threshold: Optional[float] = None
    confidence: Optional[str] = None

    def __post_init__(self):
        _check(self.threshold is None or 0 <= self.threshold <= 1,
               f"BlockDiffusion.threshold must be in [0, 1], got {self.threshold}")
        if self.confidence is not None:
            _one_of("BlockDiffusion.confidence", self.confidence, CONFIDENCE)


Method = Union[Autoregressive, Speculative, Flow, BlockDiffusion]


def family_of(method: Method) -> str:
    """The model family a method decodes: "ar" (autoregressive and speculative), "relf" or "bd"."""
    if isinstance(method, Flow):
        return "relf"
    if isinstance(method, BlockDiffusion):
        return "bd"
    if isinstance(method, (Autoregressive, Speculative)):
        return "ar"
    raise ConfigError(f"not a generation method: {method!r} (use Autoregressive(), Speculative(...), "
                      "Flow(...) or BlockDiffusion(...))")


def proposer_name(proposer: Proposer) -> str:
    if isinstance(proposer, DraftModel):
        return "draft"
    if isinstance(proposer, PromptLookup):
        return "prompt_lookup"
    return "corpus_ngram"


def generator_name(method: Method) -> str:
    """The CLI's generator name of `method` ("ar", "standard", "nsd", "greedy", "bd", "relf")."""
    if isinstance(method, Speculative):
        return method.rule
    return {"ar": "ar", "relf": "relf", "bd": "bd"}[family_of(method)]


def parse_proposer(name: str, *, draft: Any = None, ngram: int = 3, corpus: Sequence[str] | str | None = None,
                   order: int = 3, top_m: int = 16, online_tokens: int = ONLINE_NGRAM_TOKENS) -> Proposer:
    """A proposer from its CLI name: "draft" (`draft`: a run folder, a loaded model or None),
    "prompt_lookup" (`ngram`) or "corpus_ngram" (`corpus`, `order`, `top_m`, `online_tokens`)."""
    _one_of("proposer", name, PROPOSERS)
    corpus = (corpus,) if isinstance(corpus, str) else tuple(corpus or ())
    if corpus and name != "corpus_ngram":
        raise ConfigError(f"an n-gram corpus (--ngram-corpus) is for proposer corpus_ngram, not {name!r}")
    if name == "draft":
        return DraftModel(draft or None)
    if name == "prompt_lookup":
        return PromptLookup(ngram=ngram)
    return NgramTable(corpus=corpus, order=order, top_m=top_m, online_tokens=online_tokens)


def parse_method(generator: str, *, proposer: str = "draft", k: int = 4, nsd_top_p: float = 0.9,
                 draft_temperature_scale: float = 1.0, nfe: Optional[int] = None, sampler: Optional[str] = None,
                 grid: Optional[str] = None, threshold: Optional[float] = None, confidence: Optional[str] = None,
                 **proposer_kw: Any) -> Method:
    """The method object of the CLI's strings: `generator` "ar", "standard" / "nsd" / "greedy"
    (speculative, with `proposer` and its options `proposer_kw`, see `parse_proposer`), "bd" or "relf"."""
    _one_of("generator", generator, GENERATORS)
    if generator == "ar":
        return Autoregressive()
    if generator == "relf":
        return Flow(nfe=nfe, sampler=sampler, grid=grid)
    if generator == "bd":
        return BlockDiffusion(threshold=threshold, confidence=confidence)
    return Speculative(rule=generator, k=k, nsd_top_p=nsd_top_p, draft_temperature_scale=draft_temperature_scale,
                       proposer=parse_proposer(proposer, **proposer_kw))


def method_from_config(cfg) -> Method:
    """The method a run config describes: its ``speculative.*`` settings for an AR model
    (rule "none": autoregressive), ``flow.*`` for ReLF, ``sample.threshold`` for block diffusion."""
    family = cfg.model.family
    if family == "relf":
        return Flow(nfe=cfg.flow.nfe, sampler=cfg.flow.sampler, grid=cfg.flow.grid)
    if family == "bd":
        return BlockDiffusion(threshold=cfg.sample.threshold, confidence=cfg.sample.confidence)
    sp = cfg.speculative
    if sp.rule == "none":
        return Autoregressive()
    return Speculative(rule=sp.rule, k=sp.k, nsd_top_p=sp.nsd_top_p, draft_temperature_scale=sp.draft_temperature_scale,
                       proposer=parse_proposer(sp.proposer, draft=sp.draft or None, ngram=sp.ngram,
                                               order=sp.corpus_order, top_m=sp.corpus_top_m))
