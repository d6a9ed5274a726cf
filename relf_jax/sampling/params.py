"""The traced sampling knobs of the AR and speculative samplers and the one per-position draw.

`TracedSampling` holds temperature, top-k, top-p, min-p and the `processors.Penalties` (logit
bias, repetition / frequency / presence penalties) as traced values, a scalar or one per row, so
changing them does not recompile; a knob given as None is left out at trace time.
`sample_logits` draws one position's tokens under them. (The user-facing settings are
`relf_jax.methods.SamplingParams`; the samplers take these.)
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from relf_jax.config import validate_sampling
from relf_jax.errors import UserError
from relf_jax.sampling import processors


@flax.struct.dataclass
class TracedSampling:
    """Traced sampling knobs, a scalar or one value per row. min_p and penalties None: off
    (left out at trace time); penalties' token state (counts, seen) is ignored here: it lives
    in the `DecodeState`."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array | None = None
    penalties: processors.Penalties | None = None

    @classmethod
    def make(cls, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
             repetition_penalty: float = 1.0, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
             logit_bias: dict[int, float] | None = None, vocab_size: int | None = None) -> TracedSampling:
        """Settings for every row; the ones at their off value are left out. `logit_bias` needs
        `vocab_size` (its dense row is built here)."""
        validate_sampling(temperature, top_k, top_p)
        pen = processors.Penalties()
        if repetition_penalty != 1.0:
            pen = pen.replace(repetition=jnp.float32(repetition_penalty))
        if frequency_penalty:
            pen = pen.replace(frequency=jnp.float32(frequency_penalty))
        if presence_penalty:
            pen = pen.replace(presence=jnp.float32(presence_penalty))
        if logit_bias:
            if vocab_size is None:
                raise UserError("logit_bias needs the vocabulary size")
            pen = pen.replace(bias=jnp.zeros((vocab_size,), jnp.float32).at[jnp.asarray(list(logit_bias), jnp.int32)]
                              .set(jnp.asarray(list(logit_bias.values()), jnp.float32)))
        return cls(jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p),
                   jnp.float32(min_p) if min_p > 0 else None, pen if pen != processors.Penalties() else None)

    @property
    def tracks_tokens(self) -> bool:
        """Whether a penalty reads the committed tokens (the state must count them)."""
        return self.penalties is not None and self.penalties.tracks


def sample_logits(logits: jax.Array, key: jax.Array, sampling: TracedSampling, counts=None, seen=None,
                  log_probs: int = 0) -> tuple[jax.Array, jax.Array | None]:
    """(tokens [B], reported log-probs [B, 1 + 2 * log_probs] or None) for the logits [B, V] of
    one position: `processors.adjust` with the rows' token state, then `processors.sample`.
    log_probs > 0: also the drawn token's log-probability under the processed distribution and
    the `log_probs` most probable tokens (`processors.top_log_probs`)."""
    pen = sampling.penalties
    if pen is not None and counts is not None:
        pen = pen.replace(counts=counts, seen=seen)
    x = processors.adjust(logits, pen)
    tok = processors.sample(x, key, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)
    if not log_probs:
        return tok, None
    lp = processors.reported_log_probs(x, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)
    return tok, processors.top_log_probs(lp, tok, log_probs)
