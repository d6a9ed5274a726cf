"""`relf-jax train`, `train-draft`, `reflow` and `rcsd`: training runs, each a library call."""

from __future__ import annotations

import json
import os


def train_args(p):
    p.add_argument("--preset", default="cpu")
    p.add_argument("--workdir", default=None, help="run directory (default runs/<preset>)")


def train(args) -> int:
    import relf_jax as rj
    from relf_jax.config import make_config
    from relf_jax.runtime.sharding import init_distributed

    cfg = make_config(args.preset, args.overrides, workdir=args.workdir or os.path.join("runs", args.preset))
    init_distributed(cfg.mesh.distributed)
    res = rj.train(cfg)
    print(json.dumps({"workdir": res.workdir, "step": res.step, "loss": res.loss, "eval_loss": res.eval_loss,
                      "resumed_from": res.resumed_from}))
    return 0


def train_draft_args(p):
    p.add_argument("--target", default=None, help="the target's run directory (or target=DIR)")
    p.add_argument("--workdir", default=None, help="where the draft goes (default <target>/draft)")


def train_draft(args) -> int:
    from relf_jax.config import ConfigError
    from relf_jax.speculative.recipes import train_draft as distil_draft

    target = args.target
    rest = []
    for item in args.overrides:
        if item.startswith("target="):
            target = item.split("=", 1)[1]
        else:
            rest.append(item)
    if not target:
        raise ConfigError("train-draft needs the target run: --target DIR or target=DIR")
    res = distil_draft(target, rest, args.workdir)
    print(json.dumps({"workdir": res.workdir, "step": res.step, "loss": res.loss, "eval_loss": res.eval_loss}))
    return 0


def reflow_args(p):
    p.add_argument("--workdir", required=True, help="run directory holding relf/")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--pairs", type=int, default=512, help="rollout pairs per round")
    p.add_argument("--steps", type=int, default=None, help="train steps per round (default train.steps)")
    p.add_argument("--data-weight", type=float, default=None, help="lambda: weight of the data loss (default 1)")
    p.add_argument("--pair-weight", type=float, default=1.0,
                   help="weight of the pair loss (0 with --data-weight 1: the no-pairs control)")
    p.add_argument("--name", default="relf_reflow", help="round directories <workdir>/<name><r>")


def reflow(args) -> int:
    from relf_jax.config import ConfigError
    from relf_jax.flow.recipes import reflow as reflow_rounds
    from relf_jax.flow.reflow import DATA_WEIGHT

    data_weight = DATA_WEIGHT if args.data_weight is None else args.data_weight
    if (args.rounds < 1 or args.pairs < 1 or data_weight < 0 or args.pair_weight < 0
            or data_weight + args.pair_weight <= 0):
        raise ConfigError("reflow needs --rounds >= 1, --pairs >= 1, --data-weight >= 0 and --pair-weight >= 0, "
                          "not both 0")
    if not args.name or os.sep in args.name or args.name == "relf":
        raise ConfigError(f"--name must be a plain directory name other than 'relf', got {args.name!r}")
    print(json.dumps(reflow_rounds(args.workdir, args.rounds, num_pairs=args.pairs, steps=args.steps,
                                      data_weight=data_weight, pair_weight=args.pair_weight,
                                      name=args.name), indent=2))
    return 0


def rcsd_args(p):
    p.add_argument("--target", required=True, help="the target's run directory")
    p.add_argument("--draft", default=None, help="the starting draft (default <target>/draft)")
    p.add_argument("--workdir", default=None, help="replay store, trained draft, progress (default <target>/rcsd)")
    p.add_argument("--cycles", type=int, default=10)
    p.add_argument("--prompts-per-cycle", type=int, default=128)
    p.add_argument("--prompts", default=None, help="a text file, one prompt per line (default: fresh "
                                                   "synthetic_chat prompts)")
    p.add_argument("--steps-per-cycle", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=32, help="training batch (traced replies)")
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--rule", default="standard", choices=["standard", "nsd"])
    p.add_argument("--pref-weight", type=float, default=1.0, help="0: online distillation only")


def _rcsd_prompts(args, target, n: int) -> list[str]:
    """`n` prompt texts: the --prompts file's lines in turn, else fresh synthetic_chat prompts."""
    from relf_jax.config import ConfigError
    from relf_jax.eval.evaluate import exact_judge

    if not args.prompts:
        judge = exact_judge(target.cfg)
        return [info["prompt"] for info in judge.grammar.sample_with_info(n, 4242)]
    if not os.path.exists(args.prompts):
        raise ConfigError(f"--prompts file {args.prompts} does not exist")
    with open(args.prompts) as f:
        texts = [line.strip() for line in f if line.strip()]
    if not texts:
        raise ConfigError(f"--prompts file {args.prompts} has no prompts")
    return [texts[i % len(texts)] for i in range(n)]


def rcsd(args) -> int:
    from relf_jax.config import ConfigError
    from relf_jax.data.tokenizer import encode_prompt
    from relf_jax.loading import load_model
    from relf_jax.speculative.continual import ContinualDraftTrainer, ContinualSettings
    from relf_jax.speculative.rcsd import RCSDLossSettings

    if (args.cycles < 1 or args.prompts_per_cycle < 1 or args.steps_per_cycle < 0 or args.pref_weight < 0
            or args.batch_size < 1 or not args.learning_rate > 0):
        raise ConfigError("rcsd needs --cycles >= 1, --prompts-per-cycle >= 1, --steps-per-cycle >= 0, "
                          "--batch-size >= 1, --learning-rate > 0, --pref-weight >= 0")
    target = load_model(args.target, "ar")
    draft = load_model(args.draft or os.path.join(args.target, "draft"), "ar")
    texts = _rcsd_prompts(args, target, args.cycles * args.prompts_per_cycle)
    ids = [encode_prompt(target.tokenizer, t) for t in texts]
    batches = [ids[c * args.prompts_per_cycle:(c + 1) * args.prompts_per_cycle] for c in range(args.cycles)]
    k, context = 4, min(target.model_cfg.max_seq_len, draft.model_cfg.max_seq_len)
    prompt_len = min(64, context // 2)
    settings = ContinualSettings(steps_per_cycle=args.steps_per_cycle, batch_size=args.batch_size,
                                 learning_rate=args.learning_rate, rule=args.rule, k=k, prompt_len=prompt_len,
                                 max_new_tokens=min(64, context - prompt_len - k - 1),
                                 loss=RCSDLossSettings(pref_weight=args.pref_weight))
    trainer = ContinualDraftTrainer(target, draft, args.workdir or os.path.join(args.target, "rcsd"), settings)
    trainer.run(batches, on_cycle=lambda r: print(json.dumps(r), flush=True))
    return 0
