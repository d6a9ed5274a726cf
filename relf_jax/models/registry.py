"""The model families by name, and the one way to build a network: concrete or abstract."""

from __future__ import annotations

from flax import nnx

from relf_jax.config import ModelConfig
from relf_jax.models.block_diffusion import BlockDiffusionLM
from relf_jax.models.causal_lm import CausalLM
from relf_jax.models.flow_lm import FlowLM
from relf_jax.models.workload_predictor import WorkloadPredictor

FAMILIES = {"ar": CausalLM, "relf": FlowLM, "bd": BlockDiffusionLM, "dws": WorkloadPredictor}


def build_model(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    """Instantiate the network family `cfg.family` with concrete parameters."""
    if cfg.family not in FAMILIES:
        raise ValueError(f"unknown model family {cfg.family!r}; valid: {', '.join(FAMILIES)}")
    return FAMILIES[cfg.family](cfg, rngs=rngs)


def abstract_params(cfg: ModelConfig):
    """(graphdef, abstract nnx.State) of the network `cfg` describes; allocates nothing.

    The shapes, dtypes and logical axes (``nnx.eval_shape``) from which shardings, restore
    targets and parameter names are derived."""
    return nnx.split(nnx.eval_shape(lambda: build_model(cfg, nnx.Rngs(0))))
