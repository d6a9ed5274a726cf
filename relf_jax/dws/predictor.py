"""The prompt-only workload predictor: surfaces from prompts, its losses and its training.

The network is `relf_jax.models.workload_predictor.WorkloadPredictor` (family "dws"). Here:

- `predicted_surface(out, length, block_size)`: the block head's P(N >= b+1) and the step
  head's per-block distribution over T_b in 1..d turned into
  ``S[b, s] = P(N >= b+1) * P(T_b >= s+1)`` ([B, B_max, d], 0-indexed), the first block's
  step distribution restricted to its capacity ``d - P mod d`` (or d). The block head is
  either methods.md's continuation probabilities (running product) or, with
  ``predictor_block_head="length"``, a distribution over the reply's length in tokens: a reply
  of L tokens needs exactly 1 + ceil((L - cap) / d) blocks (one when L <= cap), so the network
  only predicts L and the block boundaries, which move with the prompt's length, are exact
  (`length_block_probs`); its training adds a reply-length cross-entropy (`LENGTH_CE_WEIGHT`);
- losses for the generic train loop, coarse to fine (methods.md §4): `curve_loss` regresses
  the workload curves ``sum_b min(T_b, h)`` for a few horizons h, `brier_loss` then fits the
  surface to the 0/1 map of executed cells; `scalar_loss` trains the scalar baselines
  (output length, total steps) on log(1 + y) with the same encoder;
- `WorkloadData`: the training arrays built from decoded requests; `train_predictor` runs the
  two stages (or the scalar one) through `relf_jax.train.loop.train`; `predict` is the jitted
  batch forward.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from relf_jax.config import Config, ModelConfig
from relf_jax.train.loop import TrainResult, train

# weight of the reply-length cross-entropy next to the curve / Brier losses when the block head
# is "length" (the CE is a proper score for the whole length distribution; the Brier loss sees
# it only through the block column). On 12,000 labels of `bench dws`'s 1,200-step model (64 x 2
# predictor, its 1,500 test requests, run 4's cost model) the DWS cost MAE was 3.09 ms with the
# continuation head, 3.09 / 2.88 / 2.81 ms with the length head at weight 0 / 0.1 / 1
LENGTH_CE_WEIGHT = 1.0


def horizons(block_size: int) -> tuple[int, ...]:
    """The workload-curve horizons used in coarse training: 1 (blocks), 2, d/2 and d (steps)."""
    return tuple(sorted({1, min(2, block_size), max(1, block_size // 2), block_size}))


def first_block_capacity(length: jax.Array, block_size: int) -> jax.Array:
    """Positions of the first output block: d - P mod d, or d when the prompt fills its block."""
    r = length % block_size
    return jnp.where(r == 0, block_size, block_size - r)


def max_reply_length(length: jax.Array, block_size: int, max_blocks: int) -> jax.Array:
    """The longest reply on the grid: the first block's capacity plus B_max - 1 full blocks."""
    return first_block_capacity(length, block_size) + (max_blocks - 1) * block_size


def length_log_probs(length_logits: jax.Array, length: jax.Array, block_size: int, max_blocks: int) -> jax.Array:
    """log P(L = j + 1) [B, B_max * d] of the length block head, lengths past
    `max_reply_length` excluded (-inf)."""
    ell = jnp.arange(1, length_logits.shape[-1] + 1)
    ok = ell[None, :] <= max_reply_length(length, block_size, max_blocks)[:, None]
    return jax.nn.log_softmax(jnp.where(ok, length_logits.astype(jnp.float32), -jnp.inf), axis=-1)


def length_block_probs(length_logits: jax.Array, length: jax.Array, block_size: int, max_blocks: int) -> jax.Array:
    """P(N >= b+1) [B, B_max] from a distribution over the reply's length L in 1..B_max * d tokens
    (logits [B, B_max * d], lengths past `max_reply_length` excluded): the reply needs block b+1
    (b >= 1) iff L > cap + (b - 1) * d, cap the first block's capacity."""
    probs = jnp.exp(length_log_probs(length_logits, length, block_size, max_blocks))
    tail = jnp.flip(jnp.cumsum(jnp.flip(probs, -1), axis=-1), -1)  # tail[:, j] = P(L >= j + 1)
    cap = first_block_capacity(length, block_size)
    # P(L > x) = tail[:, x] for x = cap + (b - 1) * d, b = 1 .. B_max - 1 (x <= B_max * d - 1)
    x = cap[:, None] + (jnp.arange(1, max_blocks)[None, :] - 1) * block_size
    later = jnp.take_along_axis(tail, x, axis=1)
    return jnp.concatenate([jnp.ones_like(later[:, :1]), later], axis=1)


