"""Chat templates, engine loading and `ChatModel`, the Python API for Colab.

The chat template turns OpenAI-style messages into the prompt text a model was trained on.
A checkpoint imported from HuggingFace brings its own Jinja template (`ChatTemplate.for_tokenizer`,
the default of `relf-jax serve` and `ChatModel`); relf_jax's own models use the turn format of the
built-in corpora (`synthetic_chat`, `chatterbot`)::

    <user> how is the weather <assistant> it is sunny <user> and tomorrow <assistant>

A template can also be set from a JSON file (``{"user": "...", "assistant": "...", "system":
"..."}``: the marker strings) or from a Jinja2 file (``*.jinja``). Jinja templates render as
transformers' ``apply_chat_template`` renders them (see `ChatTemplate` and docs/hf_chat.md).

`ChatModel` runs the same engines and continuous batcher as `relf-jax serve`, in process::

    from relf_jax import ChatModel
    bot = ChatModel.load("runs/cpu", generator="nsd")
    print(bot.chat([{"role": "user", "content": "hi, how are you"}]))
    for piece in bot.chat([{"role": "user", "content": "tell me about music"}], stream=True):
        print(piece, end="")
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import queue
import secrets
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Self

from relf_jax.errors import UserError
from relf_jax.serving.batching import Batcher, Event, GenerationRequest
from relf_jax.serving.engine_api import Engine, RequestParams
from relf_jax.serving.scheduler import Policy

GENERATORS = ("ar", "standard", "nsd", "greedy", "bd", "relf")
ROLES = ("system", "developer", "user", "assistant", "tool")


def message_text(content: Any) -> str:
    """A message's content as text: a string, or OpenAI content parts of type "text" (joined
    with newlines, as vLLM joins them)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else None
                what = f" (got type {kind!r}: only text is supported)" if isinstance(kind, str) and kind != "text" else ""
                raise UserError("message content parts must be objects {\"type\": \"text\", \"text\": \"...\"}" + what)
            parts.append(part["text"])
        return "\n".join(parts)
    raise UserError("message content must be a string or a list of text parts")


def _tool_call(call: Any, where: str) -> dict:
    """An assistant's tool call, with OpenAI's JSON-string ``arguments`` parsed into an object
    (what chat templates expect: they write the arguments with ``tojson``)."""
    if not isinstance(call, dict):
        raise UserError(f"{where} must be an object")
    call = dict(call)
    fn = call.get("function")
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            args = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            args = None
        if isinstance(args, dict):
            call["function"] = {**fn, "arguments": args}
    return call


def check_messages(messages: Any) -> list[dict]:
    """Validate OpenAI-style messages; returns them as the dicts a chat template sees.

    Roles: system, developer, user, assistant, tool. ``content`` is a string or a list of text
    parts (returned as a string); an assistant's may be null or absent (e.g. with
    ``tool_calls``), returned as "". Other keys (``name``, ``tool_calls``, ``tool_call_id``,
    ...) are passed on, except those whose value is null (as transformers drops them).
    """
    if not isinstance(messages, list) or not messages:
        raise UserError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise UserError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = m["role"]
        if role not in ROLES:
            raise UserError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        content = m.get("content")
        if content is None and role != "assistant":
            raise UserError(f"messages[{i}] ({role}) needs 'content'")
        msg = {k: v for k, v in m.items() if v is not None and isinstance(k, str)}
        msg["content"] = "" if content is None else message_text(content)
        if "tool_calls" in msg:
            if role != "assistant" or not isinstance(msg["tool_calls"], list):
                raise UserError(f"messages[{i}].tool_calls must be a list, on an assistant message")
            msg["tool_calls"] = [_tool_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(msg["tool_calls"])]
        out.append(msg)
    if all(m["role"] in ("system", "developer") for m in out):
        raise UserError("messages need at least one user or assistant message")
    return out


class _TemplateRefused(Exception):
    """`raise_exception` called by a chat template (its message is for the user)."""


