"""The engines: the `relf_jax.serving.engine_api.Engine` interface over every relf_jax generator.

- `AREngine` (`ar.py`): one token per step (the sampler of `relf_jax.sampling.autoregressive`).
- `SpeculativeEngine` (`speculative.py`): one draft/verify round per step, 1..k+1 tokens (the
  round of `relf_jax.speculative.generate`; standard / NSD / greedy rule; draft model, prompt
  lookup or the corpus n-gram table).
  These two may run several steps per `generate` call (``steps_per_call``, one jitted loop).
- `BlockDiffusionEngine` (`block_diffusion.py`): one committed block per step
  (confidence-threshold decoding of `relf_jax.sampling.block_diffusion`).
- `ReLFEngine` (`relf.py`): the whole reply at once (the flow sampler of
  `relf_jax.flow.samplers`, with the prompt's positions held on their embeddings), in one step.
- `MockEngine` (`mock.py`): no model; echoes the last user turn one token per step, optionally
  sleeping a fixed time per step. Its outputs are known by hand, for scheduler and server tests.

The model engines reuse the samplers' own prefill and step functions, vmapped over slots
(`slots.py`: the slot and span machinery they share; `slot_engine.py`: `SlotEngine`, the body
of the AR and speculative engines, whose decode state is a `slots.Held`).
"""

from relf_jax.serving.engines.ar import AREngine
from relf_jax.serving.engines.block_diffusion import BlockDiffusionEngine
from relf_jax.serving.engines.mock import ByteTokenizer, MockEngine
from relf_jax.serving.engines.relf import ReLFEngine
from relf_jax.serving.engines.speculative import SpeculativeEngine

__all__ = ["AREngine", "BlockDiffusionEngine", "ByteTokenizer", "MockEngine", "ReLFEngine", "SpeculativeEngine"]
