"""Judging a model's samples: the judges of a run (exact grammar or another model), the quality
report of a set of samples (gen PPL, entropy, distinct-n, speed), the held-out data scored the
same way, and the validation loss."""

from __future__ import annotations

import itertools

import jax
import numpy as np

from relf_jax.config import Config
from relf_jax.data import sources
from relf_jax.data.prepare import prepare_data
from relf_jax.errors import UserError
from relf_jax.eval.judges import ExactJudge, ModelJudge
from relf_jax.eval.metrics import quality


def exact_judge(cfg: Config) -> ExactJudge:
    """The synthetic grammar that generated `cfg`'s data, as an exact judge."""
    from relf_jax.data.synthetic_chat import GrammarConfig, SyntheticChat

    if cfg.data.source != "synthetic_chat":
        raise UserError("the exact judge needs data.source=synthetic_chat; use a model judge instead")
    return ExactJudge(SyntheticChat(GrammarConfig(seed=cfg.data.data_seed)))


def model_judge(workdir: str) -> ModelJudge:
    """Any relf_jax AR checkpoint as a judge."""
    from relf_jax.loading import load_model

    lm = load_model(workdir, "ar")
    return ModelJudge(lm.graphdef, lm.params, lm.tokenizer, lm.model_cfg.max_seq_len)


def make_judge(cfg: Config, judge: str = "exact"):
    """The judge a name says: "exact" (`exact_judge` of `cfg`) or an AR checkpoint folder (`model_judge`)."""
    return exact_judge(cfg) if judge == "exact" else model_judge(judge)


def evaluate_samples(samples, judge) -> dict:
    """Quality pair (gen PPL, entropy) plus distinct-n and speed of `samples`
    (`relf_jax.sampling.batch.Samples`) under `judge`."""
    q = quality(judge, samples.texts, samples.complete)
    return {**q.as_dict(), "tokens_per_s": samples.tokens_per_s, "judge": judge.name}


def data_reference(cfg: Config, tok, judge, n: int, max_tokens: int) -> dict:
    """The held-out data scored like samples: same tokenizer round-trip, same length cap."""
    builder = prepare_data(cfg)
    texts = list(itertools.islice(sources.iter_texts(builder, "validation"), n))
    cut, complete = [], []
    for text in texts:
        ids = tok.encode(text)
        fits = len(ids) + 1 <= max_tokens  # +1: the EOS a sample would emit
        cut.append(tok.decode(ids if fits else ids[:max_tokens]))
        complete.append(fits)
    return quality(judge, cut, complete).as_dict()


def validation_loss(lm, max_batches: int = 8) -> float:
    """Mean next-token loss on the validation split (nats/token)."""
    from relf_jax.data import pipeline
    from relf_jax.runtime.sharding import make_mesh, mesh_scope, put_global, to_host
    from relf_jax.train.loop import make_eval_step, plan_state
    from relf_jax.train.objectives import next_token_loss
    from relf_jax.train.optimizers import make_optimizer

    builder = prepare_data(lm.cfg)
    # every process reads the whole split: the same batches, and the same loss, on any number of hosts
    batches = pipeline.eval_batches(builder, "validation", lm.tokenizer, seq_len=lm.cfg.data.seq_len,
                                    batch_size=lm.cfg.train.batch_size, max_batches=max_batches,
                                    process_index=0, process_count=1)
    mesh = lm.mesh or make_mesh(1, 1, 1, devices=jax.local_devices()[:1])
    plan = plan_state(lm.model_cfg, make_optimizer(lm.cfg.train), mesh)
    step = make_eval_step(plan, next_token_loss)
    with mesh_scope(lm.mesh):
        return float(np.mean([float(to_host(step(lm.params, put_global(b, mesh)))) for b in batches]))
