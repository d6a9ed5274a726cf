"""The serving floor.

- engine_api.py: the engine interface (prefill / insert / generate / free) and its request and
  step types;
- engines/: the AR, speculative, block-diffusion and ReLF engines over that interface, the slot
  machinery they share (slots.py), and a model-free mock;
- scheduler.py: queue policies (FCFS, SJF with aging, priority) and the bounded queue;
- batching.py: continuous batching of one engine under a policy (a background thread);
- loading.py: `engine_for` (the engine of a method object over a checkpoint) and `build_models`
  (the served models);
- chat_template.py: chat templates (messages to prompt text); chat.py: `ChatModel` (the Python API);
- http/: the OpenAI-compatible HTTP server of `relf-jax serve`;
- simulator.py: a discrete-event simulator of the same scheduler (used by `relf_jax.dws`).
"""
