"""TFDS builder for the SyntheticChat corpus (see ``relf_jax.data.synthetic_chat``)."""

from relf_jax.data.builders.synthetic_chat.synthetic_chat import (
    SyntheticChatBuilder,
    SyntheticChatConfig,
    build,
)

__all__ = ["SyntheticChatBuilder", "SyntheticChatConfig", "build"]
