"""`ChatModel`, the Python API for Colab: the same engines and continuous batcher as
`relf-jax serve`, in process::

    import relf_jax as rj
    bot = rj.ChatModel.load("runs/cpu", method=rj.Speculative(rule="nsd", proposer=rj.NgramTable()))
    print(bot.chat([{"role": "user", "content": "hi, how are you"}]))
    for piece in bot.stream([{"role": "user", "content": "tell me about music"}]):
        print(piece, end="")

Chat templates: `relf_jax.serving.chat_template`; engines from checkpoints:
`relf_jax.serving.loading`.
"""

from __future__ import annotations

import dataclasses
import queue
import secrets
from collections.abc import Iterator, Sequence
from typing import Self

from relf_jax.errors import UserError
from relf_jax.methods import Autoregressive
from relf_jax.serving.batching import Batcher, Event, GenerationRequest
from relf_jax.serving.chat_template import ChatTemplate, encode_chat
from relf_jax.serving.engine_api import Engine, RequestParams
from relf_jax.serving.loading import engine_for
from relf_jax.serving.scheduler import Policy


class ChatModel:
    """Chat with a relf_jax model from Python, with the serving engines and batcher.

    Thread-safe: several threads may call `chat` at once; their requests share the slots.
    `warmup` compiles the engine at its shortest cache span only (`Engine.warmup`): loading
    stays quick, and a conversation that outgrows it pays a one-off compile (seconds on CPU).
    """

    def __init__(self, engine: Engine, template: ChatTemplate | None = None, *, policy: Policy | None = None,
                 max_queue: int | None = 256, warmup: bool = True):
        self.engine = engine
        self.template = template or ChatTemplate.for_tokenizer(engine.tokenizer)
        if warmup:
            engine.warmup(spans=1)
        self.batcher = Batcher(engine, policy, max_queue=max_queue).start()

    @classmethod
    def load(cls, workdir: str, method=None, *, template: ChatTemplate | str | None = None, slots: int = 4,
             warmup: bool = True, **engine_kw) -> ChatModel:
        """Load the checkpoint in `workdir` to decode with `method` (a `relf_jax.methods` object:
        ``Autoregressive()``, the default, ``Speculative(...)``, ``Flow(...)``, ``BlockDiffusion(...)``;
        the CLI's names become one with `relf_jax.methods.parse_method`); `engine_kw`: top_k,
        steps_per_call, max_context, see `engine_for`. ``warmup=False``: compile each program
        when a request first needs it instead of at load (a quicker load, a slower first reply)."""
        if isinstance(template, str):
            template = ChatTemplate.from_file(template)
        if isinstance(method, str):
            raise UserError(f"ChatModel.load takes a method object, not the name {method!r}: e.g. "
                            "relf_jax.Speculative(rule='nsd'), or relf_jax.methods.parse_method(name)")
        return cls(engine_for(workdir, method if method is not None else Autoregressive(), slots=slots, **engine_kw),
                   template, warmup=warmup)

    def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        return encode_chat(self.engine.tokenizer, self.template, messages)

    def chat(self, messages: Sequence[dict], params=None, *, stream: bool = False, max_tokens: int = 64,
             temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
             stop: Sequence[str] = ()) -> str | Iterator[str]:
        """The assistant's reply to `messages`, a string (``stream=True``, kept for older callers:
        the pieces of `stream`).

        params: a `relf_jax.SamplingParams`; its fields that are set replace the keywords
        (max_new_tokens is max_tokens). temperature / top_p left None take the checkpoint's
        generation defaults (``tokenizer.generation_defaults``, from generation_config.json), else
        1.0; so do the engine's other sampling settings it has fields for (top_k, min_p,
        repetition_penalty)."""
        pieces = self.stream(messages, params, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                             seed=seed, stop=stop)
        return pieces if stream else "".join(pieces)

    def stream(self, messages: Sequence[dict], params=None, *, max_tokens: int = 64,
               temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
               stop: Sequence[str] = ()) -> Iterator[str]:
        """The assistant's reply to `messages` piece by piece (text deltas); settings as in `chat`."""
        defaults = dict(getattr(self.engine.tokenizer, "generation_defaults", None) or {})
        fields = {f.name for f in dataclasses.fields(RequestParams)}
        extra = {k: v for k, v in defaults.items() if k in fields and k not in ("temperature", "top_p")}
        if params is not None:
            max_tokens = params.max_new_tokens or max_tokens
            temperature = temperature if params.temperature is None else params.temperature
            top_p = top_p if params.top_p is None else params.top_p
            seed = seed if params.seed is None else params.seed
            stop = tuple(stop) + params.stop
            if params.top_k is not None:
                extra["top_k"] = params.top_k
        req = GenerationRequest(prompt=self.prompt_ids(messages),
                                params=RequestParams(max_tokens=max_tokens,
                                                     temperature=defaults.get("temperature", 1.0)
                                                     if temperature is None else temperature,
                                                     top_p=defaults.get("top_p", 1.0) if top_p is None else top_p,
                                                     seed=secrets.randbits(31) if seed is None else seed, **extra),
                                stop=tuple(stop))
        events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        rid = self.batcher.submit(req, events.put)
        return self._pieces(rid, events)

    def _pieces(self, rid: str, events: queue.SimpleQueue[Event]) -> Iterator[str]:
        try:
            while True:
                ev = events.get()
                if ev.text:
                    yield ev.text
                if ev.finish_reason is not None:
                    self.last_usage = ev.usage
                    if ev.finish_reason == "error":
                        raise RuntimeError(ev.error)
                    return
        finally:  # an abandoned stream frees its slot
            self.batcher.cancel(rid)

    def close(self) -> None:
        self.batcher.stop(drain=False)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
