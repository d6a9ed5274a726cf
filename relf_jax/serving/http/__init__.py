"""The OpenAI-compatible HTTP server of `relf-jax serve` (FastAPI on uvicorn) over the engines.

Endpoints: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming as
server-sent events of ``chat.completion.chunk`` / ``text_completion`` objects ending with
``data: [DONE]``, with ``stream_options.include_usage``; or one JSON object), ``GET
/v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text).

Request fields (docs/openai_api.md lists each): model, messages (chat) or prompt (completions),
temperature, top_p, max_tokens (also ``max_completion_tokens``; omitted: the rest of the
context), stop, stop_token_ids, seed, n, stream, stream_options, frequency_penalty,
presence_penalty, logit_bias, logprobs / top_logprobs, and the extra parameters top_k, min_p,
repetition_penalty. A knob the request omits takes the checkpoint's generation default
(``generation_config.json``), then OpenAI's. Types are strict (``"1"`` is not a number); an
unknown field, or an OpenAI field the server does not implement (tools, response_format, echo,
suffix, best_of, ...) at a value that would change the reply, is a 400 that names it.
relf_jax extra body fields (the OpenAI client's ``extra_body``):

- ``generator``: which engine of the model answers ("ar", "standard", "nsd", "greedy", "bd",
  "relf"); default the model's first. ``speculative_k`` and ``nfe`` must match that engine's
  settings when given (they are fixed when the server starts: ``--k``, ``--nfe``);
- ``priority``: an int for the priority policy (higher first).

Bad input gets an OpenAI-style error object ``{"error": {"message", "type", "param",
"code"}}`` with a 4xx status: 400 invalid request (malformed JSON, wrong types, out-of-range
values, a prompt that does not fit the context), 404 unknown model, 413 body too large, 429
queue full (with ``Retry-After``), 503 shutting down. A client that disconnects mid-stream is
cancelled and its slot freed before the next step. On SIGTERM uvicorn stops accepting
connections, the running requests finish, then the batchers stop.

Modules: `protocol` (request schemas and checks, error bodies), `responses` (response and
chunk objects, the event stream), `asgi` (body limit, timer, the lean path), `app` (the
routes, `create_app`, `serve`), `metrics` (Prometheus text). The served models are built by
`relf_jax.serving.loading.build_models`.
"""

from relf_jax.serving.http.app import create_app, serve

__all__ = ["create_app", "serve"]
