"""HuggingFace Llama / Qwen2 checkpoints into relf_jax's causal LM (see `relf_jax.export.hf`).

`from_hf(path)` reads a *local* HuggingFace directory (``config.json``; safetensors weights,
single-file or sharded with ``model.safetensors.index.json``; ``tokenizer.json`` or a
SentencePiece ``tokenizer.model``) into a `LoadedModel`; `import_hf(path, out)` also writes it as
a relf_jax checkpoint that every `relf-jax` command reads. Nothing is fetched from a hub.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any

import numpy as np

from relf_jax.checkpoint import LoadedModel
from relf_jax.config import Config, ModelConfig
from relf_jax.data.tokenizer import HFTokenizer
from relf_jax.errors import UserError
from relf_jax.export.flat import params_from_flat, save_checkpoint

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ----------------------------------------------------------------------------- config

ROPE_TYPES = ("default", "linear", "dynamic", "llama3")  # HF rope_type values relf_jax implements


def rope_config_from_hf(hf: dict) -> dict:
    """The `ModelConfig` rope fields (and `max_seq_len`) of a ``config.json`` dict.

    Reads transformers' two spellings: ``rope_scaling`` (with ``rope_theta`` beside it, < 5) and
    ``rope_parameters`` (>= 5); like transformers, ``rope_scaling`` wins when both are present.
    rope_type ``default``, ``linear``, ``dynamic`` and ``llama3`` are supported (see
    `relf_jax.models.layers.Rope`); any other is a `UserError` that names it. A dynamic model's
    context is ``max_position_embeddings * factor`` (past max_position_embeddings, the base grows).
    """
    params = hf.get("rope_parameters") or {}
    rope = hf.get("rope_scaling") or params
    if not isinstance(rope, dict) or not isinstance(params, dict):
        raise UserError("config.json: rope_scaling / rope_parameters must be objects")
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind not in ROPE_TYPES:
        raise UserError(f"rope scaling {kind!r} (config.json) is not supported; relf_jax implements rope_type "
                        f"{', '.join(ROPE_TYPES)}")
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise UserError(f"unsupported: partial_rotary_factor={partial} (relf_jax rotates the whole head)")
    theta = rope.get("rope_theta") or hf.get("rope_theta") or params.get("rope_theta") or 10000.0
    max_len = int(hf.get("max_position_embeddings", 2048))
    out = {"rope_theta": float(theta), "max_seq_len": max_len}
    if kind == "default":
        return out

    def need(key):
        if rope.get(key) is None:
            raise UserError(f"config.json: rope_type {kind!r} needs {key!r} in rope_scaling / rope_parameters")
        try:
            return float(rope[key])
        except (TypeError, ValueError):
            raise UserError(f"config.json: rope {key!r} must be a number, got {rope[key]!r}") from None

    out.update(rope_scaling=kind, rope_factor=need("factor"))
    if kind == "llama3":
        original = hf.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings") or max_len
        out.update(rope_low_freq_factor=need("low_freq_factor"), rope_high_freq_factor=need("high_freq_factor"),
                   rope_original_max_len=int(original))
    elif kind == "dynamic":
        out.update(rope_original_max_len=max_len, max_seq_len=int(max_len * max(out["rope_factor"], 1.0)))
    return out


def model_config_from_hf(hf: dict, *, param_dtype: str = "float32") -> ModelConfig:
    """The relf_jax `ModelConfig` equal to a HuggingFace Llama / Qwen2 ``config.json`` dict."""
    kind = hf.get("model_type")
    if kind not in ARCHITECTURES:
        archs = ", ".join(hf.get("architectures") or []) or "none listed"
        raise UserError(f"unsupported architecture: model_type {kind!r} ({archs}); relf_jax imports "
                        f"{', '.join(ARCHITECTURES.values())}")
    if hf.get("hidden_act", "silu") != "silu":
        raise UserError(f"unsupported activation {hf['hidden_act']!r} (Llama/Qwen2 use silu)")
    if hf.get("mlp_bias"):
        raise UserError("unsupported: mlp_bias=true (MLP projections with biases)")
    if kind == "llama" and hf.get("attention_bias"):
        raise UserError("unsupported: attention_bias=true on a Llama model (o_proj bias)")
    if kind == "qwen2" and hf.get("use_sliding_window"):
        raise UserError("unsupported: use_sliding_window=true (sliding-window attention)")
    try:
        d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        cfg = ModelConfig(
            family="ar", vocab_size=int(hf["vocab_size"]), d_model=d, num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or d // heads), mlp_dim=int(hf["intermediate_size"]),
            **rope_config_from_hf(hf),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            embed_scaling=False, qkv_bias=kind == "qwen2", dtype="float32", param_dtype=param_dtype)
        cfg.check_rope()
        return cfg
    except KeyError as e:
        raise UserError(f"config.json lacks {e.args[0]!r}") from None


# ----------------------------------------------------------------------------- weights

def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_safetensors_dir(path: str) -> dict[str, np.ndarray]:
    """Every tensor of a HF directory's safetensors weights (single file or sharded)."""
    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        files = sorted(set(_read_json(index)["weight_map"].values()))
    else:
        files = [os.path.basename(f) for f in sorted(glob.glob(os.path.join(path, "*.safetensors")))]
    if not files:
        other = [os.path.basename(f) for f in glob.glob(os.path.join(path, "*.bin"))]
        hint = " (found PyTorch .bin files: re-save the model with safe_serialization=True)" if other else ""
        raise UserError(f"no safetensors weights in {path}{hint}")
    out = {}
    for name in files:
        full = os.path.join(path, name)
        if not os.path.exists(full):
            raise UserError(f"{name}, listed in model.safetensors.index.json, is missing from {path}")
        # "flax" reads bfloat16 too (numpy alone cannot); arrays are copied to host numpy
        with safe_open(full, framework="flax") as f:
            for key in f.keys():
                out[key] = np.asarray(f.get_tensor(key))
    return out


