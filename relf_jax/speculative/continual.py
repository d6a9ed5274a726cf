"""Continual RCSD: a served draft that keeps learning from its own verification traces.

`ContinualDraftTrainer` alternates, cycle by cycle:

1. **serve**: speculative generation (target + current draft, traced) on a batch of incoming
   prompts; the round traces become examples (`trace.examples_from_trace`) appended to the
   replay store as one shard;
2. **train**: `steps_per_cycle` optimizer steps of the generic train loop on batches that mix
   the newest shard (`recent_fraction`) with the whole buffer (replay against forgetting),
   under the RCSD loss (`rcsd.make_rcsd_loss`; its KL anchor to the frozen starting draft is
   the other guard), resuming from the previous cycle's checkpoint.

``progress.json`` records the last served and the last trained cycle (written atomically after
each phase), so a run killed anywhere resumes without losing a committed trace: a cycle that
served but did not finish training trains on what it served; training resumes from the last
checkpoint. Variant "distill" (preference weight 0) is the online-distillation baseline.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Optional, Sequence

import jax
import numpy as np

from relf_jax.io import write_json
from relf_jax.sampling import autoregressive as ar
from relf_jax.speculative import generate as spec
from relf_jax.speculative.rcsd import RCSDLossSettings, make_rcsd_loss
from relf_jax.speculative.replay import ReplayStore
from relf_jax.speculative.trace import examples_from_trace


@dataclasses.dataclass(frozen=True)
class ContinualSettings:
    # defaults: the budget `relf-jax bench rcsd` measured to move a `cpu`-preset draft (with 128
    # served prompts a cycle); 20 steps of batch 8 at 3e-4 barely changed it
    steps_per_cycle: int = 60
    batch_size: int = 32  # training batch (examples: whole traced replies)
    serve_batch: int = 8  # prompts decoded at once
    recent_fraction: float = 0.5
    learning_rate: float = 3e-3
    k: int = 4
    rule: str = "standard"
    temperature: float = 1.0
    nsd_top_p: float = 0.9
    max_new_tokens: int = 64
    prompt_len: int = 64  # fixed prompt bucket: every example has the same length
    trace_top_k: int = 32
    loss: RCSDLossSettings = RCSDLossSettings()
    seed: int = 0

    def __post_init__(self):
        if self.steps_per_cycle < 0 or self.batch_size < 1 or self.serve_batch < 1:
            raise ValueError("steps_per_cycle >= 0, batch_size >= 1 and serve_batch >= 1 are required")
        if not 0 <= self.recent_fraction <= 1:
            raise ValueError(f"recent_fraction must lie in [0, 1], got {self.recent_fraction}")
        if self.trace_top_k < 1:
            raise ValueError("trace_top_k must be >= 1: RCSD learns from the logged target distributions")


class ReplayBatches:
    """Training batches from a replay store: `recent_fraction` of each batch from the newest
    shards, the rest uniformly from all. Deterministic in (seed, step); its state is the step."""

    def __init__(self, store: ReplayStore, batch_size: int, *, recent_shards: Sequence[int],
                 recent_fraction: float, seed: int):
        parts, recent, n = [], [], 0
        recent_set = set(recent_shards)
        for shard in store.shard_ids():
            arrays = store.read(shard)
            if arrays is None:
                continue  # torn: skipped (read() warned)
            size = arrays["length"].shape[0]
            if shard in recent_set:
                recent.append(np.arange(n, n + size))
            parts.append(arrays)
            n += size
        if not parts:
            raise ValueError(f"the replay store {store.path} has no readable examples")
        self.data = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        self.recent = np.concatenate(recent) if recent else np.zeros(0, np.int64)
        self.n = n
        self.batch_size, self.recent_fraction, self.seed = batch_size, recent_fraction, seed
        self.step = 0

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, self.step])
        n_recent = int(round(self.batch_size * self.recent_fraction)) if self.recent.size else 0
        idx = np.concatenate([rng.choice(self.recent, n_recent),
                              rng.integers(0, self.n, self.batch_size - n_recent)])
        self.step += 1
        return {k: v[idx] for k, v in self.data.items()}

    def get_state(self) -> dict:
        return {"step": self.step}

    def set_state(self, state: dict) -> None:
        self.step = int(state["step"])


class ContinualDraftTrainer:
    """Serve-and-learn loop for one draft; see the module docstring.

    target, draft: `relf_jax.checkpoint.LoadedModel`s (same tokenizer); the draft is also the
    frozen reference of the preference term and the KL anchor. Everything is kept in `workdir`:
    ``replay/`` (the store), ``draft/`` (checkpoints of the trained draft), ``progress.json``.
    """

    def __init__(self, target, draft, workdir: str, settings: ContinualSettings = ContinualSettings()):
        from relf_jax.errors import UserError

        if target.tokenizer.to_bytes() != draft.tokenizer.to_bytes():
            raise UserError("the draft uses another tokenizer than the target")
        ar.check_context(settings.prompt_len, settings.max_new_tokens + settings.k + 1, target.model_cfg.max_seq_len)
        ar.check_context(settings.prompt_len, settings.max_new_tokens + settings.k + 1, draft.model_cfg.max_seq_len)
        self.target, self.reference, self.settings = target, draft, settings
        self.workdir = os.path.abspath(workdir)
        self.store = ReplayStore(os.path.join(self.workdir, "replay"))
        self.params = draft.params
        self.history: list[dict] = []
        # one loss object and one compiled train step for every cycle (the learning rate is
        # constant, so the step does not depend on the cycle's step count)
        self._loss = make_rcsd_loss(draft.graphdef, settings.loss)
        self._step_cache: dict = {}
        progress = self.progress()
        if progress["trained"] > 0:  # resume: the latest trained draft
            from relf_jax.train.loop import load_params

            _, self.params, _ = load_params(os.path.join(self.workdir, "draft"), draft.model_cfg,
                                            self._train_cfg(progress["trained"]).train)

    # ---------------------------------------------------------------- bookkeeping
    def progress(self) -> dict:
        path = os.path.join(self.workdir, "progress.json")
        if not os.path.exists(path):
            return {"served": 0, "trained": 0, "history": []}
        with open(path) as f:
            return json.load(f)

    def _write_progress(self, **kw) -> None:
        state = {**self.progress(), **kw}
        write_json(os.path.join(self.workdir, "progress.json"), state)

    def _train_cfg(self, cycle: int):
        s = self.settings
        cfg = self.reference.cfg
        train = dataclasses.replace(cfg.train, steps=cycle * s.steps_per_cycle, batch_size=s.batch_size,
                                    grad_accum=1, learning_rate=s.learning_rate, warmup_steps=0, min_lr_ratio=1.0,
                                    checkpoint_every=max(1, s.steps_per_cycle), eval_every=10 ** 9,
                                    progress=False, seed=s.seed)
        return dataclasses.replace(cfg, train=train, workdir=os.path.join(self.workdir, "draft"))

    # ---------------------------------------------------------------- the two phases
    def serve(self, prompts: Sequence[Sequence[int]], seed: int, *, log: bool = True) -> dict:
        """Speculative decoding of token-id prompts with the current draft. With `log`, the
        traces go to the replay store (one shard). Returns tau and tokens/s."""
        s = self.settings
        tok = self.target.tokenizer
        settings = spec.SpecSettings(k=s.k, rule=s.rule, max_new_tokens=s.max_new_tokens, eos_id=tok.eos_id,
                                     pad_id=tok.pad_id, trace_top_k=s.trace_top_k if log else 0)
        sp = spec.SpecParams.make(s.temperature, 1.0, s.nsd_top_p)
        key = jax.random.key(seed)
        parts, generated, forwards, seconds = [], 0, 0, 0.0
        for start in range(0, len(prompts), s.serve_batch):
            chunk = [list(p)[-s.prompt_len:] for p in prompts[start:start + s.serve_batch]]
            rows = chunk + [[tok.bos_id]] * (s.serve_batch - len(chunk))
            arr, lens = ar.pad_prompts(rows, tok.pad_id, s.prompt_len)
            key, sub = jax.random.split(key)
            t0 = time.perf_counter()
            state = jax.block_until_ready(spec.generate(
                self.target.graphdef, self.target.params, arr, lens, sub, sp, settings,
                draft_graphdef=self.reference.graphdef, draft_params=self.params))
            seconds += time.perf_counter() - t0
            generated += int(np.asarray(state.num_generated)[:len(chunk)].sum())
            forwards += int(np.asarray(state.target_forwards)[:len(chunk)].sum())
            if log:
                parts.append(examples_from_trace(state.tokens, state.lengths, state.trace,
                                                 nucleus_top_p=s.nsd_top_p, rows=len(chunk)))
        if log and parts:
            self.store.append({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
        return {"tau": generated / max(forwards, 1), "tokens_per_s": generated / max(seconds, 1e-9),
                "tokens": generated}

    def train(self, cycle: int, recent_shards: Sequence[int]):
        """Train up to ``cycle * steps_per_cycle`` steps (resuming) on the replay buffer."""
        from relf_jax.train.loop import train

        s = self.settings
        cfg = self._train_cfg(cycle)
        data = ReplayBatches(self.store, s.batch_size, recent_shards=recent_shards,
                             recent_fraction=s.recent_fraction, seed=s.seed)
        res = train(cfg, self.reference.model_cfg, self._loss, data,
                    workdir=cfg.workdir, tokenizer_bytes=self.reference.tokenizer.to_bytes(),
                    frozen=self.reference.params, init_params=self.reference.params, tensorboard=False,
                    extra_meta={"role": "draft", "rcsd": dataclasses.asdict(s.loss)}, step_cache=self._step_cache)
        self.params = res.params
        return res

    def run(self, prompt_batches: Sequence[Sequence[Sequence[int]]], cycles: Optional[int] = None,
            on_cycle=None) -> list[dict]:
        """Serve `prompt_batches[c]` and train, for cycles 1..cycles (resuming where a previous
        run stopped). Returns one record per cycle run now: tau and tokens/s while serving."""
        cycles = len(prompt_batches) if cycles is None else cycles
        records = []
        for cycle in range(1, cycles + 1):
            progress = self.progress()
            if cycle <= progress["trained"]:
                continue
            if cycle > progress["served"]:
                before = set(self.store.shard_ids())
                stats = self.serve(prompt_batches[cycle - 1], seed=self.settings.seed * 1000 + cycle)
                new = sorted(set(self.store.shard_ids()) - before)
                self._write_progress(served=cycle, served_shards={**progress.get("served_shards", {}),
                                                                  str(cycle): new},
                                     history=[*progress["history"], {"cycle": cycle, **stats}])
                progress = self.progress()
            else:
                stats = next(h for h in progress["history"] if h["cycle"] == cycle)
            recent = progress.get("served_shards", {}).get(str(cycle), [])
            res = self.train(cycle, recent)
            self._write_progress(trained=cycle)
            record = {"cycle": cycle, **{k: v for k, v in stats.items() if k != "cycle"}, "train_loss": res.loss}
            records.append(record)
            if on_cycle is not None:
                on_cycle(record)
        return records
