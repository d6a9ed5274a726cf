"""End-to-end recipes shared by the `relf-jax` CLI and Colab: data -> tokenizer -> train ->
load -> sample -> evaluate. Each is one function call::

    from relf_jax import workflows
    from relf_jax.config import make_config
    cfg = make_config("tiny", workdir="runs/tiny")
    result = workflows.train_lm(cfg)
    lm = workflows.load_model("runs/tiny")
    samples = workflows.sample(lm, n=8)
    print(workflows.evaluate_samples(lm, samples, workflows.exact_judge(cfg)))
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from relf_jax.checkpoint import EMBEDDINGS_FILE, Checkpointer, LoadedModel, tokenizer_bytes_from_meta
from relf_jax.config import Config, ModelConfig, SampleConfig, SpeculativeConfig, validate_sampling
from relf_jax.data import pipeline, sources
from relf_jax.data import tokenizer as tokenizer_lib
from relf_jax.data.tokenizer import Tokenizer, tokenizer_from_bytes, train_tokenizer
from relf_jax.errors import UserError
from relf_jax.eval.judges import ExactJudge, ModelJudge
from relf_jax.eval.metrics import quality
from relf_jax.sampling import autoregressive as ar
from relf_jax.train.loop import TrainResult, load_params, train
from relf_jax.train.objectives import masked_diffusion_loss, next_token_loss

TOKENIZER_TRAIN_DOCS = 20_000


def data_dir(cfg: Config) -> str:
    return os.path.join(os.path.abspath(cfg.workdir), "data")


def prepare_data(cfg: Config, root: Optional[str] = None):
    """Prepare the configured source (cached under ``<root or workdir>/data``); return the TFDS builder."""
    d = cfg.data
    if root is not None:
        cfg = dataclasses.replace(cfg, workdir=root)
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


def train_lm(cfg: Config, *, mesh=None) -> TrainResult:
    """Prepare data and tokenizer, then train (or resume) the model of `cfg` in its workdir.

    ``cfg.model.family`` picks the recipe: "ar" (next-token loss), "relf" (`train_relf`) or "bd"
    (block masked diffusion on whole-conversation rows).
    """
    if cfg.model.family == "relf":
        return train_relf(cfg, mesh=mesh)
    if cfg.model.family not in ("ar", "bd"):
        raise UserError(f"model.family={cfg.model.family!r} is not a language model to train here; "
                        "the dws predictor trains with `relf-jax bench dws`")
    builder = prepare_data(cfg)
    tok = prepare_tokenizer(cfg, builder)
    model_cfg = dataclasses.replace(cfg.model, vocab_size=tok.vocab_size)
    cfg = dataclasses.replace(cfg, model=model_cfg)
    d, t = cfg.data, cfg.train
    rows = row_mode(cfg)
    # block diffusion on packed rows: each document filled up to whole blocks
    align = model_cfg.block_size if model_cfg.family == "bd" and rows == "segments" else 1
    data = pipeline.make_iterator(builder, "train", tok, seq_len=d.seq_len, batch_size=t.batch_size,
                                  seed=t.seed, rows=rows, align=align)
    evals = pipeline.eval_batches(builder, "validation", tok, seq_len=d.seq_len, batch_size=t.batch_size,
                                  max_batches=t.eval_batches, rows=rows, align=align)
    loss = masked_diffusion_loss if model_cfg.family == "bd" else next_token_loss
    return train(cfg, model_cfg, loss, data, eval_data=evals,
                 workdir=os.path.join(cfg.workdir, model_cfg.family), mesh=mesh,
                 tokenizer_bytes=tok.to_bytes())


EMBEDDING_DOCS = 20_000


def row_mode(cfg: Config) -> str:
    """How training rows are cut (``data.rows``): "auto" is "segments" (several whole
    conversations per row, segment-aware attention, no pad in the loss: the same text tokens per
    step as AR's packed rows, less the row tails) for ReLF and block diffusion (there each
    conversation is filled up with pad to whole blocks, so blocks align with positions), else
    "packed"."""
    if cfg.data.rows != "auto":
        return cfg.data.rows
    return "segments" if cfg.model.family in ("relf", "bd") else "packed"


LENGTHS_FILE = "flow_lengths.npy"


def flow_segment_lengths(cfg: Config, builder, tok: Tokenizer, model_dir: str) -> np.ndarray:
    """counts [seq_len + 1] int64 of the segment lengths a ReLF model trained on
    ``data.rows="segments"`` saw (documents ``[bos, *ids, eos]``, long ones cut into rows of
    ``seq_len`` as `pipeline.SegmentRows` does), from up to 20k training documents: the length
    prior its sampler draws one segment per row from. Loaded from `model_dir`, or built and saved."""
    path = os.path.join(model_dir, LENGTHS_FILE)
    if os.path.exists(path):
        return np.load(path)
    cap = cfg.data.seq_len
    counts = np.zeros(cap + 1, np.int64)
    for text in itertools.islice(sources.iter_texts(builder, "train"), EMBEDDING_DOCS):
        n = len(tok.encode(text)) + 2
        counts[cap] += n // cap
        counts[n % cap] += n % cap > 0
    if jax.process_index() == 0:
        os.makedirs(model_dir, exist_ok=True)
        np.save(path, counts)
    return counts


def flow_lengths(lm: LoadedModel) -> Optional[np.ndarray]:
    """The segment-length counts of a ReLF model trained on segment rows (`flow_segment_lengths`),
    or None for a model trained on whole rows (it samples one segment over the full length)."""
    if "flow.lengths" in lm.extras:
        return np.asarray(lm.extras["flow.lengths"])
    path = os.path.join(lm.model_dir, LENGTHS_FILE) if lm.model_dir else ""
    return np.load(path) if path and os.path.exists(path) else None


def draw_segment_lengths(counts: np.ndarray, rng: np.random.Generator, n: int,
                         min_len: Sequence[int] | int = 1) -> np.ndarray:
    """`n` segment lengths [n] int32 drawn from `counts` (index = length), each at least its
    ``min_len`` (e.g. a prompt's length + 1; a minimum no training segment reached gets the
    longest length, ``len(counts) - 1``)."""
    lengths = np.arange(len(counts))
    out = np.empty(n, np.int32)
    lows = np.broadcast_to(np.asarray(min_len, np.int64), (n,))
    for i, low in enumerate(lows):
        w = np.where(lengths >= max(int(low), 1), counts, 0).astype(np.float64)
        out[i] = rng.choice(lengths, p=w / w.sum()) if w.sum() > 0 else len(counts) - 1
    return out


def segment_rows(lengths: np.ndarray, length: int) -> np.ndarray:
    """segment ids [B, length] int32: 1 on the first lengths[b] positions of row b, 0 (pad) after."""
    return (np.arange(length)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32)


def flow_embeddings(cfg: Config, builder, tok: Tokenizer, model_dir: str) -> np.ndarray:
    """The fixed ReLF token embeddings [V, d]: loaded from `model_dir`, or built and saved there.

    Hellinger-SVD uses next-token co-occurrences of (up to 20k) training documents.
    """
    from relf_jax.flow import embeddings as emb

    path = os.path.join(model_dir, EMBEDDINGS_FILE)
    if os.path.exists(path):
        return np.load(path)
    v, d = tok.vocab_size, cfg.model.flow_embed_dim
    norm = cfg.flow.embed_norm or None
    if cfg.flow.embeddings == "hellinger":
        # document rows end in pad ids: count the eos -> pad and pad -> pad transitions too
        tail = [tok.pad_id, tok.pad_id] if row_mode(cfg) == "documents" else []
        rows = [[tok.bos_id] + tok.encode(t) + [tok.eos_id] + tail
                for t in itertools.islice(sources.iter_texts(builder, "train"), EMBEDDING_DOCS)]
        counts = emb.cooccurrence_sparse(rows, v, cfg.flow.window)
        table = emb.hellinger_svd_embeddings(counts, d, smoothing=cfg.flow.smoothing, norm=norm,
                                             center=cfg.flow.embed_center, whiten=cfg.flow.embed_whiten)
    elif cfg.flow.embeddings == "gaussian":
        table = emb.gaussian_embeddings(v, d, seed=cfg.train.seed, norm=norm)
    else:
        table = emb.one_hot_projection_embeddings(v, d, seed=cfg.train.seed, norm=norm)
    if jax.process_index() == 0:
        os.makedirs(model_dir, exist_ok=True)
        np.save(path, table)
    return table


def flow_loss_settings(cfg: Config, pad_id: int = -1):
    from relf_jax.flow.losses import FlowLossSettings

    f = cfg.flow
    return FlowLossSettings(residual_bound=f.residual_bound, use_singular=f.use_singular, t_eps=f.t_eps,
                            t_distribution=f.t_distribution, self_condition_prob=f.self_condition_prob,
                            loss=f.loss, prompt_prob=f.prompt_prob, pad_id=pad_id, aux_weight=f.aux_weight,
                            per_position_t=f.per_position_t, context_loss=f.blind_spot)


def train_relf(cfg: Config, *, mesh=None) -> TrainResult:
    """Train (or resume) a ReLF flow model: fixed embeddings + the CE flow loss, same train loop."""
    from relf_jax.flow.losses import make_flow_loss

    builder = prepare_data(cfg)
    tok = prepare_tokenizer(cfg, builder)
    model_cfg = dataclasses.replace(cfg.model, vocab_size=tok.vocab_size,
                                    flow_prompt_input=cfg.model.flow_prompt_input or cfg.flow.prompt_prob > 0,
                                    flow_aux_head=cfg.model.flow_aux_head or cfg.flow.aux_weight > 0,
                                    flow_blind_spot=cfg.flow.blind_spot)
    cfg = dataclasses.replace(cfg, model=model_cfg)
    model_dir = os.path.join(cfg.workdir, "relf")
    if os.path.isdir(os.path.join(model_dir, "checkpoints")):
        try:
            saved = latest_meta(model_dir)["model"]
        except UserError:
            saved = None  # nothing readable to resume: no conflict
        for field, on, off, what in (("flow_prompt_input", "flow.prompt_prob > 0", "flow.prompt_prob = 0",
                                      "clean prompts"),
                                     ("flow_aux_head", "flow.aux_weight > 0", "flow.aux_weight = 0", "an auxiliary head"),
                                     ("flow_blind_spot", "flow.blind_spot=true", "flow.blind_spot=false",
                                      "a blind-spot network")):
            before = getattr(model_cfg, field) if saved is None else bool(saved.get(field, False))
            if before != getattr(model_cfg, field):
                raise UserError(f"the ReLF checkpoint in {model_dir} was trained "
                                f"{'with' if before else 'without'} {what}; resume it with "
                                f"{on if before else off}, or train in another workdir")
    table = flow_embeddings(cfg, builder, tok, model_dir)
    d, t = cfg.data, cfg.train
    rows = row_mode(cfg)
    if rows == "segments":
        flow_segment_lengths(cfg, builder, tok, model_dir)
    data = pipeline.make_iterator(builder, "train", tok, seq_len=d.seq_len, batch_size=t.batch_size, seed=t.seed,
                                  rows=rows)
    evals = pipeline.eval_batches(builder, "validation", tok, seq_len=d.seq_len, batch_size=t.batch_size,
                                  max_batches=t.eval_batches, rows=rows)
    return train(cfg, model_cfg, make_flow_loss(flow_loss_settings(cfg, tok.pad_id)), data, eval_data=evals,
                 workdir=model_dir, mesh=mesh, tokenizer_bytes=tok.to_bytes(),
                 frozen={"embeddings": jax.numpy.asarray(table)}, extra_meta={"embeddings": EMBEDDINGS_FILE})


def segment_residual(model_fn, segment_ids, table=None):
    """The samplers' ``residual_fn(z, t, sc[, known])`` of a network ``model_fn(z, sc, t, known,
    segment_ids, table)`` on rows with `segment_ids` [B, L] (None: one segment); guidance's doubled
    batch gets them twice. `table`: the fixed embeddings (read by a model with
    ``flow_evidence_input``)."""
    def residual(z, t, sc, known=None):
        seg = segment_ids
        if seg is not None and seg.shape[0] != z.shape[0]:
            seg = jnp.concatenate([seg] * (z.shape[0] // seg.shape[0]))
        return model_fn(z, sc, t, known, seg, table)
    return residual


@functools.partial(jax.jit, static_argnames=("graphdef", "settings", "batch", "length"))
def _relf_tokens(graphdef, params, key, table, prompt_tokens=None, prompt_mask=None, segment_ids=None, *,
                 settings, batch: int, length: int):
    """Token ids [batch, length] from the ReLF sampler, conditioned on the positions of
    `prompt_mask` [batch, length] holding `prompt_tokens` when given, on rows of `segment_ids`
    (one segment per row, then pad; None: the whole row); compiled once per settings and shape."""
    from flax import nnx

    from relf_jax.flow.samplers import sample as flow_sample

    residual = segment_residual(lambda *a: nnx.merge(graphdef, params)(*a), segment_ids, table)
    known = None if prompt_mask is None else (prompt_mask, jnp.take(table, prompt_tokens, axis=0))
    out = flow_sample(key, residual, table, settings, batch=batch, length=length, known=known)[0]
    return out if prompt_mask is None else jnp.where(prompt_mask, prompt_tokens, out)


def flow_table(lm: LoadedModel) -> np.ndarray:
    """A loaded ReLF model's fixed token embeddings (from the file, or from `lm.extras`)."""
    if "flow.embeddings" in lm.extras:
        return np.asarray(lm.extras["flow.embeddings"])
    return np.load(os.path.join(lm.model_dir, EMBEDDINGS_FILE))