def length_class(batch: dict, block_size: int, max_blocks: int) -> jax.Array:
    """The reply length as a 0-based class of the length block head, clipped to the grid."""
    top = max_reply_length(batch["length"], block_size, max_blocks)
    return jnp.clip(batch["out_len"].astype(jnp.int32), 1, top) - 1


def predicted_surface(out: dict, length: jax.Array, block_size: int) -> jax.Array:
    """Surface [B, B_max, d] from the heads of a batch: the step head's ``step_logits`` and the
    block head's ``continue_logits`` (continuation probabilities, running product) or
    ``length_logits`` (see `length_block_probs`)."""
    logits = out["step_logits"].astype(jnp.float32)
    max_blocks = logits.shape[1]
    if "length_logits" in out:
        p_exists = length_block_probs(out["length_logits"], length, block_size, max_blocks)
    else:
        cont = jax.nn.sigmoid(out["continue_logits"].astype(jnp.float32))
        p_exists = jnp.concatenate([jnp.ones_like(cont[:, :1]), jnp.cumprod(cont, axis=1)], axis=1)  # [B, B_max]
    t = jnp.arange(1, block_size + 1)
    cap = first_block_capacity(length, block_size)
    allowed = jnp.ones(logits.shape, bool).at[:, 0, :].set(t[None, :] <= cap[:, None])
    probs = jax.nn.softmax(jnp.where(allowed, logits, -jnp.inf), axis=-1)
    tail = jnp.flip(jnp.cumsum(jnp.flip(probs, -1), axis=-1), -1)  # P(T_b >= s + 1)
    return jnp.clip(p_exists[..., None] * tail, 0.0, 1.0)


def surface_curves(surface: jax.Array, hs: Sequence[int]) -> jax.Array:
    """E[sum_b min(T_b, h)] for each horizon: [..., B, d] -> [..., len(hs)]."""
    return jnp.stack([surface[..., :h].sum(axis=(-2, -1)) for h in hs], axis=-1)


def _length_ce(model, out: dict, batch: dict) -> jax.Array:
    """Mean cross-entropy of the reply length under the length block head (0 without one)."""
    if "length_logits" not in out:
        return jnp.float32(0.0)
    cfg = model.cfg
    logp = length_log_probs(out["length_logits"], batch["length"], cfg.block_size, cfg.max_blocks)
    target = length_class(batch, cfg.block_size, cfg.max_blocks)
    return -jnp.mean(jnp.take_along_axis(logp, target[:, None], axis=1))


def curve_loss(model, batch: dict, key: jax.Array, length_weight: float = LENGTH_CE_WEIGHT):
    """Coarse stage: squared error of the predicted workload curves, each scaled by B_max * h
    (+ `length_weight` x the reply-length cross-entropy with the length block head)."""
    del key
    cfg = model.cfg
    hs = horizons(cfg.block_size)
    out = model(batch["tokens"], batch["length"])
    s = predicted_surface(out, batch["length"], cfg.block_size)
    scale = jnp.asarray([cfg.max_blocks * h for h in hs], jnp.float32)
    err = (surface_curves(s, hs) - batch["curves"]) / scale
    ce = _length_ce(model, out, batch)
    return jnp.mean(err ** 2) + length_weight * ce, {"tokens": jnp.float32(s.shape[0]), "length_ce": ce}


def brier_loss(model, batch: dict, key: jax.Array, length_weight: float = LENGTH_CE_WEIGHT):
    """Fine stage: Brier score between the surface and the 0/1 map of executed cells (+
    `length_weight` x the reply-length cross-entropy with the length block head)."""
    del key
    cfg = model.cfg
    out = model(batch["tokens"], batch["length"])
    s = predicted_surface(out, batch["length"], cfg.block_size)
    ce = _length_ce(model, out, batch)
    return jnp.mean((s - batch["executed"]) ** 2) + length_weight * ce, {"tokens": jnp.float32(s.shape[0]),
                                                                        "length_ce": ce}


