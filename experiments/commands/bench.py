"""`relf-jax demo` and `relf-jax bench NAME` (the benches live in `experiments.bench`)."""

from __future__ import annotations


def demo_args(p):
    p.add_argument("--quick", action="store_true", help="tiny preset, about 2 minutes")
    p.add_argument("--workdir", default=None)


def demo(args) -> int:
    from experiments.demo import run_demo

    run_demo(quick=args.quick, workdir=args.workdir, overrides=args.overrides)
    return 0


def bench_args(p):
    from experiments.bench import BENCHES

    p.add_argument("which", choices=list(BENCHES))
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--quick", action="store_true", help="tiny preset, a few minutes")
    p.add_argument("--workdir", default=None, help="where models are trained / cached")
    p.add_argument("--parts", default=None, help="bench serve and relf only: which parts, comma-separated; serve: "
                                                 "engines (AR vs NSD, batch-1 overhead), batcher (the same engines "
                                                 "without the server), dws (FCFS vs SJF-DWS) and multiturn "
                                                 "(8-turn conversations, prefix cache on vs off); "
                                                 "relf: models, reflow (reflow and no-pairs control rounds), "
                                                 "latency; default all")
    p.add_argument("--preset", default=None, help="bench spec only: the target's preset (default cpu; cpu-wide: "
                                                  "a target past the caches, with a small distilled draft)")
    p.add_argument("--draft-steps", type=int, default=None, help="bench spec only: the draft's distillation "
                                                                 "steps (default half the target's; cpu-wide: "
                                                                 "1200)")
    p.add_argument("--budgets", default=None, help="bench bd and bench relf --parts core: training budgets in "
                                                   "steps, comma-separated (bd default 600,1200; core default "
                                                   "the preset's train.steps)")
    p.add_argument("--variants", default=None, help="bench relf --parts core or --parts reflow only: which "
                                                    "ReLF models, comma-separated; core: among relf (the "
                                                    "default), plain, free_head, whiten, query, query_gqa, "
                                                    "full_kv, bag, no_bag (default: the first five); reflow: whose "
                                                    "reflow studies, among relf, plain (default both)")
    p.add_argument("--ablation", action="store_true", help="bench bd only: also the old one-conversation-per-row "
                                                           "layout at the first budget")
    p.add_argument("--ar-rows", default=None, help="bench bd and bench relf --parts core: a bench relf or bd "
                                                   "report (same preset and samples) whose AR sweep rows are used "
                                                   "for the budgets it holds")


def bench_options(args) -> dict:
    """The keywords of the bench-specific options, checked against the bench they apply to."""
    from relf_jax.errors import UserError

    extra = {}
    if args.parts is not None:
        if args.which not in ("serve", "relf"):
            raise UserError("--parts applies to bench serve and bench relf only")
        extra["parts"] = [p.strip() for p in args.parts.split(",") if p.strip()]
    if args.preset is not None:
        if args.which != "spec":
            raise UserError("--preset applies to bench spec only")
        if args.quick:
            raise UserError("--preset and --quick are exclusive (--quick is the tiny preset)")
        extra["preset"] = args.preset
    if args.draft_steps is not None:
        if args.which != "spec":
            raise UserError("--draft-steps applies to bench spec only")
        if args.draft_steps < 1:
            raise UserError(f"--draft-steps must be >= 1, got {args.draft_steps}")
        extra["draft_steps"] = args.draft_steps
    core = args.which == "relf" and extra.get("parts") == ["core"]
    if args.ablation:
        if args.which != "bd":
            raise UserError("--ablation applies to bench bd only")
        extra["ablation"] = True
    if args.budgets is not None or args.ar_rows:
        if args.which != "bd" and not core:
            raise UserError("--budgets and --ar-rows apply to bench bd and bench relf --parts core only")
        extra["ar_rows"] = args.ar_rows
        try:
            extra["budgets"] = [int(x) for x in args.budgets.split(",")] if args.budgets else None
        except ValueError:
            raise UserError(f"--budgets must be comma-separated step counts, got {args.budgets!r}") from None
    if args.variants is not None:
        if not (core or args.which == "relf" and extra.get("parts") == ["reflow"]):
            raise UserError("--variants applies to bench relf --parts core or --parts reflow only")
        extra["variants"] = [v.strip() for v in args.variants.split(",") if v.strip()]
    return extra


def bench(args) -> int:
    from experiments.bench import bench_function

    extra = bench_options(args)
    bench_function(args.which)(args.out, quick=args.quick, workdir=args.workdir, overrides=args.overrides, **extra)
    return 0
