"""`relf-jax sample` and `relf-jax eval`: a trained checkpoint, its config with the sampling
overrides applied, then texts printed (sample) or judged (eval)."""

from __future__ import annotations

import dataclasses
import json
import sys

# the families that write whole sequences (no per-token stream, no speculative decoding)
WHOLE_SEQUENCE = ("relf", "bd")


def sample_args(p):
    p.add_argument("--workdir", required=True)
    p.add_argument("--prompt", action="append", default=None, help="prompt text (repeatable)")
    p.add_argument("--stream", action="store_true", help="print the reply as it is generated")


def eval_args(p):
    p.add_argument("--workdir", required=True)
    p.add_argument("--judge", default="exact", help="'exact' (synthetic grammar) or an AR run directory")
    p.add_argument("--out", default=None, help="write the result as JSON here")


def model_and_config(args):
    """(model, config, family): the checkpoint in ``args.workdir`` of the family ``model=`` names
    (default ar), its config with the sample.*, speculative.*, flow.* and draft= overrides set."""
    from relf_jax import workflows
    from relf_jax.config import ConfigError, set_value

    pairs = []
    for item in args.overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        pairs.append(item.split("=", 1))
    family = next((v for k, v in pairs if k in ("model", "model.family")), "ar")
    lm = workflows.load_model(args.workdir, family)
    cfg = lm.cfg
    for key, value in pairs:
        if key in ("model", "model.family"):
            continue
        if not key.startswith(("sample.", "speculative.", "draft", "flow.", "nfe", "sampler")):
            raise ConfigError(f"{args.command} takes only sample.*, speculative.*, flow.* (nfe=, sampler=) "
                              f"and draft= overrides, got {key!r}")
        cfg = set_value(cfg, key, value)
    cfg.validate()
    return lm, cfg, family


def whole_sequence_samples(lm, cfg, family: str, prompts):
    """(samples, a speed note, extra report fields) of a ReLF or block-diffusion model."""
    from relf_jax import workflows

    if family == "relf":
        lm = dataclasses.replace(lm, cfg=cfg)
        s = workflows.sample_relf(lm, cfg.sample.num_samples, prompts=prompts or None,
                                  batch_size=cfg.sample.batch_size, seed=cfg.sample.seed, warmup=False)
        return s, f"{cfg.flow.nfe} network calls each ({cfg.flow.sampler})", {"nfe": cfg.flow.nfe}
    s = workflows.sample_bd(lm, prompts=prompts, sample_cfg=cfg.sample, warmup=False)
    return s, f"{s.tau:.2f} tokens per forward (denoising steps + refreshes)", {}


def sample(args) -> int:
    from relf_jax import workflows
    from relf_jax.config import ConfigError

    lm, cfg, family = model_and_config(args)
    if family in WHOLE_SEQUENCE:
        s, speed_note, _ = whole_sequence_samples(lm, cfg, family, args.prompt)
        for text in s.texts:
            print(text)
        print(f"[{len(s.texts)} samples, {speed_note}, {s.tokens_per_s:,.1f} tokens/s]", file=sys.stderr)
        return 0
    cfg = fit_sample_context(lm, args.prompt or [""], cfg)
    if args.stream:
        if cfg.speculative.rule != "none":
            raise ConfigError("--stream decodes autoregressively; drop speculative.rule or --stream")
        for prompt in args.prompt or [""]:
            for piece in workflows.stream_reply(lm, prompt, cfg.sample):
                print(piece, end="", flush=True)
            print()
        return 0
    s = workflows.sample(lm, prompts=args.prompt, sample_cfg=cfg.sample, warmup=False, speculative=cfg.speculative)
    for text in s.texts:
        print(text)
    print(f"[{s.tokens} tokens, {s.tokens_per_s:,.1f} tokens/s, {s.tau:.2f} tokens per target forward]",
          file=sys.stderr)
    return 0


def evaluate(args) -> int:
    from relf_jax import workflows

    lm, cfg, family = model_and_config(args)
    if family in WHOLE_SEQUENCE:
        s, _, extra = whole_sequence_samples(lm, cfg, family, None)
        out = {**workflows.evaluate_samples(s, judge_of(args, cfg)), **extra, "step": lm.step}
    else:
        judge = judge_of(args, cfg)
        s = workflows.sample(lm, sample_cfg=cfg.sample, speculative=cfg.speculative)
        out = workflows.evaluate_samples(s, judge)
        out["tau"] = s.tau
        out["validation_loss"] = workflows.validation_loss(lm)
        out["step"] = lm.step
    print(json.dumps(out, indent=2))
    if args.out:
        workflows.write_json(args.out, out)
    return 0


def judge_of(args, cfg):
    """``--judge``: the exact synthetic-grammar judge, or the AR model in that run directory."""
    from relf_jax import workflows

    return workflows.exact_judge(cfg) if args.judge == "exact" else workflows.model_judge(args.judge)


def fit_sample_context(lm, prompts, cfg):
    """`cfg` with sample.max_new_tokens cut to the context the longest prompt leaves (a note on stderr)."""
    from relf_jax import workflows

    longest = max(len(workflows.encode_prompt(lm.tokenizer, p)) for p in prompts)
    extra = cfg.speculative.k + 1 if cfg.speculative.rule != "none" else 0
    n, note = workflows.fit_new_tokens(longest, cfg.sample.max_new_tokens, lm.model_cfg.max_seq_len, extra)
    if note:
        print(f"relf-jax: note: {note}", file=sys.stderr)
    return dataclasses.replace(cfg, sample=dataclasses.replace(cfg.sample, max_new_tokens=n))
