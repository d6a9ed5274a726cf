"""Networks only: token ids (or noisy embeddings) in, logits out.

`build_model(cfg, rngs)` picks the family named by ``cfg.family``; `abstract_params(cfg)` gives
its graphdef and parameter shapes without allocating (both in `relf_jax.models.registry`).
"""

from relf_jax.models.registry import FAMILIES, abstract_params, build_model

__all__ = ["FAMILIES", "abstract_params", "build_model"]
