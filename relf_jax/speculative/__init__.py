"""Speculative decoding: draft K tokens, verify them against the target in one pass."""

from relf_jax.speculative.verify import RULES, VerifyResult, output_distribution, verify

__all__ = ["RULES", "VerifyResult", "output_distribution", "verify"]