def flow_prompt_mode(lm: LoadedModel) -> str:
    """How a ReLF model is conditioned on a prompt: "clean" when it was trained with clean,
    flagged prompts (``flow.prompt_prob`` > 0), else "renoise" (see `relf_jax.flow.samplers`)."""
    return "clean" if lm.model_cfg.flow_prompt_input else "renoise"


def sample_relf(lm: "LoadedModel", n: Optional[int] = None, *, prompts: Optional[Sequence[str]] = None,
                nfe: Optional[int] = None, sampler: Optional[str] = None,
                guidance: Optional[float] = None, length: Optional[int] = None, batch_size: Optional[int] = None,
                seed: int = 0, warmup: bool = True, renoise: Optional[str] = None,
                prompt_mode: Optional[str] = None) -> "Samples":
    """Whole sequences from a ReLF model: `nfe` network calls each, all positions in parallel.

    Without `prompts`: `n` unconditional rows. With `prompts`: one row per prompt, the flow
    conditioned on the prompt's positions (`prompt_mode`: "clean" or "renoise", default
    `flow_prompt_mode(lm)`), and the sample is the reply: what follows the prompt up to the end
    of the turn (EOS or the next ``<user>``, `complete` when one is reached).
    Sampler settings default to the model's ``cfg.flow``; length to ``data.seq_len``. A model
    trained on segment rows (`flow_lengths`) writes one segment per row, of a length drawn from
    its training segments' lengths (with a prompt: longer than the prompt), and pad after it.
    """
    from relf_jax.data.tokenizer import turn_stop_ids
    from relf_jax.flow.samplers import FlowSamplerSettings

    f = lm.cfg.flow
    mode = prompt_mode or flow_prompt_mode(lm)
    if mode == "clean" and not lm.model_cfg.flow_prompt_input:
        raise UserError("prompt_mode='clean' needs a ReLF model trained with flow.prompt_prob > 0")
    settings = FlowSamplerSettings(nfe=nfe or f.nfe, grid=f.grid, sampler=sampler or f.sampler,
                                   c=f.residual_bound, guidance=f.guidance if guidance is None else guidance,
                                   use_singular=f.use_singular, t_eps=f.t_eps, gamma=f.gamma,
                                   renoise=renoise or f.renoise, prompt=mode)
    table = jax.numpy.asarray(flow_table(lm))
    length = length or lm.cfg.data.seq_len
    bs = batch_size or lm.cfg.sample.batch_size
    tok = lm.tokenizer
    ids = None
    if prompts is not None:
        ids = [encode_prompt(tok, p) for p in prompts]
        if not ids:
            raise UserError("no prompts to sample from")
        longest = max(len(x) for x in ids)
        if longest >= length:
            raise UserError(f"a prompt of {longest} tokens leaves no room in a ReLF row of {length}")
        n = len(ids)
    elif not n:
        raise UserError("sample_relf needs n > 0 or prompts")

    counts = flow_lengths(lm)
    if counts is not None and len(counts) - 1 < length:  # room beyond the training rows: pad up
        counts = np.pad(counts, (0, length + 1 - len(counts)))
    counts = None if counts is None else counts[:length + 1]
    len_rng = np.random.default_rng([seed, 0x5E6])

    def run(params, key, table, start, seg):
        if ids is None:
            return _relf_tokens(lm.graphdef, params, key, table, segment_ids=seg, settings=settings, batch=bs,
                                length=length)
        chunk = ids[start:start + bs]
        chunk = chunk + [chunk[0]] * (bs - len(chunk))
        toks = np.full((bs, length), tok.pad_id, np.int32)
        mask = np.zeros((bs, length), bool)
        for i, row in enumerate(chunk):
            toks[i, :len(row)], mask[i, :len(row)] = row, True
        return _relf_tokens(lm.graphdef, params, key, table, jnp.asarray(toks), jnp.asarray(mask), seg,
                            settings=settings, batch=bs, length=length)

    key = jax.random.key(seed)
    rows, seconds = [], 0.0
    for start in range(0, n, bs):
        key, sub = jax.random.split(key)
        seg = None
        if counts is not None:
            low = 1 if ids is None else [len(x) + 1 for x in (ids[start:start + bs] + [ids[start]] * bs)[:bs]]
            seg = jnp.asarray(segment_rows(draw_segment_lengths(counts, len_rng, bs, low), length))
        if warmup and start == 0:
            jax.block_until_ready(run(lm.params, sub, table, start, seg))
        t0 = time.perf_counter()
        out = np.asarray(jax.block_until_ready(run(lm.params, sub, table, start, seg)))
        seconds += time.perf_counter() - t0
        if seg is not None:
            out = np.where(np.asarray(seg) != 0, out, tok.pad_id)
        rows.extend(out[: min(bs, n - start)])
    if ids is None:
        return samples_from_rows(tok, rows, seconds=seconds, target_forwards=settings.nfe * len(rows))
    stops = set(turn_stop_ids(tok))
    texts, token_ids, complete, total = [], [], [], 0
    for row, prompt in zip(rows, ids):
        body, done = [], False
        for t in row[len(prompt):].tolist():
            if t in stops:
                done = True
                break
            if t not in (tok.pad_id, tok.bos_id):
                body.append(t)
        total += len(body) + int(done)
        token_ids.append(body)
        complete.append(done)
        texts.append(tok.decode(body))
    return Samples(texts=texts, token_ids=token_ids, complete=complete, seconds=seconds, tokens=total,
                   target_forwards=settings.nfe * len(rows))