def scalar_target(batch: dict, head: str) -> jax.Array:
    return batch["out_len"] if head == "length" else batch["total_steps"]


def scalar_loss(model, batch: dict, key: jax.Array):
    """Scalar baselines: squared error on log(1 + y), y = output tokens or total steps."""
    del key
    y = jnp.log1p(scalar_target(batch, model.cfg.predictor_head).astype(jnp.float32))
    pred = model(batch["tokens"], batch["length"])["value"]
    return jnp.mean((pred - y) ** 2), {"tokens": jnp.float32(y.shape[0])}


@dataclasses.dataclass
class WorkloadData:
    """Training / evaluation arrays of decoded requests (one row per request)."""

    tokens: np.ndarray  # [n, L] int32 prompt ids (cut to the last L, padded with 0)
    length: np.ndarray  # [n] int32 prompt tokens P
    executed: np.ndarray  # [n, B_max, d] float32 0/1 executed cells
    curves: np.ndarray  # [n, H] float32 sum_b min(T_b, h)
    out_len: np.ndarray  # [n] output tokens
    total_steps: np.ndarray  # [n]

    @classmethod
    def build(cls, prompts: Sequence[Sequence[int]], steps_per_block: Sequence[Sequence[int]],
              out_lens: Sequence[int], *, max_len: int, max_blocks: int, block_size: int) -> WorkloadData:
        from relf_jax.dws.surface import executed_map

        n = len(prompts)
        if not (n == len(steps_per_block) == len(out_lens)) or n == 0:
            raise ValueError("prompts, steps_per_block and out_lens must be non-empty and of equal length")
        toks = np.zeros((n, max_len), np.int32)
        for i, p in enumerate(prompts):
            p = list(p)[-max_len:]
            toks[i, :len(p)] = p
        hs = horizons(block_size)
        executed = np.stack([executed_map(s, max_blocks, block_size) for s in steps_per_block]).astype(np.float32)
        curves = np.asarray([[sum(min(t, h) for t in s) for h in hs] for s in steps_per_block], np.float32)
        return cls(tokens=toks, length=np.asarray([len(p) for p in prompts], np.int32), executed=executed,
                   curves=curves, out_len=np.asarray(out_lens, np.float32),
                   total_steps=np.asarray([sum(s) for s in steps_per_block], np.float32))

    def __len__(self) -> int:
        return len(self.length)

    def batch(self, idx: np.ndarray) -> dict:
        return {k: v[idx] for k, v in dataclasses.asdict(self).items()}

    def iterator(self, batch_size: int, seed: int) -> Iterator[dict]:
        """Endless shuffled batches (each pass a new permutation)."""
        rng = np.random.default_rng(seed)
        while True:
            perm = rng.permutation(len(self))
            for i in range(0, len(perm) - batch_size + 1, batch_size):
                yield self.batch(perm[i:i + batch_size])


def predictor_config(vocab_size: int, block_size: int, max_blocks: int, head: str = "surface", *,
                     d_model: int = 64, num_layers: int = 2, max_len: int = 64) -> ModelConfig:
    """The predictor's network shape (about 0.2M parameters at vocabulary 1k)."""
    return ModelConfig(family="dws", vocab_size=vocab_size, d_model=d_model, num_layers=num_layers, num_heads=4,
                       num_kv_heads=4, mlp_dim=2 * d_model, max_seq_len=max_len, block_size=block_size,
                       max_blocks=max_blocks, predictor_head=head)


def train_predictor(cfg: Config, model_cfg: ModelConfig, data: WorkloadData, workdir: str, *,
                    coarse_steps: int, fine_steps: int, eval_data: WorkloadData | None = None,
                    tokenizer_bytes: bytes | None = None) -> TrainResult:
    """Train one predictor in `workdir` (resumable): for the surface head, `coarse_steps` of
    `curve_loss` (in ``<workdir>/coarse``) then `fine_steps` of `brier_loss` from those weights;
    for a scalar head, ``coarse_steps + fine_steps`` of `scalar_loss`."""
    bs = min(cfg.train.batch_size, len(data))
    evals = [] if eval_data is None else [eval_data.batch(np.arange(min(len(eval_data), 256)))]

    def run(loss_fn, steps, wd, init_params=None):
        c = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps, batch_size=bs,
                                                                 grad_accum=1, eval_every=max(steps, 1),
                                                                 checkpoint_every=max(steps, 1)))
        return train(c, model_cfg, loss_fn, data.iterator(bs, cfg.train.seed), eval_data=evals, workdir=wd,
                     tensorboard=False, init_params=init_params, tokenizer_bytes=tokenizer_bytes)

    if model_cfg.predictor_head != "surface":
        return run(scalar_loss, coarse_steps + fine_steps, workdir)
    coarse = run(curve_loss, coarse_steps, os.path.join(workdir, "coarse"))
    return run(brier_loss, fine_steps, workdir, init_params=coarse.params)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _forward(graphdef, params, tokens, length):
    model = nnx.merge(graphdef, params)
    out = model(tokens, length)
    if model.cfg.predictor_head == "surface":
        return predicted_surface(out, length, model.cfg.block_size)
    return jnp.expm1(out["value"])


