"""Loss functions for the generic train loop: ``loss_fn(model, batch, key) -> (loss, metrics)``.

Batches come from `relf_jax.data.pipeline`: ``tokens`` and ``segment_ids``, int32
[B, L + 1], rows packed from several documents.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """Position of each token inside its document: [B, T] -> [B, T], restarting at 0."""
    t = segment_ids.shape[1]
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), segment_ids.shape)
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                              segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    first = jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)
    return idx - first


def lm_inputs(batch: dict, pad_id: int = 0):
    """(inputs, positions, segment_ids, targets, mask) of a packed batch for next-token losses.

    mask is 1 where the target is in the same document as its input and is not padding.
    """
    tokens, seg = batch["tokens"], batch["segment_ids"]
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    in_seg, tgt_seg = seg[:, :-1], seg[:, 1:]
    mask = ((in_seg == tgt_seg) & (targets != pad_id)).astype(jnp.float32)
    return inputs, segment_positions(in_seg), in_seg, targets, mask


def next_token_loss(model, batch: dict, key: jax.Array, pad_id: int = 0):
    """Mean next-token cross-entropy (nats) over targets inside the same document.

    Attention is restricted to the document (segment) and positions restart per document,
    so training matches sampling from a BOS-started context.
    """
    del key
    inputs, positions, seg, targets, mask = lm_inputs(batch, pad_id)
    logits, _ = model(inputs, positions, segment_ids=seg)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    n = jnp.maximum(mask.sum(), 1.0)
    loss = (nll * mask).sum() / n
    return loss, {"tokens": mask.sum()}


def block_ids(segment_ids: jax.Array, positions: jax.Array, block_size: int) -> jax.Array:
    """[B, L] -> [B, L]: the index, within its row, of each token's diffusion block (blocks are
    ``position // block_size`` within each document, so a block never spans two documents)."""
    starts = (positions % block_size == 0)
    starts = starts.at[:, 0].set(True) | jnp.concatenate(
        [jnp.zeros_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    return jnp.cumsum(starts.astype(jnp.int32), axis=1) - 1


def masked_diffusion_loss(model, batch: dict, key: jax.Array):
    """Block masked-diffusion loss of a `BlockDiffusionLM` (BD3-LM style) on packed rows.

    Rows hold whole documents (``segment_ids`` 1, 2, ..., 0 = padding, which takes no loss and is
    never masked); positions restart at 0 in each document and blocks are ``position //
    block_size`` within it (`BlockDiffusionLM.training_logits` keeps documents apart). Each block
    draws its own masking rate t ~ U(0, 1); every token but a document's first (BOS, always given
    at decoding time) is replaced by the mask token with probability t. The loss is the mean
    cross-entropy of the original tokens at the masked positions, predicted from the noisy block
    and the clean blocks before it. An unweighted mean over masked tokens instead of the ELBO's
    1/t weights: lower variance, and the confidence-threshold decoder only needs good per-token
    posteriors at every rate. (With ``data.rows=documents`` a row is one document followed by pad
    ids inside its segment, so the pad tail takes loss: the old layout, kept for the ablation.)
    """
    cfg = model.cfg
    tokens = batch["tokens"][:, :-1]
    seg = batch["segment_ids"][:, :-1]
    positions = segment_positions(seg)
    valid = (seg != 0) & (positions > 0)
    b, length = tokens.shape
    k_t, k_u = jax.random.split(key)
    rate = jax.random.uniform(k_t, (b, length), jnp.float32)
    rate = jnp.take_along_axis(rate, block_ids(seg, positions, cfg.block_size), axis=1)
    masked = (jax.random.uniform(k_u, (b, length)) < rate) & valid
    noisy = jnp.where(masked, cfg.vocab_size, tokens)  # id vocab_size is the mask token
    logits = model.training_logits(noisy, tokens, seg, positions)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
    w = masked.astype(jnp.float32)
    n = jnp.maximum(w.sum(), 1.0)
    return (nll * w).sum() / n, {"tokens": w.sum()}
