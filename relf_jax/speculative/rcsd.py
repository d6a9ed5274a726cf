"""The RCSD draft loss: distillation from logged target distributions plus a masked
preference term at each round's first rejection (methods.md section 3, our reading).

Batches are `relf_jax.speculative.trace.examples_from_trace` examples (position j is the
prediction of token j + 1). With q the draft being trained and q_ref a frozen reference draft
(the starting distilled draft):

- distillation ("topk_ce"): at logged positions, the cross-entropy of q against the target on
  the partition {top-T tokens, everything else}: -sum_t p_t log q(id_t) - r log(1 - sum_t q(id_t))
  with r = 1 - sum_t p_t the unlogged mass. (Dropping the second term would teach the draft to
  put all its mass on the top T, sharper than the target, which lowers min(1, p/q) acceptance.)
  "hass_topk": both distributions restricted to the target's top-T tokens and renormalised,
  -sum_t p~_t log q~(id_t) (HASS-style top-K distillation);
- preference (DPO-style) at each first rejection whose rejected token is outside the
  target's nucleus: -log sigmoid(beta [(log q(c) - log q_ref(c)) - (log q(r) - log q_ref(r))])
  with c the token the target emitted and r the rejected draft token; a rejected token inside
  the nucleus (one the target still finds plausible) is masked out, as are rounds with no
  rejection (they produce no pair);
- an optional KL anchor, kl_weight * KL(q_ref || q) at logged positions, against forgetting.

loss = distill_weight * distill + pref_weight * preference + kl_weight * anchor.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

DISTILL_MODES = ("topk_ce", "hass_topk")


@dataclasses.dataclass(frozen=True)
class RCSDLossSettings:
    distill_weight: float = 1.0
    pref_weight: float = 1.0
    beta: float = 0.1
    kl_weight: float = 0.0
    distill: str = "topk_ce"

    def __post_init__(self):
        if self.distill not in DISTILL_MODES:
            raise ValueError(f"distill must be one of {DISTILL_MODES}, got {self.distill!r}")
        if min(self.distill_weight, self.pref_weight, self.kl_weight) < 0 or self.beta <= 0:
            raise ValueError("loss weights must be >= 0 and beta > 0")


def rcsd_inputs(batch):
    """(tokens, positions, segment ids) [B, S] of a batch of examples."""
    tokens = batch["tokens"]
    b, s = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    seg = (positions < batch["length"][:, None]).astype(jnp.int32)
    return tokens, positions, seg


def rcsd_terms(draft_logits, ref_logits, batch, settings: RCSDLossSettings) -> dict:
    """The loss terms from draft and reference logits [B, S, V] (float32 math)."""
    logq = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)
    ids, probs = batch["dist_ids"], batch["dist_probs"].astype(jnp.float32)
    dmask = batch["dist_mask"].astype(jnp.float32)
    n_dist = jnp.maximum(dmask.sum(), 1.0)
    logq_top = jnp.take_along_axis(logq, ids, axis=-1)  # [B, S, T]
    if settings.distill == "topk_ce":
        rest_p = jnp.clip(1.0 - probs.sum(-1), 0.0, 1.0)
        q_top = jnp.clip(jnp.exp(logq_top).sum(-1), 0.0, 1.0 - 1e-6)
        ce = -(probs * logq_top).sum(-1) - rest_p * jnp.log1p(-q_top)
    else:
        p_tilde = probs / jnp.maximum(probs.sum(-1, keepdims=True), 1e-30)
        ce = -(p_tilde * jax.nn.log_softmax(logq_top, axis=-1)).sum(-1)
    distill = (ce * dmask).sum() / n_dist

    valid = (batch["pref_mask"] & ~batch["rejected_in_nucleus"]).astype(jnp.float32)
    logr = jax.nn.log_softmax(jax.lax.stop_gradient(ref_logits).astype(jnp.float32), axis=-1)

    def at(lp, tok):
        return jnp.take_along_axis(lp, tok[..., None], axis=-1)[..., 0]

    chosen, rejected = batch["chosen"], batch["rejected"]
    margin = (at(logq, chosen) - at(logr, chosen)) - (at(logq, rejected) - at(logr, rejected))
    pref_each = -jax.nn.log_sigmoid(settings.beta * margin)
    n_pref = valid.sum()
    pref = (pref_each * valid).sum() / jnp.maximum(n_pref, 1.0)

    kl = (jnp.exp(logr) * (logr - logq)).sum(-1)
    anchor = (kl * dmask).sum() / n_dist
    loss = settings.distill_weight * distill + settings.pref_weight * pref + settings.kl_weight * anchor
    return {"loss": loss, "distill": distill, "preference": pref, "anchor": anchor, "pairs": n_pref,
            "positions": dmask.sum(),
            "margin": (margin * valid).sum() / jnp.maximum(n_pref, 1.0)}


def make_rcsd_loss(reference_graphdef, settings: RCSDLossSettings = RCSDLossSettings()):
    """loss_fn(draft, batch, key, reference_params) for the generic train loop."""

    def loss_fn(model, batch, key, reference_params):
        del key
        tokens, positions, seg = rcsd_inputs(batch)
        draft_logits, _ = model(tokens, positions, segment_ids=seg)
        ref_logits, _ = nnx.merge(reference_graphdef, reference_params)(tokens, positions, segment_ids=seg)
        t = rcsd_terms(draft_logits, ref_logits, batch, settings)
        return t["loss"], {"tokens": t["positions"], "distill": t["distill"], "preference": t["preference"],
                           "pairs": t["pairs"], "anchor": t["anchor"], "margin": t["margin"]}

    return loss_fn
