"""Helpers for the serving tests: tiny random models on the byte tokenizer, jobs run through an
engine, a live server."""

import contextlib
import dataclasses
import os
import socket
import threading
import time

import jax.numpy as jnp
import numpy as np

ROOT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_lm(family: str = "ar", seed: int = 0, **model_kw):
    """A LoadedModel with random weights over the mock engine's byte tokenizer (vocab 262)."""
    from flax import nnx

    from relf_jax.checkpoint import LoadedModel
    from relf_jax.config import make_config
    from relf_jax.models import build_model
    from relf_jax.serving.engines import ByteTokenizer

    tok = ByteTokenizer()
    cfg = make_config("tiny", [f"model.family={family}"] if family != "ar" else [])
    mc = dataclasses.replace(cfg.model, vocab_size=tok.vocab_size, **model_kw)
    graphdef, params = nnx.split(build_model(mc, nnx.Rngs(seed)))
    extras = {}
    if family == "relf":
        table = np.random.default_rng(seed).normal(size=(tok.vocab_size, mc.flow_embed_dim))
        table *= cfg.flow.embed_norm / np.linalg.norm(table, axis=1, keepdims=True)
        extras["flow.embeddings"] = jnp.asarray(table, jnp.float32)
    return LoadedModel(cfg=cfg, model_cfg=mc, graphdef=graphdef, params=params, tokenizer=tok, step=0,
                       extras=extras)


def run_engine(engine, jobs, steps, both_paths=False):
    """jobs: (slot, prompt, params, insert_before_step). Returns slot -> tokens (prefill tokens first).

    Runs with the fused `prefill_insert` (the batcher's path); both_paths: also with `prefill` +
    `insert`, checking both give the same tokens (the tests of each engine against its sampler do;
    the others need not compile the second path). A slot that reports done is freed as the
    batcher frees it (``stopped=True``: no device update) and must emit nothing after."""
    runs = []
    for fused in ((False, True) if both_paths else (True,)):
        state = engine.init_state()
        out, stopped = {}, set()
        for step in range(steps + 1):
            for slot, prompt, params, at in jobs:
                if at == step:
                    if fused:
                        state, pre = engine.prefill_insert(prompt, params, state, slot)
                    else:
                        pre = engine.prefill(prompt, params)
                        state = engine.insert(pre, state, slot)
                    out[slot] = list(pre.tokens)
            if step < steps:
                state, res = engine.generate(state)
                for slot in out:
                    assert slot not in stopped or (res.tokens[slot] == [] and not res.done[slot])
                    out[slot] += res.tokens[slot]
                    if res.done[slot] and slot not in stopped:
                        state = engine.free(state, slot, stopped=True)
                        stopped.add(slot)
                free = [s for s in range(engine.num_slots) if s not in out]
                assert all(res.tokens[s] == [] and not res.done[s] for s in free)
        runs.append(out)
    assert all(r == runs[-1] for r in runs)
    return runs[-1]


def wait_until(condition, timeout: float = 30.0, what: str = "the condition") -> None:
    """Poll `condition()` until it holds; a RuntimeError after `timeout` seconds (a bound on a
    hang, not a measurement)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not hold within {timeout} s")
        time.sleep(0.01)


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@contextlib.contextmanager
def live_server(models, **app_kw):
    """Serve `models` (see relf_jax.serving.http.create_app) on 127.0.0.1 in a thread; yields the base URL."""
    import uvicorn

    from relf_jax.serving.http import create_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(models, **app_kw), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, what="the test server's start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        for served in models.values():
            for s in served:
                s.batcher.stop(drain=False, timeout=5)


def mock_models(slots: int = 4, step_s: float = 0.0, max_queue: int = 64, name: str = "mock", policy=None,
                cost_fn=None):
    from relf_jax.serving.batching import Batcher
    from relf_jax.serving.chat_template import ChatTemplate
    from relf_jax.serving.engines import MockEngine
    from relf_jax.serving.loading import ServedEngine

    engine = MockEngine(slots, step_s=step_s)
    batcher = Batcher(engine, policy, max_queue=max_queue, cost_fn=cost_fn).start()
    return {name: [ServedEngine(engine, batcher, ChatTemplate(), None, {})]}  # method None: the mock engine

