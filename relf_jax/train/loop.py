"""The one generic, sharded train loop.

Every model family trains here with its own ``loss_fn(model, batch, key) -> (loss, metrics)``:
AR now; ReLF, reflow, drafts, RCSD, block diffusion and the DWS predictor later.

What it does, in order:
- builds the mesh and the parameter / optimizer-state shardings from abstract shapes
  (``nnx.eval_shape`` -> logical axes -> ``NamedSharding``) and creates the state already
  sharded (``jax.jit(init, out_shardings=...)``), or restores it from the newest good
  checkpoint into those same shardings;
- runs a ``jax.jit`` train step with in/out shardings and donated state under ``jax.set_mesh``,
  with gradient accumulation as a ``lax.scan`` over micro-batches;
- checks every step's loss and gradient norm (one step behind, so the host does not stall the
  device): a non-finite value stops training with `TrainingDiverged`, and no checkpoint is
  ever written after it;
- logs to JSONL + TensorBoard, shows a progress bar with loss and tokens/s, evaluates, saves
  async keep-N checkpoints (also on Ctrl-C), and plots the loss curve.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any, Callable, Iterable, Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from relf_jax.checkpoint import Checkpointer, abstract_like
from relf_jax.config import Config, ModelConfig
from relf_jax.errors import UserError
from relf_jax.models.registry import abstract_params, build_model
from relf_jax.runtime import sharding as shd
from relf_jax.runtime.compile_options import train_options
from relf_jax.train import data_state as host_data
from relf_jax.train.metrics import MetricsWriter, plot_loss_curve
from relf_jax.train.optimizers import learning_rate_schedule, make_optimizer

# loss_fn(model, batch, key) -> (loss, metrics): metrics["tokens"] (optional) counts what the
# loss averages over (throughput, and summed over grad_accum micro-batches); other metrics are
# averaged over micro-batches
LossFn = Callable[[nnx.Module, dict, jax.Array], tuple[jax.Array, dict]]


class TrainingDiverged(RuntimeError):
    """The loss or gradient became non-finite; the last good checkpoint is kept."""


@dataclasses.dataclass
class TrainResult:
    graphdef: Any
    params: Any
    step: int
    loss: float
    eval_loss: Optional[float]
    tokens_per_s: float
    resumed_from: Optional[int]
    workdir: str


@dataclasses.dataclass
class ShardedState:
    """Shapes and shardings of a model's parameters and optimizer state on a mesh."""

    mesh: Any
    graphdef: Any
    tx: optax.GradientTransformation
    param_shardings: Any
    opt_shardings: Any
    abstract_params: Any
    abstract_opt: Any

    def restore_target(self) -> dict:
        return {"params": abstract_like(self.abstract_params, self.param_shardings),
                "opt_state": abstract_like(self.abstract_opt, self.opt_shardings)}


def plan_state(model_cfg: ModelConfig, tx: optax.GradientTransformation, mesh) -> ShardedState:
    """Abstract parameter/optimizer shapes and their shardings, without allocating anything."""
    with jax.set_mesh(mesh):
        graphdef, abstract = abstract_params(model_cfg)
        abstract_opt = jax.eval_shape(tx.init, abstract)
    return ShardedState(mesh=mesh, graphdef=graphdef, tx=tx,
                        param_shardings=shd.state_shardings(abstract, mesh),
                        opt_shardings=shd.state_shardings(abstract_opt, mesh),
                        abstract_params=abstract, abstract_opt=abstract_opt)


def init_state(plan: ShardedState, model_cfg: ModelConfig, key: jax.Array):
    """Parameters and optimizer state created directly in their shardings."""

    def init(k):
        _, params = nnx.split(build_model(model_cfg, nnx.Rngs(k)))
        return params, plan.tx.init(params)

    with jax.set_mesh(plan.mesh):
        return jax.jit(init, out_shardings=(plan.param_shardings, plan.opt_shardings))(key)


