"""TFDS builder for the English dialogs of the ``chatterbot-corpus`` package."""

from relf_jax.data.builders.chatterbot.chatterbot import (
    Chatterbot,
    first_user_turns,
    read_conversations,
    render_conversation,
)

__all__ = ["Chatterbot", "first_user_turns", "read_conversations", "render_conversation"]
