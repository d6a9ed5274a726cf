"""The `relf-jax` command line (also ``python -m experiments.launch``).

Parses arguments and calls library functions; holds no method. Each subcommand is one entry of
`COMMANDS`: its options (``add_arguments``) and what it runs (``run``), from `experiments.commands`.
Config overrides are ``key=value`` words after the subcommand, e.g.::

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
    relf-jax launch-local --processes 2 --devices-per-process 2 -- train --preset tiny

On a TPU pod run the same command on every worker; JAX's multi-host runtime is started by
`relf_jax.runtime.sharding.init_distributed` (``mesh.distributed=auto|on|off``; elsewhere the
environment names the coordinator, process count and id). `launch-local` runs N processes of a
command on this machine as N hosts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable

from experiments.commands import bench, convert, sample, serve, train


@dataclasses.dataclass(frozen=True)
class Command:
    """One subcommand: its name and help, its options, and what it runs (returns the exit status)."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    overrides: bool = False  # takes config overrides (key=value words)


def _info(args) -> int:
    from relf_jax.runtime.info import describe

    print(json.dumps(describe(serve.serving_mesh(args.overrides, "info")), indent=2))
    return 0


def _no_arguments(p):
    pass


def _launch_local_args(p):
    p.add_argument("--processes", type=int, required=True, help="how many processes (hosts) to start")
    p.add_argument("--devices-per-process", type=int, default=None,
                   help="simulated CPU devices per process (JAX_PLATFORMS=cpu, gloo collectives)")
    p.add_argument("command_args", nargs=argparse.REMAINDER, help="-- then the relf-jax subcommand and its arguments")


def _launch_local(args) -> int:
    from relf_jax.errors import UserError
    from relf_jax.runtime.local_cluster import run_local_cluster

    rest = args.command_args[1:] if args.command_args[:1] == ["--"] else args.command_args
    if not rest:
        raise UserError("launch-local needs the command to run after --, e.g. "
                        "relf-jax launch-local --processes 2 -- train --preset tiny")
    if rest[0] == "launch-local":
        raise UserError("launch-local cannot start launch-local")
    try:
        return run_local_cluster(rest, args.processes, args.devices_per_process)
    except ValueError as e:
        raise UserError(str(e)) from None


COMMANDS = (
    Command("train", "prepare data + tokenizer and train (or resume) a model", train.train_args, train.train,
            overrides=True),
    Command("train-draft", "distil a small draft model from a trained target", train.train_draft_args,
            train.train_draft, overrides=True),
    Command("reflow", "regularised reflow rounds of a trained ReLF model", train.reflow_args, train.reflow),
    Command("rcsd", "continual RCSD: serve speculatively, log traces, keep training the draft", train.rcsd_args,
            train.rcsd),
    Command("sample", "sample from a trained checkpoint", sample.sample_args, sample.sample, overrides=True),
    Command("eval", "gen PPL + entropy of samples, distinct-n, validation loss", sample.eval_args, sample.evaluate,
            overrides=True),
    Command("demo", "the main job: train, sample, measure, report", bench.demo_args, bench.demo, overrides=True),
    Command("bench", "long measurements written as JSON (bench spec | relf | verify | latency | flowstep | hf | "
                     "rcsd | dws | serve | relf-toy | bd)", bench.bench_args, bench.bench, overrides=True),
    Command("import-hf", "a local HuggingFace Llama/Qwen2 directory -> a relf_jax checkpoint", convert.import_hf_args,
            convert.import_hf),
    Command("export", "write a trained model as HuggingFace, safetensors or jax.export files", convert.export_args,
            convert.export, overrides=True),
    Command("serve", "OpenAI-compatible HTTP server: chat/completions (streaming), models, health, metrics; "
                     "continuous batching over slots (mesh.data=M mesh.tensor=N: split over devices)",
            serve.serve_args, serve.serve, overrides=True),
    Command("info", "devices, meshes (training; serving: mesh.* as serve takes them) and versions", _no_arguments,
            _info, overrides=True),
    Command("launch-local", "run a relf-jax command as N processes (hosts) of one multi-host JAX job on this "
                            "machine", _launch_local_args, _launch_local),
)
COMMANDS_BY_NAME = {c.name: c for c in COMMANDS}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: one subparser per entry of `COMMANDS`."""
    p = argparse.ArgumentParser(prog="relf-jax", description="relf_jax: low-latency language models in JAX.")
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        sp = sub.add_parser(command.name, help=command.help)
        command.add_arguments(sp)
        if command.overrides:
            sp.add_argument("overrides", nargs="*", help="config overrides key=value")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line. Config overrides (key=value) may also follow the options: argparse alone
    does not take positionals after options once a subcommand's first positional is in
    (``bench dws --out F train.steps=9``)."""
    p = build_parser()
    args, extra = p.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any(x.startswith("-") or "=" not in x for x in extra):
            p.error("unrecognized arguments: " + " ".join(extra))
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from relf_jax.errors import UserError
    from relf_jax.runtime import jit_cache

    jit_cache.enable()  # programs compiled by an earlier relf-jax process are read back (RELF_JAX_JIT_CACHE=off)
    try:
        if args.command != "launch-local":
            from relf_jax.runtime.sharding import init_distributed

            init_distributed("auto")  # a host of a multi-host job: the runtime starts before any array
        return COMMANDS_BY_NAME[args.command].run(args)
    except UserError as e:
        print(f"relf-jax: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("relf-jax: interrupted (the last finished step was checkpointed)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
