"""relf_jax: a JAX/TPU-first model zoo for low-latency chatbots (ReLF, NSD, RCSD, DWS).

The public API::

    import relf_jax as rj
    cfg = rj.make_config("cpu", ["train.steps=300", "model.family=ar"])
    rj.train(cfg)
    model = rj.load(cfg.workdir)
    params = rj.SamplingParams(temperature=0.8, max_new_tokens=64)
    texts = rj.generate(model, ["hello"], params)
    texts = rj.generate(model, ["hello"], params, method=rj.Speculative(rule="nsd", proposer=rj.PromptLookup()))
    for piece in rj.stream(model, "hello", params):
        print(piece, end="")
    report = rj.evaluate(model)
    chat = rj.ChatModel.load(cfg.workdir)
    reply = chat.chat([{"role": "user", "content": "hi"}])

Names load lazily: ``import relf_jax`` does not import JAX.
"""

# the train package is bound first, so that the `train` function below is what `relf_jax.train`
# names even after a later ``import relf_jax.train.loop`` (which does not rebind a loaded package)
import relf_jax.train as _train_package  # noqa: F401

__version__ = "0.1.0"

__all__ = [
    "Autoregressive",
    "BlockDiffusion",
    "ChatModel",
    "DraftModel",
    "Flow",
    "NgramTable",
    "PromptLookup",
    "SamplingParams",
    "Speculative",
    "__version__",
    "evaluate",
    "generate",
    "load",
    "make_config",
    "stream",
    "train",
]

_LAZY = {
    "make_config": "relf_jax.config",
    "load": "relf_jax.loading",
    "generate": "relf_jax.api",
    "stream": "relf_jax.api",
    "evaluate": "relf_jax.api",
    "SamplingParams": "relf_jax.methods",
    "Autoregressive": "relf_jax.methods",
    "Speculative": "relf_jax.methods",
    "DraftModel": "relf_jax.methods",
    "PromptLookup": "relf_jax.methods",
    "NgramTable": "relf_jax.methods",
    "Flow": "relf_jax.methods",
    "BlockDiffusion": "relf_jax.methods",
    "ChatModel": "relf_jax.serving.chat",
    "ChatTemplate": "relf_jax.serving.chat",
}


def train(cfg, *, mesh=None):
    """Prepare the data and tokenizer of `cfg`, then train (or resume) the model of
    ``cfg.model.family`` in ``<cfg.workdir>/<family>``; returns a `TrainResult`."""
    from relf_jax.api import train as _train

    return _train(cfg, mesh=mesh)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'relf_jax' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
