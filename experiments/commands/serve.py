"""`relf-jax serve`: the OpenAI-compatible HTTP server over the engines named on the command line."""

from __future__ import annotations


def serve_args(p):
    p.add_argument("--model", default=None, dest="model_path",
                   help="a HuggingFace Llama/Qwen2 folder (config.json, safetensors, tokenizer; read in place, "
                        "with its chat template, EOS ids and generation defaults) or a relf_jax run directory")
    p.add_argument("--workdir", default=None, help="trained run directory (ar/, draft/, bd/, relf/ inside), or a "
                                                   "HuggingFace folder as with --model")
    p.add_argument("--generator", action="append", default=None,
                   choices=["ar", "standard", "nsd", "greedy", "bd", "relf"],
                   help="engine(s) to serve (repeatable; the first is the default; default ar)")
    p.add_argument("--model-name", default=None, help="the model id clients ask for (default: workdir's name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--slots", type=int, default=8, help="requests decoded together per engine")
    p.add_argument("--max-queue", type=int, default=256, help="queued requests before 429")
    p.add_argument("--policy", default="fcfs", choices=["fcfs", "sjf", "priority"])
    p.add_argument("--aging", type=float, default=0.05, help="sjf: predicted cost-seconds gained per second "
                                                              "waited; priority: levels per second")
    p.add_argument("--dws-predictor", default=None, help="sjf: a trained DWS surface predictor directory")
    p.add_argument("--dws-cost-model", default=None, help="sjf: the cost model JSON (relf-jax bench dws output)")
    p.add_argument("--k", type=int, default=4, help="speculative: drafts per round")
    p.add_argument("--proposer", default="draft", choices=["draft", "prompt_lookup", "corpus_ngram"])
    p.add_argument("--ngram-corpus", nargs="+", default=None, metavar="FILE|online",
                   help="corpus_ngram: count the n-gram table from these .txt/.jsonl files, directories or globs, "
                        "and/or 'online': from the prompts and replies served (updated as requests finish). "
                        "Default: the training data of a model relf_jax trained (an imported model needs one)")
    p.add_argument("--ngram-online-tokens", type=int, default=32768,
                   help="corpus_ngram online: the newest served tokens the table counts (its memory bound)")
    p.add_argument("--draft", default=None, help="speculative: the draft's run directory (default <workdir>/draft)")
    p.add_argument("--nsd-top-p", type=float, default=0.9)
    p.add_argument("--draft-temperature-scale", type=float, default=1.0,
                   help="speculative: the proposer samples at the request's temperature times this; below 1 "
                        "lengthens NSD's accepted prefixes and sharpens its replies (the standard rule stays exact)")
    p.add_argument("--nfe", type=int, default=None, help="relf: network calls per reply")
    p.add_argument("--threshold", type=float, default=0.95, help="bd: confidence threshold")
    p.add_argument("--steps-per-call", type=int, default=None,
                   help="ar / speculative: tokens or rounds per engine call; more cut host overhead, fewer "
                        "give a finer stream (default 8 for ar, 2 for speculative)")
    p.add_argument("--max-context", type=int, default=None,
                   help="ar / speculative: prompt + reply tokens per slot, below the model's context (default: the "
                        "model's); longer requests are refused")
    p.add_argument("--prefix-cache-mb", type=float, default=0.0,
                   help="ar / speculative: MiB of memory for the prefix cache, which keeps finished requests' "
                        "keys/values so the next turn of a conversation prefills only its new tokens (LRU "
                        "eviction within the budget; 0: off)")
    p.add_argument("--chat-template", default=None, help="a .json marker template or a .jinja template (default: "
                                                         "the checkpoint's own template, else the <user>/<assistant> "
                                                         "markers)")
    p.add_argument("--mock", action="store_true", help="serve the model-free mock engine (echoes the user)")
    p.add_argument("--mock-step-ms", type=float, default=0.0, help="mock: simulated model time per step")
    p.add_argument("--no-lean-routes", action="store_true",
                   help="send generation requests through FastAPI's whole stack instead of the lean route "
                        "(the same answers; for measuring the route, as bench serve does)")
    p.add_argument("--overlap", choices=["auto", "on", "off"], default="auto",
                   help="start each engine step before the host work on the last one is done (the same "
                        "answers); auto: on for the AR and speculative engines")
    p.add_argument("--log-level", default="info")


