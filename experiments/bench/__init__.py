"""`relf-jax bench NAME`: measurements that take minutes, written as JSON with ratios measured in
one run (rows side by side in one process, on the same prompts, so their ratios hold on a noisy
machine). One module per bench; each has ``bench_<module>(out, quick=, workdir=, overrides=, ...)``.
"""

from __future__ import annotations

import importlib

# the `relf-jax bench` name -> its module in this package
BENCHES = {"spec": "spec", "relf": "relf", "verify": "verify", "latency": "latency", "flowstep": "flowstep",
           "hf": "hf", "rcsd": "rcsd", "dws": "dws", "serve": "serve", "relf-toy": "relf_toy", "bd": "bd"}


def bench_function(name: str):
    """The function that runs bench `name` (its module is imported only now: each pulls in its own stack)."""
    module = BENCHES[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), f"bench_{module}")