def samples_from_rows(tok: Tokenizer, rows, *, seconds: float = 0.0, target_forwards: int = 0) -> "Samples":
    """Whole generated rows (token ids from position 0, as ReLF writes them) as `Samples`: a
    leading BOS dropped, cut at the first EOS (complete) and pad / BOS ids removed."""
    texts, token_ids, complete, total = [], [], [], 0
    for row in rows:
        ids = [int(i) for i in row]
        if ids and ids[0] == tok.bos_id:
            ids = ids[1:]
        done = tok.eos_id in ids
        body = ids[: ids.index(tok.eos_id)] if done else ids
        body = [i for i in body if i not in (tok.pad_id, tok.bos_id)]
        total += len(body) + int(done)
        token_ids.append(body)
        complete.append(done)
        texts.append(tok.decode(body))
    return Samples(texts=texts, token_ids=token_ids, complete=complete, seconds=seconds, tokens=total,
                   target_forwards=target_forwards)


def reflow(workdir: str, rounds: int = 2, *, num_pairs: int = 512, rollout_nfe: int = 64,
           steps: Optional[int] = None, data_weight: Optional[float] = None, pair_weight: float = 1.0,
           name: str = "relf_reflow", mesh=None) -> list[dict]:
    """Regularised reflow of the ReLF model in ``<workdir>/relf``: `rounds` rounds, each trained
    (resumably) in ``<workdir>/<name><r>`` from the previous round's parameters.

    ``data_weight`` (lambda) defaults to `relf_jax.flow.reflow.DATA_WEIGHT`.
    Returns and writes (``<workdir>/<name minus "relf_">.json``, ``reflow.json`` by default) the
    straightness of each round's coupling before and after training on it. ``pair_weight=0,
    data_weight=1, name="relf_nopairs"`` is the no-pairs control: the same rounds, schedule and
    batches with the data loss only (`make_reflow_loss`). A round folder trained with other
    settings (lambda, pair weight, pairs, rollout NFE, steps) is refused, not resumed or reused.
    """
    import shutil

    from relf_jax.flow.reflow import (DATA_WEIGHT, PairBatches, make_reflow_loss, measure_straightness,
                                      rollout_pairs)

    data_weight = DATA_WEIGHT if data_weight is None else data_weight

    results = []
    source = os.path.join(workdir, "relf")
    report = os.path.join(workdir, f"{name.removeprefix('relf_')}.json")
    done = {}
    if os.path.exists(report):
        with open(report) as f:
            done = {d["round"]: d for d in json.load(f)}
    losses, step_cache = {}, {}  # rounds with the same settings share one compiled train step
    for r in range(1, rounds + 1):
        lm = load_model(source, "relf")
        cfg = lm.cfg
        target_dir = os.path.join(workdir, f"{name}{r}")
        spec = {"data_weight": float(data_weight), "pair_weight": float(pair_weight), "num_pairs": int(num_pairs),
                "rollout_nfe": int(rollout_nfe), "steps": int(steps or cfg.train.steps)}
        _check_round_settings(target_dir, done.get(r), spec, name)
        if r in done and _finished(target_dir, spec["steps"]):
            results.append(done[r])  # a finished round (an earlier run): nothing to redo
            source = target_dir
            continue
        settings = flow_loss_settings(cfg, lm.tokenizer.pad_id)
        table = jax.numpy.asarray(np.load(os.path.join(lm.model_dir, EMBEDDINGS_FILE)))
        os.makedirs(target_dir, exist_ok=True)
        shutil.copy(os.path.join(lm.model_dir, EMBEDDINGS_FILE), os.path.join(target_dir, EMBEDDINGS_FILE))
        counts, seg = flow_lengths(lm), None
        if counts is not None:  # segment rows: one segment per pair row, its length from the model's prior
            np.save(os.path.join(target_dir, LENGTHS_FILE), counts)
            lens = draw_segment_lengths(counts[:cfg.data.seq_len + 1], np.random.default_rng(1000 + r), num_pairs)
            seg = segment_rows(lens, cfg.data.seq_len)
        z0, toks = rollout_pairs(lm.graphdef, lm.params, table, jax.random.key(1000 + r), n=num_pairs,
                                 length=cfg.data.seq_len, settings=settings, nfe=rollout_nfe,
                                 batch=cfg.sample.batch_size, segment_ids=seg)
        before = measure_straightness(lm.graphdef, lm.params, table, z0, toks, settings=settings, segment_ids=seg)
        builder = prepare_data(cfg, root=workdir)  # the run's data (a round's own cfg.workdir is its model dir)
        train_cfg = dataclasses.replace(cfg.train, steps=steps or cfg.train.steps)
        rcfg = dataclasses.replace(cfg, train=train_cfg, workdir=target_dir)
        rows = row_mode(cfg) if counts is not None or cfg.data.rows != "auto" else "documents"  # older models
        data = pipeline.make_iterator(builder, "train", lm.tokenizer, seq_len=cfg.data.seq_len,
                                      batch_size=train_cfg.batch_size, seed=train_cfg.seed + r, rows=rows)
        loss = losses.setdefault(settings, make_reflow_loss(settings, data_weight, pair_weight))
        res = train(rcfg, lm.model_cfg, loss,
                    PairBatches(z0, toks, data, batch_size=train_cfg.batch_size, seed=r, segment_ids=seg),
                    workdir=target_dir,
                    mesh=mesh, tokenizer_bytes=lm.tokenizer.to_bytes(), frozen={"embeddings": table},
                    init_params=lm.params,
                    extra_meta={"embeddings": EMBEDDINGS_FILE, "reflow_round": r, "reflow": spec},
                    step_cache=step_cache)
        after = measure_straightness(res.graphdef, res.params, table, z0, toks, settings=settings, segment_ids=seg)
        results.append({"round": r, "straightness_before": before, "straightness_after": after,
                        "model_dir": os.path.abspath(target_dir), "settings": spec})
        source = target_dir
        write_json(report, [*results, *(done[k] for k in sorted(done) if k > r)])
    return results


