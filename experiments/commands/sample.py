"""`relf-jax sample` and `relf-jax eval`: a trained checkpoint, its config with the sampling
overrides applied and the method object it describes, then `relf_jax.api.sample` (texts printed)
or `relf_jax.api.evaluate` (the report)."""

from __future__ import annotations

import dataclasses
import json
import sys


def sample_args(p):
    p.add_argument("--workdir", required=True)
    p.add_argument("--prompt", action="append", default=None, help="prompt text (repeatable)")
    p.add_argument("--stream", action="store_true", help="print the reply as it is generated")


def eval_args(p):
    p.add_argument("--workdir", required=True)
    p.add_argument("--judge", default="exact", help="'exact' (synthetic grammar) or an AR run directory")
    p.add_argument("--out", default=None, help="write the result as JSON here")


def model_and_method(args):
    """(model, method): the checkpoint in ``args.workdir`` of the family ``model=`` names (default
    ar), its config with the sample.*, speculative.*, flow.*, draft= and mesh.* overrides set, and
    the method object that config describes (parsed here, once). The model is placed on the mesh
    ``mesh.*`` names (`relf_jax.runtime.sharding.model_mesh`) when a mesh key is given or the
    command runs on several hosts (`relf-jax launch-local`, a pod): the samples and the report
    are then the ones a single device gives."""
    import jax

    from relf_jax.config import ConfigError, set_value
    from relf_jax.loading import load_model
    from relf_jax.methods import method_from_config
    from relf_jax.runtime.sharding import model_mesh

    pairs = []
    for item in args.overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        pairs.append(item.split("=", 1))
    family = next((v for k, v in pairs if k in ("model", "model.family")), "ar")
    lm = load_model(args.workdir, family)
    cfg = lm.cfg
    for key, value in pairs:
        if key in ("model", "model.family"):
            continue
        if not key.startswith(("sample.", "speculative.", "draft", "flow.", "nfe", "sampler", "mesh.")):
            raise ConfigError(f"{args.command} takes only sample.*, speculative.*, flow.* (nfe=, sampler=), "
                              f"draft= and mesh.* overrides, got {key!r}")
        cfg = set_value(cfg, key, value)
    cfg.validate()
    lm = dataclasses.replace(lm, cfg=cfg)
    if any(k.startswith("mesh.") for k, _ in pairs) or jax.process_count() > 1:
        mesh = model_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
        lm = lm if mesh is None else lm.on_mesh(mesh)
    return lm, method_from_config(cfg)


def sample(args) -> int:
    from relf_jax import api
    from relf_jax.config import ConfigError
    from relf_jax.methods import Autoregressive, BlockDiffusion, Flow

    lm, method = model_and_method(args)
    n = lm.cfg.sample.num_samples
    if isinstance(method, (Flow, BlockDiffusion)):  # whole sequences
        s = api.sample(lm, args.prompt, None, method, num_samples=n)
        speed_note = (f"{method.nfe} network calls each ({method.sampler})" if isinstance(method, Flow)
                      else f"{s.tau:.2f} tokens per forward (denoising steps + refreshes)")
        for text in s.texts:
            print(text)
        print(f"[{len(s.texts)} samples, {speed_note}, {s.tokens_per_s:,.1f} tokens/s]", file=sys.stderr)
        return 0
    lm = fit_sample_context(lm, args.prompt or [""])
    if args.stream:
        if not isinstance(method, Autoregressive):
            raise ConfigError("--stream decodes autoregressively; drop speculative.rule or --stream")
        for prompt in args.prompt or [""]:
            for piece in api.stream(lm, prompt):
                print(piece, end="", flush=True)
            print()
        return 0
    s = api.sample(lm, args.prompt, None, method, num_samples=n)
    for text in s.texts:
        print(text)
    print(f"[{s.tokens} tokens, {s.tokens_per_s:,.1f} tokens/s, {s.tau:.2f} tokens per target forward]",
          file=sys.stderr)
    return 0


def evaluate(args) -> int:
    import jax

    from relf_jax import api
    from relf_jax.io import write_json

    lm, method = model_and_method(args)
    out = api.evaluate(lm, args.judge, None, method)
    print(json.dumps(out, indent=2))
    if args.out and jax.process_index() == 0:  # on several hosts: one writer
        write_json(args.out, out)
    return 0


def fit_sample_context(lm, prompts):
    """`lm` with sample.max_new_tokens cut to the context the longest prompt leaves (a note on stderr)."""
    from relf_jax.data.tokenizer import encode_prompt
    from relf_jax.sampling.recipes import fit_new_tokens

    cfg = lm.cfg
    longest = max(len(encode_prompt(lm.tokenizer, p)) for p in prompts)
    extra = cfg.speculative.k + 1 if cfg.speculative.rule != "none" else 0
    n, note = fit_new_tokens(longest, cfg.sample.max_new_tokens, lm.model_cfg.max_seq_len, extra)
    if note:
        print(f"relf-jax: note: {note}", file=sys.stderr)
    return dataclasses.replace(lm, cfg=dataclasses.replace(cfg, sample=dataclasses.replace(cfg.sample,
                                                                                           max_new_tokens=n)))
