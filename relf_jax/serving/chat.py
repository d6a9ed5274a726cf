"""Chat templates, engine loading and `ChatModel`, the Python API for Colab.

The chat template turns OpenAI-style messages into the prompt text a model was trained on.
The default is the turn format of the built-in corpora (`synthetic_chat`, `chatterbot`)::

    <user> how is the weather <assistant> it is sunny <user> and tomorrow <assistant>

A template can be set from a JSON file (``{"user": "...", "assistant": "...", "system":
"..."}``: the marker strings) or from a Jinja2 file (``*.jinja``, rendered with ``messages``
and ``add_generation_prompt=True``, as HuggingFace chat templates are).

`ChatModel` runs the same engines and continuous batcher as `relf-jax serve`, in process::

    from relf_jax import ChatModel
    bot = ChatModel.load("runs/cpu", generator="nsd")
    print(bot.chat([{"role": "user", "content": "hi, how are you"}]))
    for piece in bot.chat([{"role": "user", "content": "tell me about music"}], stream=True):
        print(piece, end="")
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import queue
import secrets
from collections.abc import Iterator, Sequence
from typing import Any, Self

from relf_jax.errors import UserError
from relf_jax.serving.batching import Batcher, Event, GenerationRequest
from relf_jax.serving.engines import Engine, RequestParams
from relf_jax.serving.scheduler import Policy

GENERATORS = ("ar", "standard", "nsd", "greedy", "bd", "relf")
ROLES = ("system", "user", "assistant")


def message_text(content: Any) -> str:
    """A message's content as text: a string, or OpenAI content parts of type "text"."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise UserError("message content parts must be objects {\"type\": \"text\", \"text\": \"...\"}")
            parts.append(part["text"])
        return " ".join(parts)
    raise UserError("message content must be a string or a list of text parts")


def check_messages(messages: Any) -> list[dict]:
    """Validate OpenAI-style messages; returns them as [{"role", "content" (str)}]."""
    if not isinstance(messages, list) or not messages:
        raise UserError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise UserError(f"messages[{i}] must be an object with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise UserError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m['role']!r}")
        out.append({"role": m["role"], "content": message_text(m["content"])})
    if all(m["role"] == "system" for m in out):
        raise UserError("messages need at least one user or assistant message")
    return out


@functools.lru_cache(maxsize=16)
def _jinja(source: str):
    """A Jinja2 chat template compiled once (compiling it per request costs more than rendering)."""
    import jinja2

    return jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(source)


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """Marker template: ``<user> text <assistant> text ... <assistant>``.

    System messages are put, marked with `system` (default: no marker), before the first turn.
    The prompt ends with the assistant marker (the model writes the reply), unless the last
    message is the assistant's, which the model then continues.
    """

    user: str = "<user>"
    assistant: str = "<assistant>"
    system: str = ""
    jinja: str = ""  # a Jinja2 template; when set, it renders instead of the markers

    def render(self, messages: Sequence[dict]) -> str:
        messages = check_messages(list(messages))
        if self.jinja:
            import jinja2

            try:
                return _jinja(self.jinja).render(messages=messages, add_generation_prompt=True)
            except jinja2.TemplateError as e:
                raise UserError(f"the chat template failed: {e}") from e
        parts = []
        for m in messages:
            text = " ".join(m["content"].split())
            if m["role"] == "system":
                parts.append(f"{self.system} {text}".strip())
            else:
                parts.append(f"{self.user if m['role'] == 'user' else self.assistant} {text}".rstrip())
        if messages[-1]["role"] != "assistant":
            parts.append(self.assistant)
        return " ".join(p for p in parts if p)

    @classmethod
    def from_file(cls, path: str) -> ChatTemplate:
        """A template from a ``.json`` marker file or a ``.jinja`` Jinja2 file."""
        if not os.path.isfile(path):
            raise UserError(f"chat template {path!r} is not a file")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if path.endswith((".jinja", ".j2")):
            return cls(jinja=text)
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"chat template {path!r} is not valid JSON: {e}") from e
        unknown = set(d) - {"user", "assistant", "system"}
        if not isinstance(d, dict) or unknown:
            raise UserError(f"chat template {path!r}: keys must be user, assistant, system; got {sorted(d)}")
        return cls(**d)


def encode_chat(tokenizer, template: ChatTemplate, messages: Sequence[dict]) -> list[int]:
    """BOS + the token ids of the rendered conversation."""
    return [tokenizer.bos_id] + tokenizer.encode(template.render(messages))


# AR tokens / speculative rounds per engine call when served (`load_engine`, `relf-jax serve`):
# amortises the host work per call (see `relf_jax.serving.engines._check_steps_per_call`). About
# 10 ms of model time per call for the demo's cpu model: 8 AR steps or 2 speculative rounds.
STEPS_PER_CALL = {"ar": 8, "speculative": 2}


