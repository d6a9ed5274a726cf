"""ReLF (rectified language flow): fixed embeddings, singular posterior, flow samplers.

Pure math, no network: `models/flow_lm.py` supplies the residual logits; training, reflow
and the fused flow-step kernel build on these functions.
"""

from relf_jax.flow.embeddings import KINDS as EMBEDDING_KINDS
from relf_jax.flow.embeddings import (
    cooccurrence_counts,
    cooccurrence_sparse,
    gaussian_embeddings,
    hellinger_rows,
    hellinger_svd_embeddings,
    make_embeddings,
    one_hot_projection_embeddings,
)
from relf_jax.flow.samplers import (
    FlowSamplerSettings,
    euler_integrate,
    final_tokens,
    guided_residual,
    sample,
    stochastic_integrate,
    time_grid,
)
from relf_jax.flow.singular import (
    DEFAULT_T_EPS,
    bounded_residual,
    interpolate,
    posterior_logits,
    posterior_mean,
    singular_logits,
    straightness,
    velocity,
)
from relf_jax.flow.step import flow_step

__all__ = [
    "DEFAULT_T_EPS",
    "EMBEDDING_KINDS",
    "FlowSamplerSettings",
    "bounded_residual",
    "cooccurrence_counts",
    "cooccurrence_sparse",
    "euler_integrate",
    "final_tokens",
    "flow_step",
    "gaussian_embeddings",
    "guided_residual",
    "hellinger_rows",
    "hellinger_svd_embeddings",
    "interpolate",
    "make_embeddings",
    "one_hot_projection_embeddings",
    "posterior_logits",
    "posterior_mean",
    "sample",
    "singular_logits",
    "stochastic_integrate",
    "straightness",
    "time_grid",
    "velocity",
]
