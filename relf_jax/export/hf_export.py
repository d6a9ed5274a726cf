"""relf_jax AR models out as HuggingFace Llama / Qwen2 directories (see `relf_jax.export.hf`).

`export_hf(lm, out)` writes ``config.json`` + ``model.safetensors`` + tokenizer files that
``transformers`` loads as ``LlamaForCausalLM`` (or ``Qwen2ForCausalLM`` for a model with q/k/v
biases). relf_jax's own models scale input embeddings by sqrt(D) and tied logits by 1/sqrt(D)
(`ModelConfig.embed_scaling`); this is folded into untied ``embed_tokens`` / ``lm_head`` weights,
so the exported model computes the same function.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Sequence

import numpy as np

from relf_jax.checkpoint import LoadedModel
from relf_jax.config import ModelConfig
from relf_jax.data.tokenizer import CHAT_MARKERS, HFTokenizer, Tokenizer
from relf_jax.errors import UserError
from relf_jax.export.flat import flat_params
from relf_jax.export.hf_import import ARCHITECTURES
from relf_jax.models.layers import convert_layout


def hf_rope_config(model_cfg: ModelConfig) -> dict:
    """The rope keys of a ``config.json`` for `model_cfg` (inverse of `rope_config_from_hf`):
    ``max_position_embeddings``, ``rope_theta``, ``rope_parameters`` and, for a scaled rope,
    ``rope_scaling`` (the same dict: transformers < 5 reads that one)."""
    m = model_cfg
    params: dict[str, Any] = {"rope_type": "default" if m.rope_scaling == "none" else m.rope_scaling,
                              "rope_theta": m.rope_theta}
    out: dict[str, Any] = {"max_position_embeddings": m.max_seq_len, "rope_theta": m.rope_theta}
    if m.rope_scaling != "none":
        params["factor"] = m.rope_factor
    if m.rope_scaling == "llama3":
        params.update(low_freq_factor=m.rope_low_freq_factor, high_freq_factor=m.rope_high_freq_factor,
                      original_max_position_embeddings=m.rope_original_max_len)
    if m.rope_scaling == "dynamic":
        out["max_position_embeddings"] = m.rope_original_max_len
    out["rope_parameters"] = params
    if m.rope_scaling != "none":
        out["rope_scaling"] = dict(params)
    return out


def hf_config_from_model(model_cfg: ModelConfig, *, bos_id: int, eos_id: int, pad_id: int) -> dict:
    """A ``config.json`` dict (Llama, or Qwen2 when the model has q/k/v biases)."""
    kind = "qwen2" if model_cfg.qkv_bias else "llama"
    tied = model_cfg.tie_embeddings and not model_cfg.embed_scaling
    cfg = {
        "architectures": [ARCHITECTURES[kind]], "model_type": kind,
        "vocab_size": model_cfg.vocab_size, "hidden_size": model_cfg.d_model,
        "intermediate_size": model_cfg.mlp_dim, "num_hidden_layers": model_cfg.num_layers,
        "num_attention_heads": model_cfg.num_heads, "num_key_value_heads": model_cfg.num_kv_heads,
        "head_dim": model_cfg.resolved_head_dim, "hidden_act": "silu",
        "rms_norm_eps": model_cfg.norm_eps,
        # both spellings: transformers < 5 reads rope_theta / rope_scaling, >= 5 rope_parameters
        **hf_rope_config(model_cfg),
        "tie_word_embeddings": tied, "attention_dropout": 0.0, "initializer_range": 0.02,
        "bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id,
        "torch_dtype": "float32", "dtype": "float32", "use_cache": True,
    }
    if kind == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    else:
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=model_cfg.num_layers)
    return cfg


def hf_tensors_from_params(model_cfg: ModelConfig, flat: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """relf_jax flat parameters -> HF tensor names, float32 (inverse of `params_from_hf_tensors`).

    `ModelConfig.embed_scaling` is folded into the weights: embed_tokens = E * sqrt(D) and, for a
    tied model, an untied lm_head = E / sqrt(D).
    """
    d, h, k, dh = model_cfg.d_model, model_cfg.num_heads, model_cfg.num_kv_heads, model_cfg.resolved_head_dim
    f = convert_layout({n: np.asarray(v, np.float32) for n, v in flat.items()}, model_cfg.weight_layout, "in_out")
    embed = f["embed"]
    out = {"model.norm.weight": f["final_norm.scale"]}
    if model_cfg.embed_scaling:
        out["model.embed_tokens.weight"] = embed * np.float32(d ** 0.5)
        out["lm_head.weight"] = embed * np.float32(d ** -0.5) if model_cfg.tie_embeddings else f["lm_head"].T
    else:
        out["model.embed_tokens.weight"] = embed
        if not model_cfg.tie_embeddings:
            out["lm_head.weight"] = f["lm_head"].T
    for i in range(model_cfg.num_layers):
        p, q = f"model.layers.{i}.", f"blocks.{i}."
        for ours, theirs, heads in (("wq", "q_proj", h), ("wk", "k_proj", k), ("wv", "v_proj", k)):
            out[f"{p}self_attn.{theirs}.weight"] = f[f"{q}attn.{ours}"].reshape(d, heads * dh).T
            if model_cfg.qkv_bias:
                out[f"{p}self_attn.{theirs}.bias"] = f[f"{q}attn.b{ours[1]}"].reshape(heads * dh)
        out[f"{p}self_attn.o_proj.weight"] = f[f"{q}attn.wo"].reshape(h * dh, d).T
        for proj in ("gate", "up", "down"):
            out[f"{p}mlp.{proj}_proj.weight"] = f[f"{q}mlp.w_{proj}"].T
        out[f"{p}input_layernorm.weight"] = f[f"{q}attn_norm.scale"]
        out[f"{p}post_attention_layernorm.weight"] = f[f"{q}mlp_norm.scale"]
    return {n: np.ascontiguousarray(v) for n, v in out.items()}


# Texts the SentencePiece -> tokenizer.json conversion is checked on (plus the caller's).
_PROBE_TEXTS = ("<user> hello , how are you today ? <assistant> i am fine , thanks !",
                "what is the weather like", "<assistant> ok <user> 42 .")


def spm_to_tokenizer_json(tok: Tokenizer, check_texts: Sequence[str] = ()) -> str:
    """A ``tokenizer.json`` that tokenizes like relf_jax's SentencePiece model (needs transformers).

    transformers converts the BPE merges; the normalizer and pre-tokenizer are then set to
    SentencePiece's behaviour here (NFKC, whitespace collapsed, a word-boundary piece before every
    word including the chat markers, unknown characters -> unk). The result is checked against
    the SentencePiece model on `check_texts`; a mismatch is an error.
    """
    try:
        from tokenizers import Regex, normalizers, pre_tokenizers
        from tokenizers import Tokenizer as _Backend
        from transformers import AutoTokenizer
    except ImportError:
        raise UserError("exporting relf_jax's SentencePiece tokenizer to tokenizer.json needs transformers "
                        "(pip install 'relf_jax[hf]')") from None
    with tempfile.TemporaryDirectory() as tmp:
        tok.save(os.path.join(tmp, "tokenizer.model"))
        with open(os.path.join(tmp, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump({"tokenizer_class": "LlamaTokenizer", "legacy": True, "add_bos_token": False,
                       "add_eos_token": False, "unk_token": tok.id_to_piece(tok.unk_id)}, f)
        spec = json.loads(AutoTokenizer.from_pretrained(tmp).backend_tokenizer.to_str())
    markers = [m for m in CHAT_MARKERS if tok.piece_to_id(m) != tok.unk_id]
    # user-defined markers become ordinary vocabulary words isolated by the pre-tokenizer
    spec["added_tokens"] = [a for a in spec["added_tokens"] if a["content"] not in markers]
    model = spec["model"]
    if model.get("type") == "BPE":
        model["ignore_merges"] = True  # a whole word in the vocabulary (a marker) is one token
        model["byte_fallback"] = False
        model["unk_token"] = tok.id_to_piece(tok.unk_id)
    backend = _Backend.from_str(json.dumps(spec))
    backend.normalizer = normalizers.Sequence([
        normalizers.NFKC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Strip(),
        normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    splits = [pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never", split=True)]
    if markers:
        pattern = "|".join(m.replace("|", "\\|") for m in markers)
        splits.insert(0, pre_tokenizers.Split(Regex(pattern), "isolated"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(splits)
    bad = [t for t in (*_PROBE_TEXTS, *check_texts)
           if backend.encode(t, add_special_tokens=False).ids != tok.encode(t)]
    if bad:
        raise UserError(f"the converted tokenizer.json disagrees with the SentencePiece model on {len(bad)} "
                        f"text(s), e.g. {bad[0][:60]!r}")
    return backend.to_str()


def export_hf(lm: LoadedModel, out: str, *, check_texts: Sequence[str] = ()) -> str:
    """Write `lm` (an AR model) as a HuggingFace directory that ``transformers`` loads.

    Files: config.json, generation_config.json, model.safetensors (float32),
    tokenizer.json + tokenizer_config.json (and tokenizer.model for a SentencePiece tokenizer),
    chat_template.jinja (+ additional_chat_templates/) when the tokenizer has templates.
    ``tokenizer(text)`` in transformers gives relf_jax's prompt ids (`encode_prompt`: a BOS where
    relf_jax puts one); generation_config.json lists every EOS id and the generation defaults
    (with ``do_sample: true`` when they include sampling settings). Returns `out`.
    """
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer as _Backend
    from tokenizers import processors

    if lm.model_cfg.family != "ar":
        raise UserError(f"--format hf exports AR models; this is a {lm.model_cfg.family!r} model "
                        "(use --format safetensors)")
    tok = lm.tokenizer
    os.makedirs(out, exist_ok=True)
    piece = tok.id_to_piece
    if isinstance(tok, HFTokenizer):
        tok_json = tok.backend.to_str()
        names = dict(tok.special_tokens_map)
    else:
        backend = _Backend.from_str(spm_to_tokenizer_json(tok, check_texts))
        bos = piece(tok.bos_id)  # relf_jax's prompts start with BOS: so does tokenizer(text)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.bos_id)])
        tok_json = backend.to_str()
        tok.save(os.path.join(out, "tokenizer.model"))
        names = {"bos_token": bos, "eos_token": piece(tok.eos_id), "pad_token": piece(tok.pad_id)}
        if getattr(tok, "unk_id", -1) >= 0:
            names["unk_token"] = piece(tok.unk_id)
    with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tok_json)
    tcfg = {"tokenizer_class": "PreTrainedTokenizerFast", **names, "add_bos_token": bool(tok.add_bos),
            "add_eos_token": False, "model_max_length": lm.model_cfg.max_seq_len}
    eos_ids = list(tok.eos_ids)
    gen = {"bos_token_id": tok.bos_id, "eos_token_id": eos_ids if len(eos_ids) > 1 else tok.eos_id,
           "pad_token_id": tok.pad_id, **tok.generation_defaults}
    if set(tok.generation_defaults) - {"repetition_penalty"}:
        gen["do_sample"] = True
    ids = {"bos_id": tok.bos_id, "eos_id": tok.eos_id, "pad_id": tok.pad_id}
    files = {
        "config.json": hf_config_from_model(lm.model_cfg, **ids),
        "generation_config.json": gen,
        "tokenizer_config.json": tcfg,
    }
    for name, obj in files.items():
        with open(os.path.join(out, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2)
    for name, source in tok.chat_templates.items():
        dest = os.path.join(out, "chat_template.jinja" if name == "default" else
                            os.path.join("additional_chat_templates", f"{name}.jinja"))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with open(dest, "w", encoding="utf-8") as f:
            f.write(source)
    tensors = hf_tensors_from_params(lm.model_cfg, flat_params(lm.params))
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out
