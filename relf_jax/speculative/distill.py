"""Draft training by distillation: match the target's full next-token distribution.

The baseline the RCSD issue improves on. The loss runs through the generic train loop with
the target's parameters as its `frozen` input (an argument of the compiled step, not a
constant baked into it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from relf_jax.train.objectives import lm_inputs


def make_distill_loss(target_graphdef, temperature: float = 1.0):
    """loss_fn(draft, batch, key, target_params): cross-entropy of the draft to the target's
    soft distribution at every in-document position (nats; equals KL + target entropy)."""

    def loss_fn(model, batch, key, target_params):
        del key
        inputs, positions, seg, _, mask = lm_inputs(batch)
        draft_logits, _ = model(inputs, positions, segment_ids=seg)
        target_logits, _ = nnx.merge(target_graphdef, target_params)(inputs, positions, segment_ids=seg)
        p = jax.nn.softmax(jax.lax.stop_gradient(target_logits).astype(jnp.float32) / temperature, axis=-1)
        log_q = jax.nn.log_softmax(draft_logits.astype(jnp.float32) / temperature, axis=-1)
        ce = -(p * log_q).sum(-1)
        entropy = -(p * jnp.log(jnp.maximum(p, 1e-30))).sum(-1)
        n = jnp.maximum(mask.sum(), 1.0)
        loss = (ce * mask).sum() / n
        return loss, {"tokens": mask.sum(), "kl": ((ce - entropy) * mask).sum() / n}

    return loss_fn
