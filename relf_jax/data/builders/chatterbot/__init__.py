"""TFDS builder for the English dialogs of the ``chatterbot-corpus`` package."""

from relf_jax.data.builders.chatterbot.chatterbot import Chatterbot, render_conversation

__all__ = ["Chatterbot", "render_conversation"]
