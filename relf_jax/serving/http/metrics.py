"""``GET /metrics``: the served engines' batcher counters as Prometheus exposition text."""

import math
import time

from relf_jax.serving.loading import ServedEngine


def prometheus_text(models: dict[str, list[ServedEngine]], http_totals: dict | None = None) -> str:
    """Prometheus exposition text: queue length, slots, TTFT, tokens, tokens/s, acceptance length,
    and the server-side seconds of generation requests (`RequestTimer`)."""
    lines: list[str] = []

    def metric(name: str, kind: str, doc: str, samples: list[tuple[dict, float]]):
        lines.append(f"# HELP {name} {doc}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
            v = "+Inf" if value == math.inf else repr(float(value))
            lines.append(f"{name}{{{lab}}} {v}" if lab else f"{name} {v}")

    served = [(name, s) for name, ss in models.items() for s in ss]

    def each(fn):
        return [({"model": n, "generator": s.generator}, fn(s)) for n, s in served]

    metric("relf_queue_length", "gauge", "Requests waiting for a slot.", each(lambda s: s.batcher.queue_length()))
    metric("relf_active_slots", "gauge", "Slots holding a request.", each(lambda s: s.batcher.active()))
    metric("relf_slots", "gauge", "Slots of the engine.", each(lambda s: s.engine.num_slots))
    metric("relf_requests_total", "counter", "Finished requests by finish reason.",
           [({"model": n, "generator": s.generator, "reason": r}, c)
            for n, s in served for r, c in s.batcher.stats.requests.items()])
    metric("relf_rejected_total", "counter", "Requests refused with 429 (queue full).",
           each(lambda s: s.batcher.stats.rejected))
    metric("relf_generated_tokens_total", "counter", "Tokens generated.", each(lambda s: s.batcher.stats.tokens))
    metric("relf_tokens_per_second", "gauge", "Generated tokens per second since start.",
           each(lambda s: s.batcher.stats.tokens / max(time.monotonic() - s.batcher.stats.started, 1e-9)))
    metric("relf_model_seconds_total", "counter", "Seconds spent in engine prefill and steps.",
           each(lambda s: s.batcher.stats.model_s))
    metric("relf_engine_steps_total", "counter", "Engine generate steps.", each(lambda s: s.batcher.stats.steps))
    metric("relf_overlapped_steps_total", "counter",
           "Engine steps started before the host work on the previous step (timed as model seconds only "
           "while the step was still running).", each(lambda s: s.batcher.stats.overlapped))
    metric("relf_overlapped_steps_ready_early_total", "counter",
           "Overlapped steps that had already finished when collected (their host work counted as overhead).",
           each(lambda s: s.batcher.stats.ready_early))
    metric("relf_acceptance_length", "gauge",
           "Mean tokens a request gains per step (speculative: accepted drafts + 1).",
           each(lambda s: s.batcher.stats.tokens / max(s.batcher.stats.slot_steps, 1)))
    metric("relf_accepted_draft_tokens_total", "counter", "Speculative draft tokens accepted.",
           each(lambda s: s.batcher.stats.accepted))
    cached = [(n, s, s.engine.prefix_cache.metrics()) for n, s in served if s.engine.prefix_cache is not None]
    for key, kind, doc in (("hits", "counter", "Prefills that reused cached prefix blocks."),
                           ("lookups", "counter", "Prefills that looked their prompt up in the prefix cache."),
                           ("hit_tokens", "counter", "Prompt tokens served from the prefix cache (not prefilled)."),
                           ("evictions", "counter", "Prefix-cache blocks evicted (least recently used)."),
                           ("bytes_in_use", "gauge", "Bytes of the prefix cache's blocks holding a prefix."),
                           ("bytes_budget", "gauge", "Bytes of the prefix cache's pool (its memory budget).")):
        metric(f"relf_prefix_cache_{key}" + ("_total" if kind == "counter" else ""), kind, doc,
               [({"model": n, "generator": s.generator}, m[key]) for n, s, m in cached])
    lines.append("# HELP relf_ttft_seconds Time to first token.")
    lines.append("# TYPE relf_ttft_seconds histogram")
    for n, s in served:
        st = s.batcher.stats
        lab = f'model="{n}",generator="{s.generator}"'
        for b, c in st.ttft_buckets.items():
            le = "+Inf" if b == math.inf else repr(b)
            lines.append(f'relf_ttft_seconds_bucket{{{lab},le="{le}"}} {c}')
        lines.append(f"relf_ttft_seconds_sum{{{lab}}} {st.ttft_sum!r}")
        lines.append(f"relf_ttft_seconds_count{{{lab}}} {st.ttft_count}")
    metric("relf_e2e_seconds_sum", "counter", "Summed end-to-end seconds of finished requests.",
           each(lambda s: s.batcher.stats.e2e_sum))
    metric("relf_e2e_seconds_count", "counter", "Finished requests counted in relf_e2e_seconds_sum.",
           each(lambda s: s.batcher.stats.e2e_count))
    if http_totals is not None:
        lines.append("# HELP relf_http_request_duration_seconds Server-side seconds of generation requests "
                     "(ASGI call to the last response byte).")
        lines.append("# TYPE relf_http_request_duration_seconds summary")
        lines.append(f"relf_http_request_duration_seconds_sum {float(http_totals['seconds'])!r}")
        lines.append(f"relf_http_request_duration_seconds_count {int(http_totals['count'])}")
    return "\n".join(lines) + "\n"