def serving_mesh(words, command: str = "serve"):
    """The mesh `relf-jax serve` runs its engines on: ``mesh.data`` slot groups x ``mesh.tensor``
    devices per model copy (and ``mesh.fsdp``) over this host's devices, from the command's
    ``mesh.*`` words (the only overrides it takes; defaults: every device a slot group). None: one
    device, the plain engines."""
    from relf_jax.config import Config, ConfigError, set_value
    from relf_jax.runtime.sharding import model_mesh

    cfg = Config()
    for item in words:
        key, eq, value = item.partition("=")
        if not eq or not key.startswith("mesh.") or key == "mesh.distributed":
            raise ConfigError(f"{command} takes only mesh.data, mesh.fsdp and mesh.tensor overrides "
                              f"(e.g. mesh.data=2 mesh.tensor=4), got {item!r}")
        cfg = set_value(cfg, key, value)
    return model_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, local=True)


def _cost_fn(args):
    """SJF's cost function: the DWS predictor with its cost model, or None."""
    from relf_jax.errors import UserError

    if not (args.dws_predictor or args.dws_cost_model):
        return None
    if not (args.dws_predictor and args.dws_cost_model):
        raise UserError("--dws-predictor and --dws-cost-model go together")
    from relf_jax.dws.predictor import WorkloadCost
    from relf_jax.loading import load_model

    return WorkloadCost(load_model(args.dws_predictor, "dws"), args.dws_cost_model)


def serve(args) -> int:
    from relf_jax.errors import UserError
    from relf_jax.methods import parse_method
    from relf_jax.serving.chat_template import ChatTemplate
    from relf_jax.serving.http import serve as run_server
    from relf_jax.serving.loading import build_models

    cost_fn = _cost_fn(args)
    if args.model_path and args.workdir and args.model_path != args.workdir:
        raise UserError("give the model once: --model PATH or --workdir DIR")
    if args.ngram_corpus and args.proposer != "corpus_ngram":
        raise UserError("--ngram-corpus is for --proposer corpus_ngram")
    template = ChatTemplate.from_file(args.chat_template) if args.chat_template else None
    mesh = serving_mesh(args.overrides)
    # the edge: the command line's names become method objects here, once
    chosen = [parse_method(g, proposer=args.proposer, k=args.k, nsd_top_p=args.nsd_top_p,
                           draft_temperature_scale=args.draft_temperature_scale, nfe=args.nfe,
                           threshold=args.threshold, draft=args.draft, corpus=args.ngram_corpus,
                           online_tokens=args.ngram_online_tokens) for g in args.generator or ["ar"]]
    models = build_models(args.model_path or args.workdir, chosen, model_name=args.model_name,
                          slots=args.slots, max_queue=args.max_queue, policy=args.policy, aging=args.aging,
                          template=template, cost_fn=cost_fn, mock=args.mock, mock_step_s=args.mock_step_ms / 1e3,
                          steps_per_call=args.steps_per_call, max_context=args.max_context,
                          prefix_cache_mb=args.prefix_cache_mb, mesh=mesh,
                          overlap={"auto": None, "on": True, "off": False}[args.overlap])
    name = next(iter(models))
    where = "one device" if mesh is None else "mesh " + " x ".join(f"{a}={n}" for a, n in mesh.shape.items())
    print(f"[serve] model {name!r} with {', '.join(s.generator for s in models[name])} on "
          f"http://{args.host}:{args.port}/v1 (policy {args.policy}, {args.slots} slots, {where})", flush=True)
    run_server(models, host=args.host, port=args.port, log_level=args.log_level, lean=not args.no_lean_routes)
    return 0
