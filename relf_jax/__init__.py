"""relf_jax: a JAX/TPU-first model zoo for low-latency chatbots (ReLF, NSD, RCSD, DWS).

``relf_jax.ChatModel`` (loaded lazily, see `relf_jax.serving.chat`) chats with a trained
checkpoint from Python; `relf_jax.workflows` holds the train/sample/evaluate recipes.
"""


def __getattr__(name):
    if name in ("ChatModel", "ChatTemplate"):
        from relf_jax.serving import chat

        return getattr(chat, name)
    raise AttributeError(f"module 'relf_jax' has no attribute {name!r}")
