"""The serving floor.

- engines.py: one slot-based interface (prefill / insert / generate / free) over the AR,
  speculative, block-diffusion and ReLF generators, plus a model-free mock;
- scheduler.py: queue policies (FCFS, SJF with aging, priority) and the bounded queue;
- batching.py: continuous batching of one engine under a policy (a background thread);
- chat.py: chat templates, `load_engine`, and `ChatModel` (the Python API);
- server.py: the OpenAI-compatible HTTP server of `relf-jax serve`;
- simulator.py: a discrete-event simulator of the same scheduler (used by `relf_jax.dws`).
"""
