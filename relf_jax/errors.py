"""Errors meant for the user: the CLI prints their message on one line and exits non-zero."""


class UserError(ValueError):
    """Bad input (a preset, key, value, file, prompt or checkpoint); the message says which."""