def _check_round_settings(target_dir: str, record: Optional[dict], spec: dict, name: str) -> None:
    """Refuse to resume or reuse a reflow round that was trained with other settings.

    A round's checkpoints carry its settings (meta ``"reflow"``); older rounds only in the
    round's record of the report. A round whose settings cannot be read is refused as well.
    """
    try:
        meta = latest_meta(target_dir)
    except UserError:
        return  # nothing trained there yet
    found = meta.get("reflow") or (record or {}).get("settings")
    if found is None or {k: found.get(k) for k in spec} != spec:
        what = "unknown settings" if found is None else ", ".join(f"{k}={found.get(k)}" for k in spec)
        want = ", ".join(f"{k}={v}" for k, v in spec.items())
        raise UserError(f"{os.path.abspath(target_dir)} holds a reflow round trained with {what}, not {want}; "
                        f"pick another --name (now {name!r}) or remove that folder")


def _finished(model_dir: str, steps: int) -> bool:
    """Whether `model_dir` holds a checkpoint at (or past) step `steps`."""
    try:
        return int(latest_meta(model_dir).get("step", -1)) >= steps
    except UserError:
        return False


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
    from relf_jax.config import set_value
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


def latest_meta(model_dir: str) -> dict:
    """The metadata of the newest readable checkpoint in `model_dir` (UserError if none)."""
    ckpt = Checkpointer(model_dir, async_save=False, read_only=True)
    for step in reversed(ckpt.steps()):
        try:
            return ckpt.read_meta(step)
        except Exception:  # noqa: BLE001 - unreadable: fall back to the previous one
            continue
    raise UserError(f"no checkpoint found in {os.path.join(os.path.abspath(model_dir), 'checkpoints')}; "
                    "train one first (relf-jax train ...)")


