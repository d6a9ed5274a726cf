"""HuggingFace Llama / Qwen2 checkpoints in and out of relf_jax's causal LM: one place for both
directions (`hf_import`, `hf_export`).

Import: `from_hf(path)` reads a *local* HuggingFace directory (``config.json``; safetensors
weights, single-file or sharded with ``model.safetensors.index.json``; ``tokenizer.json`` or a
SentencePiece ``tokenizer.model``) into a `LoadedModel`; `import_hf(path, out)` also writes it
as a relf_jax checkpoint that every `relf-jax` command reads. Nothing is fetched from a hub.

Export: `export_hf(lm, out)` writes ``config.json`` + ``model.safetensors`` + tokenizer files
that ``transformers`` loads as ``LlamaForCausalLM`` (or ``Qwen2ForCausalLM`` for a model with
q/k/v biases).

Weight layout (HF -> relf_jax; HF linear weights are [out, in]):

    model.embed_tokens.weight [V, D]            -> embed [V, D]
    layers.i.self_attn.{q,k,v}_proj.weight       -> blocks.i.attn.w{q,k,v} [D, heads, Dh]
    layers.i.self_attn.{q,k,v}_proj.bias (Qwen2) -> blocks.i.attn.b{q,k,v} [heads, Dh]
    layers.i.self_attn.o_proj.weight [D, H*Dh]   -> blocks.i.attn.wo [H, Dh, D]
    layers.i.mlp.{gate,up,down}_proj.weight      -> blocks.i.mlp.w_{gate,up,down} (transposed)
    layers.i.{input,post_attention}_layernorm    -> blocks.i.{attn,mlp}_norm.scale
    model.norm.weight                            -> final_norm.scale
    lm_head.weight [V, D] (untied)               -> lm_head [D, V]

Both use the same rotary convention (rotate-half, theta ** (-2i / Dh); rope scaling llama3,
linear and dynamic as transformers computes them, `rope_config_from_hf`), RMSNorm in float32 and
SwiGLU, so the logits agree to float32 rounding. relf_jax's own models scale input embeddings by
sqrt(D) and tied logits by 1/sqrt(D) (`ModelConfig.embed_scaling`); on export this is folded into
untied ``embed_tokens`` / ``lm_head`` weights, so the exported model computes the same function.
"""

from relf_jax.export.hf_export import (
    export_hf,
    hf_config_from_model,
    hf_rope_config,
    hf_tensors_from_params,
    spm_to_tokenizer_json,
)
from relf_jax.export.hf_import import (
    ARCHITECTURES,
    ROPE_TYPES,
    from_hf,
    generation_defaults_from_hf,
    import_hf,
    is_hf_dir,
    model_config_from_hf,
    params_from_hf_tensors,
    read_chat_templates,
    read_safetensors_dir,
    rope_config_from_hf,
    tokenizer_from_hf,
)

__all__ = [
    "ARCHITECTURES", "ROPE_TYPES", "export_hf", "from_hf", "generation_defaults_from_hf", "hf_config_from_model",
    "hf_rope_config", "hf_tensors_from_params", "import_hf", "is_hf_dir", "model_config_from_hf",
    "params_from_hf_tensors", "read_chat_templates", "read_safetensors_dir", "rope_config_from_hf",
    "spm_to_tokenizer_json", "tokenizer_from_hf",
]