def make_train_step(plan: ShardedState, loss_fn: LossFn, grad_accum: int, batch_shardings: Any,
                    frozen_shardings: Any = None):
    """The jitted step: (params, opt_state, batch, key, frozen) -> (params, opt_state, metrics).

    `frozen` is an optional pytree the loss reads but does not train (e.g. a distillation
    teacher's parameters); it is an argument, never a closure, so it is not baked into the
    compiled program.
    """
    graphdef, tx = plan.graphdef, plan.tx

    def step(params, opt_state, batch, key, frozen):
        def micro_loss(p, mb, k):
            model = nnx.merge(graphdef, p)
            return loss_fn(model, mb, k) if frozen is None else loss_fn(model, mb, k, frozen)

        grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
        if grad_accum == 1:
            (loss, aux), grads = grad_fn(params, batch, key)
        else:
            micro = jax.tree.map(lambda x: x.reshape((grad_accum, x.shape[0] // grad_accum) + x.shape[1:]), batch)

            def body(carry, inp):
                gsum, lsum, asum = carry
                mb, i = inp
                (l, a), g = grad_fn(params, mb, jax.random.fold_in(key, i))
                return (jax.tree.map(jnp.add, gsum, g), lsum + l, jax.tree.map(jnp.add, asum, a)), None

            zero_g = jax.tree.map(jnp.zeros_like, params)
            aux0 = jax.eval_shape(lambda: grad_fn(params, jax.tree.map(lambda x: x[0], micro), key)[0][1])
            zero_a = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), aux0)
            (gsum, lsum, aux), _ = jax.lax.scan(body, (zero_g, 0.0, zero_a), (micro, jnp.arange(grad_accum)))
            grads = jax.tree.map(lambda g: g / grad_accum, gsum)
            loss = lsum / grad_accum
            # the step's metrics: "tokens" counts add up over micro-batches, every other entry
            # (accuracy, cross-entropy, KL, ...) is each micro-batch's value, so it is averaged
            aux = {k: v if k == "tokens" else v / grad_accum for k, v in aux.items()}
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = {"loss": loss, "grad_norm": grad_norm, **{k: jnp.asarray(v, jnp.float32) for k, v in aux.items()}}
        return params, opt_state, metrics

    return jax.jit(step,
                   in_shardings=(plan.param_shardings, plan.opt_shardings, batch_shardings, None, frozen_shardings),
                   out_shardings=(plan.param_shardings, plan.opt_shardings, None),
                   donate_argnums=(0, 1), compiler_options=train_options(plan.mesh))


def make_eval_step(plan: ShardedState, loss_fn: LossFn):
    graphdef = plan.graphdef

    def evaluate(params, batch, frozen=None):
        model = nnx.merge(graphdef, params)
        key = jax.random.key(0)
        loss, _ = loss_fn(model, batch, key) if frozen is None else loss_fn(model, batch, key, frozen)
        return loss

    return jax.jit(evaluate)


def put_batch(batch: dict, mesh) -> dict:
    """Host-local numpy batch -> global arrays sharded over (data, fsdp) on the batch axis."""
    out = {}
    for k, v in batch.items():
        v = np.asarray(v)
        out[k] = jax.make_array_from_process_local_data(shd.batch_sharding(mesh, v.ndim), v)
    return out


def train(cfg: Config, model_cfg: ModelConfig, loss_fn: LossFn, data: Iterator[dict], *,
          eval_data: Iterable[dict] = (), workdir: Optional[str] = None, mesh=None,
          tokenizer_bytes: Optional[bytes] = None, extra_meta: Optional[dict] = None,
          tensorboard: bool = True, frozen: Any = None, init_params: Any = None,
          step_cache: Optional[dict] = None) -> TrainResult:
    """Train `model_cfg` on `data` for ``cfg.train.steps`` steps, resuming from `workdir`.

    data: an iterator of numpy batches (grain iterators' ``get_state``/``set_state`` are used
    for checkpointing when present); eval_data: a few fixed batches for the eval loss.
    frozen: optional untrained inputs of the loss (``loss_fn(model, batch, key, frozen)``),
    e.g. a teacher's parameters; sharded by their logical axes like the parameters.
    init_params: start from these parameters (fresh optimizer) instead of a random init when
    `workdir` has no checkpoint yet, e.g. the previous reflow round's model.
    step_cache: a dict the caller keeps across calls that train the same model with the same
    `loss_fn` object (e.g. the cycles of continual learning): the compiled train step is reused
    when the mesh, shardings and optimizer (`optimizer_signature`) match, instead of being
    compiled again. The step closes over the first call's optimizer, so the signature leaves out
    ``train.steps`` only when the learning rate does not depend on it.
    """
    tc = cfg.train
    workdir = os.path.abspath(workdir or cfg.workdir)
    os.makedirs(workdir, exist_ok=True)
    mesh = mesh or shd.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    micro = tc.batch_size // tc.grad_accum
    if micro % shards:  # train.batch_size is the global batch, whatever the number of processes
        raise UserError(f"train.batch_size / train.grad_accum = {micro} must be divisible by the "
                        f"{shards} data x fsdp shards of the mesh")
    plan = plan_state(model_cfg, make_optimizer(tc), mesh)
    ckpt = Checkpointer(workdir, keep=tc.keep_checkpoints, async_save=tc.async_checkpoint)
    meta = {"family": model_cfg.family, "config": cfg.to_dict(), "model": dataclasses.asdict(model_cfg),
            **(extra_meta or {})}
    step, params, opt_state, resumed_from = _start(plan, ckpt, meta, model_cfg, tc, data, init_params)
    run = _Run(tc=tc, plan=plan, ckpt=ckpt, meta=meta, data=data, loss_fn=loss_fn,
               tokenizer_bytes=tokenizer_bytes, step_cache=step_cache, step=step, params=params,
               opt_state=opt_state, writer=MetricsWriter(workdir, tensorboard=tensorboard))
    eval_batches = [put_batch(b, mesh) for b in eval_data]
    schedule = learning_rate_schedule(tc)
    rng = jax.random.key(tc.seed + 1)
    with jax.set_mesh(mesh):
        run.loop(eval_batches, frozen, schedule, rng)
    plot_loss_curve(run.writer.path, os.path.join(workdir, "loss_curve.png"))
    return TrainResult(graphdef=plan.graphdef, params=run.params, step=run.step, loss=run.last_loss,
                       eval_loss=run.eval_loss, tokens_per_s=run.tok_per_s, resumed_from=resumed_from,
                       workdir=workdir)


def _start(plan: ShardedState, ckpt: Checkpointer, meta: dict, model_cfg: ModelConfig, tc, data, init_params):
    """(step, params, opt_state, resumed_from): the newest good checkpoint (and the data iterator's
    state in it), else a fresh init or `init_params` with a fresh optimizer."""
    restored = ckpt.restore_latest(plan.restore_target(), family=model_cfg.family, model=meta["model"])
    if restored is not None:
        step, state, data_state, _ = restored
        if data_state is not None and hasattr(data, "set_state"):
            data.set_state(host_data.own(data_state))
        return step, state["params"], state["opt_state"], step
    params, opt_state = init_state(plan, model_cfg, jax.random.key(tc.seed))
    if init_params is not None:
        # a copy: the train step donates its parameters, and the caller may still use (or
        # pass as `frozen`) the arrays it gave
        params = jax.device_put(jax.tree.map(jnp.copy, init_params), plan.param_shardings)
        with jax.set_mesh(plan.mesh):
            opt_state = jax.jit(plan.tx.init, out_shardings=plan.opt_shardings)(params)
    return 0, params, opt_state, None


@dataclasses.dataclass
class _Run:
    """One call of `train`: the state that changes step by step, and where it is written."""

    tc: Any
    plan: ShardedState
    ckpt: Checkpointer
    meta: dict
    data: Iterator[dict]
    loss_fn: LossFn
    tokenizer_bytes: Optional[bytes]
    step_cache: Optional[dict]
    step: int
    params: Any
    opt_state: Any
    writer: MetricsWriter
    frozen: Any = None
    frozen_sh: Any = None
    train_step: Any = None
    # the last step's metrics, checked one step later so the host does not stall the device
    pending: Optional[tuple[int, dict]] = None
    last_loss: float = float("nan")
    eval_loss: Optional[float] = None
    tok_per_s: float = 0.0
    window_tokens: float = 0.0
    window_start: float = 0.0

    def loop(self, eval_batches: list[dict], frozen: Any, schedule, rng: jax.Array) -> None:
        """Train up to ``train.steps`` (under the mesh), checkpointing also on Ctrl-C."""
        tc, mesh = self.tc, self.plan.mesh
        eval_step = make_eval_step(self.plan, self.loss_fn)
        if frozen is not None:
            self.frozen_sh = shd.state_shardings(frozen, mesh)
            frozen = jax.device_put(frozen, self.frozen_sh)
        self.frozen = frozen
        pbar = _progress(tc.progress, total=tc.steps, initial=self.step)
        self.window_start = time.perf_counter()
        try:
            while self.step < tc.steps:
                np_batch = self._next_batch()
                batch = put_batch(np_batch, mesh)
                train_step = self._compiled_step(batch)
                self.params, self.opt_state, metrics = train_step(
                    self.params, self.opt_state, batch, jax.random.fold_in(rng, self.step), frozen)
                self.step += 1
                if self.pending is not None:
                    self._account(np_batch, schedule, pbar)
                self.pending = (self.step, metrics)
                pbar.update(1)
                self._evaluate_and_save(eval_step, eval_batches)
            if self.pending is not None:
                self.last_loss = self.check(*self.pending)["loss"]
        except KeyboardInterrupt:
            # nothing lost on Ctrl-C: checkpoint the last finished (and finite) step
            if self.pending is not None and self.step not in self.ckpt.steps():
                self.check(*self.pending)
                self.save(self.step, force=True)
            raise
        finally:
            pbar.close()
            self.writer.close()
            self.ckpt.close()  # waits for async saves still in flight

    def _next_batch(self) -> dict:
        try:
            return next(self.data)
        except StopIteration:
            raise UserError(f"the training data ran out at step {self.step} of {self.tc.steps}; "
                            "use more data or fewer train.steps") from None

    def _compiled_step(self, batch: dict):
        """The jitted train step, compiled for the first batch's shardings (or taken from
        `step_cache` when it holds one for the same model, loss, optimizer, mesh and shardings)."""
        if self.train_step is None:
            tc, frozen_sh = self.tc, self.frozen_sh
            batch_sh = jax.tree.map(lambda x: x.sharding, batch)
            key = (self.plan.graphdef, self.loss_fn, tc.grad_accum, optimizer_signature(tc), self.plan.mesh,
                   jax.tree.structure(batch_sh), tuple(jax.tree.leaves(batch_sh)),
                   jax.tree.structure(frozen_sh), tuple(jax.tree.leaves(frozen_sh)))
            if self.step_cache is not None and key in self.step_cache:
                self.train_step = self.step_cache[key]
            else:
                self.train_step = make_train_step(self.plan, self.loss_fn, tc.grad_accum, batch_sh, frozen_sh)
                if self.step_cache is not None:
                    self.step_cache[key] = self.train_step
        return self.train_step

    def _account(self, np_batch: dict, schedule, pbar) -> None:
        """Check the previous step's metrics; every ``log_every`` steps log them with tokens/s."""
        host = self.check(*self.pending)
        self.window_tokens += host.get("tokens", float(np.prod(np_batch["tokens"].shape)))
        self.last_loss = host["loss"]
        s = self.pending[0]
        if s % self.tc.log_every == 0:
            now = time.perf_counter()
            self.tok_per_s = self.window_tokens / max(now - self.window_start, 1e-9)
            self.window_tokens, self.window_start = 0.0, now
            self.writer.write(s, {"loss": host["loss"], "grad_norm": host["grad_norm"],
                                  "learning_rate": float(schedule(s - 1)), "tokens_per_s": self.tok_per_s})
            pbar.set_postfix(loss=f"{host['loss']:.3f}", tok_s=f"{self.tok_per_s:,.0f}")

    def _evaluate_and_save(self, eval_step, eval_batches: list[dict]) -> None:
        tc, step = self.tc, self.step
        if step % tc.eval_every == 0 or step == tc.steps:
            if eval_batches:
                self.eval_loss = float(np.mean([float(eval_step(self.params, b, self.frozen))
                                                for b in eval_batches]))
                self.writer.write(step, {"eval_loss": self.eval_loss})
        if step % tc.checkpoint_every == 0 or step == tc.steps:
            self.last_loss = self.check(*self.pending)["loss"]
            self.save(step, force=step == tc.steps)

    def check(self, s: int, m: dict) -> dict:
        """Host copies of step `s`'s metrics; `TrainingDiverged` if the loss or gradient norm is
        not finite."""
        host = {k: float(v) for k, v in jax.device_get(m).items()}
        if not (math.isfinite(host["loss"]) and math.isfinite(host["grad_norm"])):
            good = [x for x in self.ckpt.steps() if x < s]
            raise TrainingDiverged(
                f"non-finite loss ({host['loss']}) or gradient norm ({host['grad_norm']}) at step {s}; "
                f"stopped. The last good checkpoint is "
                f"{'step ' + str(good[-1]) if good else 'none'} in {self.ckpt.directory}")
        return host

    def save(self, s: int, force: bool = False) -> None:
        data_state = host_data.gather(self.data.get_state()) if hasattr(self.data, "get_state") else None
        self.ckpt.save(s, {"params": self.params, "opt_state": self.opt_state}, data_state=data_state,
                       meta=self.meta, tokenizer_bytes=self.tokenizer_bytes, force=force)


def optimizer_signature(tc) -> tuple:
    """What the compiled train step's optimizer depends on: its hyperparameters, and
    ``train.steps`` unless the learning-rate schedule is constant (no warmup, min_lr_ratio 1)."""
    constant = tc.warmup_steps == 0 and tc.min_lr_ratio == 1.0
    return (tc.learning_rate, tc.warmup_steps, tc.min_lr_ratio, tc.weight_decay, tc.b1, tc.b2, tc.grad_clip,
            None if constant else tc.steps)


def load_params(workdir: str, model_cfg: ModelConfig, train_cfg, mesh=None):
    """Restore (graphdef, params, meta) from the newest good checkpoint in `workdir`.

    Raises `UserError` if there is none or it holds another model family.
    """
    mesh = mesh or shd.make_mesh(1, 1, 1, devices=jax.local_devices()[:1])
    plan = plan_state(model_cfg, make_optimizer(train_cfg), mesh)
    restored = Checkpointer(workdir, async_save=False, read_only=True).restore_latest(
        plan.restore_target(), family=model_cfg.family)
    if restored is None:
        raise UserError(f"no checkpoint found in {os.path.join(os.path.abspath(workdir), 'checkpoints')}")
    step, state, _, meta = restored
    return plan.graphdef, state["params"], meta


def _progress(enabled: bool, total: int, initial: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled or jax.process_index() != 0,
                desc="train", unit="step", dynamic_ncols=True)
