"""`relf-jax bench relf-toy`: does a ReLF network learn to read context? A toy with a known answer.

Composition only. Every row is BOS, one of `words` word ids repeated `repeats` times, EOS, then
pad. A model that reads its neighbours writes the same word at every position. One that does
not writes a different word at each. The exact posterior of this data is known: a softmax over
the candidate rows of the Gaussian path likelihood. With it as the denoiser the samplers must
return valid rows; that is the reference.

Variants, all on fixed Gaussian embeddings (non-degenerate, row norm `embed_norm`):
- ``exact``: the exact posterior (as a residual on the singular logits, bound 1e4); no training;
- ``singular``: the shipped parametrisation, ``logits = s + c tanh(f / c)``, trained with the
  shipped flow loss through the generic train loop (self-conditioning off);
- ``no_singular``: the same network and loss without the singular logits (the ablation);
- ``aux``: the shipped parametrisation plus the auxiliary singular-free head
  (``flow.aux_weight`` = `aux_weight`; sampling uses the main head only);
- ``per_position``: the shipped parametrisation trained with a time per position in a
  `per_position_t` share of rows (``flow.per_position_t``; sampling keeps one t per row);
- ``aux_per_position``: both extensions;
- ``blind_spot``: the blind-spot network (``flow.blind_spot``: the model's layers split into a
  left-to-right and a right-to-left stream, so the residual at a position never sees that
  position) trained as the context classifier p(x_i | Z_{-i}); sampling adds the singular logits;
  self-conditioning off, like the other trained variants;
- ``default``: the shipped default ReLF exactly as ``model=relf`` trains and samples it (today the
  context-reading network with the context loss, self-conditioning and guidance as configured).

Reported per variant and sampler (Euler, stochastic; `nfe` steps): the share of samples that are
a data row (``valid_share``), the distinct rows among the samples over the most there can be,
min(samples, words) (``distinct_share``; a sampler that always writes the same valid row reads
valid 1.0 and distinct 1 / words; ``distinct_rows`` is the count, ``distinct_valid_rows`` that of
the distinct data rows among them), the
entropy of the sampled rows' empirical distribution (``sample_entropy``, nats; the data's is
log(words)), and the CE of the posterior at the word positions at a few times t.
Measured (`benchmarks/relf_toy/cpu_variants.json`, docs/relf.md): at 600 steps the shipped
parametrisation returns no sample that is a data row (its posterior is the positional prior's);
the network without singular logits returns only data rows; the auxiliary head recovers part
of the gap, and per-position times add a little on top of it (not alone); the blind-spot
network with the context loss recovers the most of the variants that keep the singular logits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from relf_jax.config import make_config
from relf_jax.flow.exact import exact_residual
from relf_jax.flow.singular import network_residual
from relf_jax.io import write_json

PAD, EOS, BOS, FIRST_WORD = 0, 1, 2, 3


@dataclasses.dataclass(frozen=True)
class ToySizes:
    preset: str = "cpu"
    steps: int = 600
    batch: int = 16
    words: int = 24
    repeats: int = 6
    length: int = 16
    vocab: int = 64
    embed_dim: int = 32
    embed_norm: float = 3.0
    samples: int = 128
    nfe: int = 64
    probe_times: tuple[float, ...] = (0.2, 0.3, 0.5)
    aux_weight: float = 1.0  # the ``aux`` variant's flow.aux_weight
    per_position_t: float = 0.5  # the ``per_position`` variant's flow.per_position_t
    seed: int = 0


QUICK = ToySizes(preset="tiny", steps=60, samples=64, nfe=32)


def candidate_rows(sz: ToySizes) -> np.ndarray:
    """[words, length + 1] int32: every data row (the loss reads the first `length` tokens)."""
    if FIRST_WORD + sz.words > sz.vocab or sz.repeats + 2 > sz.length:
        raise ValueError("toy sizes: need FIRST_WORD + words <= vocab and repeats + 2 <= length")
    rows = np.full((sz.words, sz.length + 1), PAD, np.int32)
    rows[:, 0] = BOS
    rows[:, 1:1 + sz.repeats] = (FIRST_WORD + np.arange(sz.words))[:, None]
    rows[:, 1 + sz.repeats] = EOS
    return rows


class ToyBatches:
    """Batch i: `batch` rows drawn uniformly from the candidates, a function of i only; the state
    ({"i": i}) lets the train loop checkpoint and resume it like a grain iterator."""

    def __init__(self, rows: np.ndarray, batch: int, seed: int = 0):
        self.rows, self.batch, self.seed, self.i = rows, batch, seed, 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        pick = np.random.default_rng([self.seed, self.i]).integers(0, len(self.rows), self.batch)
        self.i += 1
        tokens = self.rows[pick]
        return {"tokens": tokens, "segment_ids": np.ones_like(tokens)}

    def get_state(self) -> dict:
        return {"i": self.i}

    def set_state(self, state: dict) -> None:
        self.i = int(state["i"])


def valid_share(samples: np.ndarray, rows: np.ndarray) -> float:
    """Share of sampled rows [n, L] equal to a data row."""
    data = rows[:, :samples.shape[1]]
    return float(np.mean([(data == s).all(1).any() for s in samples]))


def distinct_rows(samples: np.ndarray) -> int:
    """How many distinct rows the sampled rows [n, L] hold."""
    return len({tuple(r) for r in np.asarray(samples).tolist()})


def distinct_share(samples: np.ndarray, data_rows: int | None = None) -> float:
    """Distinct sampled rows over the most a faithful sampler could write, min(n, data_rows)
    (`data_rows` None: n): 1 / min(n, data_rows) for a collapsed sampler, ~1 for one that covers
    the data. Read it next to the valid share (distinct invalid rows count too)."""
    n = len(samples) if data_rows is None else min(len(samples), data_rows)
    return min(1.0, distinct_rows(samples) / max(n, 1))


def sample_entropy(samples: np.ndarray) -> float:
    """Entropy (nats) of the empirical distribution of the sampled rows [n, L]: 0 for a collapsed
    sampler, log(words) for one that draws the toy's rows uniformly (and at most log n)."""
    _, counts = np.unique(np.asarray(samples), axis=0, return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log(p)).sum())


