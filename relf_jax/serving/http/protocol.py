"""The OpenAI protocol of `relf-jax serve`: the request schemas (strict pydantic models), the
checks a schema cannot express, the engine settings a request maps to, and error bodies.

Types are strict (``"1"`` is not a number); an unknown field, or an OpenAI field the server does
not implement (tools, response_format, echo, suffix, best_of, ...) at a value that would change
the reply, is a 400 that names it. A knob the request omits takes the checkpoint's generation
default (``generation_config.json``), then OpenAI's.
"""

import json
import secrets
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from relf_jax.errors import UserError
from relf_jax.serving.engine_api import LOGPROBS_TOP, Engine, RequestParams

MAX_BODY_BYTES = 1 << 20
MAX_N = 16  # choices per request
SEED_STRIDE = 0x9E3779B1  # choice i of a seeded request samples with seed + i * SEED_STRIDE (choice 0: the seed)

# OpenAI request fields this server does not implement: a 400 naming the field, unless the value
# given is the field's no-op (NO_OP)
UNIMPLEMENTED = ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "response_format",
                 "audio", "modalities", "prediction", "reasoning_effort", "web_search_options", "service_tier",
                 "suffix", "echo", "best_of")
NO_OP: dict[str, Callable[[Any], bool]] = {
    "tools": lambda v: v == [], "functions": lambda v: v == [], "tool_choice": lambda v: v == "none",
    "function_call": lambda v: v == "none", "parallel_tool_calls": lambda v: v is False,
    "response_format": lambda v: v == {"type": "text"}, "modalities": lambda v: v == ["text"],
    "service_tier": lambda v: v in ("auto", "default"), "echo": lambda v: v is False, "suffix": lambda v: v == "",
    "best_of": lambda v: v == 1}


def dumps(obj) -> str:
    """JSON text, ASCII-only: a lone surrogate the client sent (echoed in an error) stays encodable."""
    return json.dumps(obj, ensure_ascii=True)


class APIError(Exception):
    """An OpenAI-style error answer: `status`, and the fields of `error_body`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


STRICT = ConfigDict(strict=True, extra="forbid")


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # name, tool_calls, tool_call_id: the template's
    role: str
    content: str | list[dict[str, Any]] | None = None


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class Common(BaseModel):
    """The fields chat and completions requests share."""

    model_config = STRICT
    model: str
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2 ** 63), le=2 ** 63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    # extra parameters (vLLM's names): top_k -1 or 0 is off
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    stop_token_ids: list[int] | None = None
    # no effect on the reply
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    # relf_jax's own
    generator: str | None = None
    speculative_k: int | None = Field(None, ge=1)
    nfe: int | None = Field(None, ge=1)
    priority: int = Field(0, ge=-(2 ** 31), le=2 ** 31 - 1)
    # OpenAI fields this server does not implement: refused by name unless at their no-op value
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    service_tier: Any = None
    suffix: Any = None
    echo: Any = None
    best_of: Any = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(Common):
    messages: list[Message] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=LOGPROBS_TOP)


class CompletionRequest(Common):
    prompt: str | list[str]
    logprobs: int | None = Field(None, ge=0, le=LOGPROBS_TOP)


def refuse_unimplemented(body: Common) -> None:
    """400 naming the first OpenAI field this server does not implement (given at a value
    that would change the reply)."""
    for name in UNIMPLEMENTED:
        value = getattr(body, name, None)
        if value is None or NO_OP.get(name, lambda v: False)(value):
            continue
        raise APIError(400, f"'{name}' is not implemented by this server", param=name, code="unsupported_field")


def stops_of(body: Common) -> tuple[str, ...]:
    stop = body.stop
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > 4:
        raise APIError(400, "at most 4 stop sequences", param="stop")
    if any(not s for s in stops):
        raise APIError(400, "stop sequences must be non-empty", param="stop")
    return stops


def chat_max_tokens(body: ChatRequest) -> int | None:
    return body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens


def chat_top_logprobs(body: ChatRequest) -> int | None:
    """The top log-probs a chat request asks for per token (None: no log-probs)."""
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


def completion_prompt(body: CompletionRequest) -> str:
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise APIError(400, "prompt must be a string (or a list of one string)", param="prompt")
        prompt = prompt[0]
    return prompt


def _logit_bias(body: Common) -> tuple[tuple[int, float], ...]:
    bias = []
    for key, value in (body.logit_bias or {}).items():
        try:
            tok = int(key)
        except ValueError:
            raise APIError(400, f"logit_bias keys are token ids, got {key!r}", param="logit_bias") from None
        bias.append((tok, float(value)))
    return tuple(bias)


def params_of(body: Common, max_tokens: int | None, prompt_len: int, engine: Engine,
              logprobs: int | None) -> list[RequestParams]:
    """The request's settings, one per choice (n); omitted knobs take the checkpoint's
    generation defaults (`generation_config.json`), then OpenAI's."""
    defaults = dict(getattr(engine.tokenizer, "generation_defaults", None) or {})

    def knob(name, fallback):
        value = getattr(body, name)
        return defaults.get(name, fallback) if value is None else value

    if max_tokens is None:  # the rest of the context, as vLLM
        max_tokens = engine.max_context - engine.reserve() - prompt_len
        if max_tokens < 1:
            raise APIError(400, f"the prompt of {prompt_len} tokens fills the model context of "
                                f"{engine.max_context - engine.reserve()} tokens", param="messages")
    bias = _logit_bias(body)
    top_k = knob("top_k", 0)
    base = secrets.randbits(31) if body.seed is None else int(body.seed) % (2 ** 31)
    try:
        return [RequestParams(
            max_tokens=max_tokens, temperature=float(knob("temperature", 1.0)), top_p=float(knob("top_p", 1.0)),
            seed=(base + i * SEED_STRIDE) % (2 ** 31) if body.seed is not None or i == 0 else secrets.randbits(31),
            top_k=0 if top_k in (-1, None) else int(top_k), min_p=float(knob("min_p", 0.0)),
            repetition_penalty=float(knob("repetition_penalty", 1.0)),
            frequency_penalty=float(body.frequency_penalty or 0.0),
            presence_penalty=float(body.presence_penalty or 0.0), logit_bias=bias, logprobs=logprobs,
            stop_token_ids=tuple(body.stop_token_ids or ())) for i in range(body.n)]
    except UserError as e:
        raise APIError(400, str(e)) from e