def _raise_exception(message):
    raise _TemplateRefused(str(message))


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """``tojson`` as transformers defines it: plain ``json.dumps`` (Jinja's own escapes HTML)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _jinja(source: str):
    """A Jinja2 chat template compiled once (compiling it per request costs more than rendering),
    in the environment transformers' ``apply_chat_template`` uses: sandboxed, trim_blocks and
    lstrip_blocks, loop controls, ``{% generation %}`` blocks (rendered as their body),
    ``raise_exception``, ``strftime_now`` and the plain-JSON ``tojson`` filter."""
    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` marks the assistant's tokens for training
        masks; a prompt renders just the body."""

        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    class Namespace(jinja2.utils.Namespace):
        """``namespace()`` that refuses underscore names (no way to reach dunder attributes)."""

        def __init__(*args, **kwargs):
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            if any(isinstance(k, str) and k.startswith("_") for k in attrs):
                raise jinja2.exceptions.SecurityError("a chat template may not set underscore names on a namespace")
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError("a chat template may not set underscore names on a namespace")
            jinja2.utils.Namespace.__setitem__(self, name, value)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=Namespace)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise UserError(f"the chat template is not valid Jinja: {e} (line {e.lineno})") from e


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A chat template: Jinja (`jinja`, a HuggingFace chat template) or markers.

    Jinja: rendered as transformers' ``apply_chat_template(messages, add_generation_prompt=True)``
    renders it: `check_messages`' messages, ``tools`` (None unless given; `tool_jinja`, the
    checkpoint's ``tool_use`` template, renders when tools are given and it exists),
    ``add_generation_prompt``, ``documents`` (None) and the tokenizer's special tokens
    (``bos_token``, ``eos_token``, ``pad_token``, ``unk_token``: those the model defines). A
    ``developer`` message is rendered as ``system`` unless the template mentions "developer".
    A template's ``raise_exception`` and any failure to render are `UserError` (HTTP 400).

    Markers: ``<user> text <assistant> text ... <assistant>``. System (and developer) messages
    are put, marked with `system` (default: no marker), before the first turn. The prompt ends
    with the assistant marker (the model writes the reply), unless the last message is the
    assistant's, which the model then continues. No tool role.
    """

    user: str = "<user>"
    assistant: str = "<assistant>"
    system: str = ""
    jinja: str = ""  # a Jinja2 template; when set, it renders instead of the markers
    tool_jinja: str = ""  # the Jinja2 template for requests with tools (HF's "tool_use"), if any

    @classmethod
    def for_tokenizer(cls, tok) -> ChatTemplate:
        """The checkpoint's own template (an imported HF model's ``chat_template``), else markers."""
        source = getattr(tok, "chat_template", None)
        if not source:
            return cls()
        return cls(jinja=source, tool_jinja=(getattr(tok, "chat_templates", None) or {}).get("tool_use", ""))

    def render(self, messages: Sequence[dict], *, special_tokens: Mapping[str, str] | None = None,
               tools: Sequence[dict] | None = None) -> str:
        messages = check_messages(list(messages))
        if self.jinja:
            return self._render_jinja(messages, special_tokens or {}, tools)
        parts = []
        for m in messages:
            if m["role"] == "tool":
                raise UserError("the marker chat template has no tool role; serve a model with a template that has one")
            text = " ".join(m["content"].split())
            if m["role"] in ("system", "developer"):
                parts.append(f"{self.system} {text}".strip())
            else:
                parts.append(f"{self.user if m['role'] == 'user' else self.assistant} {text}".rstrip())
        if messages[-1]["role"] != "assistant":
            parts.append(self.assistant)
        return " ".join(p for p in parts if p)

    def _render_jinja(self, messages: list[dict], special_tokens: Mapping[str, str], tools) -> str:
        import jinja2

        source = self.tool_jinja if tools is not None and self.tool_jinja else self.jinja
        if "developer" not in source:
            messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
        context = {**special_tokens, "messages": messages, "tools": None if tools is None else list(tools),
                   "documents": None, "add_generation_prompt": True}
        try:
            return _jinja(source).render(**context)
        except _TemplateRefused as e:
            raise UserError(f"the chat template refused the messages: {e}") from e
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError,
                ArithmeticError) as e:
            raise UserError(f"the chat template failed: {e}") from e

    @classmethod
    def from_file(cls, path: str) -> ChatTemplate:
        """A template from a ``.json`` marker file or a ``.jinja`` Jinja2 file."""
        if not os.path.isfile(path):
            raise UserError(f"chat template {path!r} is not a file")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if path.endswith((".jinja", ".j2")):
            _jinja(text)  # a syntax error is reported now, not on every request
            return cls(jinja=text)
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"chat template {path!r} is not valid JSON: {e}") from e
        unknown = set(d) - {"user", "assistant", "system"} if isinstance(d, dict) else set()
        if not isinstance(d, dict) or unknown:
            raise UserError(f"chat template {path!r}: keys must be user, assistant, system; "
                            f"got {sorted(d) if isinstance(d, dict) else type(d).__name__}")
        return cls(**d)


def encode_chat(tokenizer, template: ChatTemplate, messages: Sequence[dict], *,
                tools: Sequence[dict] | None = None) -> list[int]:
    """The prompt ids of a conversation: the rendered template's tokens (special tokens the
    template writes, e.g. ``<|im_start|>``, are their single ids), after a BOS when the tokenizer's
    prompts start with one (``add_bos``) and the template did not already write it."""
    specials = dict(getattr(tokenizer, "special_tokens_map", None) or {})
    text = template.render(messages, special_tokens=specials, tools=tools)
    ids = tokenizer.encode(text)
    bos = specials.get("bos_token")
    if getattr(tokenizer, "add_bos", True) and not (bos and text.startswith(bos)):
        ids = [tokenizer.bos_id] + ids
    return ids


# AR tokens / speculative rounds per engine call when served (`load_engine`, `relf-jax serve`):
# amortises the host work per call (see `relf_jax.serving.engines.slots.check_steps_per_call`). About
# 10 ms of model time per call for the demo's cpu model: 8 AR steps or 2 speculative rounds.
STEPS_PER_CALL = {"ar": 8, "speculative": 2}


# traffic tokens an online corpus n-gram table keeps (`load_engine`'s ngram_corpus "online")
ONLINE_NGRAM_TOKENS = 32768


def _or(steps_per_call: int | None, kind: str) -> int:
    return STEPS_PER_CALL[kind] if steps_per_call is None else steps_per_call


def load_engine(workdir: str, generator: str = "ar", *, slots: int = 8, k: int = 4, proposer: str = "draft",
                draft: str | None = None, nsd_top_p: float = 0.9, nfe: int | None = None,
                threshold: float = 0.95, top_k: int = 0, steps_per_call: int | None = None,
                max_context: int | None = None, ngram_corpus: str | Sequence[str] | None = None,
                ngram_online_tokens: int = ONLINE_NGRAM_TOKENS) -> Engine:
    """An engine over the checkpoint in `workdir` (the ``<workdir>/<family>`` layout of `relf-jax train`),
    or over a HuggingFace Llama / Qwen2 folder, loaded in place (AR and speculative generators;
    a draft may be an HF folder too).

    generator: "ar"; "standard" / "nsd" / "greedy" (speculative, with `proposer` "draft" (the
    model in `draft`, default ``<workdir>/draft``), "prompt_lookup" or "corpus_ngram" (next-token
    statistics, `k` drafts per round) of `ngram_corpus`: text files, directories or globs
    (`workflows.corpus_ngram_table`), and/or ``"online"``: the prompts and replies served,
    counted as requests finish (`relf_jax.speculative.ngram_draft.OnlineNgram`, keeping the
    newest `ngram_online_tokens` tokens; the named files, if any, always count). None: the
    training data of a model relf_jax trained; an imported model needs a corpus (`UserError`).
    "bd" (block diffusion, `threshold`); "relf" (`nfe` steps). `steps_per_call`: AR tokens or
    speculative rounds per engine call (`relf_jax.serving.engines.slots.check_steps_per_call`;
    None: `STEPS_PER_CALL`). `max_context` (AR and speculative; the others ignore it, as AR
    ignores `nfe`): prompt + reply tokens a slot holds, below the model's context (None: the
    model's). A slot's KV cache holds at most this many tokens (the engines size it to what the
    occupied slots need, `relf_jax.serving.engines.slots.Spans`); longer requests are refused
    (HTTP 400).
    """
    from relf_jax import workflows
    from relf_jax.data.tokenizer import same_tokenization
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
    dm = table = online = None
    corpus = [ngram_corpus] if isinstance(ngram_corpus, str) else list(ngram_corpus or [])
    if corpus and proposer != "corpus_ngram":
        raise UserError(f"an n-gram corpus (--ngram-corpus) is for proposer corpus_ngram, not {proposer!r}")
    if proposer == "corpus_ngram":
        files = [c for c in corpus if c != "online"]
        if "online" in corpus:
            from relf_jax.speculative.ngram_draft import OnlineNgram

            online = OnlineNgram(lm.model_cfg.vocab_size, max_tokens=ngram_online_tokens,
                                 seed_rows=workflows.corpus_rows(lm, files) if files else ())
            print(f"[corpus_ngram] the n-gram table counts the requests served (the newest {ngram_online_tokens} "
                  f"tokens){' and ' + ', '.join(files) if files else ''}", file=sys.stderr, flush=True)
        else:
            table = workflows.corpus_ngram_table(lm, files=files)
    if proposer == "draft":
        path = draft or os.path.join(workdir, "draft")
        if draft is None and not os.path.exists(path):
            raise UserError(f"generator {generator!r} with proposer 'draft' needs a draft model: none at {path}; "
                            "name one with draft= (relf-jax serve --draft PATH) or use proposer 'prompt_lookup' "
                            "or 'corpus_ngram'")
        dm = workflows.load_model(path, "ar")
        if not same_tokenization(dm.tokenizer, lm.tokenizer):
            raise UserError(f"the draft in {path} uses another tokenizer than the target")
    return E.SpeculativeEngine(lm, dm, slots, rule=generator, k=k, proposer=proposer, nsd_top_p=nsd_top_p,
                               steps_per_call=_or(steps_per_call, "speculative"),
                               name=f"spec-{generator}", max_context=max_context, ngram_table=table,
                               ngram_online=online)


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
    def load(cls, workdir: str, generator: str = "ar", *, template: ChatTemplate | str | None = None,
             slots: int = 4, **engine_kw) -> ChatModel:
        """Load the checkpoint in `workdir` with `generator` (see `load_engine` for the choices)."""
        if isinstance(template, str):
            template = ChatTemplate.from_file(template)
        return cls(load_engine(workdir, generator, slots=slots, **engine_kw), template)

    def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        return encode_chat(self.engine.tokenizer, self.template, messages)

    def chat(self, messages: Sequence[dict], *, stream: bool = False, max_tokens: int = 64,
             temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
             stop: Sequence[str] = ()) -> str | Iterator[str]:
        """The assistant's reply to `messages` (a string), or with `stream` an iterator of text pieces.

        temperature / top_p left None take the checkpoint's generation defaults
        (``tokenizer.generation_defaults``, from generation_config.json), else 1.0; so do the
        engine's other sampling settings it has fields for (top_k, min_p, repetition_penalty)."""
        defaults = dict(getattr(self.engine.tokenizer, "generation_defaults", None) or {})
        fields = {f.name for f in dataclasses.fields(RequestParams)}
        extra = {k: v for k, v in defaults.items() if k in fields and k not in ("temperature", "top_p")}
        req = GenerationRequest(prompt=self.prompt_ids(messages),
                                params=RequestParams(max_tokens=max_tokens,
                                                     temperature=defaults.get("temperature", 1.0)
                                                     if temperature is None else temperature,
                                                     top_p=defaults.get("top_p", 1.0) if top_p is None else top_p,
                                                     seed=secrets.randbits(31) if seed is None else seed, **extra),
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