def word_ce(residual, table, rows, *, t: float, c, use_singular: bool, n: int = 64, seed: int = 7) -> float:
    """Mean CE (nats) of the posterior at the word positions of `n` data rows noised to time t."""
    from relf_jax.flow.singular import interpolate, posterior_logits

    pick = np.random.default_rng(seed).integers(0, len(rows), n)
    x = jnp.asarray(rows[pick, :-1])

    @jax.jit  # one program, not one per operation
    def mean_ce(x, key):
        x1 = table[x]
        tt = jnp.full((n,), t, jnp.float32)
        z = interpolate(x1, jax.random.normal(key, x1.shape), tt)
        f = residual(z, tt, jnp.zeros_like(z))
        lp = jax.nn.log_softmax(posterior_logits(z, tt, table, f, c=c, use_singular=use_singular), -1)
        ce = -jnp.take_along_axis(lp, x[..., None], -1)[..., 0]
        words = x >= FIRST_WORD
        return jnp.sum(jnp.where(words, ce, 0.0)) / jnp.sum(words)

    return float(mean_ce(x, jax.random.key(seed)))


def _train(sz: ToySizes, rows, table, *, use_singular: bool = True, aux_weight: float = 0.0,
           per_position_t: float = 0.0, blind_spot: bool = False, default: bool = False, workdir: str,
           overrides: Sequence[str]):
    """Train one variant; ``default``: the settings ``model=relf`` trains with (`overrides` apply),
    else the paper's parametrisation with the named changes (self-conditioning off)."""
    from relf_jax.flow.losses import FlowLossSettings, make_flow_loss
    from relf_jax.flow.recipes import CleanStart, clean_start_steps, flow_loss_settings
    from relf_jax.train.loop import train

    cfg = make_config(sz.preset, ["model=relf", f"train.steps={sz.steps}", f"train.batch_size={sz.batch}",
                                  "train.progress=false", f"train.checkpoint_every={sz.steps}",
                                  f"train.eval_every={sz.steps}", f"train.seed={sz.seed}", *overrides],
                      workdir=workdir)
    if default:
        settings = flow_loss_settings(cfg)
        blind_spot = cfg.flow.blind_spot
    else:
        settings = FlowLossSettings(residual_bound=cfg.flow.residual_bound, use_singular=use_singular,
                                    self_condition_prob=0.0, aux_weight=aux_weight, per_position_t=per_position_t,
                                    context_loss=blind_spot)
    model_cfg = dataclasses.replace(cfg.model, vocab_size=sz.vocab, max_seq_len=sz.length,
                                    flow_embed_dim=sz.embed_dim, flow_aux_head=settings.aux_weight > 0,
                                    flow_blind_spot=blind_spot, flow_bag_input=default and cfg.model.flow_bag_input)
    data = ToyBatches(rows, sz.batch, sz.seed)
    if default and clean_start_steps(cfg) > 0:  # the default recipe's clean start, as train_relf has it
        data = CleanStart(data, clean_start_steps(cfg), cfg.flow.clean_t)
    res = train(cfg, model_cfg, make_flow_loss(settings), data, workdir=workdir, tensorboard=False,
                frozen={"embeddings": table})
    return res, cfg


