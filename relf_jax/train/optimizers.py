"""AdamW with linear warmup, cosine decay and global-norm clipping."""

from __future__ import annotations

import jax
import optax

from relf_jax.config import TrainConfig


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warmup to `learning_rate`, then cosine decay to `learning_rate * min_lr_ratio`."""
    steps = max(cfg.steps, cfg.warmup_steps + 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
        decay_steps=steps, end_value=cfg.learning_rate * cfg.min_lr_ratio)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW; weight decay only on matrices (not norms or biases)."""

    def decay_mask(params):
        return jax.tree.map(lambda x: getattr(x, "ndim", 0) > 1, params)

    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2,
                    weight_decay=cfg.weight_decay, mask=decay_mask),
    )