def load_model(workdir: str, family: str = "ar") -> LoadedModel:
    """Restore the newest good `family` checkpoint from ``<workdir>/<family>`` (or `workdir`).

    A HuggingFace Llama / Qwen2 folder (config.json + safetensors) is read in place as an AR
    model (`relf_jax.export.hf.from_hf`)."""
    from relf_jax.export import hf

    if hf.is_hf_dir(workdir) and not os.path.isdir(os.path.join(workdir, family, "checkpoints")):
        if family != "ar":
            raise UserError(f"{workdir} is a HuggingFace folder: it holds an AR model, not a {family!r} one")
        return hf.from_hf(workdir)
    model_dir = os.path.join(workdir, family)
    if not os.path.isdir(os.path.join(model_dir, "checkpoints")):
        model_dir = workdir
    meta = latest_meta(model_dir)
    if meta.get("family") != family:
        raise UserError(f"the checkpoint in {model_dir} holds a {meta.get('family')!r} model, not {family!r}")
    cfg = Config.from_dict(meta["config"])
    model_cfg = ModelConfig(**meta["model"])
    graphdef, params, meta = load_params(model_dir, model_cfg, cfg.train)
    tok_bytes = tokenizer_bytes_from_meta(meta)
    if tok_bytes is None:
        raise UserError(f"the checkpoint in {model_dir} carries no tokenizer")
    return LoadedModel(cfg=cfg, model_cfg=model_cfg, graphdef=graphdef, params=params,
                       tokenizer=tokenizer_from_bytes(tok_bytes), step=int(meta["step"]), model_dir=model_dir)