VARIANTS = ("exact", "default", "singular", "no_singular", "aux", "per_position", "aux_per_position", "blind_spot")
# the trained variants' loss settings beyond the shipped ones (names of ToySizes fields for the values)
_TRAINED = {"singular": {}, "no_singular": {"use_singular": False}, "aux": {"aux_weight": "aux_weight"},
            "per_position": {"per_position_t": "per_position_t"},
            "aux_per_position": {"aux_weight": "aux_weight", "per_position_t": "per_position_t"},
            "blind_spot": {"blind_spot": True}, "default": {"default": True}}


def bench_relf_toy(out: str, quick: bool = False, workdir: str | None = None, overrides: Sequence[str] = (),
                   sizes: ToySizes | None = None, variants: Sequence[str] = VARIANTS) -> dict:
    from flax import nnx

    from relf_jax.flow import embeddings as emb
    from relf_jax.flow.samplers import FlowSamplerSettings
    from relf_jax.flow.samplers import sample as flow_sample

    sz = sizes or (QUICK if quick else ToySizes())
    root = os.path.abspath(workdir or os.path.join("runs", "bench_relf_toy" + ("_quick" if quick else "")))
    rows = candidate_rows(sz)
    table = jnp.asarray(emb.gaussian_embeddings(sz.vocab, sz.embed_dim, seed=sz.seed, norm=sz.embed_norm))
    # the sizes and overrides name each variant's directory: a rerun with other settings trains
    # anew instead of resuming (and reporting) a model trained on another toy; so do the default
    # recipe's clean start and bag input (a model trained before they were the default is not reused)
    default = make_config(sz.preset, ["model=relf", *overrides])
    key = [dataclasses.asdict(sz), list(overrides), [default.flow.clean_start, default.flow.clean_t],
           default.model.flow_bag_input]
    tag = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:8]
    t0 = time.perf_counter()
    result = {"sizes": dataclasses.asdict(sz), "rows": []}
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown variants {sorted(unknown)}; valid: {', '.join(VARIANTS)}")
    for variant in variants:
        use_singular = variant != "no_singular"
        sampling = {}  # sampler settings beyond the paper's (the default variant's own config)
        if variant == "exact":
            # bound 1e4: in effect none, while the final decode at t = 1 keeps the singular logits alone
            residual, c = exact_residual(rows, table), 1e4
        else:
            extra = {k: (getattr(sz, v) if isinstance(v, str) else v) for k, v in _TRAINED[variant].items()}
            res, cfg = _train(sz, rows, table, workdir=os.path.join(root, f"{variant}_{tag}"), overrides=overrides,
                              **extra)
            c = cfg.flow.residual_bound
            if variant == "default":
                f = cfg.flow
                sampling = {"guidance": f.guidance, "grid": f.grid, "gamma": f.gamma, "renoise": f.renoise,
                            "use_singular": f.use_singular}
                use_singular = f.use_singular

                def residual(z, t, sc, *unused, g=res.graphdef, p=res.params):
                    return network_residual(nnx.merge(g, p), z, sc, t, embeddings=table)  # sc as trained
            else:
                def residual(z, t, sc, *unused, g=res.graphdef, p=res.params):
                    # trained without self-conditioning: it always saw sc = 0, so it gets 0 here too
                    return network_residual(nnx.merge(g, p), z, jnp.zeros_like(sc), t, embeddings=table)
        ce = {f"{t:g}": word_ce(residual, table, rows, t=t, c=c, use_singular=use_singular)
              for t in sz.probe_times}
        for sampler in ("euler", "stochastic"):
            st = FlowSamplerSettings(nfe=sz.nfe, sampler=sampler, c=c, **{"use_singular": use_singular, **sampling})
            draw = jax.jit(lambda k, st=st, fn=residual: flow_sample(k, fn, table, st, batch=sz.samples,
                                                                      length=sz.length)[0])
            samples = np.asarray(draw(jax.random.key(sz.seed + 1)))
            row = {"variant": variant, "sampler": sampler, "nfe": sz.nfe,
                   "valid_share": valid_share(samples, rows), "distinct_share": distinct_share(samples, sz.words),
                   "distinct_rows": distinct_rows(samples),
                   "distinct_valid_rows": distinct_rows([r for r in samples if valid_share(r[None], rows) == 1.0]),
                   "sample_entropy": sample_entropy(samples), "data_entropy": float(np.log(sz.words)),
                   "word_ce": ce}
            result["rows"].append(row)
            print(f"[bench relf-toy] {variant:>16} {sampler:>10}: valid rows {row['valid_share']:.3f}  "
                  f"distinct {row['distinct_share']:.3f}  entropy {row['sample_entropy']:.2f} / "
                  f"{row['data_entropy']:.2f}  word CE at t={list(ce)}: {[round(v, 2) for v in ce.values()]}",
                  flush=True)
            write_json(out, {**result, "complete": False})
    result["wall_s"] = time.perf_counter() - t0
    write_json(out, {**result, "complete": True})
    return result

