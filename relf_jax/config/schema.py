"""The configuration's schema: a `Config` is a tree of frozen dataclasses (model, data, train,
sample, speculative, flow, mesh), each validated (`Config.validate`), plus the typed coercion of
override strings and saved dicts into them (`coerce`, `from_dict`)."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, Literal

from relf_jax.errors import UserError

# the speculative proposers: a draft model, the prompt's own n-grams, a corpus n-gram table
Proposer = Literal["draft", "prompt_lookup", "corpus_ngram"]
PROPOSERS: tuple[str, ...] = typing.get_args(Proposer)


class ConfigError(UserError):
    """A bad preset, key or value. The message is one line meant for the user."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Network shape. `vocab_size` 0 means: take it from the tokenizer."""

    # ar: causal LM; relf: rectified language flow; bd: block-diffusion LM (masked diffusion inside
    # blocks, causal across them); dws: the prompt-only workload predictor of relf_jax.dws
    family: Literal["ar", "relf", "bd", "dws"] = "ar"
    vocab_size: int = 0
    d_model: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 0  # 0: d_model // num_heads
    mlp_dim: int = 384
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    # rope scaling (HuggingFace's rope_type; see relf_jax.models.layers.Rope): "none", "linear"
    # (rope_factor), "llama3" (rope_factor, rope_low/high_freq_factor, rope_original_max_len: the
    # pre-training context) or "dynamic" (NTK; rope_factor; rope_original_max_len: HF's
    # max_position_embeddings, past which the base grows with the sequence length)
    rope_scaling: Literal["none", "linear", "dynamic", "llama3"] = "none"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    # relf_jax's own convention: input embeddings times sqrt(d_model), tied logits times
    # d_model**-0.5. HuggingFace Llama/Qwen2 use neither (False for imported checkpoints).
    embed_scaling: bool = True
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2)
    dtype: Literal["float32", "bfloat16"] = "float32"
    # ar / bd: how the blocks' dense weights (and an untied head) are stored, "in_out" ([in, out])
    # or "out_in" ([out, in], PyTorch's order). The same function, another XLA:CPU kernel: for a
    # 210 MB target (d 1024, 4 layers) "out_in" made the one-token step 1.13x and the 5-token
    # (K = 4) verification 1.38x faster (docs/speculative.md); relf_jax.models.layers.WEIGHT_LAYOUTS.
    weight_layout: Literal["in_out", "out_in"] = "in_out"
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    flow_embed_dim: int = 32  # relf: width of the fixed token embeddings (paper's best: 32)
    # relf: a learned "known position" input, so the network can be told which positions hold a
    # clean prompt (set by training with flow.prompt_prob > 0; see relf_jax.flow.losses)
    flow_prompt_input: bool = False
    # relf: a second, singular-free output head on the same trunk, trained with its own CE
    # (set by training with flow.aux_weight > 0; see relf_jax.flow.losses). Sampling ignores it.
    flow_aux_head: bool = False
    # relf: a blind-spot network (the default; our construction): the residual at position i reads
    # every position but i, through a left-to-right and a right-to-left stream (see
    # relf_jax.models.flow_lm). Training sets it from flow.blind_spot, which trains it as the
    # context classifier p(x_i | Z_{-i}); False is the paper's plain bidirectional network.
    flow_blind_spot: bool = True
    # relf, blind-spot network: of model.num_layers, this many are query layers on top of the two
    # streams (our construction): position i's query attends to every left-stream state j < i and
    # every right-stream state j > i at once (and to itself), so it mixes both sides' tokens in
    # attention; the streams get (num_layers - flow_query_layers) / 2 layers each. 0: the streams
    # are read at i - 1 and i + 1 only, through one MLP block. Not the default: with
    # flow_kv_heads = num_heads (bench relf core's "query" variant) it lowers gen PPL at equal steps
    # but costs 1.4-1.6x a network forward and 1.3-1.4x a training step (docs/relf.md).
    flow_query_layers: int = 0
    # relf: key/value heads of the ReLF network's attention; 0: model.num_kv_heads. Its own field so
    # a ReLF variant can change them without changing the AR model of the same config.
    flow_kv_heads: int = 0
    # relf: each position's own evidence as an extra input (our extension): the log of its
    # singular posterior, clip(log softmax(s(Z_j, t)), -10) / 10 [V], projected; a function of Z_j
    # alone, so a blind-spot network stays blind. Needs the embeddings at call time (`table=`).
    flow_evidence_input: bool = False
    # relf: the residual head reads the fixed embeddings too (our extension; the default since
    # 12-07): f = h W + (h P) E^T, P [d_model, flow_embed_dim] zero-initialised, so every word's
    # residual logit shares a part in the embeddings' span, as tied input/output embeddings do in
    # a small LM (ReLF-64 gen PPL -24 % at 600 steps, docs/relf.md). Needs the embeddings at call
    # time (`relf_jax.flow.singular.network_residual` passes them). False: the head W alone.
    flow_embed_head: bool = True
    # relf, blind-spot network: a leave-one-out bag of the segment's tokens as a further input to
    # every position (our extension, the default since 2026-12-07, eighth session): g_j =
    # MLP(input_j, t) summed over the other positions j of i's segment, / sqrt(their number),
    # projected (zero-initialised) into the state the streams' MLP block reads. The form of a Bayes
    # reader of the conversation's topic from noisy neighbours (a sum of per-token terms,
    # `experiments.bench.relf_core.bag_of_tokens_topic_posterior`); position i's own input never
    # enters its bag, so the blind spot stays exact. ReLF-64 at matched entropy -6 % to -15 % at
    # 1,200 steps (two seeds), forward 1.03x, training step 1.18x (docs/relf.md). The plain network
    # (flow.blind_spot=false) has no bag whatever this says.
    flow_bag_input: bool = True
    block_size: int = 8  # bd: tokens per diffusion block; dws: the block size of the decoder predicted
    max_blocks: int = 16  # dws: output blocks on the workload surface's grid (B_max)
    # dws: "surface" (block head + step head -> S[b, s]) or a scalar baseline on the same encoder
    predictor_head: Literal["surface", "length", "steps"] = "surface"
    # dws surface head's block head: "continue" (continuation logits, methods.md as written) or
    # "length" (a distribution over the reply's token count; the blocks follow from it and the
    # first block's capacity exactly; see relf_jax.dws.predictor.predicted_surface)
    predictor_block_head: Literal["continue", "length"] = "continue"

    @property
    def resolved_flow_kv_heads(self) -> int:
        """The ReLF network's key/value heads: `flow_kv_heads`, or num_kv_heads when it is 0."""
        return self.flow_kv_heads or self.num_kv_heads

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.num_heads

    def check_rope(self) -> None:
        """Raise `ConfigError` for unusable rope settings (called by `Config.validate` and on HF import)."""
        _check(self.rope_theta > 0, f"model.rope_theta must be > 0, got {self.rope_theta}")
        if self.rope_scaling == "none":
            return
        what = f"model.rope_scaling={self.rope_scaling}"
        _check(self.family in ("ar", "bd"), f"{what} applies to the ar and bd families (their decoder stack), "
                                            f"not {self.family!r}")
        _check(self.rope_factor >= 1.0, f"{what} needs model.rope_factor >= 1, got {self.rope_factor}")
        if self.rope_scaling in ("llama3", "dynamic"):
            _check(self.rope_original_max_len > 0,
                   f"{what} needs model.rope_original_max_len > 0 (the pre-training context length)")
        if self.rope_scaling == "llama3":
            _check(self.rope_low_freq_factor > 0, f"{what} needs model.rope_low_freq_factor > 0")
            _check(self.rope_high_freq_factor > self.rope_low_freq_factor,
                   f"{what} needs model.rope_high_freq_factor > model.rope_low_freq_factor, got "
                   f"{self.rope_high_freq_factor} and {self.rope_low_freq_factor}")
        if self.rope_scaling == "dynamic":
            _check(self.resolved_head_dim > 2, f"{what} needs a head width > 2")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where text comes from and how it is cut into training rows."""

    source: str = "synthetic_chat"  # synthetic_chat | chatterbot | text_files | tfds:<name>
    path: str = ""  # for text_files: a .txt/.jsonl file, a directory or a glob
    num_train: int = 20000  # synthetic_chat conversations
    num_validation: int = 500
    data_seed: int = 0
    topics: str = ""  # synthetic_chat topic subset, e.g. "0,1,2"; empty: all
    seq_len: int = 128
    # "packed": documents concatenated and cut into rows (AR training); "documents": one
    # document per row, BOS..EOS then pad ids (the loss sees the pad tail too); "segments": several
    # whole documents per row with segment ids, pad only at the row's end and outside the loss
    # (whole-sequence families: ReLF; see relf_jax.data.pipeline); "auto": the model family's choice.
    rows: Literal["auto", "packed", "documents", "segments"] = "auto"
    # "segments" rows: a row's tail is filled from the next pack_lookahead documents (the longest
    # that fits), so little of it is pad; 1 is stream order (a document that does not fit starts
    # the next row: 0.80x AR's text per step on the cpu preset; docs/relf.md).
    pack_lookahead: int = 64
    vocab_size: int = 1024  # tokenizer size
    tokenizer_type: Literal["bpe", "unigram"] = "bpe"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 600
    batch_size: int = 16  # rows per optimizer step over all hosts (each host reads batch_size / processes)
    grad_accum: int = 1
    learning_rate: float = 3e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 10
    eval_every: int = 200
    eval_batches: int = 4
    checkpoint_every: int = 200
    keep_checkpoints: int = 3
    async_checkpoint: bool = True
    progress: bool = True


@dataclasses.dataclass(frozen=True)
class SampleConfig:
    num_samples: int = 32
    batch_size: int = 8
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    prompt: str = ""
    threshold: float = 0.95  # block diffusion: commit masked positions whose top probability exceeds it
    # block diffusion: a position's confidence is its top probability ("max": where to commit is
    # chosen from the distributions alone) or the sampled token's probability ("sampled", the old
    # rule, which skews samples to frequent tokens; docs/block_diffusion.md)
    confidence: Literal["max", "sampled"] = "max"


@dataclasses.dataclass(frozen=True)
class FlowConfig:
    """ReLF (rectified language flow) training and sampling settings; see relf_jax/flow."""

    embeddings: Literal["hellinger", "gaussian", "one_hot"] = "hellinger"
    # row norm of the fixed embeddings (sets the flow's SNR); 0: sqrt(model.flow_embed_dim). 1.5 measured
    # better than sqrt(32) on the cpu preset (64-NFE stochastic gen PPL 564 vs 638, longer samples)
    embed_norm: float = 1.5
    smoothing: float = 1e-3  # added to co-occurrence counts (Hellinger-SVD)
    # Hellinger-SVD counts the tokens up to `window` positions after each token (1 = next token)
    window: int = 1
    # Hellinger-SVD geometry (relf_jax.flow.embeddings; measured in docs/relf.md): centre the
    # Hellinger rows before the SVD (PCA), and whiten the kept components (U_d instead of U_d S_d)
    embed_center: bool = False
    embed_whiten: bool = False
    residual_bound: float = 10.0  # c in c * tanh(f / c)
    use_singular: bool = True  # False: the ablation without singular logits
    t_eps: float = 1e-4
    t_distribution: Literal["uniform", "logit_normal", "late"] = "uniform"
    self_condition_prob: float = 0.5
    # share of training rows whose first k tokens (k uniform over the row's text) are given clean
    # and flagged, with no loss on them: the model learns p(rest | prompt) directly, and prompted
    # sampling (serving, ChatModel) holds the prompt clean instead of renoising it. 0: the
    # paper's unconditional training (and prompted sampling by renoising the prompt).
    prompt_prob: float = 0.0
    loss: Literal["ce", "mse"] = "ce"
    # weight of an auxiliary CE on a singular-free head of the same network (our extension; 0: off,
    # the paper's loss). With the singular logits supplying each position's own evidence the
    # network tends to learn only the positional prior (`relf-jax bench relf-toy`); the auxiliary
    # head makes its trunk learn what the tokens are, which the residual can then read from the
    # context. Measured: README's ReLF section.
    aux_weight: float = 0.0
    # share of training rows in which every position draws its own t (our extension; 0: the paper's
    # one t per row). Sampling keeps one t per row. Makes reading noisy neighbours pay in training:
    # see relf_jax.flow.losses; measured: README's ReLF section.
    per_position_t: float = 0.0
    # A clean start (our extension, the default since 2026-12-07, seventh session): the first
    # `clean_start` share of train.steps draws every row's t from [clean_t, 1) (neighbours nearly
    # clean), the rest from t_distribution. Over the whole t range from the first step the network never learns to read
    # long-range context (the conversation's topic; the context is noise in most rows), and a
    # 50 / 50 mix of near-1 and uniform rows does not either; once learned on near-clean rows the
    # reading survives, and sharpens, under the full range. Measured: docs/relf.md, "A clean start".
    # 0: off (the paper's schedule).
    clean_start: float = 0.4
    clean_t: float = 0.98
    # The default ReLF reads its context (issue 35): the network reads every position but its own
    # (model.flow_blind_spot) and is trained as the context classifier p(x_i | Z_{-i}) with plain
    # CE; sampling adds the singular logits, so the posterior is the exact product
    # p(Z_i | x_i) p(x_i | Z_{-i}) when the classifier is. See relf_jax.flow.losses and docs/relf.md.
    # False: the paper's plain parametrisation (bidirectional network, CE under s + c tanh(f / c)),
    # kept for ablation rows; it stays at the positional prior (`relf-jax bench relf-toy`).
    blind_spot: bool = True
    nfe: int = 16
    sampler: Literal["euler", "stochastic"] = "euler"
    # the samplers' time grid (relf_jax.flow.samplers.time_grid). "late" (small steps near t = 1,
    # where the posterior decides; the default since 2026-12-07): on "uniform" the default model's
    # samples lose diversity with no gain in gen PPL (docs/relf.md, "The time grid")
    grid: Literal["uniform", "cosine", "late"] = "late"
    guidance: float = 1.0
    gamma: float = 1.0
    # stochastic sampler's noise: "linear" (methods.md's Z' = aZ + (1-a) eps) or "marginal"
    # (the path's exact noise level at t' = a t); see relf_jax.flow.samplers. "marginal" measured
    # better (docs/relf.md: same gen PPL at +0.8 nats of entropy, at both budgets)
    renoise: Literal["linear", "marginal"] = "marginal"


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding at sampling time. rule "none" samples autoregressively."""

    rule: Literal["none", "standard", "nsd", "greedy"] = "none"
    k: int = 4
    proposer: Proposer = "draft"
    nsd_top_p: float = 0.9
    draft_temperature_scale: float = 1.0  # the proposer samples at temperature x this (relf_jax.methods.Speculative)
    ngram: int = 3  # prompt lookup: longest n-gram to match
    corpus_order: int = 3  # corpus_ngram: contexts of up to order - 1 tokens
    corpus_top_m: int = 16  # corpus_ngram: next tokens kept per context
    draft: str = ""  # draft run directory; empty: <workdir>/draft


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh. -1 on one axis means: all the devices the other axes leave."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    distributed: Literal["auto", "on", "off"] = "auto"