@dataclasses.dataclass
class Samples:
    texts: list[str]  # decoded replies (EOS excluded)
    token_ids: list[list[int]]
    complete: list[bool]  # reply ended with EOS
    seconds: float  # decode wall time, compilation excluded
    tokens: int  # generated tokens (EOS included)
    target_forwards: int = 0  # target forward passes (AR: one per token)
    denoise_steps: int = 0  # block diffusion: denoising steps (target_forwards less one refresh per block)
    denoise_commits: int = 0  # block diffusion: positions committed (all positions of the decoded blocks)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    @property
    def tau(self) -> float:
        """Tokens per target forward pass (1 for AR decoding)."""
        return self.tokens / max(self.target_forwards, 1)


def encode_prompt(tok: Tokenizer, prompt: str) -> list[int]:
    """BOS (when the tokenizer's prompts start with one) + the prompt's tokens
    (`relf_jax.data.tokenizer.encode_prompt`). An empty prompt starts a fresh conversation."""
    return tokenizer_lib.encode_prompt(tok, prompt)


def fit_new_tokens(prompt_len: int, max_new_tokens: int, max_seq_len: int, extra: int = 0) -> tuple[int, str]:
    """`max_new_tokens` cut to the context left after a `prompt_len`-token prompt (and `extra`
    tokens a speculative round may overshoot by), with a one-line note when it was cut ("" when
    not). A prompt that leaves no room at all is a `UserError`."""
    room = max_seq_len - prompt_len - extra
    if room < 1:
        ar.check_context(prompt_len, max(max_new_tokens, 1) + extra, max_seq_len)
    if max_new_tokens <= room:
        return max_new_tokens, ""
    return room, (f"max_new_tokens {max_new_tokens} -> {room}: the prompt takes {prompt_len} of the model's "
                  f"{max_seq_len}-token context")


