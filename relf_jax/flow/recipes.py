"""ReLF training recipes: fixed token embeddings from the run's data (`flow_embeddings`), the
flow loss from the run's config, training (`train_relf`) and regularised reflow (`reflow`)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil
from typing import Optional

import jax
import numpy as np

from relf_jax.checkpoint import EMBEDDINGS_FILE, latest_meta
from relf_jax.config import Config, saved_model_config
from relf_jax.data import pipeline, sources
from relf_jax.data.prepare import prepare_data, prepare_tokenizer, row_mode
from relf_jax.errors import UserError
from relf_jax.flow import embeddings as emb
from relf_jax.flow.lengths import LENGTHS_FILE, draw_segment_lengths, flow_lengths, flow_segment_lengths, segment_rows
from relf_jax.flow.losses import FlowLossSettings, make_flow_loss
from relf_jax.io import write_json
from relf_jax.loading import load_model
from relf_jax.train.loop import TrainResult, train

EMBEDDING_DOCS = 20_000


def flow_embeddings(cfg: Config, builder, tok, model_dir: str) -> np.ndarray:
    """The fixed ReLF token embeddings [V, d]: loaded from `model_dir`, or built and saved there.

    Hellinger-SVD uses next-token co-occurrences of (up to 20k) training documents.
    """
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


def flow_loss_settings(cfg: Config, pad_id: int = -1) -> FlowLossSettings:
    f = cfg.flow
    return FlowLossSettings(residual_bound=f.residual_bound, use_singular=f.use_singular, t_eps=f.t_eps,
                            t_distribution=f.t_distribution, self_condition_prob=f.self_condition_prob,
                            loss=f.loss, prompt_prob=f.prompt_prob, pad_id=pad_id, aux_weight=f.aux_weight,
                            per_position_t=f.per_position_t, context_loss=f.blind_spot)


# network switches (most set by training from flow.*): a checkpoint trained with others cannot be resumed
_NETWORK_SWITCHES = (("flow_prompt_input", "flow.prompt_prob > 0", "flow.prompt_prob = 0", "clean prompts"),
                     ("flow_aux_head", "flow.aux_weight > 0", "flow.aux_weight = 0", "an auxiliary head"),
                     ("flow_blind_spot", "flow.blind_spot=true", "flow.blind_spot=false", "a blind-spot network"),
                     ("flow_embed_head", "model.flow_embed_head=true", "model.flow_embed_head=false",
                      "an embedding-tied residual head"),
                     ("flow_bag_input", "model.flow_bag_input=true", "model.flow_bag_input=false",
                      "a leave-one-out bag input"))


# network sizes (ModelConfig attributes) a checkpoint is resumed with: (attribute, what, override)
_NETWORK_SHAPES = (("flow_query_layers", "query layers", "model.flow_query_layers"),
                   ("resolved_flow_kv_heads", "key/value heads", "model.flow_kv_heads"))


def check_resumable(model_dir: str, model_cfg) -> None:
    """Refuse to resume a ReLF checkpoint in `model_dir` trained with another network (`UserError`)."""
    if not os.path.isdir(os.path.join(model_dir, "checkpoints")):
        return
    try:
        saved = latest_meta(model_dir)["model"]
    except UserError:
        saved = None  # nothing readable to resume: no conflict
    for field, on, off, what in _NETWORK_SWITCHES:
        before = getattr(model_cfg, field) if saved is None else bool(saved.get(field, False))
        if before != getattr(model_cfg, field):
            raise UserError(f"the ReLF checkpoint in {model_dir} was trained "
                            f"{'with' if before else 'without'} {what}; resume it with "
                            f"{on if before else off}, or train in another workdir")
    if saved is None:
        return
    saved_cfg = saved_model_config(saved)
    for field, what, key in _NETWORK_SHAPES:
        before = getattr(saved_cfg, field)
        if before != getattr(model_cfg, field) and (model_cfg.flow_blind_spot or field != "flow_query_layers"):
            raise UserError(f"the ReLF checkpoint in {model_dir} was trained with {before} {what}; resume it "
                            f"with {key}={before}, or train in another workdir")


class CleanStart:
    """The training batches with a ``t_min`` [B] float32 field: ``t_min`` for the first `steps`
    batches, 0 after (the flow loss draws those rows' t from [t_min, 1): `relf_jax.flow.losses`).
    Its position (batches drawn) is part of the data state, so a resumed run continues the
    schedule; a state saved without it (a run started before the clean start) resumes past it."""

    def __init__(self, data, steps: int, t_min: float):
        self.data, self.steps, self.t_min, self.drawn = data, int(steps), float(t_min), 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = dict(next(self.data))
        value = self.t_min if self.drawn < self.steps else 0.0
        batch["t_min"] = np.full((len(batch["tokens"]),), value, np.float32)
        self.drawn += 1
        return batch

    def get_state(self) -> dict:
        return {"clean_start": self.drawn, "data": self.data.get_state()}

    def set_state(self, state) -> None:
        if isinstance(state, dict) and "clean_start" in state:
            self.drawn = int(state["clean_start"])
            state = state["data"]
        else:
            self.drawn = self.steps
        self.data.set_state(state)


def clean_start_steps(cfg: Config) -> int:
    """How many of ``train.steps`` train near t = 1 first (``flow.clean_start``)."""
    return int(round(cfg.flow.clean_start * cfg.train.steps))


def train_relf(cfg: Config, *, mesh=None) -> TrainResult:
    """Train (or resume) a ReLF flow model: fixed embeddings + the CE flow loss, same train loop."""
    builder = prepare_data(cfg)
    tok = prepare_tokenizer(cfg, builder)
    model_cfg = dataclasses.replace(cfg.model, vocab_size=tok.vocab_size,
                                    flow_prompt_input=cfg.model.flow_prompt_input or cfg.flow.prompt_prob > 0,
                                    flow_aux_head=cfg.model.flow_aux_head or cfg.flow.aux_weight > 0,
                                    flow_blind_spot=cfg.flow.blind_spot,
                                    flow_bag_input=cfg.model.flow_bag_input and cfg.flow.blind_spot)
    cfg = dataclasses.replace(cfg, model=model_cfg)
    model_dir = os.path.join(cfg.workdir, "relf")
    check_resumable(model_dir, model_cfg)
    table = flow_embeddings(cfg, builder, tok, model_dir)
    d, t = cfg.data, cfg.train
    rows = row_mode(cfg)
    if rows == "segments":
        flow_segment_lengths(cfg, builder, tok, model_dir)
    data = pipeline.make_iterator(builder, "train", tok, seq_len=d.seq_len, batch_size=t.batch_size, seed=t.seed,
                                  rows=rows, lookahead=d.pack_lookahead)
    if clean_start_steps(cfg) > 0:
        data = CleanStart(data, clean_start_steps(cfg), cfg.flow.clean_t)
    evals = pipeline.eval_batches(builder, "validation", tok, seq_len=d.seq_len, batch_size=t.batch_size,
                                  max_batches=t.eval_batches, rows=rows, lookahead=d.pack_lookahead)
    return train(cfg, model_cfg, make_flow_loss(flow_loss_settings(cfg, tok.pad_id)), data, eval_data=evals,
                 workdir=model_dir, mesh=mesh, tokenizer_bytes=tok.to_bytes(),
                 frozen={"embeddings": jax.numpy.asarray(table)}, extra_meta={"embeddings": EMBEDDINGS_FILE})


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
    from relf_jax.flow.reflow import DATA_WEIGHT

    data_weight = DATA_WEIGHT if data_weight is None else data_weight
    results = []
    source = os.path.join(workdir, "relf")
    report = os.path.join(workdir, f"{name.removeprefix('relf_')}.json")
    done = {}
    if os.path.exists(report):
        with open(report) as f:
            done = {d["round"]: d for d in json.load(f)}
    caches = ({}, {})  # rounds with the same settings share one loss and one compiled train step
    for r in range(1, rounds + 1):
        lm = load_model(source, "relf")
        target_dir = os.path.join(workdir, f"{name}{r}")
        spec = {"data_weight": float(data_weight), "pair_weight": float(pair_weight), "num_pairs": int(num_pairs),
                "rollout_nfe": int(rollout_nfe), "steps": int(steps or lm.cfg.train.steps)}
        check_round_settings(target_dir, done.get(r), spec, name)
        if r in done and finished(target_dir, spec["steps"]):
            results.append(done[r])  # a finished round (an earlier run): nothing to redo
        else:
            results.append(reflow_round(lm, workdir, target_dir, r, spec, caches, mesh=mesh))
            write_json(report, [*results, *(done[k] for k in sorted(done) if k > r)])
        source = target_dir
    return results


def reflow_round(lm, workdir: str, target_dir: str, r: int, spec: dict, caches=({}, {}), *, mesh=None) -> dict:
    """Reflow round `r` of the ReLF model `lm` into `target_dir` with the settings `spec`: roll out
    pairs, train on them (and the data), measure straightness before and after."""
    from relf_jax.flow.reflow import PairBatches, make_reflow_loss, measure_straightness, rollout_pairs

    cfg = lm.cfg
    losses, step_cache = caches
    settings = flow_loss_settings(cfg, lm.tokenizer.pad_id)
    table = jax.numpy.asarray(np.load(os.path.join(lm.model_dir, EMBEDDINGS_FILE)))
    os.makedirs(target_dir, exist_ok=True)
    shutil.copy(os.path.join(lm.model_dir, EMBEDDINGS_FILE), os.path.join(target_dir, EMBEDDINGS_FILE))
    counts, seg = flow_lengths(lm), None
    if counts is not None:  # segment rows: one segment per pair row, its length from the model's prior
        np.save(os.path.join(target_dir, LENGTHS_FILE), counts)
        lens = draw_segment_lengths(counts[:cfg.data.seq_len + 1], np.random.default_rng(1000 + r), spec["num_pairs"])
        seg = segment_rows(lens, cfg.data.seq_len)
    z0, toks = rollout_pairs(lm.graphdef, lm.params, table, jax.random.key(1000 + r), n=spec["num_pairs"],
                             length=cfg.data.seq_len, settings=settings, nfe=spec["rollout_nfe"],
                             batch=cfg.sample.batch_size, grid=cfg.flow.grid, segment_ids=seg)
    before = measure_straightness(lm.graphdef, lm.params, table, z0, toks, settings=settings, segment_ids=seg)
    builder = prepare_data(cfg, root=workdir)  # the run's data (a round's own cfg.workdir is its model dir)
    train_cfg = dataclasses.replace(cfg.train, steps=spec["steps"])
    rcfg = dataclasses.replace(cfg, train=train_cfg, workdir=target_dir)
    rows = row_mode(cfg) if counts is not None or cfg.data.rows != "auto" else "documents"  # older models
    data = pipeline.make_iterator(builder, "train", lm.tokenizer, seq_len=cfg.data.seq_len,
                                  batch_size=train_cfg.batch_size, seed=train_cfg.seed + r, rows=rows,
                                  lookahead=cfg.data.pack_lookahead)
    loss = losses.setdefault(settings, make_reflow_loss(settings, spec["data_weight"], spec["pair_weight"]))
    res = train(rcfg, lm.model_cfg, loss,
                PairBatches(z0, toks, data, batch_size=train_cfg.batch_size, seed=r, segment_ids=seg),
                workdir=target_dir, mesh=mesh, tokenizer_bytes=lm.tokenizer.to_bytes(),
                frozen={"embeddings": table}, init_params=lm.params,
                extra_meta={"embeddings": EMBEDDINGS_FILE, "reflow_round": r, "reflow": spec},
                step_cache=step_cache)
    after = measure_straightness(res.graphdef, res.params, table, z0, toks, settings=settings, segment_ids=seg)
    return {"round": r, "straightness_before": before, "straightness_after": after,
            "model_dir": os.path.abspath(target_dir), "settings": spec}


def check_round_settings(target_dir: str, record: Optional[dict], spec: dict, name: str) -> None:
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


def finished(model_dir: str, steps: int) -> bool:
    """Whether `model_dir` holds a checkpoint at (or past) step `steps`."""
    try:
        return int(latest_meta(model_dir).get("step", -1)) >= steps
    except UserError:
        return False
