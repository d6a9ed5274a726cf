"""What `relf-jax bench relf` compares: the AR sweep, the samplers, ablations, extensions, the
reflow control and the core comparison's variants (config overrides)."""

AR_TEMPERATURES = (0.6, 0.7, 0.8, 0.9, 1.0, 1.1)
QUICK_AR_TEMPERATURES = (0.7, 0.85, 1.0)
EULER_NFES = (8, 16, 32)
GUIDANCE = (1.0, 1.3, 1.7, 2.5)
PROMPT_TRAINING = ["flow.prompt_prob=0.5"]
ABLATIONS = {"no_singular": ["flow.use_singular=false"], "gaussian_embeddings": ["flow.embeddings=gaussian"],
             "mse_loss": ["flow.loss=mse"]}
# our extensions to the paper's training, trained at the full budget, against the plain ReLF rows
EXTENSIONS = {"aux_head": ["flow.aux_weight=1"], "per_position_t": ["flow.per_position_t=0.5"],
              "aux_head_per_position_t": ["flow.aux_weight=1", "flow.per_position_t=0.5"],
              "plain": ["flow.blind_spot=false", "model.flow_embed_head=false"]}
# extensions that also get two reflow rounds (and the 8 / 16 / 32-NFE Euler rows before and after);
# since issue 35 the "relf" rows are the context-reading default and "plain" is the paper's network
REFLOW_EXTENSIONS = ("plain",)


PARTS = ("models", "reflow", "latency", "core")
DEFAULT_PARTS = PARTS[:3]  # "core" runs alone, on request
# the no-pairs control of a reflow study: the same rounds, schedule and batches, data loss only
NO_PAIRS = {"pair_weight": 0.0, "data_weight": 1.0}

# the paper's plain parametrisation, the ablation row of the core comparison
PLAIN = ["flow.blind_spot=false", "model.flow_embed_head=false"]
# the residual head's free matrix alone, without the embedding-tied part (the default head before 12-07)
FREE_HEAD = ["model.flow_embed_head=false"]
# the ReLF models of the core comparison: the default, and variants (overrides) against it
# "query": two of the four layers as query layers over both streams (model.flow_query_layers), full
# multi-head attention in the ReLF network (no grouped keys; model.flow_kv_heads). ReLF-64 gen PPL
# -2 % / -10 % at 600 steps and -7 % / -19 % at 1,200 (seeds 0 / 1); each half alone ("query_gqa",
# "full_kv") is not better than the default. It costs 1.4-1.6x a network forward and 1.3-1.4x a
# training step (docs/relf.md), so it is not the default.
QUERY = ["model.flow_query_layers=2", "model.flow_kv_heads=4"]
# "bag": the leave-one-out bag input (model.flow_bag_input) named explicitly, as its rows were measured
# before it became the default (12-07, eighth session; docs/relf.md); "no_bag": the default before it
CORE_VARIANTS = {"relf": [], "plain": PLAIN, "free_head": FREE_HEAD, "whiten": ["flow.embed_whiten=true"],
                 "query": QUERY, "query_gqa": ["model.flow_query_layers=2"], "full_kv": ["model.flow_kv_heads=4"],
                 "bag": ["model.flow_bag_input=true"], "no_bag": ["model.flow_bag_input=false"]}
# what `--parts core` trains without --variants (the two halves of "query" only on request)
DEFAULT_CORE_VARIANTS = ("relf", "plain", "free_head", "whiten", "query")