def _ar_batch(lm: LoadedModel, sc: SampleConfig):
    settings = ar.DecodeSettings(max_new_tokens=sc.max_new_tokens, eos_id=lm.tokenizer.eos_id,
                                 pad_id=lm.tokenizer.pad_id)
    params = ar.SamplingParams.make(sc.temperature, sc.top_k, sc.top_p)

    def run(arr, lens, key):
        state = ar.generate(lm.graphdef, lm.params, arr, lens, key, params, settings)
        return state.tokens, state.lengths, state

    return run


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
    import sys

    from relf_jax.speculative import ngram_draft

    if files:
        rows = corpus_rows(lm, files)
        print(f"[corpus_ngram] the n-gram table counts {len(rows)} documents of {', '.join(files)}",
              file=sys.stderr, flush=True)
        return ngram_draft.build_ngram_draft(rows, lm.model_cfg.vocab_size, order=order, top_m=top_m)
    if not trained_by_relf_jax(lm):
        raise UserError("proposer corpus_ngram: this model was imported (HuggingFace), and relf_jax does not have "
                        "its training text; name text to count (relf-jax serve --ngram-corpus FILE..., or "
                        "ngram_corpus=[...] in load_engine / ChatModel.load) or count the traffic served "
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


def _spec_batch(lm: LoadedModel, sc: SampleConfig, spc: SpeculativeConfig, draft: Optional[LoadedModel]):
    from relf_jax.speculative import generate as spec

    settings = spec.SpecSettings(k=spc.k, rule=spc.rule, proposer=spc.proposer, max_new_tokens=sc.max_new_tokens,
                                 eos_id=lm.tokenizer.eos_id, pad_id=lm.tokenizer.pad_id, ngram=spc.ngram,
                                 top_k=sc.top_k)
    params = spec.SpecParams.make(sc.temperature, sc.top_p, spc.nsd_top_p)
    table = corpus_ngram_table(lm, spc.corpus_order, spc.corpus_top_m) if spc.proposer == "corpus_ngram" else None

    def run(arr, lens, key):
        state = spec.generate(lm.graphdef, lm.params, arr, lens, key, params, settings,
                              draft_graphdef=draft.graphdef if draft else None,
                              draft_params=draft.params if draft else table)
        return state.tokens, state.lengths, state

    return run


def load_draft(lm: LoadedModel, spc: SpeculativeConfig, workdir: Optional[str] = None) -> LoadedModel:
    """The draft model for speculative decoding: `spc.draft` or ``<workdir>/draft``."""
    path = spc.draft or os.path.join(workdir or lm.cfg.workdir, "draft")
    draft = load_model(path, "ar")
    if not tokenizer_lib.same_tokenization(draft.tokenizer, lm.tokenizer):
        raise UserError(f"the draft in {path} uses another tokenizer than the target")
    return draft


def sample(lm: LoadedModel, prompts: Optional[Sequence[str]] = None, n: Optional[int] = None,
           sample_cfg: Optional[SampleConfig] = None, warmup: bool = True,
           speculative: Optional[SpeculativeConfig] = None, draft: Optional[LoadedModel] = None) -> Samples:
    """Sample replies, `batch_size` prompts at a time, autoregressively or speculatively.

    prompts: texts to continue (default: `n` empty prompts, i.e. unconditional conversations).
    speculative: a `SpeculativeConfig` with rule != "none" decodes with a draft model (`draft`,
    for proposer "draft"), prompt lookup or the corpus n-gram table (`corpus_ngram_table`). With `warmup`, the batch shape is compiled before
    the clock starts.
    """
    sc = sample_cfg or lm.cfg.sample
    validate_sampling(sc.temperature, sc.top_k, sc.top_p)
    n = n or sc.num_samples
    prompts = list(prompts) if prompts is not None else [""] * n
    if not prompts:
        raise UserError("no prompts to sample from")
    spc = speculative if speculative is not None else lm.cfg.speculative
    use_spec = spc.rule != "none"
    if use_spec and spc.proposer == "draft" and draft is None:
        draft = load_draft(lm, spc)
    tok = lm.tokenizer
    ids = [encode_prompt(tok, p) for p in prompts]
    longest = max(len(x) for x in ids)
    extra = spc.k + 1 if use_spec else 0
    ar.check_context(longest, sc.max_new_tokens + extra, lm.model_cfg.max_seq_len)
    bucket = min(ar.prompt_bucket(longest), lm.model_cfg.max_seq_len - sc.max_new_tokens - extra)
    run = _spec_batch(lm, sc, spc, draft) if use_spec else _ar_batch(lm, sc)
    bs = sc.batch_size
    key = jax.random.key(sc.seed)
    texts, token_ids, complete, seconds, total, forwards = [], [], [], 0.0, 0, 0
    for start in range(0, len(ids), bs):
        chunk = ids[start:start + bs]
        rows = chunk + [[tok.bos_id]] * (bs - len(chunk))  # fixed batch shape: one compilation
        arr, lens = ar.pad_prompts(rows, tok.pad_id, bucket)
        key, sub = jax.random.split(key)
        if warmup and start == 0:
            jax.block_until_ready(run(arr, lens, sub)[0])
        t0 = time.perf_counter()
        out_tokens, out_lengths, state = run(arr, lens, sub)
        jax.block_until_ready(out_tokens)
        seconds += time.perf_counter() - t0
        toks, lengths, plens = np.asarray(out_tokens), np.asarray(out_lengths), np.asarray(lens)
        if use_spec:
            forwards += int(np.asarray(state.target_forwards)[:len(chunk)].sum())
        for i in range(len(chunk)):
            reply = toks[i, plens[i]:lengths[i]].tolist()
            total += len(reply)
            done = bool(reply) and reply[-1] == tok.eos_id
            body = reply[:-1] if done else reply
            token_ids.append(body)
            complete.append(done)
            texts.append(tok.decode(body))
    return Samples(texts=texts, token_ids=token_ids, complete=complete, seconds=seconds, tokens=total,
                   target_forwards=forwards if use_spec else total)


def sample_bd(lm: LoadedModel, prompts: Optional[Sequence[str]] = None, n: Optional[int] = None,
              sample_cfg: Optional[SampleConfig] = None, warmup: bool = True) -> Samples:
    """Replies from a block-diffusion model by confidence-threshold decoding (`relf_jax.dws.decoding`),
    `batch_size` prompts at a time: tokens sampled at ``sample.temperature`` (0: greedy), commits by
    ``sample.threshold`` and ``sample.confidence``, at most
    ceil(``sample.max_new_tokens`` / block size) blocks, stopping at EOS or (when every prompt is
    non-empty, i.e. a reply is wanted) at the ``<user>`` marker of the next turn.
    ``target_forwards`` counts denoising steps plus one cache refresh per block."""
    from relf_jax.dws import decoding as bdd
    from relf_jax.dws.workload import decode_settings

    sc = sample_cfg or lm.cfg.sample
    n = n or sc.num_samples
    prompts = list(prompts) if prompts is not None else [""] * n
    if not prompts:
        raise UserError("no prompts to sample from")
    d = lm.model_cfg.block_size
    settings = decode_settings(lm, max_blocks=-(-sc.max_new_tokens // d), threshold=sc.threshold,
                               temperature=sc.temperature, confidence=sc.confidence)
    tok = lm.tokenizer
    if not all(prompts):  # a fresh conversation starts with <user>: only EOS (or pad) ends it
        settings = dataclasses.replace(settings, stop_ids=tuple(i for i in settings.stop_ids
                                                                if i in (tok.eos_id, tok.pad_id)))
    ids = [encode_prompt(tok, p) for p in prompts]
    bucket = bdd.prompt_bucket(max(len(x) for x in ids), d)
    bs = sc.batch_size
    key = jax.random.key(sc.seed)
    texts, token_ids, complete, seconds, total, forwards, steps, commits = [], [], [], 0.0, 0, 0, 0, 0
    for start in range(0, len(ids), bs):
        chunk = ids[start:start + bs]
        arr, plen = bdd.pad_prompts(chunk + [[tok.bos_id]] * (bs - len(chunk)), tok.pad_id, d, bucket)
        key, sub = jax.random.split(key)
        if warmup and start == 0:
            jax.block_until_ready(bdd.generate(lm.graphdef, lm.params, arr, plen, settings, sub).tokens)
        t0 = time.perf_counter()
        state = jax.device_get(bdd.generate(lm.graphdef, lm.params, arr, plen, settings, sub))
        seconds += time.perf_counter() - t0
        for i, out in enumerate(bdd.outputs(state, plen)[:len(chunk)]):
            done = bool(out) and out[-1] in settings.stop_ids
            body = out[:-1] if done else out
            total += len(out)
            forwards += int(state.steps[i].sum() + state.num_blocks[i])
            steps += int(state.steps[i].sum())
            commits += d - int(plen[i]) % d + d * (int(state.num_blocks[i]) - 1)  # first block: the prompt's rest
            token_ids.append(body)
            complete.append(done)
            texts.append(tok.decode(body))
    return Samples(texts=texts, token_ids=token_ids, complete=complete, seconds=seconds, tokens=total,
                   target_forwards=forwards, denoise_steps=steps, denoise_commits=commits)


def stream_reply(lm: LoadedModel, prompt: str, sample_cfg: Optional[SampleConfig] = None):
    """Yield the reply to `prompt` piece by piece (text deltas) as it is generated."""
    sc = sample_cfg or lm.cfg.sample
    tok = lm.tokenizer
    ids = encode_prompt(tok, prompt)
    ar.check_context(len(ids), sc.max_new_tokens, lm.model_cfg.max_seq_len)
    arr, lens = ar.pad_prompts([ids], tok.pad_id, min(ar.prompt_bucket(len(ids)),
                                                      lm.model_cfg.max_seq_len - sc.max_new_tokens))
    settings = ar.DecodeSettings(max_new_tokens=sc.max_new_tokens, eos_id=tok.eos_id, pad_id=tok.pad_id)
    out: list[int] = []
    shown = ""
    for toks, emitted in ar.stream(lm.graphdef, lm.params, arr, lens, jax.random.key(sc.seed),
                                   ar.SamplingParams.make(sc.temperature, sc.top_k, sc.top_p), settings):
        if not emitted[0] or int(toks[0]) == tok.eos_id:
            continue
        out.append(int(toks[0]))
        text = tok.decode(out)
        if len(text) > len(shown):
            yield text[len(shown):]
            shown = text


def exact_judge(cfg: Config) -> ExactJudge:
    """The synthetic grammar that generated `cfg`'s data, as an exact judge."""
    from relf_jax.data.synthetic_chat import GrammarConfig, SyntheticChat

    if cfg.data.source != "synthetic_chat":
        raise UserError("the exact judge needs data.source=synthetic_chat; use a model judge instead")
    return ExactJudge(SyntheticChat(GrammarConfig(seed=cfg.data.data_seed)))


def model_judge(workdir: str) -> ModelJudge:
    """Any relf_jax AR checkpoint as a judge."""
    lm = load_model(workdir, "ar")
    return ModelJudge(lm.graphdef, lm.params, lm.tokenizer, lm.model_cfg.max_seq_len)


def evaluate_samples(samples: Samples, judge) -> dict:
    """Quality pair (gen PPL, entropy) plus distinct-n and speed of `samples` under `judge`."""
    q = quality(judge, samples.texts, samples.complete)
    return {**q.as_dict(), "tokens_per_s": samples.tokens_per_s, "judge": judge.name}


def data_reference(cfg: Config, tok: Tokenizer, judge, n: int, max_tokens: int) -> dict:
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


def validation_loss(lm: LoadedModel, max_batches: int = 8) -> float:
    """Mean next-token loss on the validation split (nats/token)."""
    from relf_jax.train.loop import make_eval_step, plan_state
    from relf_jax.train.optimizers import make_optimizer
    from relf_jax.sharding import make_mesh

    builder = prepare_data(lm.cfg)
    batches = pipeline.eval_batches(builder, "validation", lm.tokenizer, seq_len=lm.cfg.data.seq_len,
                                    batch_size=lm.cfg.train.batch_size, max_batches=max_batches)
    plan = plan_state(lm.model_cfg, make_optimizer(lm.cfg.train), make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    step = make_eval_step(plan, next_token_loss)
    return float(np.mean([float(step(lm.params, b)) for b in batches]))


def write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