def params_from_hf_tensors(model_cfg: ModelConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF tensor names -> relf_jax flat parameter names (see the module docstring)."""
    d, h, k, dh = model_cfg.d_model, model_cfg.num_heads, model_cfg.num_kv_heads, model_cfg.resolved_head_dim
    t = {n: v for n, v in tensors.items() if not n.endswith(_IGNORED_SUFFIXES)}
    used: set[str] = set()

    def take(name: str) -> np.ndarray:
        if name not in t:
            raise UserError(f"the weights lack {name!r}")
        used.add(name)
        return t[name]

    def shaped(name: str, arr: np.ndarray, shape: tuple) -> np.ndarray:
        if arr.size != int(np.prod(shape)):
            raise UserError(f"{name} has shape {tuple(arr.shape)}; config.json implies {int(np.prod(shape))} "
                            "elements for it (mismatched shapes)")
        return arr.reshape(shape)

    out = {"embed": take("model.embed_tokens.weight"), "final_norm.scale": take("model.norm.weight")}
    if not model_cfg.tie_embeddings:
        out["lm_head"] = take("lm_head.weight").T
    elif "lm_head.weight" in t:
        used.add("lm_head.weight")  # a tied model may still store the (identical) head
    for i in range(model_cfg.num_layers):
        p, q = f"model.layers.{i}.", f"blocks.{i}."
        for ours, theirs, heads in (("wq", "q_proj", h), ("wk", "k_proj", k), ("wv", "v_proj", k)):
            w = take(f"{p}self_attn.{theirs}.weight")
            out[f"{q}attn.{ours}"] = shaped(f"{p}self_attn.{theirs}.weight", w.T, (d, heads, dh))
            if model_cfg.qkv_bias:
                b = take(f"{p}self_attn.{theirs}.bias")
                out[f"{q}attn.b{ours[1]}"] = shaped(f"{p}self_attn.{theirs}.bias", b, (heads, dh))
        out[f"{q}attn.wo"] = shaped(f"{p}self_attn.o_proj.weight", take(f"{p}self_attn.o_proj.weight").T, (h, dh, d))
        for proj in ("gate", "up", "down"):
            out[f"{q}mlp.w_{proj}"] = take(f"{p}mlp.{proj}_proj.weight").T
        out[f"{q}attn_norm.scale"] = take(f"{p}input_layernorm.weight")
        out[f"{q}mlp_norm.scale"] = take(f"{p}post_attention_layernorm.weight")
    extra = sorted(set(t) - used)
    if extra:
        raise UserError(f"the weights hold tensors this {model_cfg.num_layers}-layer config does not use: "
                        f"{extra[:5]}{'...' if len(extra) > 5 else ''}")
    return {n: np.ascontiguousarray(v) for n, v in out.items()}


# ----------------------------------------------------------------------------- tokenizer

def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _id_list(value: Any, what: str) -> list[int]:
    """An ``*_token_id`` entry: an int, a list of ints, or absent."""
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise UserError(f"{what} must be a token id or a list of ids, got {value!r}")
    return list(items)


def read_chat_templates(path: str, tcfg: dict) -> dict[str, str]:
    """The folder's chat templates, name -> Jinja source (``"default"``: the one used without tools).

    As transformers reads them: ``chat_template.jinja`` (default) and
    ``additional_chat_templates/<name>.jinja`` take priority over the ``chat_template`` key of
    tokenizer_config.json, which is a string (the default) or a list of
    ``{"name": ..., "template": ...}``; a processor's ``chat_template.json`` is the last resort.
    """
    templates: dict[str, str] = {}
    main = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(main):
        with open(main, encoding="utf-8") as f:
            templates["default"] = f.read()
    for extra in sorted(glob.glob(os.path.join(path, "additional_chat_templates", "*.jinja"))):
        with open(extra, encoding="utf-8") as f:
            templates[os.path.basename(extra)[:-len(".jinja")]] = f.read()
    if templates:
        return templates
    value = tcfg.get("chat_template")
    if value is None and os.path.isfile(os.path.join(path, "chat_template.json")):
        value = _read_json(os.path.join(path, "chat_template.json")).get("chat_template")
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: t["template"] for t in value}
    raise UserError(f"{path}: chat_template in tokenizer_config.json must be a string or a list of "
                    "{\"name\": ..., \"template\": ...}")


def generation_defaults_from_hf(gen: dict) -> dict:
    """Sampling defaults from a generation_config.json dict, as transformers' ``generate`` uses them.

    transformers samples only with ``do_sample: true``; otherwise it decodes greedily and
    ignores temperature / top_p / top_k / min_p. So those four are defaults only when do_sample
    is true (an OpenAI-style server otherwise keeps its own defaults, T = 1). repetition_penalty
    applies to greedy decoding too and is always taken. ``top_k: 0`` means no top-k (dropped).
    """
    keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    if gen.get("do_sample") is not True:
        keys = ("repetition_penalty",)
    out: dict = {}
    for k in keys:
        v = gen.get(k)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v):
            raise UserError(f"generation_config.json: {k} must be a number, got {v!r}")
        ok = {"temperature": v >= 0, "top_p": 0 < v <= 1, "top_k": v >= 0 and float(v).is_integer(),
              "min_p": 0 <= v <= 1, "repetition_penalty": v > 0}[k]
        if not ok:
            raise UserError(f"generation_config.json: {k}={v!r} is out of range")
        if k == "top_k":
            if int(v) > 0:
                out[k] = int(v)
        else:
            out[k] = float(v)
    return out


def _adds_bos(tk) -> int | None:
    """The id the tokenizer's post-processor puts before a text, if any (what ``tokenizer(text)``
    adds and ``add_special_tokens=False`` leaves out)."""
    bare = tk.encode("a", add_special_tokens=False).ids
    full = tk.encode("a", add_special_tokens=True).ids
    if len(full) > len(bare) and full[1:1 + len(bare)] == bare:
        return int(full[0])
    return None


def tokenizer_from_hf(path: str, hf_cfg: dict) -> HFTokenizer:
    """The directory's tokenizer (``tokenizer.json``; a ``tokenizer.model`` via transformers),
    with the folder's special tokens, EOS ids, chat templates and generation defaults.

    - Special tokens (bos/eos/pad/unk) are those of tokenizer_config.json (or
      special_tokens_map.json); ids from config.json / generation_config.json fill the gaps.
    - BOS: prompts start with one (``add_bos``) when tokenizer_config.json's ``add_bos_token``
      says so, or, without that key, when the tokenizer's post-processor adds it (what
      ``tokenizer(text)`` does). A model without a bos_token (Qwen2) gets none.
    - EOS ids: the tokenizer's eos_token, then every ``eos_token_id`` of generation_config.json
      and config.json (an int or a list), in that order, without repeats.
    - Chat templates: `read_chat_templates`; generation defaults: `generation_defaults_from_hf`.
    """
    tok_json = os.path.join(path, "tokenizer.json")
    if os.path.exists(tok_json):
        with open(tok_json, encoding="utf-8") as f:
            text = f.read()
    elif os.path.exists(os.path.join(path, "tokenizer.model")):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise UserError(f"{path} has only a SentencePiece tokenizer.model; reading it needs transformers "
                            "(pip install 'relf_jax[hf]')") from None
        text = AutoTokenizer.from_pretrained(path).backend_tokenizer.to_str()
    else:
        raise UserError(f"no tokenizer.json or tokenizer.model in {path}")
    from tokenizers import Tokenizer as _Backend

    tk = _Backend.from_str(text)
    tcfg_path = os.path.join(path, "tokenizer_config.json")
    tcfg = _read_json(tcfg_path) if os.path.exists(tcfg_path) else {}
    gen_path = os.path.join(path, "generation_config.json")
    gen = _read_json(gen_path) if os.path.exists(gen_path) else {}
    stm_path = os.path.join(path, "special_tokens_map.json")
    stm = _read_json(stm_path) if os.path.exists(stm_path) else {}
    names = ("bos_token", "eos_token", "pad_token", "unk_token")
    tokens = {}
    for name in names:
        t = _token_text(tcfg[name]) if name in tcfg else _token_text(stm.get(name))
        if t is not None and tk.token_to_id(t) is not None:
            tokens[name] = t
    ids = {n: tk.token_to_id(t) for n, t in tokens.items()}

    def config_id(key: str) -> int | None:
        found = (_id_list(hf_cfg.get(key), f"config.json {key}")
                 or _id_list(gen.get(key), f"generation_config.json {key}"))
        return found[0] if found else None

    eos_ids = list(dict.fromkeys(
        ([ids["eos_token"]] if "eos_token" in ids else [])
        + _id_list(gen.get("eos_token_id"), "generation_config.json eos_token_id")
        + _id_list(hf_cfg.get("eos_token_id"), "config.json eos_token_id")))
    if not eos_ids:
        raise UserError(f"{path}: no eos token in tokenizer_config.json, config.json or generation_config.json")
    added = _adds_bos(tk)
    bos = ids.get("bos_token")
    if "add_bos_token" in tcfg and isinstance(tcfg["add_bos_token"], bool):
        add_bos = tcfg["add_bos_token"] and bos is not None
    else:
        add_bos = added is not None and (bos is None or added == bos)
        if add_bos and bos is None:  # the post-processor's BOS, named nowhere else
            bos = added
            tokens["bos_token"] = tk.id_to_token(added)
    if bos is None:  # no BOS (Qwen2): the config's id, or EOS, for code that needs an id
        bos = config_id("bos_token_id")
        bos = eos_ids[0] if bos is None else bos
    pad = ids.get("pad_token", config_id("pad_token_id"))
    return HFTokenizer(text, bos_id=bos, eos_id=eos_ids[0], eos_ids=eos_ids, add_bos=add_bos,
                       pad_id=eos_ids[0] if pad is None else pad, unk_id=ids.get("unk_token", -1),
                       special_tokens=tokens, chat_templates=read_chat_templates(path, tcfg),
                       generation_defaults=generation_defaults_from_hf(gen))


# ----------------------------------------------------------------------------- public API

def is_hf_dir(path: str) -> bool:
    """Whether `path` is a HuggingFace model folder: config.json and safetensors weights."""
    path = os.path.expanduser(str(path))
    return (os.path.isfile(os.path.join(path, "config.json"))
            and (os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
                 or bool(glob.glob(os.path.join(path, "*.safetensors")))))


def from_hf(path: str, *, mesh=None, param_dtype: str = "float32") -> LoadedModel:
    """Load a local HuggingFace Llama / Qwen2 directory as a relf_jax AR model.

    `mesh`: place the parameters by their logical axes on this mesh (default: one device).
    Raises `UserError` for a missing directory or config.json, an unsupported architecture,
    weights that do not match the config, or a missing tokenizer.
    """
    path = os.path.expanduser(str(path))
    if not os.path.isdir(path):
        raise UserError(f"{path!r} is not a local directory; relf_jax reads HuggingFace checkpoints from disk "
                        "only (download one first, e.g. `huggingface-cli download NAME --local-dir DIR`)")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise UserError(f"{path} has no config.json: not a HuggingFace model directory")
    hf_cfg = _read_json(cfg_path)
    model_cfg = model_config_from_hf(hf_cfg, param_dtype=param_dtype)
    tokenizer = tokenizer_from_hf(path, hf_cfg)
    flat = params_from_hf_tensors(model_cfg, read_safetensors_dir(path))
    graphdef, params = params_from_flat(model_cfg, flat, mesh=mesh, what=f"the weights in {path}")
    cfg = dataclasses.replace(Config(), model=model_cfg, workdir=path)
    return LoadedModel(cfg=cfg, model_cfg=model_cfg, graphdef=graphdef, params=params, tokenizer=tokenizer,
                       step=0, model_dir=path)


def import_hf(path: str, out: str, *, param_dtype: str = "float32") -> LoadedModel:
    """`from_hf`, then save as a relf_jax checkpoint in ``<out>/ar`` (for `relf-jax sample` etc.)."""
    lm = from_hf(path, param_dtype=param_dtype)
    model_dir = os.path.join(out, "ar")
    lm = dataclasses.replace(lm, cfg=dataclasses.replace(lm.cfg, workdir=out), model_dir=model_dir)
    save_checkpoint(lm, model_dir, extra_meta={"source": f"hf:{os.path.abspath(path)}"})
    return lm
