"""The public API behind ``import relf_jax as rj``: train, load, generate, stream, evaluate.

Each takes typed objects (`relf_jax.methods`): a method (`Autoregressive`, `Speculative`,
`Flow`, `BlockDiffusion`) and `SamplingParams`, and dispatches to the recipe beside the
method (`relf_jax.sampling.recipes`, `relf_jax.speculative.recipes`, `relf_jax.flow`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, Optional, Union

from relf_jax.checkpoint import LoadedModel
from relf_jax.config import Config
from relf_jax.errors import UserError
from relf_jax.loading import load
from relf_jax.methods import (
    Autoregressive,
    Flow,
    Method,
    SamplingParams,
    Speculative,
    family_of,
)
from relf_jax.runtime.sharding import mesh_scope
from relf_jax.sampling.batch import Samples

Prompts = Union[str, Sequence[str], None]


def train(cfg: Config, *, mesh=None):
    """Prepare the data and tokenizer of `cfg`, then train (or resume) the model of
    ``cfg.model.family`` ("ar", "bd" or "relf") in ``<cfg.workdir>/<family>``; a `TrainResult`."""
    if cfg.model.family == "relf":
        from relf_jax.flow.recipes import train_relf

        return train_relf(cfg, mesh=mesh)
    from relf_jax.train.recipes import train_decoder

    return train_decoder(cfg, mesh=mesh)


def as_model(model: Union[str, LoadedModel]) -> LoadedModel:
    """`model` itself, or the model `load` reads from a path."""
    return load(model) if isinstance(model, str) else model


def sample(model: Union[str, LoadedModel], prompts: Prompts = None, params: Optional[SamplingParams] = None,
           method: Optional[Method] = None, *, num_samples: Optional[int] = None, warmup: bool = False) -> Samples:
    """`generate`, returning `Samples`: texts with token ids, completeness and speed.
    num_samples: unconditional samples when `prompts` is None (default: ``params.n``)."""
    lm = as_model(model)
    method = method if method is not None else Autoregressive()
    family = family_of(method)
    if lm.model_cfg.family != family:
        raise UserError(f"{type(method).__name__} decodes a {family!r} model; this one is {lm.model_cfg.family!r}")
    params = params if params is not None else SamplingParams()
    sc = params.sample_config(lm.cfg.sample)
    if isinstance(prompts, str):
        prompts = [prompts]
    if prompts is not None:
        prompts = [p for p in prompts for _ in range(params.n)]
    n = num_samples or params.n
    with mesh_scope(lm.mesh):  # a model placed on a mesh (`LoadedModel.on_mesh`) samples split over it
        out = _sample(lm, prompts, n, sc, method, warmup)
    if params.stop:
        out.texts = [cut_at_strings(t, params.stop)[0] for t in out.texts]
    return out


def _sample(lm: LoadedModel, prompts, n: int, sc, method: Method, warmup: bool) -> Samples:
    """`sample`'s dispatch to the method's batch recipe."""
    if isinstance(method, Autoregressive):
        from relf_jax.sampling.recipes import sample_ar

        out = sample_ar(lm, prompts, n, sc, warmup=warmup)
    elif isinstance(method, Speculative):
        from relf_jax.speculative.recipes import sample as sample_speculative

        out = sample_speculative(lm, prompts, n, sc, warmup=warmup, method=method)
    elif isinstance(method, Flow):
        from relf_jax.flow.generate import sample_relf

        out = sample_relf(lm, None if prompts is not None else n, prompts=prompts, nfe=method.nfe,
                          sampler=method.sampler, guidance=method.guidance, length=method.length,
                          batch_size=sc.batch_size, seed=sc.seed, warmup=warmup, renoise=method.renoise,
                          prompt_mode=method.prompt_mode)
    else:
        from relf_jax.sampling.recipes import sample_bd

        sc = dataclasses.replace(sc, **{k: v for k, v in (("threshold", method.threshold),
                                                          ("confidence", method.confidence)) if v is not None})
        out = sample_bd(lm, prompts, n, sc, warmup=warmup)
    return out


def generate(model: Union[str, LoadedModel], prompts: Prompts = None, params: Optional[SamplingParams] = None,
             method: Optional[Method] = None) -> list[str]:
    """The replies of `model` (a loaded model or a path for `load`) to `prompts` (one text, a
    list, or None: ``params.n`` unconditional samples), one per prompt (``params.n`` each),
    decoded with `method` (default `Autoregressive()`) and `params` (default: the model's own
    ``sample.*`` settings)."""
    return sample(model, prompts, params, method).texts


def cut_at_strings(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """`text` cut before the first of `stops`, and whether one was found."""
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[:min(cuts)], True) if cuts else (text, False)


def stream(model: Union[str, LoadedModel], prompt: str, params: Optional[SamplingParams] = None,
           method: Optional[Method] = None) -> Iterator[str]:
    """The reply to `prompt` piece by piece (text deltas), decoded autoregressively. With
    ``params.stop`` the reply ends before the first stop string (pieces are held back until no
    stop can start in them)."""
    from relf_jax.sampling.recipes import stream_reply

    lm = as_model(model)
    if method is not None and not isinstance(method, Autoregressive):
        raise UserError(f"stream decodes autoregressively; {type(method).__name__} is for generate "
                        "(or ChatModel, which streams every method)")
    params = params if params is not None else SamplingParams()
    pieces = _on_mesh(lm, stream_reply(lm, prompt, params.sample_config(lm.cfg.sample)))
    if not params.stop:
        yield from pieces
        return
    hold = max(len(s) for s in params.stop) - 1
    text, shown = "", 0
    for piece in pieces:
        text += piece
        cut, found = cut_at_strings(text, params.stop)
        end = len(cut) if found else max(shown, len(text) - hold)
        if end > shown:
            yield text[shown:end]
            shown = end
        if found:
            return
    if len(text) > shown:
        yield text[shown:]


def _on_mesh(lm: LoadedModel, pieces: Iterator[str]) -> Iterator[str]:
    """`pieces`, each one produced under the model's mesh (`mesh_scope`); a generator's body runs
    between the caller's calls, so the scope is entered per step, not around the caller."""
    while True:
        with mesh_scope(lm.mesh):
            piece = next(pieces, None)
        if piece is None:
            return
        yield piece


def evaluate(model: Union[str, LoadedModel], judge: Any = "exact", params: Optional[SamplingParams] = None,
             method: Optional[Method] = None, *, num_samples: Optional[int] = None,
             validation: bool = True) -> dict:
    """The quality report of `model`'s unconditional samples (`num_samples`, default the
    model's ``sample.num_samples``): gen PPL and entropy under `judge` ("exact": the synthetic
    grammar; a path: an AR checkpoint; or a judge object), distinct-n, speed; for AR and
    speculative decoding also tokens per target forward ("tau") and (with `validation`) the
    validation loss (nats/token)."""
    from relf_jax.eval.evaluate import evaluate_samples, make_judge, validation_loss

    lm = as_model(model)
    method = method if method is not None else Autoregressive()
    if isinstance(judge, str):
        judge = make_judge(lm.cfg, judge)
    s = sample(lm, None, params, method, num_samples=num_samples or lm.cfg.sample.num_samples, warmup=True)
    out = evaluate_samples(s, judge)
    if family_of(method) == "ar":
        out["tau"] = s.tau
        if validation:
            out["validation_loss"] = validation_loss(lm)  # on the model's mesh, if it has one
    if isinstance(method, Flow):
        out["nfe"] = method.nfe or lm.cfg.flow.nfe
    out["step"] = lm.step
    return out