def _or(steps_per_call: int | None, kind: str) -> int:
    return STEPS_PER_CALL[kind] if steps_per_call is None else steps_per_call


def load_engine(workdir: str, generator: str = "ar", *, slots: int = 8, k: int = 4, proposer: str = "draft",
                draft: str | None = None, nsd_top_p: float = 0.9, nfe: int | None = None,
                threshold: float = 0.95, top_k: int = 0, steps_per_call: int | None = None,
                max_context: int | None = None) -> Engine:
    """An engine over the checkpoint in `workdir` (the ``<workdir>/<family>`` layout of `relf-jax train`).

    generator: "ar"; "standard" / "nsd" / "greedy" (speculative, with `proposer` "draft" (the
    model in `draft`, default ``<workdir>/draft``), "prompt_lookup" or "corpus_ngram" (next-token
    statistics of the training data, `workflows.corpus_ngram_table`), `k` drafts per round);
    "bd" (block diffusion, `threshold`); "relf" (`nfe` steps). `steps_per_call`: AR tokens or
    speculative rounds per engine call (`relf_jax.serving.engines._check_steps_per_call`;
    None: `STEPS_PER_CALL`). `max_context` (AR and speculative; the others ignore it, as AR
    ignores `nfe`): prompt + reply tokens a slot holds, below the model's context (None: the
    model's). A slot's KV cache holds at most this many tokens (the engines size it to what the
    occupied slots need, `relf_jax.serving.engines._Spans`); longer requests are refused
    (HTTP 400).
    """
    from relf_jax import workflows
    from relf_jax.serving import engines as E

    if generator not in GENERATORS:
        raise UserError(f"unknown generator {generator!r}; choose one of: {', '.join(GENERATORS)}")
    if generator == "bd":
        return E.BlockDiffusionEngine(workflows.load_model(workdir, "bd"), slots, threshold=threshold)
    if generator == "relf":
        return E.ReLFEngine(workflows.load_model(workdir, "relf"), slots, nfe=nfe)
    lm = workflows.load_model(workdir, "ar")
    if generator == "ar":
        return E.AREngine(lm, slots, top_k=top_k, steps_per_call=_or(steps_per_call, "ar"), max_context=max_context)
    dm = table = None
    if proposer == "corpus_ngram":
        table = workflows.corpus_ngram_table(lm)
    if proposer == "draft":
        path = draft or os.path.join(workdir, "draft")
        dm = workflows.load_model(path, "ar")
        if dm.tokenizer.to_bytes() != lm.tokenizer.to_bytes():
            raise UserError(f"the draft in {path} uses another tokenizer than the target")
    return E.SpeculativeEngine(lm, dm, slots, rule=generator, k=k, proposer=proposer, nsd_top_p=nsd_top_p,
                               steps_per_call=_or(steps_per_call, "speculative"),
                               name=f"spec-{generator}", max_context=max_context, ngram_table=table)


class ChatModel:
    """Chat with a relf_jax model from Python, with the serving engines and batcher.

    Thread-safe: several threads may call `chat` at once; their requests share the slots.
    `warmup` compiles the engine at its shortest cache span only (`Engine.warmup`): loading
    stays quick, and a conversation that outgrows it pays a one-off compile (seconds on CPU).
    """

    def __init__(self, engine: Engine, template: ChatTemplate | None = None, *, policy: Policy | None = None,
                 max_queue: int | None = 256, warmup: bool = True):
        self.engine = engine
        self.template = template or ChatTemplate()
        if warmup:
            engine.warmup(spans=1)
        self.batcher = Batcher(engine, policy, max_queue=max_queue).start()

    @classmethod
    def load(cls, workdir: str, generator: str = "ar", *, template: ChatTemplate | str | None = None,
             slots: int = 4, **engine_kw) -> ChatModel:
        """Load the checkpoint in `workdir` with `generator` (see `load_engine` for the choices)."""
        if isinstance(template, str):
            template = ChatTemplate.from_file(template)
        return cls(load_engine(workdir, generator, slots=slots, **engine_kw), template)

    def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        return encode_chat(self.engine.tokenizer, self.template, messages)

    def chat(self, messages: Sequence[dict], *, stream: bool = False, max_tokens: int = 64,
             temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None,
             stop: Sequence[str] = ()) -> str | Iterator[str]:
        """The assistant's reply to `messages` (a string), or with `stream` an iterator of text pieces."""
        req = GenerationRequest(prompt=self.prompt_ids(messages),
                                params=RequestParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                                     seed=secrets.randbits(31) if seed is None else seed),
                                stop=tuple(stop))
        events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        rid = self.batcher.submit(req, events.put)
        pieces = self._pieces(rid, events)
        return pieces if stream else "".join(pieces)

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