@dataclasses.dataclass(frozen=True)
class Config:
    preset: str = "cpu"
    workdir: str = "runs/default"
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    sample: SampleConfig = SampleConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    flow: FlowConfig = FlowConfig()
    mesh: MeshConfig = MeshConfig()

    def validate(self) -> "Config":
        """Raise `ConfigError` for values no run can use; return self."""
        m, d, t, s = self.model, self.data, self.train, self.sample
        _check(m.d_model > 0 and m.num_layers > 0, "model.d_model and model.num_layers must be > 0")
        _check(m.num_heads > 0 and m.num_kv_heads > 0, "model.num_heads and model.num_kv_heads must be > 0")
        _check(m.num_heads % m.num_kv_heads == 0,
               f"model.num_heads={m.num_heads} must be a multiple of model.num_kv_heads={m.num_kv_heads}")
        _check(m.head_dim > 0 or m.d_model % m.num_heads == 0,
               f"model.d_model={m.d_model} must be divisible by model.num_heads={m.num_heads} (or set model.head_dim)")
        _check(m.resolved_head_dim % 2 == 0, "the head dimension must be even (RoPE rotates pairs)")
        _check(m.block_size >= 1 and m.max_blocks >= 1, "model.block_size and model.max_blocks must be >= 1")
        m.check_rope()
        _check(m.weight_layout == "in_out" or m.family in ("ar", "bd"),
               f"model.weight_layout={m.weight_layout} is for the ar and bd families (token-by-token decoders), "
               f"not model.family={m.family}")
        _check(d.seq_len >= 2, "data.seq_len must be >= 2")
        _check(d.pack_lookahead >= 1, "data.pack_lookahead must be >= 1")
        _check(d.seq_len <= m.max_seq_len,
               f"data.seq_len={d.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
        _check(d.vocab_size >= 16, "data.vocab_size must be >= 16")
        _check(t.steps >= 0 and t.batch_size > 0 and t.grad_accum > 0,
               "train.steps >= 0, train.batch_size > 0 and train.grad_accum > 0 are required")
        _check(t.batch_size % t.grad_accum == 0,
               f"train.batch_size={t.batch_size} must be divisible by train.grad_accum={t.grad_accum}")
        _check(t.learning_rate > 0, "train.learning_rate must be > 0")
        _check(t.checkpoint_every > 0 and t.keep_checkpoints > 0 and t.log_every > 0 and t.eval_every > 0,
               "train.checkpoint_every, train.keep_checkpoints, train.log_every and train.eval_every must be > 0")
        validate_sampling(s.temperature, s.top_k, s.top_p)
        _check(0 <= s.threshold <= 1, f"sample.threshold must be in [0, 1], got {s.threshold}")
        _check(s.num_samples > 0 and s.batch_size > 0 and s.max_new_tokens > 0,
               "sample.num_samples, sample.batch_size and sample.max_new_tokens must be > 0")
        fl = self.flow
        _check(0.0 <= fl.prompt_prob < 1.0, "flow.prompt_prob must lie in [0, 1)")
        _check(fl.residual_bound > 0 and fl.t_eps > 0 and fl.nfe >= 1 and fl.embed_norm >= 0,
               "flow.residual_bound, flow.t_eps, flow.nfe must be > 0 and flow.embed_norm >= 0")
        _check(0 <= fl.self_condition_prob <= 1, "flow.self_condition_prob must be in [0, 1]")
        _check(fl.aux_weight >= 0, "flow.aux_weight must be >= 0")
        _check(0 <= fl.per_position_t <= 1, "flow.per_position_t must be in [0, 1]")
        _check(0 <= fl.clean_start < 1 and 0 < fl.clean_t < 1,
               f"flow.clean_start must lie in [0, 1) and flow.clean_t in (0, 1), got {fl.clean_start} and {fl.clean_t}")
        _check(fl.window >= 1, "flow.window (the Hellinger co-occurrence window) must be >= 1")
        _check(m.flow_kv_heads >= 0 and m.num_heads % m.resolved_flow_kv_heads == 0,
               f"model.flow_kv_heads must be 0 (model.num_kv_heads) or divide model.num_heads={m.num_heads}, "
               f"got {m.flow_kv_heads}")
        stream_layers = m.num_layers - m.flow_query_layers
        _check(m.family != "relf" or not fl.blind_spot or (stream_layers >= 2 and stream_layers % 2 == 0
                                                           and m.flow_query_layers >= 0),
               f"the default ReLF (flow.blind_spot=true) splits model.num_layers - model.flow_query_layers between "
               f"two streams: it needs an even number >= 2, got {m.num_layers} - {m.flow_query_layers} (or set "
               f"flow.blind_spot=false)")
        sp = self.speculative
        _check(sp.k >= 1, f"speculative.k must be >= 1, got {sp.k}")
        _check(0 < sp.nsd_top_p <= 1, f"speculative.nsd_top_p must be in (0, 1], got {sp.nsd_top_p}")
        _check(sp.draft_temperature_scale > 0,
               f"speculative.draft_temperature_scale must be > 0, got {sp.draft_temperature_scale}")
        _check(sp.ngram >= 1, f"speculative.ngram must be >= 1, got {sp.ngram}")
        _check(sp.corpus_order >= 2, f"speculative.corpus_order must be >= 2, got {sp.corpus_order}")
        _check(sp.corpus_top_m >= 1, f"speculative.corpus_top_m must be >= 1, got {sp.corpus_top_m}")
        for name in ("data", "fsdp", "tensor"):
            v = getattr(self.mesh, name)
            _check(v == -1 or v > 0, f"mesh.{name} must be -1 or > 0, got {v}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Config":
        return from_dict(cls, d, prefix="")


def validate_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """The sampling settings every generator shares; raise `ConfigError` if unusable."""
    _check(temperature >= 0, f"temperature must be >= 0, got {temperature}")
    _check(top_k >= 0, f"top_k must be >= 0, got {top_k}")
    _check(0 < top_p <= 1, f"top_p must be in (0, 1], got {top_p}")


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def coerce(key: str, ftype: Any, value: Any) -> Any:
    origin = typing.get_origin(ftype)
    if origin is Literal:
        choices = typing.get_args(ftype)
        if value not in choices:
            raise ConfigError(f"{key}={value!r} is not valid; choose one of: {', '.join(map(str, choices))}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ftype) if a is not type(None)]
        if value in (None, "none", "None"):
            return None
        return coerce(key, args[0], value)
    if ftype is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key}={value!r} is not a bool; use true or false")
    if ftype is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} is not an int")
        if isinstance(value, int):
            return value
        try:
            return int(str(value).replace("_", ""))
        except ValueError:
            raise ConfigError(f"{key}={value!r} is not an int") from None
    if ftype is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        try:
            return float(str(value))
        except ValueError:
            raise ConfigError(f"{key}={value!r} is not a number") from None
    if ftype is str:
        return str(value)
    raise ConfigError(f"{key}: unsupported field type {ftype}")


# model fields added after checkpoints were first written, whose default changes the network: a
# saved config without one was trained without it (field -> the value it then had)
SAVED_WITHOUT = {"flow_embed_head": False, "flow_bag_input": False}


def saved_model_config(d: dict[str, Any]) -> "ModelConfig":
    """The `ModelConfig` a checkpoint's saved model fields describe (`SAVED_WITHOUT` fills a field
    it predates). A field this version does not know (a checkpoint written by another version or
    a patched model) is a `ConfigError` naming it."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(f"the checkpoint's model config has fields this relf_jax does not know: "
                          f"{', '.join(unknown)} (written by another version or a patched model)")
    return ModelConfig(**{**SAVED_WITHOUT, **d})


def from_dict(cls: type, d: dict[str, Any], prefix: str) -> Any:
    if cls is ModelConfig:
        d = {**SAVED_WITHOUT, **d}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    names = {f.name for f in dataclasses.fields(cls)}
    for k, v in d.items():
        if k not in names:
            raise ConfigError(f"unknown config key {prefix + k!r} in saved config")
        if dataclasses.is_dataclass(hints[k]):
            kwargs[k] = from_dict(hints[k], v, prefix + k + ".")
        else:
            kwargs[k] = coerce(prefix + k, hints[k], v)
    return cls(**kwargs)
