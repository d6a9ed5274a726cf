"""Models in and out of relf_jax: HuggingFace Llama/Qwen2 (`hf`), safetensors for every family
(`safetensors_io`) and serialized `jax.export` prefill/decode steps (`jax_export`)."""
