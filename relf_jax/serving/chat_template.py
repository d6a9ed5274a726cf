"""Chat templates: OpenAI-style messages to the prompt text a model was trained on.

A checkpoint imported from HuggingFace brings its own Jinja template (`ChatTemplate.for_tokenizer`,
the default of `relf-jax serve` and `ChatModel`); relf_jax's own models use the turn format of the
built-in corpora (`synthetic_chat`, `chatterbot`)::

    <user> how is the weather <assistant> it is sunny <user> and tomorrow <assistant>

A template can also be set from a JSON file (``{"user": "...", "assistant": "...", "system":
"..."}``: the marker strings) or from a Jinja2 file (``*.jinja``). Jinja templates render as
transformers' ``apply_chat_template`` renders them (see `ChatTemplate` and docs/hf_chat.md).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from relf_jax.errors import UserError

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
                what = (f" (got type {kind!r}: only text is supported)"
                        if isinstance(kind, str) and kind != "text" else "")
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
            msg["tool_calls"] = [_tool_call(c, f"messages[{i}].tool_calls[{j}]")
                                 for j, c in enumerate(msg["tool_calls"])]
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


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks the assistant's tokens for training
    masks; a prompt renders just the body."""

    tags = frozenset({"generation"})

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _Namespace(jinja2.utils.Namespace):
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


@functools.lru_cache(maxsize=16)
def _jinja(source: str):
    """A Jinja2 chat template compiled once (compiling it per request costs more than rendering),
    in the environment transformers' ``apply_chat_template`` uses: sandboxed, trim_blocks and
    lstrip_blocks, loop controls, ``{% generation %}`` blocks (rendered as their body),
    ``raise_exception``, ``strftime_now`` and the plain-JSON ``tojson`` filter."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace)
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