def predict(graphdef, params, tokens: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Surfaces [n, B_max, d] (surface head) or scalars [n] (output tokens / total steps)."""
    return np.asarray(_forward(graphdef, params, jnp.asarray(tokens), jnp.asarray(length)))


class WorkloadCost:
    """Predicted cost (seconds) of a request from its prompt alone: the surface predictor + a
    fitted `CostModel`. The serving scheduler ranks by it (``SJF(key="dws_cost")``).

    predictor: a loaded "dws" model with the surface head (`relf_jax.checkpoint.LoadedModel`,
    e.g. ``relf_jax.loading.load_model(".../predictor_*/surface", "dws")``); cost_model: a
    `CostModel`, its dict, or a JSON file holding one (``relf-jax bench dws``'s output, whose
    "cost_model" entry is used).
    """

    def __init__(self, predictor, cost_model):
        import json

        from relf_jax.dws.cost_model import CostModel
        from relf_jax.errors import UserError

        self.lm = predictor
        if self.lm.model_cfg.predictor_head != "surface":
            raise UserError(f"the predictor has the {self.lm.model_cfg.predictor_head!r} head; "
                            "the DWS cost needs the surface head")
        if isinstance(cost_model, str):
            with open(cost_model) as f:
                cost_model = json.load(f)
            cost_model = cost_model.get("cost_model", cost_model)
        self.model = cost_model if isinstance(cost_model, CostModel) else CostModel.from_dict(cost_model)
        self.max_len = self.lm.model_cfg.max_seq_len
        self._fn = jax.jit(functools.partial(_forward, self.lm.graphdef))
        # prompt widths one call pads to: powers of two from 16, then max_len (the encoder masks
        # padding, so the width changes no prediction; a narrower call costs less)
        self.widths = tuple(w for w in (16, 32, 64, 128, 256, 512) if w < self.max_len) + (self.max_len,)
        for w in self.widths:  # compile one prompt's shapes now, not on the first requests
            self([self.lm.tokenizer.bos_id] * w)

    # row counts one `batch` call pads to (each compiled once); longer lists go in chunks of the largest
    BATCHES = (1, 4, 16)

    def __call__(self, prompt: Sequence[int]) -> dict[str, float]:
        """``{"dws_cost": seconds, "prompt_len": tokens}`` for one prompt (token ids, BOS first)."""
        return self.batch([prompt])[0]

    def batch(self, prompts: Sequence[Sequence[int]]) -> list[dict[str, float]]:
        """`__call__` for several prompts in one predictor call (per `BATCHES` chunk)."""
        out = []
        for i in range(0, len(prompts), self.BATCHES[-1]):
            chunk = prompts[i:i + self.BATCHES[-1]]
            rows = next(b for b in self.BATCHES if b >= len(chunk))
            width = next(w for w in self.widths if w >= min(max(len(p) for p in chunk), self.max_len))
            arr = np.zeros((rows, width), np.int32)
            length = np.ones((rows,), np.int32)  # padding rows: one token, discarded
            for j, prompt in enumerate(chunk):
                cut = list(prompt)[-width:]
                arr[j, :len(cut)] = cut
                length[j] = len(prompt)
            surface = np.asarray(self._fn(self.lm.params, arr, length))[:len(chunk)]
            cost = self.model.predict(length[:len(chunk)] / self.lm.model_cfg.block_size, surface)
            out += [{"dws_cost": float(c), "prompt_len": float(len(p))} for c, p in zip(cost, chunk)]
        return out
