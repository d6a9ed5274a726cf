"""`relf-jax import-hf` and `relf-jax export`: checkpoints to and from other formats."""

from __future__ import annotations

import json


def import_hf_args(p):
    p.add_argument("path", help="directory with config.json, safetensors weights and a tokenizer")
    p.add_argument("--out", required=True, help="run directory to write (the model goes to <out>/ar)")
    p.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16"])


def import_hf(args) -> int:
    from relf_jax.export.hf import import_hf
    from relf_jax.models.causal_lm import count_params

    lm = import_hf(args.path, args.out, param_dtype=args.param_dtype)
    print(json.dumps({"workdir": args.out, "model_dir": lm.model_dir, "params": count_params(lm.params),
                      "vocab_size": lm.model_cfg.vocab_size, "layers": lm.model_cfg.num_layers}))
    return 0


def export_args(p):
    p.add_argument("--workdir", required=True, help="run directory of the model")
    p.add_argument("--format", required=True, choices=["hf", "safetensors", "jax-export"])
    p.add_argument("--out", required=True, help="directory (hf, jax-export) or .safetensors file")
    p.add_argument("--batch", type=int, default=1, help="jax-export: batch size of the exported steps")
    p.add_argument("--prompt-len", type=int, default=64, help="jax-export: padded prompt length")
    p.add_argument("--max-len", type=int, default=None, help="jax-export: cache length (default max_seq_len)")
    p.add_argument("--platforms", default=None, help="jax-export: e.g. cpu,cuda,tpu (default: this backend)")


def export(args) -> int:
    from relf_jax.config import ConfigError
    from relf_jax.loading import load_model

    family = "ar"
    for item in args.overrides:
        key, _, value = item.partition("=")
        if key not in ("model", "model.family") or not value:
            raise ConfigError(f"export takes only model=ar|relf as an override, got {item!r}")
        family = value
    lm = load_model(args.workdir, family)
    if args.format == "hf":
        from relf_jax.export.hf import export_hf
        out = export_hf(lm, args.out)
    elif args.format == "safetensors":
        from relf_jax.export.safetensors_io import save_safetensors
        out = save_safetensors(lm, args.out)
    else:
        from relf_jax.export.jax_export import export_decode
        platforms = [p.strip() for p in args.platforms.split(",")] if args.platforms else None
        out = export_decode(lm, args.out, batch=args.batch, prompt_len=args.prompt_len, max_len=args.max_len,
                            platforms=platforms)
    print(json.dumps({"format": args.format, "out": out, "family": family, "step": lm.step}))
    return 0
