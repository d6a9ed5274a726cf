"""The `relf-jax` command line (also ``python -m experiments.launch``).

Parses arguments and calls library functions; holds no method. Config overrides are
``key=value`` words after the subcommand, e.g.::

    relf-jax train --preset tiny --workdir runs/tiny train.steps=200
    relf-jax sample --workdir runs/tiny --prompt "<user> how is the weather <assistant>"
    relf-jax train-draft target=runs/tiny
    relf-jax sample --workdir runs/tiny speculative.rule=nsd speculative.k=4 draft=runs/tiny/draft
    relf-jax eval --workdir runs/tiny
    relf-jax bench spec --out spec.json [--quick]
    relf-jax bench relf --out relf.json [--quick]
    relf-jax bench relf-toy --out relf_toy.json [--quick]
    relf-jax train --preset tiny --workdir runs/tiny model=relf
    relf-jax reflow --workdir runs/tiny --rounds 2
    relf-jax sample --workdir runs/tiny/relf_reflow2 model=relf nfe=16 sampler=euler
    relf-jax rcsd --target runs/tiny --cycles 10
    relf-jax import-hf path/to/hf_llama --out runs/llama
    relf-jax export --workdir runs/tiny --format hf --out exported/tiny_hf
    relf-jax export --workdir runs/tiny --format safetensors --out exported/tiny.safetensors [model=relf]
    relf-jax export --workdir runs/tiny --format jax-export --out exported/tiny_steps --batch 1
    relf-jax bench hf --out hf.json [--quick]
    relf-jax bench rcsd --out rcsd.json [--quick]
    relf-jax bench dws --out dws.json [--quick]
    relf-jax bench bd --out bd.json [--quick] [--budgets 600,1200] [--ablation] [--ar-rows relf.json]
    relf-jax serve --workdir runs/cpu --generator nsd --generator ar --port 8000
    relf-jax serve --model path/to/hf_qwen2_instruct --port 8000
    relf-jax bench serve --out serve.json [--quick]
    relf-jax demo --quick
    relf-jax info

On a TPU pod run the same command on every worker; JAX's multi-host runtime is started by
`relf_jax.sharding.init_distributed` (``mesh.distributed=auto|on|off``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="relf-jax", description="relf_jax: low-latency language models in JAX.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="prepare data + tokenizer and train (or resume) a model")
    t.add_argument("--preset", default="cpu")
    t.add_argument("--workdir", default=None, help="run directory (default runs/<preset>)")

    td = sub.add_parser("train-draft", help="distil a small draft model from a trained target")
    td.add_argument("--target", default=None, help="the target's run directory (or target=DIR)")
    td.add_argument("--workdir", default=None, help="where the draft goes (default <target>/draft)")

    rf = sub.add_parser("reflow", help="regularised reflow rounds of a trained ReLF model")
    rf.add_argument("--workdir", required=True, help="run directory holding relf/")
    rf.add_argument("--rounds", type=int, default=2)
    rf.add_argument("--pairs", type=int, default=512, help="rollout pairs per round")
    rf.add_argument("--steps", type=int, default=None, help="train steps per round (default train.steps)")
    rf.add_argument("--data-weight", type=float, default=None, help="lambda: weight of the data loss (default 1)")
    rf.add_argument("--pair-weight", type=float, default=1.0,
                    help="weight of the pair loss (0 with --data-weight 1: the no-pairs control)")
    rf.add_argument("--name", default="relf_reflow", help="round directories <workdir>/<name><r>")

    rc = sub.add_parser("rcsd", help="continual RCSD: serve speculatively, log traces, keep training the draft")
    rc.add_argument("--target", required=True, help="the target's run directory")
    rc.add_argument("--draft", default=None, help="the starting draft (default <target>/draft)")
    rc.add_argument("--workdir", default=None, help="replay store, trained draft, progress (default <target>/rcsd)")
    rc.add_argument("--cycles", type=int, default=10)
    rc.add_argument("--prompts-per-cycle", type=int, default=128)
    rc.add_argument("--prompts", default=None, help="a text file, one prompt per line (default: fresh "
                                                    "synthetic_chat prompts)")
    rc.add_argument("--steps-per-cycle", type=int, default=60)
    rc.add_argument("--batch-size", type=int, default=32, help="training batch (traced replies)")
    rc.add_argument("--learning-rate", type=float, default=3e-3)
    rc.add_argument("--rule", default="standard", choices=["standard", "nsd"])
    rc.add_argument("--pref-weight", type=float, default=1.0, help="0: online distillation only")

    s = sub.add_parser("sample", help="sample from a trained checkpoint")
    s.add_argument("--workdir", required=True)
    s.add_argument("--prompt", action="append", default=None, help="prompt text (repeatable)")
    s.add_argument("--stream", action="store_true", help="print the reply as it is generated")

    e = sub.add_parser("eval", help="gen PPL + entropy of samples, distinct-n, validation loss")
    e.add_argument("--workdir", required=True)
    e.add_argument("--judge", default="exact", help="'exact' (synthetic grammar) or an AR run directory")
    e.add_argument("--out", default=None, help="write the result as JSON here")

    d = sub.add_parser("demo", help="the main job: train, sample, measure, report")
    d.add_argument("--quick", action="store_true", help="tiny preset, about 2 minutes")
    d.add_argument("--workdir", default=None)

    b = sub.add_parser("bench", help="long measurements written as JSON (bench spec | relf | verify | latency | "
                                     "flowstep | hf | rcsd | dws | serve | relf-toy | bd)")
    b.add_argument("which", choices=["spec", "relf", "verify", "latency", "flowstep", "hf", "rcsd", "dws", "serve",
                                     "relf-toy", "bd"])
    b.add_argument("--out", required=True, help="JSON file to write")
    b.add_argument("--quick", action="store_true", help="tiny preset, a few minutes")
    b.add_argument("--workdir", default=None, help="where models are trained / cached")
    b.add_argument("--parts", default=None, help="bench serve and relf only: which parts, comma-separated; serve: "
                                                 "engines (AR vs NSD, batch-1 overhead), batcher (the same engines without the "
                                                 "server) and dws (FCFS vs SJF-DWS); "
                                                 "relf: models, reflow (reflow and no-pairs control rounds), "
                                                 "latency; default all")

    b.add_argument("--budgets", default=None, help="bench bd only: training budgets in steps, comma-separated "
                                                   "(default 600,1200)")
    b.add_argument("--ablation", action="store_true", help="bench bd only: also the old one-conversation-per-row "
                                                           "layout at the first budget")
    b.add_argument("--ar-rows", default=None, help="bench bd only: a bench relf report whose AR sweep rows are "
                                                   "used for the budgets it holds")

    ih = sub.add_parser("import-hf", help="a local HuggingFace Llama/Qwen2 directory -> a relf_jax checkpoint")
    ih.add_argument("path", help="directory with config.json, safetensors weights and a tokenizer")
    ih.add_argument("--out", required=True, help="run directory to write (the model goes to <out>/ar)")
    ih.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16"])

    ex = sub.add_parser("export", help="write a trained model as HuggingFace, safetensors or jax.export files")
    ex.add_argument("--workdir", required=True, help="run directory of the model")
    ex.add_argument("--format", required=True, choices=["hf", "safetensors", "jax-export"])
    ex.add_argument("--out", required=True, help="directory (hf, jax-export) or .safetensors file")
    ex.add_argument("--batch", type=int, default=1, help="jax-export: batch size of the exported steps")
    ex.add_argument("--prompt-len", type=int, default=64, help="jax-export: padded prompt length")
    ex.add_argument("--max-len", type=int, default=None, help="jax-export: cache length (default max_seq_len)")
    ex.add_argument("--platforms", default=None, help="jax-export: e.g. cpu,cuda,tpu (default: this backend)")

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server: chat/completions (streaming), models, "
                                      "health, metrics; continuous batching over slots")
    sv.add_argument("--model", default=None, dest="model_path",
                    help="a HuggingFace Llama/Qwen2 folder (config.json, safetensors, tokenizer; read in place, "
                         "with its chat template, EOS ids and generation defaults) or a relf_jax run directory")
    sv.add_argument("--workdir", default=None, help="trained run directory (ar/, draft/, bd/, relf/ inside), or a "
                                                    "HuggingFace folder as with --model")
    sv.add_argument("--generator", action="append", default=None,
                    choices=["ar", "standard", "nsd", "greedy", "bd", "relf"],
                    help="engine(s) to serve (repeatable; the first is the default; default ar)")
    sv.add_argument("--model-name", default=None, help="the model id clients ask for (default: workdir's name)")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--slots", type=int, default=8, help="requests decoded together per engine")
    sv.add_argument("--max-queue", type=int, default=256, help="queued requests before 429")
    sv.add_argument("--policy", default="fcfs", choices=["fcfs", "sjf", "priority"])
    sv.add_argument("--aging", type=float, default=0.05, help="sjf: predicted cost-seconds gained per second "
                                                               "waited; priority: levels per second")
    sv.add_argument("--dws-predictor", default=None, help="sjf: a trained DWS surface predictor directory")
    sv.add_argument("--dws-cost-model", default=None, help="sjf: the cost model JSON (relf-jax bench dws output)")
    sv.add_argument("--k", type=int, default=4, help="speculative: drafts per round")
    sv.add_argument("--proposer", default="draft", choices=["draft", "prompt_lookup", "corpus_ngram"])
    sv.add_argument("--ngram-corpus", nargs="+", default=None, metavar="FILE|online",
                    help="corpus_ngram: count the n-gram table from these .txt/.jsonl files, directories or globs, "
                         "and/or 'online': from the prompts and replies served (updated as requests finish). "
                         "Default: the training data of a model relf_jax trained (an imported model needs one)")
    sv.add_argument("--ngram-online-tokens", type=int, default=32768,
                    help="corpus_ngram online: the newest served tokens the table counts (its memory bound)")
    sv.add_argument("--draft", default=None, help="speculative: the draft's run directory (default <workdir>/draft)")
    sv.add_argument("--nsd-top-p", type=float, default=0.9)
    sv.add_argument("--nfe", type=int, default=None, help="relf: network calls per reply")
    sv.add_argument("--threshold", type=float, default=0.95, help="bd: confidence threshold")
    sv.add_argument("--steps-per-call", type=int, default=None,
                    help="ar / speculative: tokens or rounds per engine call; more cut host overhead, fewer "
                         "give a finer stream (default 8 for ar, 2 for speculative)")
    sv.add_argument("--max-context", type=int, default=None,
                    help="ar / speculative: prompt + reply tokens per slot, below the model's context (default: the "
                         "model's); longer requests are refused")
    sv.add_argument("--chat-template", default=None, help="a .json marker template or a .jinja template (default: "
                                                          "the checkpoint's own template, else the <user>/<assistant> "
                                                          "markers)")
    sv.add_argument("--mock", action="store_true", help="serve the model-free mock engine (echoes the user)")
    sv.add_argument("--mock-step-ms", type=float, default=0.0, help="mock: simulated model time per step")
    sv.add_argument("--no-lean-routes", action="store_true",
                    help="send generation requests through FastAPI's whole stack instead of the lean route "
                         "(the same answers; for measuring the route, as bench serve does)")
    sv.add_argument("--overlap", choices=["auto", "on", "off"], default="auto",
                    help="start each engine step before the host work on the last one is done (the same "
                         "answers); auto: on for the AR and speculative engines")
    sv.add_argument("--log-level", default="info")

    sub.add_parser("info", help="devices, mesh and versions")
    for sp in (t, td, s, e, d, b, ex):
        sp.add_argument("overrides", nargs="*", help="config overrides key=value")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line. Config overrides (key=value) may also follow the options: argparse alone
    does not take positionals after options once a subcommand's first positional is in
    (``bench dws --out F train.steps=9``)."""
    p = _parser()
    args, extra = p.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any(x.startswith("-") or "=" not in x for x in extra):
            p.error("unrecognized arguments: " + " ".join(extra))
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from relf_jax import jit_cache
    from relf_jax.errors import UserError

    jit_cache.enable()  # programs compiled by an earlier relf-jax process are read back (RELF_JAX_JIT_CACHE=off)

    try:
        return _run(args)
    except UserError as e:
        print(f"relf-jax: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("relf-jax: interrupted (the last finished step was checkpointed)", file=sys.stderr)
        return 130


def _run(args) -> int:
    from relf_jax import workflows
    from relf_jax.config import make_config, set_value
    from relf_jax.sharding import init_distributed

    if args.command == "info":
        from relf_jax.info import describe
        print(json.dumps(describe(), indent=2))
        return 0
    if args.command == "serve":
        return _serve(args)
    if args.command == "demo":
        from experiments.demo import run_demo
        run_demo(quick=args.quick, workdir=args.workdir, overrides=args.overrides)
        return 0
    if args.command == "bench":
        from experiments.bench import bench_function
        run_bench = bench_function(args.which)
        extra = {}
        if args.parts is not None:
            if args.which not in ("serve", "relf"):
                from relf_jax.errors import UserError
                raise UserError("--parts applies to bench serve and bench relf only")
            extra["parts"] = [p.strip() for p in args.parts.split(",") if p.strip()]
        if args.budgets is not None or args.ablation or args.ar_rows:
            if args.which != "bd":
                from relf_jax.errors import UserError
                raise UserError("--budgets, --ablation and --ar-rows apply to bench bd only")
            extra["ar_rows"] = args.ar_rows
            try:
                extra["budgets"] = [int(x) for x in args.budgets.split(",")] if args.budgets else None
            except ValueError:
                from relf_jax.errors import UserError
                raise UserError(f"--budgets must be comma-separated step counts, got {args.budgets!r}") from None
            extra["ablation"] = args.ablation
        run_bench(args.out, quick=args.quick, workdir=args.workdir, overrides=args.overrides, **extra)
        return 0
    if args.command == "train":
        cfg = make_config(args.preset, args.overrides, workdir=args.workdir or os.path.join("runs", args.preset))
        init_distributed(cfg.mesh.distributed)
        res = workflows.train_lm(cfg)
        print(json.dumps({"workdir": res.workdir, "step": res.step, "loss": res.loss, "eval_loss": res.eval_loss,
                          "resumed_from": res.resumed_from}))
        return 0
    if args.command == "reflow":
        from relf_jax.flow.reflow import DATA_WEIGHT
        data_weight = DATA_WEIGHT if args.data_weight is None else args.data_weight
        if (args.rounds < 1 or args.pairs < 1 or data_weight < 0 or args.pair_weight < 0
                or data_weight + args.pair_weight <= 0):
            from relf_jax.config import ConfigError
            raise ConfigError("reflow needs --rounds >= 1, --pairs >= 1, --data-weight >= 0 and --pair-weight >= 0, "
                              "not both 0")
        if not args.name or os.sep in args.name or args.name == "relf":
            from relf_jax.config import ConfigError
            raise ConfigError(f"--name must be a plain directory name other than 'relf', got {args.name!r}")
        print(json.dumps(workflows.reflow(args.workdir, args.rounds, num_pairs=args.pairs, steps=args.steps,
                                          data_weight=data_weight, pair_weight=args.pair_weight,
                                          name=args.name), indent=2))
        return 0
    if args.command == "rcsd":
        return _rcsd(args)
    if args.command == "import-hf":
        from relf_jax.export.hf import import_hf
        from relf_jax.models.causal_lm import count_params
        lm = import_hf(args.path, args.out, param_dtype=args.param_dtype)
        print(json.dumps({"workdir": args.out, "model_dir": lm.model_dir, "params": count_params(lm.params),
                          "vocab_size": lm.model_cfg.vocab_size, "layers": lm.model_cfg.num_layers}))
        return 0
    if args.command == "export":
        return _export(args)
    if args.command == "train-draft":
        target = args.target
        rest = []
        for item in args.overrides:
            if item.startswith("target="):
                target = item.split("=", 1)[1]
            else:
                rest.append(item)
        if not target:
            from relf_jax.config import ConfigError
            raise ConfigError("train-draft needs the target run: --target DIR or target=DIR")
        res = workflows.train_draft(target, rest, args.workdir)
        print(json.dumps({"workdir": res.workdir, "step": res.step, "loss": res.loss, "eval_loss": res.eval_loss}))
        return 0
    from relf_jax.config import ConfigError

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
    if family == "relf":
        lm = dataclasses.replace(lm, cfg=cfg)
        s = workflows.sample_relf(lm, cfg.sample.num_samples, prompts=getattr(args, "prompt", None) or None,
                                  batch_size=cfg.sample.batch_size, seed=cfg.sample.seed, warmup=False)
        return _sample_or_eval(args, cfg, lm, s, f"{cfg.flow.nfe} network calls each ({cfg.flow.sampler})",
                               {"nfe": cfg.flow.nfe})
    if family == "bd":
        s = workflows.sample_bd(lm, prompts=getattr(args, "prompt", None), sample_cfg=cfg.sample, warmup=False)
        return _sample_or_eval(args, cfg, lm, s, f"{s.tau:.2f} tokens per forward (denoising steps + refreshes)")
    if args.command == "sample":
        cfg = _fit_sample_context(lm, args.prompt or [""], cfg)
        if args.stream:
            if cfg.speculative.rule != "none":
                from relf_jax.config import ConfigError
                raise ConfigError("--stream decodes autoregressively; drop speculative.rule or --stream")
            for prompt in args.prompt or [""]:
                for piece in workflows.stream_reply(lm, prompt, cfg.sample):
                    print(piece, end="", flush=True)
                print()
            return 0
        s = workflows.sample(lm, prompts=args.prompt, sample_cfg=cfg.sample, warmup=False,
                             speculative=cfg.speculative)
        for text in s.texts:
            print(text)
        print(f"[{s.tokens} tokens, {s.tokens_per_s:,.1f} tokens/s, {s.tau:.2f} tokens per target forward]",
              file=sys.stderr)
        return 0
    if args.command == "eval":
        judge = workflows.exact_judge(cfg) if args.judge == "exact" else workflows.model_judge(args.judge)
        s = workflows.sample(lm, sample_cfg=cfg.sample, speculative=cfg.speculative)
        out = workflows.evaluate_samples(s, judge)
        out["tau"] = s.tau
        out["validation_loss"] = workflows.validation_loss(lm)
        out["step"] = lm.step
        print(json.dumps(out, indent=2))
        if args.out:
            workflows.write_json(args.out, out)
        return 0
    raise AssertionError(args.command)


def _fit_sample_context(lm, prompts, cfg):
    """`cfg` with sample.max_new_tokens cut to the context the longest prompt leaves (a note on stderr)."""
    from relf_jax import workflows

    longest = max(len(workflows.encode_prompt(lm.tokenizer, p)) for p in prompts)
    extra = cfg.speculative.k + 1 if cfg.speculative.rule != "none" else 0
    n, note = workflows.fit_new_tokens(longest, cfg.sample.max_new_tokens, lm.model_cfg.max_seq_len, extra)
    if note:
        print(f"relf-jax: note: {note}", file=sys.stderr)
    return dataclasses.replace(cfg, sample=dataclasses.replace(cfg.sample, max_new_tokens=n))


def _sample_or_eval(args, cfg, lm, samples, speed_note: str, extra: dict | None = None) -> int:
    """`sample`: print the texts and a one-line speed summary; `eval`: judge them, print (and
    write) the JSON. Shared by the whole-sequence generators (ReLF, block diffusion)."""
    from relf_jax import workflows

    if args.command == "sample":
        for text in samples.texts:
            print(text)
        print(f"[{len(samples.texts)} samples, {speed_note}, {samples.tokens_per_s:,.1f} tokens/s]", file=sys.stderr)
        return 0
    judge = workflows.exact_judge(cfg) if args.judge == "exact" else workflows.model_judge(args.judge)
    out = {**workflows.evaluate_samples(samples, judge), **(extra or {}), "step": lm.step}
    print(json.dumps(out, indent=2))
    if args.out:
        workflows.write_json(args.out, out)
    return 0


def _serve(args) -> int:
    from relf_jax.serving.chat import ChatTemplate
    from relf_jax.serving.server import build_models, serve

    cost_fn = None
    if args.dws_predictor or args.dws_cost_model:
        if not (args.dws_predictor and args.dws_cost_model):
            from relf_jax.errors import UserError
            raise UserError("--dws-predictor and --dws-cost-model go together")
        from relf_jax import workflows
        from relf_jax.dws.predictor import WorkloadCost
        cost_fn = WorkloadCost(workflows.load_model(args.dws_predictor, "dws"), args.dws_cost_model)
    if args.model_path and args.workdir and args.model_path != args.workdir:
        from relf_jax.errors import UserError
        raise UserError("give the model once: --model PATH or --workdir DIR")
    if args.ngram_corpus and args.proposer != "corpus_ngram":
        from relf_jax.errors import UserError
        raise UserError("--ngram-corpus is for --proposer corpus_ngram")
    template = ChatTemplate.from_file(args.chat_template) if args.chat_template else None
    models = build_models(args.model_path or args.workdir, args.generator or ["ar"], model_name=args.model_name, slots=args.slots,
                          max_queue=args.max_queue, policy=args.policy, aging=args.aging, template=template,
                          cost_fn=cost_fn, mock=args.mock, mock_step_s=args.mock_step_ms / 1e3, k=args.k,
                          proposer=args.proposer, draft=args.draft, nsd_top_p=args.nsd_top_p, nfe=args.nfe,
                          threshold=args.threshold, steps_per_call=args.steps_per_call, max_context=args.max_context,
                          ngram_corpus=args.ngram_corpus, ngram_online_tokens=args.ngram_online_tokens,
                          overlap={"auto": None, "on": True, "off": False}[args.overlap])
    name = next(iter(models))
    print(f"[serve] model {name!r} with {', '.join(s.generator for s in models[name])} on "
          f"http://{args.host}:{args.port}/v1 (policy {args.policy}, {args.slots} slots)", flush=True)
    serve(models, host=args.host, port=args.port, log_level=args.log_level, lean=not args.no_lean_routes)
    return 0


def _export(args) -> int:
    from relf_jax import workflows
    from relf_jax.config import ConfigError

    family = "ar"
    for item in args.overrides:
        key, _, value = item.partition("=")
        if key not in ("model", "model.family") or not value:
            raise ConfigError(f"export takes only model=ar|relf as an override, got {item!r}")
        family = value
    lm = workflows.load_model(args.workdir, family)
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


def _rcsd(args) -> int:
    from relf_jax import workflows
    from relf_jax.config import ConfigError
    from relf_jax.speculative.continual import ContinualDraftTrainer, ContinualSettings
    from relf_jax.speculative.rcsd import RCSDLossSettings

    if (args.cycles < 1 or args.prompts_per_cycle < 1 or args.steps_per_cycle < 0 or args.pref_weight < 0
            or args.batch_size < 1 or not args.learning_rate > 0):
        raise ConfigError("rcsd needs --cycles >= 1, --prompts-per-cycle >= 1, --steps-per-cycle >= 0, "
                          "--batch-size >= 1, --learning-rate > 0, --pref-weight >= 0")
    target = workflows.load_model(args.target, "ar")
    draft = workflows.load_model(args.draft or os.path.join(args.target, "draft"), "ar")
    n = args.cycles * args.prompts_per_cycle
    if args.prompts:
        if not os.path.exists(args.prompts):
            raise ConfigError(f"--prompts file {args.prompts} does not exist")
        with open(args.prompts) as f:
            texts = [line.strip() for line in f if line.strip()]
        if not texts:
            raise ConfigError(f"--prompts file {args.prompts} has no prompts")
        texts = [texts[i % len(texts)] for i in range(n)]
    else:
        judge = workflows.exact_judge(target.cfg)
        texts = [info["prompt"] for info in judge.grammar.sample_with_info(n, 4242)]
    ids = [workflows.encode_prompt(target.tokenizer, t) for t in texts]
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


if __name__ == "__main__":
    sys.exit(main())
